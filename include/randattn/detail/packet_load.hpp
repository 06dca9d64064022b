#pragma once
// Stored element types read as the compute type: float, double, Eigen::bfloat16, Eigen::half and
// int8, loaded one packet of the compute type at a time (load_packet), so that a kernel reading a
// compressed row converts it in registers and never writes a widened copy. With AVX-512 or AVX2
// the conversions are one or two instructions per packet (bfloat16: the 16 bits shifted into the
// high half of a float; half: vcvtph2ps; int8: sign extension and vcvtdq2ps), with SSE2 alone
// for bfloat16 and int8; other builds and pairs widen element by element into a packet-sized
// buffer. Widening is exact: every bfloat16, half and int8 value is a float.
//
// narrow<T>(x) rounds a compute value to a storage type, to nearest with ties to even, from
// double in one rounding (round to odd into float first, then to the 8- or 11-bit significand:
// float has more than two extra bits, so the two steps round as one).

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "../core/half_precision.hpp"

namespace randattn::detail {

// A stored value as the compute type Scalar (exact).
template <typename Scalar, typename T>
inline Scalar widen(T x) {
  if constexpr (is_half_precision_v<T>) {
    return Scalar(static_cast<float>(x));
  } else {
    return Scalar(x);
  }
}

// x rounded to float, toward zero, with the last bit set if that was inexact (round to odd).
inline float round_to_odd(double x) {
  float f = static_cast<float>(x);
  if (!std::isfinite(x) || double(f) == x) return f;
  if (std::abs(double(f)) > std::abs(x)) f = std::nextafter(f, 0.0f);
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= 1u;
  std::memcpy(&f, &u, 4);
  return f;
}

// x rounded to the floating-point storage type T (float, double, bfloat16 or half).
template <typename T, typename Scalar>
inline T narrow(Scalar x) {
  if constexpr (is_half_precision_v<T>) {
    if constexpr (std::is_same<Scalar, double>::value) {
      return T(round_to_odd(x));
    } else {
      return T(static_cast<float>(x));
    }
  } else {
    return static_cast<T>(x);
  }
}

// The packet P_t of the compute type at p[0, size) of type T. (Packets are told apart by their
// scalar and size: GCC warns about the vector types' attributes as template arguments.)
template <typename P_t, typename T>
inline P_t load_packet(const T* p) {
  using Scalar = typename Eigen::internal::unpacket_traits<P_t>::type;
  constexpr int size = Eigen::internal::unpacket_traits<P_t>::size;
  if constexpr (std::is_same<T, Scalar>::value) {
    return Eigen::internal::ploadu<P_t>(p);
  } else {
#if defined(__AVX512F__)
    if constexpr (std::is_same<Scalar, float>::value && size == 16) {
      const auto* v = reinterpret_cast<const void*>(p);
      if constexpr (std::is_same<T, Eigen::bfloat16>::value)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)v)), 16));
      if constexpr (std::is_same<T, Eigen::half>::value)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)v));
      if constexpr (std::is_same<T, std::int8_t>::value)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)v)));
    }
    if constexpr (std::is_same<Scalar, double>::value && size == 8 && std::is_same<T, float>::value)
      return _mm512_cvtps_pd(_mm256_loadu_ps(p));
#endif
#if defined(__AVX2__)
    if constexpr (std::is_same<Scalar, float>::value && size == 8) {
      const auto* v = reinterpret_cast<const void*>(p);
      if constexpr (std::is_same<T, Eigen::bfloat16>::value)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)v)), 16));
#if defined(__F16C__)
      if constexpr (std::is_same<T, Eigen::half>::value)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)v));
#endif
      if constexpr (std::is_same<T, std::int8_t>::value)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)v)));
    }
    if constexpr (std::is_same<Scalar, double>::value && size == 4 && std::is_same<T, float>::value)
      return _mm256_cvtps_pd(_mm_loadu_ps(p));
#endif
#if defined(__SSE2__)
    // The baseline x86-64 (SSE2, no F16C): bfloat16 by interleaving with zero words, int8 by
    // spreading each byte over a lane and shifting it down with its sign.
    if constexpr (std::is_same<Scalar, float>::value && size == 4) {
      if constexpr (std::is_same<T, Eigen::bfloat16>::value)
        return _mm_castsi128_ps(_mm_unpacklo_epi16(
            _mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
      if constexpr (std::is_same<T, std::int8_t>::value) {
        std::int32_t four;
        std::memcpy(&four, p, 4);
        const __m128i x = _mm_cvtsi32_si128(four), pairs = _mm_unpacklo_epi8(x, x);
        return _mm_cvtepi32_ps(_mm_srai_epi32(_mm_unpacklo_epi16(pairs, pairs), 24));
      }
    }
#endif
    alignas(64) Scalar buf[size];
    for (int i = 0; i < size; ++i) buf[i] = widen<Scalar>(p[i]);
    return Eigen::internal::pload<P_t>(buf);
  }
}

}  // namespace randattn::detail
