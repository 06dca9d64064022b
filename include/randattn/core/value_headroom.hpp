#pragma once
// Values near the type's maximum. An attention output is a convex combination of value rows, so
// it is representable whenever the values are; its numerator Σ_j w_j v_j (weights up to 1, one
// term per scored key) is not. Methods whose numerator has up to `terms` such terms run on
// 2^-e · v, with e the smallest exponent that leaves terms · max|v| a quarter of the range, and
// scale the output back by 2^e. Both scalings are powers of two, so they are exact for normal
// values (only values below 2^e times the smallest normal number lose bits), and e = 0 -- the
// same arithmetic as without this header -- whenever terms · max|v| is already in range.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <Eigen/Core>

#include "softmax_accumulator.hpp"
#include "types.hpp"

namespace randattn::detail {

// The exponent e >= 0 for values `v` and up to `terms` numerator terms per output row.
template <typename Derived>
int value_headroom(const Eigen::MatrixBase<Derived>& v, double terms) {
  using Scalar = typename Derived::Scalar;
  if (v.size() == 0) return 0;
  const double largest = double(v.cwiseAbs().maxCoeff());
  const double limit = double(std::numeric_limits<Scalar>::max()) / 4;
  if (!std::isfinite(largest) || largest == 0) return 0;  // non-finite: the input checks report it
  // In log2, as terms * largest itself may overflow (double values near the maximum).
  const double excess = std::log2(largest) + std::log2(std::max(terms, 1.0)) - std::log2(limit);
  return excess > 0 ? int(std::ceil(excess)) : 0;
}

// x ← 2^e x (e of either sign).
template <typename Derived>
void scale_by_power_of_two(const Eigen::MatrixBase<Derived>& x_, int e) {
  using Scalar = typename Derived::Scalar;
  auto& x = const_cast<Eigen::MatrixBase<Derived>&>(x_);
  if (e != 0) x.derived() *= static_cast<Scalar>(std::ldexp(1.0, e));
}

// out ← 2^e out for an output computed on 2^-e v (e >= 0). The exact output is a convex
// combination of finite values, so it is in range; the rounding of num / den can leave an entry a
// few ulps beyond 2^-e times the type's maximum, which the scaling would turn into an infinity.
// Such an entry becomes the largest finite value of its sign (NaN stays NaN).
template <typename Derived>
void unscale_output(const Eigen::MatrixBase<Derived>& out_, int e) {
  using Scalar = typename Derived::Scalar;
  if (e == 0) return;
  auto& out = const_cast<Eigen::MatrixBase<Derived>&>(out_);
  const Scalar big = std::numeric_limits<Scalar>::max();
  out.derived() =
      (out.derived() * static_cast<Scalar>(std::ldexp(1.0, e))).cwiseMin(big).cwiseMax(-big);
}

// An accumulator built on 2^-e v, as if built on v (numerators that overflow become infinite:
// the caller's result check reports them).
template <typename Scalar>
SoftmaxAccumulator<Scalar> unscaled_accumulator(SoftmaxAccumulator<Scalar> acc, int e) {
  if (e == 0) return acc;
  auto [nd, log_scale] = std::move(acc).release();
  scale_by_power_of_two(nd.leftCols(nd.cols() - 1), e);
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

}  // namespace randattn::detail
