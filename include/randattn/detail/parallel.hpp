#pragma once
// Parallel loops over independent work items. Each item is computed by one thread in a
// fixed way, so results do not depend on the thread count. Exceptions thrown inside the
// parallel region are carried out of it and rethrown (the first one wins).

#include <exception>
#include <mutex>

#include "../core/types.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace randattn::detail {

template <typename Fn>
void parallel_for(Index count, Fn&& fn) {
  std::exception_ptr error;
#if defined(_OPENMP)
  std::mutex error_mutex;
#pragma omp parallel for schedule(dynamic, 1) if (count > 1 && !omp_in_parallel())
  for (Index i = 0; i < count; ++i) {
    try {
      fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
#else
  for (Index i = 0; i < count; ++i) {
    try {
      fn(i);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
#endif
  if (error) std::rethrow_exception(error);
}

}  // namespace randattn::detail
