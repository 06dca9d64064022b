#pragma once
// Gram matrices of mode unfoldings, G_j = M_j M_j^T (d_j x d_j), for dense tensors (exact HOSVD,
// the unfolding bound of the spectral norm) and for pairs of sparse sketches (Algorithm 2's
// N_j = M_j(A1) M_j(A2)^T), plus the top eigenvectors of a symmetric matrix.

#include <algorithm>
#include <cmath>
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

// The entries of one sketch in a block of `width` unfolding columns (inner indices c0 .. c0 +
// width - 1 of outer slab o), grouped by column: column c holds entries start[c] .. start[c +
// 1] - 1, rows in increasing order. The sketch's flat order sorts a slab by row, then column, so
// a counting sort in flat order keeps the rows increasing. A slab of at most kBlockColumns
// columns is one block, sorted in one sweep over its entries; a wider slab is cut into blocks,
// each row read from a cursor that the slab's blocks advance in turn, so the counters stay in
// cache and a block costs its entries plus one step per row.
template <typename Scalar>
struct ColumnBlock {
  static constexpr Index kBlockColumns = 1024;

  ColumnBlock(const SparseTensor<Scalar>& s, const ModeSplit& split)
      : flat_(s.indices().data()), values_(s.values().data()), nnz_(s.nnz()), split_(split) {}

  std::vector<Index> start;
  std::vector<std::int32_t> row;
  std::vector<Scalar> value;

  // The first entry at or after flat index f.
  Index first_at(Index f) const { return Index(std::lower_bound(flat_, flat_ + nnz_, f) - flat_); }

  // The whole slab o (split.inner <= kBlockColumns).
  void gather_slab(Index o) {
    const Index e0 = first_at(o * split_.dim * split_.inner),
                e1 = first_at((o + 1) * split_.dim * split_.inner);
    prepare(split_.inner, e1 - e0);
    Index* count = start.data() + 1;
    for (Index e = e0; e < e1; ++e) {
      const Index run = split_.run(flat_[e]), c = flat_[e] - run * split_.inner;
      column_[std::size_t(e - e0)] = std::int32_t(c);
      run_row_[std::size_t(e - e0)] = std::int32_t(run - o * split_.dim);
      ++count[c];
    }
    place(e1 - e0, [&](Index t) { return std::pair<Index, Index>(run_row_[std::size_t(t)], e0 + t); });
  }

  // Moves the row cursors to the runs of slab o (split.inner > kBlockColumns).
  void begin_slab(Index o) {
    cursor_.resize(std::size_t(split_.dim) + 1);
    for (Index i = 0; i <= split_.dim; ++i)
      cursor_[std::size_t(i)] = first_at((o * split_.dim + i) * split_.inner);
    run_end_.assign(cursor_.begin() + 1, cursor_.end());
  }
  // The block of columns c0 .. c0 + width - 1 of the slab begun last.
  void gather_block(Index o, Index c0, Index width) {
    start.assign(std::size_t(width) + 1, 0);
    Index* count = start.data() + 1;
    Index entries = 0;
    stop_.resize(std::size_t(split_.dim));
    for (Index i = 0; i < split_.dim; ++i) {
      const Index first = (o * split_.dim + i) * split_.inner + c0, limit = first + width;
      Index e = cursor_[std::size_t(i)];
      for (; e < run_end_[std::size_t(i)] && flat_[e] < limit; ++e) ++count[flat_[e] - first];
      stop_[std::size_t(i)] = e;
      entries += e - cursor_[std::size_t(i)];
    }
    grow(entries);
    finish_counts();
    for (Index i = 0; i < split_.dim; ++i) {
      const Index first = (o * split_.dim + i) * split_.inner + c0;
      for (Index& e = cursor_[std::size_t(i)]; e < stop_[std::size_t(i)]; ++e) {
        const std::size_t slot = std::size_t(next_[std::size_t(flat_[e] - first)]++);
        row[slot] = std::int32_t(i);
        value[slot] = values_[e];
      }
    }
  }

 private:
  void prepare(Index width, Index entries) {
    start.assign(std::size_t(width) + 1, 0);
    grow(entries);
    if (column_.size() < std::size_t(entries)) {
      column_.resize(std::size_t(entries));
      run_row_.resize(std::size_t(entries));
    }
  }
  void grow(Index entries) {
    if (row.size() < std::size_t(entries)) {
      row.resize(std::size_t(entries));
      value.resize(std::size_t(entries));
    }
  }
  // Counts to starts; next_ = the starts.
  void finish_counts() {
    for (std::size_t c = 1; c < start.size(); ++c) start[c] += start[c - 1];
    next_.assign(start.begin(), start.end() - 1);
  }
  // Places the `entries` counted entries in order; at(t) gives the t-th one's (row, entry).
  template <typename At>
  void place(Index entries, At at) {
    finish_counts();
    for (Index t = 0; t < entries; ++t) {
      const auto [r, e] = at(t);
      const std::size_t slot = std::size_t(next_[std::size_t(column_[std::size_t(t)])]++);
      row[slot] = std::int32_t(r);
      value[slot] = values_[e];
    }
  }

