#pragma once
// Matrix products whose rounding does not depend on Eigen's thread count.
// Eigen picks its depth blocking from the number of threads once the inner dimension is
// large, which reorders the sums; cutting the inner dimension into fixed panels here makes
// the summation order a function of the shapes alone.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>

#include <Eigen/Core>

#include "../core/types.hpp"

namespace randattn::detail {

constexpr Index kMaxGemmDepth = 256;

// out = a * b (accumulate = false) or out += a * b (accumulate = true).
template <typename Out, typename A, typename B>
void gemm_fixed_depth(Out&& out, const A& a, const B& b, bool accumulate) {
  const Index depth = a.cols();
  if (depth == 0) {
    if (!accumulate) out.setZero();
    return;
  }
  for (Index k0 = 0; k0 < depth; k0 += kMaxGemmDepth) {
    const Index kb = std::min(kMaxGemmDepth, depth - k0);
    if (k0 == 0 && !accumulate) {
      out.noalias() = a.middleCols(k0, kb) * b.middleRows(k0, kb);
    } else {
      out.noalias() += a.middleCols(k0, kb) * b.middleRows(k0, kb);
    }
  }
}

}  // namespace randattn::detail
