#pragma once
// Exact softmax attention: a naive reference that forms the n_q x n_k score matrix, and a
// tiled online-softmax version (flash-attention style) that never does: each query block
// sweeps the key blocks and merges every block's partial [num | den] into the shared
// SoftmaxAccumulator. Memory O((n_q + n_k) * (d + dv)) plus one block of scores per thread.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include <Eigen/Core>

#include "../detail/batch.hpp"
#include "../detail/fresh_matrix.hpp"
#include "../detail/gemm.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "detail/output_check.hpp"
#include "exact_tile.hpp"
#include "input_checks.hpp"
#include "options.hpp"
#include "softmax_accumulator.hpp"
#include "types.hpp"

namespace randattn {

// causal, scale (default 1/sqrt(d)) and check_finite: see core/options.hpp.
struct ExactOptions : AttentionOptions {
  Index block_size = 0;  // query and key block length; 0 = automatic (128)
  // Queries and keys are the same positions (n_q == n_k): query i never attends to key i unless
  // it has no other key (n = 1, or position 0 under causal), as shared-QK LSH.
  bool exclude_self = false;
};

// The options of exact attention for n_q queries of dimension d (block_size, d >= 1 when there
// are queries, the scale) and its logit scale.
template <typename Scalar>
Scalar check_exact_options(const char* where, const ExactOptions& opt, Index n_q, Index d) {
  detail::require(opt.block_size >= 0 && opt.block_size <= detail::kMaxGemmDepth, where,
                  "block_size must be in [0, ", detail::kMaxGemmDepth, "], got ", opt.block_size);
  detail::require(n_q == 0 || d > 0, where, "d must be >= 1 (", n_q, " queries of dimension ", d,
                  ")");
  return detail::resolve_scale<Scalar>(where, opt, detail::inverse_sqrt_dim(d));
}

// The checks of exact attention's arguments and its logit scale: the shared shape and count
// contract (core/input_checks.hpp), block_size, d >= 1 when there are queries, and the scale.
// Finiteness is not scanned here: exact attention finds a NaN or Inf through its result (see
// detail::check_result_finite).
template <typename Scalar>
Scalar check_exact_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                          const Eigen::Ref<const RowMatrix<Scalar>>& k,
                          const Eigen::Ref<const RowMatrix<Scalar>>& v, const ExactOptions& opt) {
  check_attention_shapes<Scalar>(where, q, k, v);
  check_attention_counts(where, q.rows(), k.rows(), opt.causal);
  return check_exact_options<Scalar>(where, opt, q.rows(), q.cols());
}

// The tile length of exact attention: opt.block_size, or kDefaultExactTile for 0.
inline Index exact_block_size(const ExactOptions& opt) {
  return opt.block_size > 0 ? opt.block_size : kDefaultExactTile;
}

