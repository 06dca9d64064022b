#pragma once
// Gram matrices of mode unfoldings, G_j = M_j M_j^T (d_j x d_j), for dense tensors (exact HOSVD,
// the unfolding bound of the spectral norm) and for pairs of sparse sketches (Algorithm 2's
// N_j = M_j(A1) M_j(A2)^T), plus the top eigenvectors of a symmetric matrix.

#include <algorithm>
#include <vector>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "../core/types.hpp"
#include "../detail/gemm.hpp"
#include "../detail/validation.hpp"
#include "sparse_tensor.hpp"
#include "tensor_view.hpp"

namespace randattn::detail {

// The entries of a in flat row-major order: the view's own data when it is contiguous,
// otherwise a copy kept in `storage`.
template <typename Scalar>
const Scalar* row_major_data(const TensorView<Scalar>& a, Vector<Scalar>& storage) {
  if (a.is_contiguous()) return a.data();
  storage.resize(a.size());
  for_each_run(a, 0, a.size(), [&](Index flat0, const Scalar* p, Index stride, Index len) {
    for (Index t = 0; t < len; ++t) storage(flat0 + t) = p[t * stride];
  });
  return storage.data();
}

// G = M_j M_j^T for a contiguous row-major tensor, accumulated over panels of at most
// kMaxGemmDepth unfolding columns (copied into one buffer), so the rounding depends on the
// shape alone, never on the thread count. Only the lower triangle is accumulated; the result is
// the full symmetric matrix.
template <typename Scalar>
RowMatrix<Scalar> dense_mode_gram(const Scalar* data, const std::vector<Index>& dims, Index mode) {
  const ModeSplit split(dims, mode);
  const Index d = split.dim, cols = split.cols();
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> g = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>::Zero(d, d);
  RowMatrix<Scalar> panel(d, std::min(cols, kMaxGemmDepth));
  using Slice = Eigen::Map<const RowMatrix<Scalar>>;  // X_p = A[p, :, :] as d x inner
  for (Index c0 = 0; c0 < cols; c0 += kMaxGemmDepth) {
    const Index width = std::min(kMaxGemmDepth, cols - c0);
    for (Index c = c0; c < c0 + width;) {
      const Index p = c / split.inner, s = c % split.inner;
      const Index len = std::min(split.inner - s, c0 + width - c);
      panel.middleCols(c - c0, len) = Slice(data + p * d * split.inner, d, split.inner).middleCols(s, len);
      c += len;
    }
    g.template selfadjointView<Eigen::Lower>().rankUpdate(panel.leftCols(width));
  }
  return g.template selfadjointView<Eigen::Lower>();
}

// N = M_j(s1) M_j(s2)^T, summed column by column of the unfoldings: sum_c s1[:, c] s2[:, c]^T.
template <typename Scalar>
RowMatrix<Scalar> sketch_mode_product(const SparseTensor<Scalar>& s1, const SparseTensor<Scalar>& s2,
                                      Index mode) {
  const auto m1 = unfold<Eigen::ColMajor>(s1, mode);
  const auto m2 = unfold<Eigen::ColMajor>(s2, mode);
  RowMatrix<Scalar> n = RowMatrix<Scalar>::Zero(m1.rows(), m2.rows());
  using It = typename Eigen::SparseMatrix<Scalar, Eigen::ColMajor, Index>::InnerIterator;
  for (Index c = 0; c < m1.outerSize(); ++c) {
    for (It a(m1, c); a; ++a) {
      for (It b(m2, c); b; ++b) n(a.row(), b.row()) += a.value() * b.value();
    }
  }
  return n;
}

// The r eigenvectors of the symmetric matrix `sym` with the largest eigenvalues, as columns in
// decreasing order of eigenvalue. Each is signed so that its entry of largest magnitude is
// positive (eigenvectors are defined up to sign; this makes the output reproducible).
template <typename Scalar>
void top_eigenvectors(const RowMatrix<Scalar>& sym, Index r, RowMatrix<Scalar>& vectors,
                      Vector<Scalar>& values) {
  const Eigen::SelfAdjointEigenSolver<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>> eig(sym);
  require(eig.info() == Eigen::Success, "top_eigenvectors", "the eigensolver did not converge on a ",
          shape_of(sym), " matrix");
  const Index d = sym.rows();
  vectors.resize(d, r);
  values.resize(r);
  for (Index t = 0; t < r; ++t) {  // eigenvalues come in increasing order
    auto v = eig.eigenvectors().col(d - 1 - t);
    Index big = 0;
    v.cwiseAbs().maxCoeff(&big);
    vectors.col(t) = v[big] < 0 ? Vector<Scalar>(-v) : Vector<Scalar>(v);
    values(t) = eig.eigenvalues()(d - 1 - t);
  }
}

}  // namespace randattn::detail
