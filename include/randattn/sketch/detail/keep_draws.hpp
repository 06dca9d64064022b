#pragma once
// The random numbers behind the keep decisions of sparsification.
//
// Entry omega (flat row-major index) is kept when u_omega < p_omega, for a uniform u_omega in
// [0, 1) drawn in two parts, u_omega = (r_omega + v_omega) / 256:
//   r_omega, a uniform byte: tile T = omega / 256 holds the bytes of 16 Philox blocks (seed,
//     stream, counter 16 T + l, j = 0), l < 16; entry offset o = omega % 256 takes byte
//     (o / 16) % 4 of word o / 64 of block o % 16. So sixteen consecutive entries read the same
//     byte of the same word of sixteen consecutive blocks, which makes the decisions of a tile
//     a handful of vector operations;
//   v_omega, a 53-bit uniform (Philox counter omega, j = 1), drawn only when r_omega = t with
//     t = floor(256 p_omega): entries with r < t are kept and r > t dropped on the byte alone.
// Hence P(keep) = t / 256 + P(v < 256 p - t) / 256 = p + delta with 0 <= delta < 2^-61 (the
// uniform v has 53 bits; 256 p - t is exact in double), and every r, v is a different Philox
// output, so the decisions are independent across entries. An entry with p = 1 is kept without
// a draw (t = 256 > r) and one with p = 0 is never kept. The draws are a pure function of
// (seed, stream, omega); the tile grid is fixed by the flat index, never by how the data are
// traversed, so blocks of any size, any thread count and any storage order see the same draws.

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../../core/types.hpp"
#include "../../detail/bits.hpp"
#include "../../random/philox.hpp"
#include "../../random/philox_lanes.hpp"

namespace randattn::detail {

constexpr Index kDrawTile = 256;  // entries per tile of coarse draws

// The coarse draws r of one tile, as the 16 Philox blocks' words.
class TileDraws {
 public:
  explicit TileDraws(const Philox& rng) : rng_(rng) {}

  // Makes words() the draws of tile `tile` (no work when it already is).
  void load(Index tile) {
    if (tile == tile_) return;
    PhiloxLanes::generate(rng_, std::uint64_t(tile) * PhiloxLanes::kLanes, 0, words_);
    tile_ = tile;
  }
  // r of entry offset o of the loaded tile: entries 16 g .. 16 g + 15 are the bytes g % 4 of
  // words_[g / 4][0 .. 15].
  int byte(Index o) const { return int((words_[o / 64][o % 16] >> (8 * ((o / 16) % 4))) & 0xFFu); }
  const PhiloxLanes::Words& words() const { return words_; }

  // The fine part v of entry omega, uniform on [0, 1) with 53 bits.
  double fine(Index omega) const { return rng_.uniform(std::uint64_t(omega), 1); }

 private:
  Philox rng_;
  Index tile_ = -1;
  alignas(64) PhiloxLanes::Words words_ = {};
};

// Keep decisions for the entries o0 <= o < o1 of a tile with probabilities p[o] and coarse
// draws `draws` (nullptr when no entry has 0 < p < 1: then p = 1 keeps and p = 0 drops): bit o of
// `keep` is set when the byte alone keeps entry o, bit o of `tie` when r = floor(256 p) and the
// fine draw decides (keep_tie). Bits outside [o0, o1) are zero.
inline void tile_decisions(const double* p, const TileDraws* draws, Index o0, Index o1,
                           std::uint64_t (&keep)[4], std::uint64_t (&tie)[4]) {
  for (int w = 0; w < 4; ++w) keep[w] = tie[w] = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (o0 == 0 && o1 == kDrawTile) {
    const __m512d scale = _mm512_set1_pd(256), zero = _mm512_setzero_pd(), one = _mm512_set1_pd(1);
    const __m512i low_byte = _mm512_set1_epi32(0xFF);
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
        const __m512i r = _mm512_and_si512(
            _mm512_srli_epi32(_mm512_load_si512(draws->words()[g / 4]), unsigned(8 * (g % 4))),
            low_byte);
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
    const int t = int(p[o] * 256);  // p = 1 gives 256, above every byte
    const int r = draws ? draws->byte(o) : 256;
    const bool k = draws ? r < t : p[o] >= 1, e = r == t && p[o] > 0;
    keep[o / 64] |= std::uint64_t(k) << (o % 64);
    tie[o / 64] |= std::uint64_t(e) << (o % 64);
  }
}

// The fine decision of a tie: v < 256 p - floor(256 p), exact in double.
inline bool keep_tie(double p, double v) {
  const double scaled = p * 256;
  return v < scaled - double(int(scaled));
}

}  // namespace randattn::detail