namespace detail {

// Names the first non-finite entry of q, k or v (see check_result_finite).
template <typename Scalar>
auto exact_input_scan(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                      const Eigen::Ref<const RowMatrix<Scalar>>& k,
                      const Eigen::Ref<const RowMatrix<Scalar>>& v) {
  return [=, &q, &k, &v] { check_attention_finite<Scalar>(where, q, k, v); };
}

// The leading rows of an exclude_self call that attend to their own key alone (the self rule's
// fallback): row 0 under causal masking, every row when there is a single key, none otherwise.
inline Index exact_rows_alone_with_self(Index n_q, Index n_k, bool causal) {
  return n_k == 0 ? 0 : causal ? 1 : (n_k == 1 ? n_q : 0);
}

template <typename Scalar>
SoftmaxAccumulator<Scalar> exact_tiled(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                       const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                       const Eigen::Ref<const RowMatrix<Scalar>>& v, Scalar scale,
                                       bool causal, Index block, bool exclude_self = false) {
  const Index n_q = q.rows(), n_k = k.rows(), dv = v.cols();
  SoftmaxAccumulator<Scalar> acc(n_q, dv);
  if (n_q == 0) return acc;
  Scratch<RowMatrix<Scalar>> qs(n_q, q.cols());
  qs = scale * q;
  const Index q_blocks = (n_q + block - 1) / block;
  // Query blocks are independent and each runs on one thread: results do not depend on the
  // thread count.
  parallel_for(q_blocks, [&](Index qb) {
    const Index i0 = qb * block, bq = std::min(block, n_q - i0);
    ExactTile<Scalar> tile(bq, block, dv, causal, exclude_self);
    // Causal: key blocks wholly after the query block are skipped.
    const Index k_end = causal ? i0 + bq : n_k;
    for (Index j0 = 0; j0 < k_end; j0 += block) {
      const Index bk = std::min(block, k_end - j0);
      tile.attend(qs.middleRows(i0, bq), i0, k.middleRows(j0, bk), v.middleRows(j0, bk), j0, acc,
                  i0);
    }
  });
  if (exclude_self && n_k > 0) {
    // The self rule's fallback: a query whose own key is its only key attends to it.
    ExactTile<Scalar> self(1, 1, dv, false);
    for (Index i = 0; i < exact_rows_alone_with_self(n_q, n_k, causal); ++i)
      self.attend(qs.middleRows(i, 1), i, k.middleRows(i, 1), v.middleRows(i, 1), i, acc, i);
  }
  return acc;
}

}  // namespace detail

// Unnormalised exact attention as an accumulator (for merging with other partial results).
template <typename Scalar>
SoftmaxAccumulator<Scalar> exact_attention_accumulate(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                                      const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                                      const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                      const ExactOptions& opt = {}) {
  const Scalar scale = check_exact_inputs<Scalar>("exact_attention", q, k, v, opt);
  const Index block = exact_block_size(opt);
  detail::require(!opt.exclude_self || q.rows() == k.rows(), "exact_attention",
                  "exclude_self needs as many queries (", q.rows(), ") as keys (", k.rows(), ")");
  SoftmaxAccumulator<Scalar> acc =
      detail::exact_tiled<Scalar>(q, k, v, scale, opt.causal, block, opt.exclude_self);
  const auto scan = detail::exact_input_scan<Scalar>("exact_attention", q, k, v);
  detail::check_accumulator_finite("exact_attention", acc, opt.check_finite, scan);
  return acc;
}

namespace detail {

// exact_attention_into's work: checks out, writes the output into it and returns the accumulator
// (for the row log-sum-exps of the forward of a backward pass).
template <typename DQ, typename DK, typename DV, typename DO>
SoftmaxAccumulator<typename DQ::Scalar> exact_attention_finalized(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DO>& out, const ExactOptions& opt) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value,
                "q, k, v and out must share the scalar type");
  const Eigen::Ref<const RowMatrix<Scalar>> qr(q), kr(k), vr(v);
  check_attention_output<Scalar>("exact_attention", out, qr, kr, vr);
  // Every row of an exact accumulator has den >= 1 (its maximal term is exp(0)).
  SoftmaxAccumulator<Scalar> acc = exact_attention_accumulate<Scalar>(qr, kr, vr, opt);
  acc.finalize_into(out);
  return acc;
}

}  // namespace detail

// softmax(scale * Q K^T [masked]) V, tiled, written into `out` (n_q x dv; a matrix, block, Map
// or Ref that shares no memory with q, k or v). A rejected `out` is not written.
template <typename DQ, typename DK, typename DV, typename DO>
void exact_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                          const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
                          const ExactOptions& opt = {}) {
  detail::exact_attention_finalized(q, k, v, out, opt);
}

// softmax(scale * Q K^T [masked]) V, tiled: q n_q x d, k n_k x d, v n_k x dv -> n_q x dv.
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> exact_attention(const Eigen::MatrixBase<DQ>& q,
                                               const Eigen::MatrixBase<DK>& k,
                                               const Eigen::MatrixBase<DV>& v,
                                               const ExactOptions& opt = {}) {
  auto out = detail::fresh_matrix<RowMatrix<typename DQ::Scalar>>(q.rows(), v.cols());
  exact_attention_into(q, k, v, out, opt);
  return out;
}

