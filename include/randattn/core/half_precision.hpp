#pragma once
// Half-precision storage (Eigen::half, IEEE binary16, and Eigen::bfloat16) around float32
// arithmetic. Every half value is a float32 value, so widening is exact; the float32 result is
// rounded to the nearest half value (ties to even) once, at the end. A finite float32 value
// beyond the half type's range would round to infinity: round_to_half() refuses it instead, so a
// half result is never an infinity that its float32 computation did not produce.
//
// The registry runs every method on half inputs this way (registry/half_precision.hpp); the
// functions here are the conversion itself, for callers of the other entry points.

#include <randattn/core/invalid_argument.hpp>
#include <randattn/core/types.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdio>
#include <string>
#include <type_traits>

namespace randattn {

template <typename T>
struct is_half_precision : std::false_type {};
template <>
struct is_half_precision<Eigen::half> : std::true_type {};
template <>
struct is_half_precision<Eigen::bfloat16> : std::true_type {};
template <typename T>
inline constexpr bool is_half_precision_v = is_half_precision<T>::value;

// The type a computation on Scalar inputs runs in: float for the half types, Scalar otherwise.
template <typename Scalar>
using compute_scalar_t = std::conditional_t<is_half_precision_v<Scalar>, float, Scalar>;

// "float16", "bfloat16", "float32" or "float64": NumPy's and torch's names.
template <typename Scalar>
constexpr const char* scalar_type_name() {
  if constexpr (std::is_same<Scalar, Eigen::half>::value) return "float16";
  if constexpr (std::is_same<Scalar, Eigen::bfloat16>::value) return "bfloat16";
  if constexpr (std::is_same<Scalar, float>::value) return "float32";
  if constexpr (std::is_same<Scalar, double>::value) return "float64";
  return "unknown";
}

// The unit roundoff of rounding to Half: 2^-11 for float16, 2^-8 for bfloat16. A normal value x
// rounds to x(1 + δ) with |δ| <= this; float16 values below 2^-14 (subnormal) are off by at most
// 2^-25 instead.
template <typename Half>
constexpr double half_unit_roundoff() {
  static_assert(is_half_precision_v<Half>, "a half-precision type");
  return std::is_same<Half, Eigen::half>::value ? 0x1p-11 : 0x1p-8;
}

// out[i] = float(in[i]) for i < count: exact.
template <typename Half>
void widen_to_float(const Half* in, Index count, float* out) {
  static_assert(is_half_precision_v<Half>, "a half-precision type");
  if (count <= 0) return;
  Eigen::Map<Eigen::ArrayXf>(out, count) =
      Eigen::Map<const Eigen::Array<Half, Eigen::Dynamic, 1>>(in, count).template cast<float>();
}

// Throws randattn::invalid_argument naming `what` and the first offending flat index when a finite
// in[i] (i < count) lies beyond the largest finite Half (65504 for float16), i.e. would round to
// infinity. Non-finite values (NaN, ±Inf: only present when the inputs held them) pass.
template <typename Half>
void check_half_range(const float* in, Index count, const std::string& what) {
  static_assert(is_half_precision_v<Half>, "a half-precision type");
  if (count <= 0) return;
  // The smallest magnitude that rounds to infinity: the largest finite value plus half its ulp,
  // a tie that rounds to even, i.e. up (65504 + 16; bfloat16: (2 - 2^-7) 2^127 + 2^119).
  const float limit = std::is_same<Half, Eigen::half>::value ? 65520.0f : 0x1.ffp127f;
  if (!(Eigen::Map<const Eigen::ArrayXf>(in, count).abs() >= limit).any()) return;
  for (Index i = 0; i < count; ++i)
    if (std::isfinite(in[i]) && std::abs(in[i]) >= limit) {
      char text[200];
      std::snprintf(text, sizeof text,
                    ": entry %lld is %.7g, beyond the largest finite %s (%.7g); pass %s inputs "
                    "for a wider range",
                    static_cast<long long>(i), double(in[i]), scalar_type_name<Half>(),
                    double(Eigen::NumTraits<Half>::highest()),
                    std::is_same<Half, Eigen::half>::value ? "bfloat16 or float32" : "float32");
      throw invalid_argument(what + text);
    }
}

// Writes in[i] rounded to the nearest Half (ties to even) into out[i] for i < count, after
// check_half_range() (which throws before anything is written).
template <typename Half>
void round_to_half(const float* in, Index count, Half* out, const std::string& what) {
  check_half_range<Half>(in, count, what);
  if (count <= 0) return;
  Eigen::Map<Eigen::Array<Half, Eigen::Dynamic, 1>>(out, count) =
      Eigen::Map<const Eigen::ArrayXf>(in, count).template cast<Half>();
}

}  // namespace randattn
