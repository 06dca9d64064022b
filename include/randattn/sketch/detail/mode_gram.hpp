#pragma once
// Gram matrices of mode unfoldings, G_j = M_j M_j^T (d_j x d_j), for dense tensors (exact HOSVD,
// the unfolding bound of the spectral norm) and for pairs of sparse sketches (Algorithm 2's
// N_j = M_j(A1) M_j(A2)^T), plus the top eigenvectors of a symmetric matrix.

#include <algorithm>
#include <cstdint>
#include <vector>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "../../core/types.hpp"
#include "../../detail/gemm.hpp"
#include "../../detail/validation.hpp"
#include "../../detail/vector_pool.hpp"
#include "../sparse_tensor.hpp"
#include "../tensor_view.hpp"

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
  auto update = [&](const auto& panel) {
    g.template selfadjointView<Eigen::Lower>().rankUpdate(panel);
  };
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

// The entries of a sparse tensor grouped by the column of its mode-j unfolding: column c holds
// entries start[c] .. start[c + 1] - 1, with their rows (the mode-j index) and values, in flat
// order within the column. A counting sort with 32-bit rows, into vectors of the thread's pool
// (vector_pool.hpp) that go back to it afterwards: a grouping is a few MB built six times per
// sketched HOSVD, and with its storage reused, keeping each entry's row and column from the
// counting pass is cheaper than locating the entry again.
template <typename Scalar>
struct ColumnGroups {
  std::vector<Index> start = VectorPool<Index>::take();
  std::vector<std::int32_t> row = VectorPool<std::int32_t>::take();
  std::vector<Scalar> value = VectorPool<Scalar>::take();

  ColumnGroups(const SparseTensor<Scalar>& s, const ModeSplit& split) {
    start.assign(std::size_t(split.cols()) + 1, 0);
    row.resize(std::size_t(s.nnz()));
    value.resize(std::size_t(s.nnz()));
    const std::vector<Index>& flat = s.indices();
    // Each entry's row and column, located once (the second pass reads them back).
    std::vector<Index> rc = VectorPool<Index>::take(2 * std::size_t(s.nnz()));
    rc.resize(2 * std::size_t(s.nnz()));
    for (Index e = 0; e < s.nnz(); ++e) {
      Index& r = rc[2 * std::size_t(e)];
      Index& c = rc[2 * std::size_t(e) + 1];
      split.locate(flat[std::size_t(e)], r, c);
      ++start[std::size_t(c) + 1];
    }
    for (std::size_t k = 1; k < start.size(); ++k) start[k] += start[k - 1];
    std::vector<Index> next = VectorPool<Index>::take(start.size() - 1);
    next.assign(start.begin(), start.end() - 1);
    for (Index e = 0; e < s.nnz(); ++e) {
      const std::size_t slot = std::size_t(next[std::size_t(rc[2 * std::size_t(e) + 1])]++);
      row[slot] = std::int32_t(rc[2 * std::size_t(e)]);
      value[slot] = s.values()[std::size_t(e)];
    }
    VectorPool<Index>::give(std::move(next));
    VectorPool<Index>::give(std::move(rc));
  }
  ~ColumnGroups() {
    VectorPool<Index>::give(std::move(start));
    VectorPool<std::int32_t>::give(std::move(row));
    VectorPool<Scalar>::give(std::move(value));
  }
  ColumnGroups(const ColumnGroups&) = delete;
  ColumnGroups& operator=(const ColumnGroups&) = delete;
};

// N = M_j(s1) M_j(s2)^T = sum over unfolding columns c of s1[:, c] s2[:, c]^T: both sketches
// grouped by column, then for every pair of entries sharing a column one multiply-add into the
// dense d x d result, row by row of s1. Cost O(nnz + columns + sum_c nnz_1(c) nnz_2(c)).
template <typename Scalar>
RowMatrix<Scalar> sketch_mode_product(const SparseTensor<Scalar>& s1,
                                      const SparseTensor<Scalar>& s2, Index mode) {
  require(mode >= 0 && mode < s1.order() && s1.dims() == s2.dims(), "sketch_mode_product", "mode ",
          mode, " of sketches of shapes ", dims_str(s1.dims()), " and ", dims_str(s2.dims()));
  const ModeSplit split(s1.dims(), mode);
  require(split.dim <= Index(INT32_MAX), "sketch_mode_product", "dimension ", split.dim,
          " of mode ", mode, " exceeds 2^31 - 1");
  const ColumnGroups<Scalar> m1(s1, split), m2(s2, split);
  const Index d = split.dim;
  RowMatrix<Scalar> n = RowMatrix<Scalar>::Zero(d, d);
  Scalar* out = n.data();
  for (Index c = 0; c < split.cols(); ++c) {
    const Index b0 = m2.start[std::size_t(c)], b1 = m2.start[std::size_t(c) + 1];
    if (b0 == b1) continue;
    for (Index a = m1.start[std::size_t(c)]; a < m1.start[std::size_t(c) + 1]; ++a) {
      Scalar* row = out + Index(m1.row[std::size_t(a)]) * d;
      const Scalar x = m1.value[std::size_t(a)];
      for (Index b = b0; b < b1; ++b) row[m2.row[std::size_t(b)]] += x * m2.value[std::size_t(b)];
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
  const Eigen::SelfAdjointEigenSolver<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>> eig(
      sym);
  require(eig.info() == Eigen::Success, "top_eigenvectors",
          "the eigensolver did not converge on a ", shape_of(sym), " matrix");
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