  const Index* flat_;
  const Scalar* values_;
  Index nnz_;
  const ModeSplit& split_;
  std::vector<Index> next_, cursor_, run_end_, stop_;
  std::vector<std::int32_t> column_, run_row_;
};

// out[ra, rb] += x_a y_b (one fused multiply-add each) for the entries a (rows ra, values x) and
// b of one unfolding column, whose rows are distinct. (A masked AVX-512 gather and scatter of
// the b measured slower than this loop for the handful of entries a column holds.)
template <typename Scalar>
void add_column_product(Scalar* out, Index d, const std::int32_t* ra, const Scalar* xa, Index na,
                        const std::int32_t* rb, const Scalar* yb, Index nb) {
  for (Index a = 0; a < na; ++a) {
    Scalar* row = out + Index(ra[a]) * d;
    for (Index b = 0; b < nb; ++b) row[rb[b]] = std::fma(xa[a], yb[b], row[rb[b]]);
  }
}

// N = M_j(s1) M_j(s2)^T = sum over unfolding columns c of s1[:, c] s2[:, c]^T, one multiply-add
// per pair of entries sharing a column, the columns in increasing order (so every entry of N
// sums its terms in the same order whatever the blocking). The sketches' flat order already
// sorts each outer slab by row, then column: a slab is taken in blocks of columns, each block's
// entries grouped in cache (ColumnBlock); for the last mode a column is a contiguous run of
// entries. Cost O(nnz + outer * dim * blocks + sum_c nnz_1(c) nnz_2(c)).
template <typename Scalar>
RowMatrix<Scalar> sketch_mode_product(const SparseTensor<Scalar>& s1,
                                      const SparseTensor<Scalar>& s2, Index mode) {
  require(mode >= 0 && mode < s1.order() && s1.dims() == s2.dims(), "sketch_mode_product", "mode ",
          mode, " of sketches of shapes ", dims_str(s1.dims()), " and ", dims_str(s2.dims()));
  const ModeSplit split(s1.dims(), mode);
  require(split.dim <= Index(INT32_MAX), "sketch_mode_product", "dimension ", split.dim,
          " of mode ", mode, " exceeds 2^31 - 1");
  const Index d = split.dim;
  RowMatrix<Scalar> n = RowMatrix<Scalar>::Zero(d, d);
  Scalar* out = n.data();
  if (split.inner == 1) {
    // Column o holds the entries with flat / d = o, contiguous in both sketches.
    const Index *f1 = s1.indices().data(), *f2 = s2.indices().data();
    const Scalar *v1 = s1.values().data(), *v2 = s2.values().data();
    const Index n1 = s1.nnz(), n2 = s2.nnz();
    for (Index a = 0, b = 0; a < n1 && b < n2;) {
      const Index ca = split.run_of_dim(f1[a]), cb = split.run_of_dim(f2[b]);
      if (ca != cb) {
        (ca < cb ? a : b) += 1;
        continue;
      }
      const Index first = ca * d;
      Index a1 = a, b1 = b;
      while (a1 < n1 && f1[a1] < first + d) ++a1;
      while (b1 < n2 && f2[b1] < first + d) ++b1;
      for (; a < a1; ++a) {
        Scalar* row = out + (f1[a] - first) * d;
        for (Index e = b; e < b1; ++e) row[f2[e] - first] = std::fma(v1[a], v2[e], row[f2[e] - first]);
      }
      b = b1;
    }
    return n;
  }
  ColumnBlock<Scalar> g1(s1, split), g2(s2, split);
  auto products = [&](Index width) {
    for (Index c = 0; c < width; ++c) {
      const Index a0 = g1.start[std::size_t(c)], a1 = g1.start[std::size_t(c) + 1];
      const Index b0 = g2.start[std::size_t(c)], b1 = g2.start[std::size_t(c) + 1];
      if (a0 == a1 || b0 == b1) continue;
      add_column_product(out, d, g1.row.data() + a0, g1.value.data() + a0, a1 - a0,
                         g2.row.data() + b0, g2.value.data() + b0, b1 - b0);
    }
  };
  const Index block = ColumnBlock<Scalar>::kBlockColumns;
  for (Index o = 0; o < split.outer; ++o) {
    if (split.inner <= block) {
      g1.gather_slab(o);
      g2.gather_slab(o);
      products(split.inner);
      continue;
    }
    g1.begin_slab(o);
    g2.begin_slab(o);
    for (Index c0 = 0; c0 < split.inner; c0 += block) {
      const Index width = std::min(block, split.inner - c0);
      g1.gather_block(o, c0, width);
      g2.gather_block(o, c0, width);
      products(width);
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
