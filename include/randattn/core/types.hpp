#pragma once
// Common matrix aliases and the shape of batched multi-head buffers.

#include <randattn/detail/intrinsics.hpp>

#include <Eigen/Core>

namespace randattn {

using Index = Eigen::Index;

// Token data is row-major: one token per row, contiguous.
template <typename Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

template <typename Scalar>
using RowMatrixMap = Eigen::Map<RowMatrix<Scalar>>;
template <typename Scalar>
using ConstRowMatrixMap = Eigen::Map<const RowMatrix<Scalar>>;

// Shape of (batch, heads, n, d) row-major buffers: queries (batch, heads, n_q, d),
// keys (batch, heads, n_k, d), values (batch, heads, n_k, dv), output (batch, heads, n_q, dv).
struct BatchShape {
  Index batch = 1;
  Index heads = 1;
  Index n_q = 0;
  Index n_k = 0;
  Index d = 0;
  Index dv = 0;

  Index slices() const { return batch * heads; }
};

}  // namespace randattn