// Reference implementation: forms the full score matrix (O(n_q * n_k) memory). For tests and
// benchmarks; use exact_attention otherwise.
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> naive_attention(const Eigen::MatrixBase<DQ>& q,
                                               const Eigen::MatrixBase<DK>& k,
                                               const Eigen::MatrixBase<DV>& v,
                                               const ExactOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  const RowMatrix<Scalar> qm = q, km = k, vm = v;
  const Scalar scale = check_exact_inputs<Scalar>("naive_attention", qm, km, vm, opt);

  RowMatrix<Scalar> p = (scale * qm) * km.transpose();
  if (opt.causal) {
    for (Index i = 0; i < p.rows(); ++i)
      p.row(i).tail(p.cols() - i - 1).setConstant(-std::numeric_limits<Scalar>::infinity());
  }
  detail::require(!opt.exclude_self || qm.rows() == km.rows(), "naive_attention",
                  "exclude_self needs as many queries as keys");
  if (opt.exclude_self)  // the self rule: own key masked unless it is the only one
    for (Index i = 0; i < p.rows(); ++i)
      if (opt.causal ? i > 0 : p.cols() > 1) p(i, i) = -std::numeric_limits<Scalar>::infinity();
  for (Index i = 0; i < p.rows(); ++i) {
    p.row(i).array() = (p.row(i).array() - p.row(i).maxCoeff()).exp();
    p.row(i) /= p.row(i).sum();
  }
  RowMatrix<Scalar> out = p * vm;
  detail::check_result_finite("naive_attention", out, opt.check_finite,
                              detail::exact_input_scan<Scalar>("naive_attention", qm, km, vm));
  return out;
}

namespace detail {

// The batched forward, with the row log-sum-exps written into lse (slices x n_q entries, sharing
// no memory with the other buffers) unless it is null.
template <typename Scalar>
void exact_batched(const char* where, const Scalar* q, const Scalar* k, const Scalar* v,
                   Scalar* out, Scalar* lse, const BatchShape& shape, const ExactOptions& opt) {
  check_batch_qkv_output(where, shape, q, k, v, out);
  for_each_slice(
      where, shape, q && k && v && out,
      [&](Index s) {
        const auto qs = slice_of(q, s, shape.n_q, shape.d), ks = slice_of(k, s, shape.n_k, shape.d);
        const auto vs = slice_of(v, s, shape.n_k, shape.dv);
        check_exact_inputs<Scalar>(where, qs, ks, vs, opt);
        if (opt.check_finite) exact_input_scan<Scalar>(where, qs, ks, vs)();
      },
      [&](Index s) {
        auto o = slice_of(out, s, shape.n_q, shape.dv);
        const auto acc = exact_attention_accumulate<Scalar>(slice_of(q, s, shape.n_q, shape.d),
                                                            slice_of(k, s, shape.n_k, shape.d),
                                                            slice_of(v, s, shape.n_k, shape.dv), opt);
        acc.finalize_into(o);
        if (lse) acc.log_sum_exp_into(Eigen::Map<Vector<Scalar>>(lse + s * shape.n_q, shape.n_q));
      });
}

}  // namespace detail

// Batched multi-head exact attention over contiguous row-major buffers:
// q (batch, heads, n_q, d), k (batch, heads, n_k, d), v (batch, heads, n_k, dv) ->
// out (batch, heads, n_q, dv). Slices run in parallel, each on one thread, so results do not
// depend on the thread count.
template <typename Scalar>
void exact_attention_batched(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out,
                             const BatchShape& shape, const ExactOptions& opt = {}) {
  detail::exact_batched<Scalar>("exact_attention_batched", q, k, v, out, nullptr, shape, opt);
}

}  // namespace randattn
