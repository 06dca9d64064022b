#pragma once
// Matrix products whose rounding does not depend on Eigen's thread count.
// Eigen picks its depth blocking from the number of threads once the inner dimension is
// large, which reorders the sums; cutting the inner dimension into fixed panels here makes
// the summation order a function of the shapes alone.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include <Eigen/Core>

#include "../core/types.hpp"

namespace randattn::detail {

constexpr Index kMaxGemmDepth = 256;

// out = 0, a row (row-major) or column at a time with memset where entries are contiguous. An
// Eigen assignment of zero to a block with an outer stride was a packet loop that GCC 12 turns
// into memset at -O3 only (at -O2 it took twice as long).
template <typename Out>
void set_zero(Out&& out) {
  if (out.size() == 0) return;
  if (out.innerStride() != 1) {
    out.setZero();
    return;
  }
  using T = typename std::decay_t<Out>::Scalar;
  const std::size_t bytes = sizeof(T) * std::size_t(out.innerSize());
  for (Index i = 0; i < out.outerSize(); ++i) std::memset(out.data() + i * out.outerStride(), 0, bytes);
}

// out = a * b (accumulate = false) or out += a * b (accumulate = true). The product is always
// added to out (Eigen's `=` clears its destination first, then adds to it, just as here).
template <typename Out, typename A, typename B>
void gemm_fixed_depth(Out&& out, const A& a, const B& b, bool accumulate) {
  const Index depth = a.cols();
  if (!accumulate) set_zero(out);
  for (Index k0 = 0; k0 < depth; k0 += kMaxGemmDepth) {
    const Index kb = std::min(kMaxGemmDepth, depth - k0);
    out.noalias() += a.middleCols(k0, kb) * b.middleRows(k0, kb);
  }
}

}  // namespace randattn::detail
