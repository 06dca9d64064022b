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

// G = M_j M_j^T for a contiguous row-major tensor, accumulated (lower triangle only, by Eigen's
// symmetric rank-k update) over panels of at most kMaxGemmDepth unfolding columns read in
// place: for the last mode M_j is the column-major d x (D / d) matrix the data already are; for
// any other mode the columns of M_j are those of the row-major slices A[i_<j, :, i_>j], d x inner,
// cut into panels within each slice. The panels depend on the shape alone, so the rounding never
// depends on the thread count. The result is the full symmetric matrix.
template <typename Scalar>
RowMatrix<Scalar> dense_mode_gram(const Scalar* data, const std::vector<Index>& dims, Index mode) {
  using ColMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>;
  const ModeSplit split(dims, mode);
  const Index d = split.dim;
  ColMatrix g = ColMatrix::Zero(d, d);
  auto update = [&](const auto& panel) { g.template selfadjointView<Eigen::Lower>().rankUpdate(panel); };
  if (split.inner == 1) {
    const Eigen::Map<const ColMatrix> m(data, d, split.outer);
    for (Index c0 = 0; c0 < split.outer; c0 += kMaxGemmDepth)
      update(m.middleCols(c0, std::min(kMaxGemmDepth, split.outer - c0)));
  } else {
    for (Index o = 0; o < split.outer; ++o) {
      const Eigen::Map<const RowMatrix<Scalar>> slice(data + o * d * split.inner, d, split.inner);
      for (Index c0 = 0; c0 < split.inner; c0 += kMaxGemmDepth)
        update(slice.middleCols(c0, std::min(kMaxGemmDepth, split.inner - c0)));
    }
  }
  return g.template selfadjointView<Eigen::Lower>();
}

// N = M_j(s1) M_j(s2)^T = sum over unfolding columns c of s1[:, c] s2[:, c]^T: both sketches
// grouped by column (unfold), then for every pair of entries sharing a column one multiply-add
// into the dense d x d result, row by row of s1. Cost O(nnz + columns + sum_c nnz_1(c) nnz_2(c)).
template <typename Scalar>
RowMatrix<Scalar> sketch_mode_product(const SparseTensor<Scalar>& s1, const SparseTensor<Scalar>& s2,
                                      Index mode) {
  const auto m1 = unfold<Eigen::ColMajor>(s1, mode);
  const auto m2 = unfold<Eigen::ColMajor>(s2, mode);
  const Index d = m1.rows();
  RowMatrix<Scalar> n = RowMatrix<Scalar>::Zero(d, m2.rows());
  const Index *start1 = m1.outerIndexPtr(), *start2 = m2.outerIndexPtr();
  const Index *row1 = m1.innerIndexPtr(), *row2 = m2.innerIndexPtr();
  const Scalar *value1 = m1.valuePtr(), *value2 = m2.valuePtr();
  Scalar* out = n.data();
  for (Index c = 0; c < m1.outerSize(); ++c) {
    const Index b0 = start2[c], b1 = start2[c + 1];
    if (b0 == b1) continue;
    for (Index a = start1[c]; a < start1[c + 1]; ++a) {
      Scalar* row = out + row1[a] * n.cols();
      const Scalar x = value1[a];
      for (Index b = b0; b < b1; ++b) row[row2[b]] += x * value2[b];
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
