#pragma once
// Sparse-score attention through the shared core (the accumulator of core/softmax_accumulator.hpp):
// for a sparse nonnegative score matrix W_hat (n_q x n_k) the accumulator holds [num | den] = W_hat
// [V | 1].
//
// sparse_score_accumulate: the core step for any such W_hat (a SparseTensor of order 2 or a
//   row-major Eigen::SparseMatrix), with optional per-row log-scales.
// sparse_score_attention(_accumulate, _into): W_ij = exp(scale q_i.k_j - c_i), c_i = max_j of the
//   row's logits, sparsified by Algorithm 1 with a StreamingSparsifier fed with blocks of
//   block_size score rows (two passes, each recomputing the block's logits): memory
//   O(block_size * n_k + nnz), never the full score matrix. E[W_hat] = W, so [num | den] is
//   unbiased for softmax attention's numerator and denominator (the ratio is not).
//   With budget >= n_q * n_k every entry is kept and the result is exact attention up to rounding.
// A row of W_hat with no stored entry has den = 0 and finalizes to a zero row; the accumulator
// can be merged with others (e.g. an exact local window) before finalizing.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include <Eigen/Core>
#include <Eigen/SparseCore>

#include "../core/detail/output_check.hpp"
#include "../core/detail/score_tile.hpp"
#include "../core/exact_attention.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../detail/fresh_matrix.hpp"
#include "../detail/gemm.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "sparse_tensor.hpp"
#include "sparsify.hpp"

