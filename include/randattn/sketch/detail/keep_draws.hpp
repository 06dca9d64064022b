#pragma once
// The random numbers behind the keep decisions of sparsification.
//
// Entry omega (flat row-major index) is kept when u_omega < p_omega, for a uniform u_omega in
// [0, 1) drawn in two parts, u_omega = (r_omega + v_omega) / 2^16:
//   r_omega, a uniform 16-bit integer: tile T = omega / 256 holds the words of 32 Philox blocks
//     (seed, stream, counter 32 T + l, j = 0), l < 32. Entry offset o = omega % 256 is lane
//     o % 16 of group g = o / 16 and takes the 16-bit half g % 2 (low half first) of word
//     (g / 2) % 4 of block 32 T + 16 (g / 8) + o % 16. So sixteen consecutive entries read the
//     same half of the same word of sixteen consecutive blocks, which makes the decisions of a
//     tile a handful of vector operations;
//   v_omega, a 53-bit uniform (Philox counter omega, j = 1), drawn only when r_omega = t with
//     t = floor(2^16 p_omega): entries with r < t are kept and r > t dropped on r alone.
// Hence P(keep) = t / 2^16 + P(v < 2^16 p - t) / 2^16 = p + delta with 0 <= delta < 2^-69 (the
// uniform v has 53 bits; 2^16 p - t is exact in double), and every r, v is a different Philox
// output, so the decisions are independent across entries. An entry with p = 1 is kept without
// a draw (t = 2^16 > r) and one with p = 0 is never kept. Ties (r = t) come once in 2^16 entries
// with 0 < p < 1, so the 53-bit draws cost nothing measurable. The draws are a pure function of
// (seed, stream, omega); the tile grid is fixed by the flat index, never by how the data are
// traversed, so blocks of any size, any thread count and any storage order see the same draws.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../../core/types.hpp"
#include "../../detail/bits.hpp"
#include "../../random/philox.hpp"
#include "../../random/philox_lanes.hpp"

namespace randattn::detail {

constexpr Index kDrawTile = 256;         // entries per tile of coarse draws
constexpr int kCoarseBits = 16;          // bits of r
constexpr double kCoarseLevels = 65536;  // 2^kCoarseBits

// The coarse draws r of one tile, as the words of its 32 Philox blocks.
class TileDraws {
 public:
  explicit TileDraws(const Philox& rng) : rng_(rng) {}

  // Makes words() the draws of tile `tile` (no work when it already is).
  void load(Index tile) {
    if (tile == tile_) return;
    const std::uint64_t first = std::uint64_t(tile) * 2 * PhiloxLanes::kLanes;
    PhiloxLanes::generate(rng_, first, 0, words_[0]);
    PhiloxLanes::generate(rng_, first + PhiloxLanes::kLanes, 0, words_[1]);
    tile_ = tile;
  }
  // The sixteen words whose half g % 2 holds r of entries 16 g .. 16 g + 15 of the loaded tile.
  const std::uint32_t* group_words(int g) const { return words_[g / 8][(g / 2) % 4]; }
  // r of entry offset o of the loaded tile.
  int coarse(Index o) const {
    const int g = int(o / 16);
    return int((group_words(g)[o % 16] >> (kCoarseBits * (g % 2))) & 0xFFFFu);
  }

  // The fine part v of entry omega, uniform on [0, 1) with 53 bits.
  double fine(Index omega) const { return rng_.uniform(std::uint64_t(omega), 1); }

 private:
  Philox rng_;
  Index tile_ = -1;
  alignas(64) PhiloxLanes::Words words_[2] = {};
};

// Keep decisions for the entries o0 <= o < o1 of a tile with probabilities p[o] and coarse
// draws `draws` (nullptr when no entry has 0 < p < 1: then p = 1 keeps and p = 0 drops): bit o of
// `keep` is set when r alone keeps entry o, bit o of `tie` when r = floor(2^16 p) and the
// fine draw decides (keep_tie). Bits outside [o0, o1) are zero.
inline void tile_decisions(const double* p, const TileDraws* draws, Index o0, Index o1,
                           std::uint64_t (&keep)[4], std::uint64_t (&tie)[4]) {
  for (int w = 0; w < 4; ++w) keep[w] = tie[w] = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (o0 == 0 && o1 == kDrawTile) {
    const __m512d scale = _mm512_set1_pd(kCoarseLevels), zero = _mm512_setzero_pd(),
                  one = _mm512_set1_pd(1);
    const __m512i low_half = _mm512_set1_epi32(0xFFFF);
    for (int g = 0; g < 16; ++g) {
      const __m512d lo = _mm512_load_pd(p + 16 * g), hi = _mm512_load_pd(p + 16 * g + 8);
      std::uint64_t k, e = 0;
      if (draws == nullptr) {
        k = std::uint64_t(_mm512_cmp_pd_mask(lo, one, _CMP_GE_OQ)) |
            std::uint64_t(_mm512_cmp_pd_mask(hi, one, _CMP_GE_OQ)) << 8;
      } else {
        const __m512i t = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm512_cvttpd_epi32(_mm512_mul_pd(lo, scale))),
            _mm512_cvttpd_epi32(_mm512_mul_pd(hi, scale)), 1);
        const __m512i r =
            _mm512_and_si512(_mm512_srli_epi32(_mm512_load_si512(draws->group_words(g)),
                                               unsigned(kCoarseBits * (g % 2))),
                             low_half);
        const __mmask16 positive = __mmask16(_mm512_cmp_pd_mask(lo, zero, _CMP_GT_OQ) |
                                             (_mm512_cmp_pd_mask(hi, zero, _CMP_GT_OQ) << 8));
        k = _mm512_cmplt_epi32_mask(r, t);
        e = _mm512_mask_cmpeq_epi32_mask(positive, r, t);
      }
      keep[g / 4] |= k << (16 * (g % 4));
      tie[g / 4] |= e << (16 * (g % 4));
    }
    return;
  }
#endif
  for (Index o = o0; o < o1; ++o) {
    const int t = int(p[o] * kCoarseLevels);  // p = 1 gives 2^16, above every r
    const int r = draws ? draws->coarse(o) : int(kCoarseLevels);
    const bool k = draws ? r < t : p[o] >= 1, e = r == t && p[o] > 0;
    keep[o / 64] |= std::uint64_t(k) << (o % 64);
    tie[o / 64] |= std::uint64_t(e) << (o % 64);
  }
}

// The fine decision of a tie: v < 2^16 p - floor(2^16 p), exact in double.
inline bool keep_tie(double p, double v) {
  const double scaled = p * kCoarseLevels;
  return v < scaled - double(int(scaled));
}

}  // namespace randattn::detail
