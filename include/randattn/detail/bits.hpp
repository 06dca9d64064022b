#pragma once
// Bit tricks on 64-bit masks (keep decisions of a tile, opened filters of a block of queries).

#include <cstdint>

namespace randattn::detail {

// Index of the lowest set bit of bits != 0.
inline int count_trailing_zeros(std::uint64_t bits) {
#if defined(__GNUC__) || defined(__clang__)
  return __builtin_ctzll(bits);
#else
  int n = 0;
  for (; (bits & 1) == 0; bits >>= 1) ++n;
  return n;
#endif
}

}  // namespace randattn::detail