namespace randattn {

// causal, scale (default 1/sqrt(d)) and check_finite: see core/options.hpp.
struct SparseScoreOptions : AttentionOptions {
  double budget = 0;  // Algorithm 1's n for the n_q x n_k weight matrix
  std::uint64_t seed = 0;
  std::uint32_t stream = 0;
  Index block_size = 0;  // score rows computed at a time; 0 = automatic (64)
};

template <typename Scalar>
struct SparseScoreAttention {
  SoftmaxAccumulator<Scalar> accumulator;  // [num | den] = W_hat [V | 1], log-scales c_i
  SparseSketch<Scalar> weights;            // W_hat and the parameters of its sketch
};

namespace detail {

constexpr Index kSparseRowBlock = 64;

// [num | den] rows from row_entries(i, f), which calls f(column, weight) for row i's entries;
// rows in parallel blocks, each row summed by one thread in storage order.
template <typename Scalar, typename DV, typename RowEntries>
SoftmaxAccumulator<Scalar> sparse_numden(const char* where, Index rows,
                                         const Eigen::MatrixBase<DV>& v, Vector<Scalar> log_scale,
                                         RowEntries&& row_entries) {
  const Index dv = v.cols();
  // Pooled storage, given back by the accumulator's destructor.
  RowMatrix<Scalar> nd = MatrixPool<RowMatrix<Scalar>>::take(rows, dv + 1);
  nd.setZero();
  parallel_for((rows + kSparseRowBlock - 1) / kSparseRowBlock, [&](Index b) {
    for (Index i = b * kSparseRowBlock; i < std::min(rows, (b + 1) * kSparseRowBlock); ++i) {
      row_entries(i, [&](Index col, Scalar w) {
        nd.row(i).head(dv) += w * v.row(col);
        nd(i, dv) += w;
      });
    }
  });
  // A non-finite value row or an overflowing product shows in the small result.
  check_result_finite(where, nd, true, [&] { require_finite(v, where, "v"); });
  if (log_scale.size() == 0) {
    log_scale = MatrixPool<Vector<Scalar>>::take(rows);
    log_scale.setZero();
  }
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

template <typename Scalar, typename Values>
void check_sparse_scores(const char* where, Index rows, Index cols, const Values& values,
                         Index v_rows, Index log_scale_size) {
  require(cols == v_rows, where, "the score matrix is ", rows, "x", cols, " but v has ", v_rows,
          " rows");
  require(log_scale_size == 0 || log_scale_size == rows, where, log_scale_size, " log-scales for ",
          rows, " rows");
  for (const Scalar w : values) {
    require(w >= 0 && std::isfinite(w), where,
            "score weights must be finite and nonnegative, found ", w);
  }
}

}  // namespace detail

// [num | den] = W_hat [V | 1] for a sparse tensor of order 2 (n_q x n_k) and v (n_k x dv).
template <typename Scalar, typename DV>
SoftmaxAccumulator<Scalar> sparse_score_accumulate(const SparseTensor<Scalar>& w,
                                                   const Eigen::MatrixBase<DV>& v,
                                                   Vector<Scalar> log_scale = {}) {
  const char* where = "sparse_score_accumulate";
  detail::require(w.order() == 2, where, "the score tensor must have order 2, got shape ",
                  detail::dims_str(w.dims()));
  const Index rows = w.dim(0), cols = w.dim(1);
  detail::check_sparse_scores<Scalar>(where, rows, cols, w.values(), v.rows(), log_scale.size());
  const auto& idx = w.indices();
  return detail::sparse_numden<Scalar>(
      where, rows, v, std::move(log_scale), [&](Index i, auto&& f) {
        // Indices are sorted flat row-major, so row i is one contiguous range.
        auto e = std::lower_bound(idx.begin(), idx.end(), i * cols);
        for (; e != idx.end() && *e < (i + 1) * cols; ++e)
          f(*e - i * cols, w.values()[std::size_t(e - idx.begin())]);
      });
}

// The same for a row-major Eigen::SparseMatrix (n_q x n_k).
template <typename Scalar, typename StorageIndex, typename DV>
SoftmaxAccumulator<Scalar> sparse_score_accumulate(
    const Eigen::SparseMatrix<Scalar, Eigen::RowMajor, StorageIndex>& w,
    const Eigen::MatrixBase<DV>& v, Vector<Scalar> log_scale = {}) {
  using Matrix = Eigen::SparseMatrix<Scalar, Eigen::RowMajor, StorageIndex>;
  const char* where = "sparse_score_accumulate";
  std::vector<Scalar> values;
  for (Index i = 0; i < w.outerSize(); ++i)
    for (typename Matrix::InnerIterator it(w, i); it; ++it) values.push_back(it.value());
  detail::check_sparse_scores<Scalar>(where, w.rows(), w.cols(), values, v.rows(),
                                      log_scale.size());
  return detail::sparse_numden<Scalar>(where, w.rows(), v, std::move(log_scale),
                                       [&](Index i, auto&& f) {
                                         for (typename Matrix::InnerIterator it(w, i); it; ++it)
                                           f(Index(it.col()), it.value());
                                       });
}

// Sparsified softmax scores and their [num | den] (see the header comment).
template <typename Scalar>
SparseScoreAttention<Scalar> sparse_score_attention_accumulate(
    const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
    const Eigen::Ref<const RowMatrix<Scalar>>& v, const SparseScoreOptions& opt) {
  const char* where = "sparse_score_attention";
  ExactOptions exact;
  static_cast<AttentionOptions&>(exact) = opt;
  const Scalar scale = check_exact_inputs<Scalar>(where, q, k, v, exact);
  detail::require(opt.block_size >= 0, where, "block_size must be >= 0, got ", opt.block_size);
  const Index n_q = q.rows(), n_k = k.rows();
  const Index rows = std::min(opt.block_size > 0 ? opt.block_size : detail::kSparseRowBlock,
                              std::max<Index>(n_q, 1));

  SparsifyOptions sp;
  sp.budget = opt.budget;
  sp.seed = opt.seed;
  sp.stream = opt.stream;
  StreamingSparsifier<Scalar> sparsifier({n_q, n_k}, sp);
  detail::Scratch<RowMatrix<Scalar>> qs(n_q, q.cols());
  qs = scale * q;
  // A tile spans whole score rows, so its rows in order are the weights in flat index order.
  detail::ScoreTile<Scalar> tile(rows, n_k, v.cols());
  detail::TileMask<> mask;
  mask.causal = opt.causal;
  Vector<Scalar> log_scale = detail::MatrixPool<Vector<Scalar>>::take(n_q);
  // Every row of W in order, computed identically in both passes: feed(weights, n_k) per row.
  auto for_each_row = [&](auto&& feed) {
    for (Index i0 = 0; i0 < n_q; i0 += rows) {
      const Index bq = std::min(rows, n_q - i0);
      tile.logits(qs.middleRows(i0, bq), k);
      tile.mask(detail::TileIndex::range(i0, bq), detail::TileIndex::range(0, n_k), mask);
      tile.exponentiate();
      log_scale.segment(i0, bq) = tile.row_max();
      for (Index t = 0; t < bq; ++t) feed(tile.scores().row(t).data(), n_k);
    }
  };
  for_each_row([&](const Scalar* w, Index count) { sparsifier.add_norm_block(w, count); });
  for_each_row([&](const Scalar* w, Index count) { sparsifier.add_sample_block(w, count); });
  SparseSketch<Scalar> w = sparsifier.finish();
  SoftmaxAccumulator<Scalar> acc = sparse_score_accumulate(w, v, std::move(log_scale));
  return {std::move(acc), std::move(w)};
}

// Normalised sparse-score attention (rows with no sampled key are zero), written into `out`
// (n_q x dv; a matrix, block, Map or Ref that shares no memory with q, k or v). A rejected `out`
// is not written. The sketch's storage goes back to the calling thread's pool, so a loop of calls
// with the same shapes reuses it.
template <typename DQ, typename DK, typename DV, typename DO>
void sparse_score_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
                                 const SparseScoreOptions& opt) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value,
                "q, k, v and out must share the scalar type");
  const Eigen::Ref<const RowMatrix<Scalar>> qr(q), kr(k), vr(v);
  detail::check_attention_output<Scalar>("sparse_score_attention", out, qr, kr, vr);
  SparseScoreAttention<Scalar> r = sparse_score_attention_accumulate<Scalar>(qr, kr, vr, opt);
  r.accumulator.finalize_into(out);
  detail::recycle(static_cast<SparseTensor<Scalar>&&>(r.weights));
}

// Normalised sparse-score attention (rows with no sampled key are zero).
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> sparse_score_attention(const Eigen::MatrixBase<DQ>& q,
                                                      const Eigen::MatrixBase<DK>& k,
                                                      const Eigen::MatrixBase<DV>& v,
                                                      const SparseScoreOptions& opt) {
  auto out = detail::fresh_matrix<RowMatrix<typename DQ::Scalar>>(q.rows(), v.cols());
  sparse_score_attention_into(q, k, v, out, opt);
  return out;
}

}  // namespace randattn
