#pragma once
// Sixteen Philox4x32-10 blocks at once, for consecutive counters: block l of a call is
// Philox::bits(i0 + l, j), bit for bit. The state is kept one word per array of sixteen lanes
// (structure of arrays), so every step of a round is one operation on sixteen lanes: explicit
// AVX-512 code where the target has it, otherwise plain loops over the lanes, which compilers
// vectorise for other instruction sets when their cost model agrees (the result is the same).

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <Random123/philox.h>

#include "philox.hpp"

namespace randattn {

struct PhiloxLanes {
  static constexpr int kLanes = 16;
  using Words = std::uint32_t[4][kLanes];  // words[w][l] = word w of block i0 + l

  // words[w][l] = Philox(seed, stream).bits(i0 + l, j)[w] for l < 16.
  static void generate(const Philox& rng, std::uint64_t i0, std::uint32_t j, Words& words) {
    std::uint32_t x0[kLanes], x1[kLanes], x2[kLanes], x3[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const std::uint64_t i = i0 + std::uint64_t(l);
      x0[l] = j;
      x1[l] = std::uint32_t(i);
      x2[l] = std::uint32_t(i >> 32);
      x3[l] = rng.stream();
    }
    std::uint32_t k0 = std::uint32_t(rng.seed()), k1 = std::uint32_t(rng.seed() >> 32);
#if defined(__AVX512F__)
    __m512i v0 = _mm512_loadu_si512(x0), v1 = _mm512_loadu_si512(x1), v2 = _mm512_loadu_si512(x2),
            v3 = _mm512_loadu_si512(x3);
    const __m512i m0 = _mm512_set1_epi32(int(PHILOX_M4x32_0)),
                  m1 = _mm512_set1_epi32(int(PHILOX_M4x32_1));
    // (hi, lo) halves of the 32 x 32 -> 64-bit products m * x, lane by lane.
    auto mulhilo = [](__m512i m, __m512i x, __m512i& hi, __m512i& lo) {
      const __m512i even = _mm512_mul_epu32(x, m),
                    odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), m);
      constexpr __mmask16 odd_lanes = 0xAAAA;
      lo = _mm512_mask_blend_epi32(odd_lanes, even, _mm512_slli_epi64(odd, 32));
      hi = _mm512_mask_blend_epi32(odd_lanes, _mm512_srli_epi64(even, 32), odd);
    };
    for (int round = 0; round < 10; ++round) {
      __m512i hi0, lo0, hi1, lo1;
      mulhilo(m0, v0, hi0, lo0);
      mulhilo(m1, v2, hi1, lo1);
      v0 = _mm512_ternarylogic_epi32(hi1, v1, _mm512_set1_epi32(int(k0)), 0x96);  // three-way xor
      v2 = _mm512_ternarylogic_epi32(hi0, v3, _mm512_set1_epi32(int(k1)), 0x96);
      v1 = lo1;
      v3 = lo0;
      k0 += PHILOX_W32_0;
      k1 += PHILOX_W32_1;
    }
    _mm512_storeu_si512(words[0], v0);
    _mm512_storeu_si512(words[1], v1);
    _mm512_storeu_si512(words[2], v2);
    _mm512_storeu_si512(words[3], v3);
#else
    for (int round = 0; round < 10; ++round) {
      for (int l = 0; l < kLanes; ++l) {
        const std::uint64_t p0 = std::uint64_t(PHILOX_M4x32_0) * x0[l];
        const std::uint64_t p1 = std::uint64_t(PHILOX_M4x32_1) * x2[l];
        const std::uint32_t y0 = std::uint32_t(p1 >> 32) ^ x1[l] ^ k0;
        const std::uint32_t y2 = std::uint32_t(p0 >> 32) ^ x3[l] ^ k1;
        x1[l] = std::uint32_t(p1);
        x3[l] = std::uint32_t(p0);
        x0[l] = y0;
        x2[l] = y2;
      }
      k0 += PHILOX_W32_0;
      k1 += PHILOX_W32_1;
    }
    for (int l = 0; l < kLanes; ++l) {
      words[0][l] = x0[l];
      words[1][l] = x1[l];
      words[2][l] = x2[l];
      words[3][l] = x3[l];
    }
#endif
  }
};

}  // namespace randattn
