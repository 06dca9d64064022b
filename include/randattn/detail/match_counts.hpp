#pragma once
// cnt[u] += [a matches b[u]] over int32 rows, eight lanes at a time where AVX2 is there: the
// round counts of LSH's duplicate correction. GCC vectorises the plain loop at -O3 but not at
// -O2, where it took half of an 8-round LSH call; the counts are integers, so every path gives
// the same result.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>

#include "../core/types.hpp"

namespace randattn::detail {

// Exact matches: cnt[u] += (b[u] == a).
inline void add_matches(std::int32_t a, const std::int32_t* b, Index n, std::int32_t* cnt) {
  Index u = 0;
#if defined(__AVX2__)
  const __m256i va = _mm256_set1_epi32(a);
  for (; u + 8 <= n; u += 8) {
    const __m256i eq = _mm256_cmpeq_epi32(va, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + u)));
    __m256i* c = reinterpret_cast<__m256i*>(cnt + u);
    _mm256_storeu_si256(c, _mm256_sub_epi32(_mm256_loadu_si256(c), eq));  // eq lanes are -1
  }
#endif
  for (; u < n; ++u) cnt[u] += (a == b[u]);
}

// Matches within one step: cnt[u] += (a − b[u] ∈ {0, 1, wrap}) (adjacent buckets on a ring).
inline void add_adjacent_matches(std::int32_t a, const std::int32_t* b, Index n, std::int32_t wrap,
                                 std::int32_t* cnt) {
  Index u = 0;
#if defined(__AVX2__)
  const __m256i va = _mm256_set1_epi32(a), one = _mm256_set1_epi32(1), vw = _mm256_set1_epi32(wrap);
  for (; u + 8 <= n; u += 8) {
    const __m256i diff =
        _mm256_sub_epi32(va, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + u)));
    const __m256i hit = _mm256_or_si256(
        _mm256_or_si256(_mm256_cmpeq_epi32(diff, _mm256_setzero_si256()), _mm256_cmpeq_epi32(diff, one)),
        _mm256_cmpeq_epi32(diff, vw));
    __m256i* c = reinterpret_cast<__m256i*>(cnt + u);
    _mm256_storeu_si256(c, _mm256_sub_epi32(_mm256_loadu_si256(c), hit));
  }
#endif
  for (; u < n; ++u) {
    const std::int32_t diff = a - b[u];
    cnt[u] += (diff == 0) | (diff == 1) | (diff == wrap);
  }
}

}  // namespace randattn::detail
