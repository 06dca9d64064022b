#pragma once
// Comparisons of up to 64 consecutive entries against one threshold as the bits of a word: the
// sign bits of SimHash codes (decode/simhash_tables.hpp) and the filters a block of queries
// opens (lsf/lsf_attention.hpp). One vector compare per packet where the instruction set has it.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "../core/types.hpp"

namespace randattn::detail {

// Bit u set for x[u] > threshold (Strict) or x[u] >= threshold, u < count <= 64. NaN compares
// false either way.
template <bool Strict, typename Scalar>
std::uint64_t threshold_mask(const Scalar* x, Index count, Scalar threshold) {
  std::uint64_t bits = 0;
  Index u = 0;
#if defined(__AVX512F__)
  constexpr int kPredicate = Strict ? _CMP_GT_OQ : _CMP_GE_OQ;
  if constexpr (std::is_same<Scalar, float>::value) {
    const __m512 t = _mm512_set1_ps(threshold);
    for (; u + 16 <= count; u += 16)
      bits |= std::uint64_t(_mm512_cmp_ps_mask(_mm512_loadu_ps(x + u), t, kPredicate)) << u;
  } else if constexpr (std::is_same<Scalar, double>::value) {
    const __m512d t = _mm512_set1_pd(threshold);
    for (; u + 8 <= count; u += 8)
      bits |= std::uint64_t(_mm512_cmp_pd_mask(_mm512_loadu_pd(x + u), t, kPredicate)) << u;
  }
#elif defined(__AVX__)
  constexpr int kPredicate = Strict ? _CMP_GT_OQ : _CMP_GE_OQ;
  if constexpr (std::is_same<Scalar, float>::value) {
    const __m256 t = _mm256_set1_ps(threshold);
    for (; u + 8 <= count; u += 8)
      bits |= std::uint64_t(unsigned(_mm256_movemask_ps(
                  _mm256_cmp_ps(_mm256_loadu_ps(x + u), t, kPredicate))))
              << u;
  } else if constexpr (std::is_same<Scalar, double>::value) {
    const __m256d t = _mm256_set1_pd(threshold);
    for (; u + 4 <= count; u += 4)
      bits |= std::uint64_t(unsigned(_mm256_movemask_pd(
                  _mm256_cmp_pd(_mm256_loadu_pd(x + u), t, kPredicate))))
              << u;
  }
#endif
  for (; u < count; ++u) bits |= std::uint64_t(Strict ? x[u] > threshold : x[u] >= threshold) << u;
  return bits;
}

}  // namespace randattn::detail
