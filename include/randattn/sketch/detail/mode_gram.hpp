#pragma once
// Gram matrices of mode unfoldings, G_j = M_j M_j^T (d_j x d_j), for dense tensors (exact HOSVD,
// the unfolding bound of the spectral norm) and for pairs of sparse sketches (Algorithm 2's
// N_j = M_j(A1) M_j(A2)^T).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <Eigen/Core>

#include "../../core/types.hpp"
#include "../../detail/gemm.hpp"
#include "../../detail/parallel.hpp"
#include "../../detail/validation.hpp"
#include "../../detail/vector_pool.hpp"
#include "../../linalg/symmetric_top_eigen.hpp"
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
    finish_counts();
    for (Index t = 0; t < e1 - e0; ++t)
      place(column_[std::size_t(t)], run_row_[std::size_t(t)], e0 + t);
  }

  // Moves the row cursors to column c0 of slab o (split.inner > kBlockColumns).
  void begin_slab(Index o, Index c0) {
    cursor_.resize(std::size_t(split_.dim));
    run_end_.resize(std::size_t(split_.dim));
    for (Index i = 0; i < split_.dim; ++i) {
      const Index first = (o * split_.dim + i) * split_.inner;
      cursor_[std::size_t(i)] = first_at(first + c0);
      run_end_[std::size_t(i)] = first_at(first + split_.inner);
    }
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
      for (Index& e = cursor_[std::size_t(i)]; e < stop_[std::size_t(i)]; ++e)
        place(flat_[e] - first, std::int32_t(i), e);
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
  // Places entry e (row r of its slab) next in column c (after finish_counts).
  void place(Index c, std::int32_t r, Index e) {
    const std::size_t slot = std::size_t(next_[std::size_t(c)]++);
    row[slot] = r;
    value[slot] = values_[e];
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

// The columns of M_j cut into units of work: for the last mode (inner = 1) one column each, else
// one outer slab each, or one block of kBlockColumns columns of a slab when a slab is wider.
inline Index product_units(const ModeSplit& split, Index block) {
  if (split.inner == 1 || split.inner <= block) return split.outer;
  return split.outer * ((split.inner + block - 1) / block);
}

// out += sum over the columns c of units u0 .. u1 - 1 of s1[:, c] s2[:, c]^T (out: d x d,
// row-major): one fused multiply-add per pair of entries sharing a column, the columns in
// increasing order (so every entry of out sums its terms in the same order whatever the
// blocking). The sketches' flat order already sorts each outer slab by row, then column: a slab
// is taken in blocks of columns, each block's entries grouped in cache (ColumnBlock); for the
// last mode a column is a contiguous run of entries.
template <typename Scalar>
void add_mode_product(const SparseTensor<Scalar>& s1, const SparseTensor<Scalar>& s2,
                      const ModeSplit& split, Index u0, Index u1, Scalar* out) {
  const Index d = split.dim;
  if (split.inner == 1) {
    const Index *f1 = s1.indices().data(), *f2 = s2.indices().data();
    const Scalar *v1 = s1.values().data(), *v2 = s2.values().data();
    const Index n1 = Index(std::lower_bound(f1, f1 + s1.nnz(), u1 * d) - f1),
                n2 = Index(std::lower_bound(f2, f2 + s2.nnz(), u1 * d) - f2);
    Index a = Index(std::lower_bound(f1, f1 + n1, u0 * d) - f1),
          b = Index(std::lower_bound(f2, f2 + n2, u0 * d) - f2);
    while (a < n1 && b < n2) {
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
        for (Index e = b; e < b1; ++e)
          row[f2[e] - first] = std::fma(v1[a], v2[e], row[f2[e] - first]);
      }
      b = b1;
    }
    return;
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
  if (split.inner <= block) {
    for (Index o = u0; o < u1; ++o) {
      g1.gather_slab(o);
      g2.gather_slab(o);
      products(split.inner);
    }
    return;
  }
  const Index blocks = (split.inner + block - 1) / block;
  for (Index u = u0; u < u1; ++u) {
    const Index o = u / blocks, c0 = (u % blocks) * block,
                width = std::min(block, split.inner - c0);
    if (u == u0 || c0 == 0) {
      g1.begin_slab(o, c0);
      g2.begin_slab(o, c0);
    }
    g1.gather_block(o, c0, width);
    g2.gather_block(o, c0, width);
    products(width);
  }
}

// Each mode product is summed over this many consecutive ranges of units, in order, whatever
// the thread count; the ranges (of all the modes asked for) run in parallel.
constexpr Index kProductParts = 4;

// N_j = M_j(s1) M_j(s2)^T (d_j x d_j) for each mode j of `modes`. Cost O(nnz + sum_c nnz_1(c)
// nnz_2(c)) per mode, plus the cursors of wide slabs.
template <typename Scalar>
std::vector<RowMatrix<Scalar>> sketch_mode_products(const SparseTensor<Scalar>& s1,
                                                    const SparseTensor<Scalar>& s2,
                                                    const std::vector<Index>& modes) {
  std::vector<ModeSplit> splits;
  for (const Index mode : modes) {
    require(mode >= 0 && mode < s1.order() && s1.dims() == s2.dims(), "sketch_mode_product",
            "mode ", mode, " of sketches of shapes ", dims_str(s1.dims()), " and ",
            dims_str(s2.dims()));
    splits.emplace_back(s1.dims(), mode);
    require(splits.back().dim <= Index(INT32_MAX), "sketch_mode_product", "dimension ",
            splits.back().dim, " of mode ", mode, " exceeds 2^31 - 1");
  }
  const Index k = Index(modes.size()), P = kProductParts;
  std::vector<RowMatrix<Scalar>> n(static_cast<std::size_t>(k));
  // Part 0 sums into n[j] itself, the others into storage of the calling thread's pool.
  std::vector<std::vector<Scalar>> partial(static_cast<std::size_t>(k * P));
  for (Index task = 0; task < k * P; ++task) {
    const Index d = splits[std::size_t(task / P)].dim;
    if (task % P == 0) {
      n[std::size_t(task / P)] = RowMatrix<Scalar>::Zero(d, d);
    } else {
      partial[std::size_t(task)] = VectorPool<Scalar>::take(std::size_t(d * d));
      partial[std::size_t(task)].assign(std::size_t(d * d), Scalar(0));
    }
  }
  parallel_for(k * P, [&](Index task) {
    const Index part = task % P;
    const ModeSplit& split = splits[std::size_t(task / P)];
    const Index units = product_units(split, ColumnBlock<Scalar>::kBlockColumns);
    Scalar* out = part == 0 ? n[std::size_t(task / P)].data() : partial[std::size_t(task)].data();
    add_mode_product(s1, s2, split, units * part / P, units * (part + 1) / P, out);
  });
  for (Index task = 0; task < k * P; ++task) {
    if (task % P == 0) continue;
    std::vector<Scalar>& p = partial[std::size_t(task)];
    RowMatrix<Scalar>& sum = n[std::size_t(task / P)];
    sum += Eigen::Map<const RowMatrix<Scalar>>(p.data(), sum.rows(), sum.cols());
    VectorPool<Scalar>::give(std::move(p));
  }
  return n;
}

template <typename Scalar>
RowMatrix<Scalar> sketch_mode_product(const SparseTensor<Scalar>& s1,
                                      const SparseTensor<Scalar>& s2, Index mode) {
  return std::move(sketch_mode_products(s1, s2, {mode}).front());
}

}  // namespace randattn::detail
