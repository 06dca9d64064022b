#pragma once
// Wall time of a part of a call, for reports.

#include <chrono>

namespace randattn::detail {

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace randattn::detail
