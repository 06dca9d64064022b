#pragma once
// The backward pass of exact attention (FlashAttention-2, Dao 2023, Algorithm 2, on the CPU):
// the forward keeps its output O and the row log-sum-exps L_i; the backward recomputes every
// score tile's probabilities P = exp(scale · Q Kᵀ − L) from them and, with D_i = dO_i · O_i,
//   dV += Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D 1ᵀ),   dQ += scale · dS K,   dK += scale · dSᵀ Q.
// Five products per tile against the forward's two; no n_q x n_k matrix: memory
// O((n_q + n_k) · (d + dv)) plus one tile per thread.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <initializer_list>
#include <limits>

#include <Eigen/Core>

#include "../detail/batch.hpp"
#include "../detail/gemm.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "detail/output_check.hpp"
#include "detail/score_tile.hpp"
#include "exact_attention.hpp"
#include "types.hpp"

namespace randattn {

// The forward of the backward pass: writes the same output into `out` as exact_attention_into,
// bit for bit, and returns the row log-sum-exps L_i = log Σ_j exp(scale · q_i·k_j) over each
// row's valid keys (n_q entries), which exact_attention_backward takes with the output.
template <typename DQ, typename DK, typename DV, typename DO>
Vector<typename DQ::Scalar> exact_attention_forward_into(const Eigen::MatrixBase<DQ>& q,
                                                         const Eigen::MatrixBase<DK>& k,
                                                         const Eigen::MatrixBase<DV>& v,
                                                         const Eigen::MatrixBase<DO>& out,
                                                         const ExactOptions& opt = {}) {
  const auto acc = detail::exact_attention_finalized(q, k, v, out, opt);
  Vector<typename DQ::Scalar> lse(acc.rows());
  acc.log_sum_exp_into(lse);
  return lse;
}

namespace detail {

// No NaN or +inf among the row log-sum-exps (−inf marks a row without weight).
template <typename Derived>
void require_log_sum_exps(const Eigen::DenseBase<Derived>& lse, const char* where) {
  const auto& x = lse.derived();
  for (Index i = 0; i < x.size(); ++i)
    require(x(i) < std::numeric_limits<typename Derived::Scalar>::infinity(), where, "lse(", i,
            ") = ", x(i), "; pass the row log-sum-exps of the forward (finite, or -inf for a row "
            "without weight)");
}

// The checks of exact_attention_backward's inputs (one slice) and its logit scale: those of the
// forward, then out, lse and grad_out against q, k and v; grad_out must be finite whatever
// check_finite says, and q, k, v and out are scanned when it is set.
template <typename Scalar>
Scalar check_exact_backward_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                   const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                   const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                   const Eigen::Ref<const RowMatrix<Scalar>>& out,
                                   const Eigen::Ref<const Vector<Scalar>>& lse,
                                   const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                                   const ExactOptions& opt) {
  const Scalar scale = check_exact_inputs<Scalar>(where, q, k, v, opt);
  require(!opt.exclude_self || q.rows() == k.rows(), where, "exclude_self needs as many queries (",
          q.rows(), ") as keys (", k.rows(), ")");
  require(out.rows() == q.rows() && out.cols() == v.cols(), where, "out is ", shape_of(out),
          ", expected ", q.rows(), "x", v.cols(), " (queries x value dimension)");
  require(grad_out.rows() == q.rows() && grad_out.cols() == v.cols(), where, "grad_out is ",
          shape_of(grad_out), ", expected ", q.rows(), "x", v.cols(),
          " (the shape of out: queries x value dimension)");
  require(lse.size() == q.rows(), where, "lse has ", lse.size(), " entries, expected one per query (",
          q.rows(), ")");
  require_finite(grad_out, where, "grad_out");
  require_log_sum_exps(lse, where);
  if (opt.check_finite) {
    check_attention_finite<Scalar>(where, q, k, v);
    require_finite(out, where, "out");
  }
  return scale;
}

// What every tile of one backward call reads and writes: the queries times the logit scale, the
// keys, values, row log-sum-exps L, D = rowsum(dO ∘ O) and dO, and the gradients, which the
// tiles accumulate (dq without its factor scale, applied once at the end).
template <typename Scalar>
struct ExactBackwardViews {
  Eigen::Ref<const RowMatrix<Scalar>> qs, k, v, grad_out;
  Eigen::Ref<const Vector<Scalar>> lse, delta;
  Eigen::Ref<RowMatrix<Scalar>> dq, dk, dv;
};

// One tile of the backward: queries [i0, i0 + br) against keys [j0, j0 + bc), through the score
// tile of the forward (the same logits, the same masks).
template <typename Scalar>
class ExactGradientTile {
 public:
  ExactGradientTile(Index max_rows, Index max_cols, bool causal, bool exclude_self)
      : tile_(max_rows, max_cols, 0), ds_(max_rows, max_cols) {
    mask_.causal = causal;
    mask_.exclude_self = exclude_self;
  }

  void accumulate(ExactBackwardViews<Scalar>& x, Index i0, Index br, Index j0, Index bc) {
    const auto qs = x.qs.middleRows(i0, br), go = x.grad_out.middleRows(i0, br);
    const auto k = x.k.middleRows(j0, bc), v = x.v.middleRows(j0, bc);
    tile_.logits(qs, k);
    tile_.mask(TileIndex::range(i0, br), TileIndex::range(j0, bc), mask_);
    tile_.exponentiate_from(x.lse.segment(i0, br));
    const auto p = tile_.scores();
    gemm_fixed_depth(x.dv.middleRows(j0, bc), p.transpose(), go, true);
    auto ds = ds_.topLeftCorner(br, bc);
    gemm_fixed_depth(ds, go, v.transpose(), false);
    for (Index t = 0; t < br; ++t)
      ds.row(t).array() = p.row(t).array() * (ds.row(t).array() - x.delta(i0 + t));
    gemm_fixed_depth(x.dq.middleRows(i0, br), ds, k, true);
    gemm_fixed_depth(x.dk.middleRows(j0, bc), ds.transpose(), qs, true);
  }

 private:
  ScoreTile<Scalar> tile_;
  Scratch<RowMatrix<Scalar>> ds_;
  TileMask<> mask_;
};

// The gradients of one slice into x.dq, x.dk, x.dv (overwritten), for checked inputs.
//
// Schedule. A tile (query block a, key block b) adds to dq's block a and to dk's and dv's block b.
// FlashAttention-2 loops over key blocks outside and adds to dQ with atomics, in an order that
// depends on the threads; two passes (dK, dV over key blocks, then dQ over query blocks) would
// recompute P and dP, seven products per tile instead of five. Here the tiles run in steps
// t = 0, 1, ...: step t holds the tiles (a, b) with a = (b + t) mod max(blocks), one per key block
// and at most one per query block, so the tiles of a step write disjoint blocks and run in
// parallel, and every gradient block sums its tiles in the order of the steps: one pass, five
// products per tile, and the same bits for any thread count.
template <typename Scalar>
void exact_backward_tiled(ExactBackwardViews<Scalar>& x, Scalar scale, bool causal,
                          bool exclude_self, Index block) {
  const Index n_q = x.qs.rows(), n_k = x.k.rows();
  x.dq.setZero();
  x.dk.setZero();
  x.dv.setZero();
  if (n_q == 0) return;
  const Index q_blocks = (n_q + block - 1) / block, k_blocks = (n_k + block - 1) / block;
  const Index steps = std::max(q_blocks, k_blocks);
  for (Index t = 0; t < steps; ++t) {
    parallel_for_with(
        k_blocks, [&] { return ExactGradientTile<Scalar>(block, block, causal, exclude_self); },
        [&](Index b, ExactGradientTile<Scalar>& tile) {
          const Index a = (b + t) % steps;
          // Causal: key blocks after the query block are skipped (n_q == n_k, the same blocks).
          if (a >= q_blocks || (causal && b > a)) return;
          tile.accumulate(x, a * block, std::min(block, n_q - a * block), b * block,
                          std::min(block, n_k - b * block));
        });
  }
  // The self rule's fallback: a query whose own key is its only key attends to it alone.
  if (exclude_self) {
    ExactGradientTile<Scalar> self(1, 1, false, false);
    for (Index i = 0; i < exact_rows_alone_with_self(n_q, n_k, causal); ++i)
      self.accumulate(x, i, 1, i, 1);
  }
  x.dq *= scale;
}

// The backward of one checked slice.
template <typename Scalar>
void exact_backward_slice(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                          const Eigen::Ref<const RowMatrix<Scalar>>& k,
                          const Eigen::Ref<const RowMatrix<Scalar>>& v,
                          const Eigen::Ref<const RowMatrix<Scalar>>& out,
                          const Eigen::Ref<const Vector<Scalar>>& lse,
                          const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                          Eigen::Ref<RowMatrix<Scalar>> dq, Eigen::Ref<RowMatrix<Scalar>> dk,
                          Eigen::Ref<RowMatrix<Scalar>> dv, Scalar scale, const ExactOptions& opt) {
  Scratch<RowMatrix<Scalar>> qs(q.rows(), q.cols());
  qs = scale * q;  // as the forward: the same logits
  Scratch<Vector<Scalar>> delta(q.rows());
  delta = (grad_out.array() * out.array()).rowwise().sum();
  ExactBackwardViews<Scalar> x{qs, k, v, grad_out, lse, delta, dq, dk, dv};
  exact_backward_tiled<Scalar>(x, scale, opt.causal, opt.exclude_self, exact_block_size(opt));
}

}  // namespace detail

// The gradients of <grad_out, O> with respect to q, k and v, for O = exact_attention(q, k, v, opt)
// given with its row log-sum-exps lse (exact_attention_forward_into, same options): dq (n_q x d),
// dk (n_k x d) and dv (n_k x dv) are overwritten, and share no memory with an input or with each
// other. A row without weight (lse = −inf) contributes nothing. Bad shapes or options, a
// non-finite grad_out or lse = NaN or +inf throw std::invalid_argument before anything is written;
// so do non-finite q, k, v or out under opt.check_finite. Results do not depend on the thread
// count.
template <typename Scalar>
void exact_attention_backward(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                              const Eigen::Ref<const RowMatrix<Scalar>>& k,
                              const Eigen::Ref<const RowMatrix<Scalar>>& v,
                              const Eigen::Ref<const RowMatrix<Scalar>>& out,
                              const Eigen::Ref<const Vector<Scalar>>& lse,
                              const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                              Eigen::Ref<RowMatrix<Scalar>> dq, Eigen::Ref<RowMatrix<Scalar>> dk,
                              Eigen::Ref<RowMatrix<Scalar>> dv, const ExactOptions& opt = {}) {
  const char* where = "exact_attention_backward";
  const Scalar scale =
      detail::check_exact_backward_inputs<Scalar>(where, q, k, v, out, lse, grad_out, opt);
  using detail::named_input, detail::shape_of;
  detail::require(dq.rows() == q.rows() && dq.cols() == q.cols(), where, "dq is ", shape_of(dq),
                  ", expected ", shape_of(q), " (the shape of q)");
  detail::require(dk.rows() == k.rows() && dk.cols() == k.cols(), where, "dk is ", shape_of(dk),
                  ", expected ", shape_of(k), " (the shape of k)");
  detail::require(dv.rows() == v.rows() && dv.cols() == v.cols(), where, "dv is ", shape_of(dv),
                  ", expected ", shape_of(v), " (the shape of v)");
  detail::check_written_apart(
      where, {named_input("dq", dq), named_input("dk", dk), named_input("dv", dv)},
      {named_input("q", q), named_input("k", k), named_input("v", v), named_input("out", out),
       named_input("lse", lse), named_input("grad_out", grad_out)});
  detail::exact_backward_slice<Scalar>(q, k, v, out, lse, grad_out, dq, dk, dv, scale, opt);
}

// The batched forward of the backward pass: exact_attention_batched's output, bit for bit, and
// every slice's row log-sum-exps in lse (batch, heads, n_q).
template <typename Scalar>
void exact_attention_forward_batched(const Scalar* q, const Scalar* k, const Scalar* v,
                                     Scalar* out, Scalar* lse, const BatchShape& shape,
                                     const ExactOptions& opt = {}) {
  const char* where = "exact_attention_forward_batched";
  detail::check_batch_shape(where, shape);
  detail::require(shape.slices() == 0 || shape.n_q == 0 || lse, where, "null data pointer (lse)");
  using detail::named_buffer;
  const Index slices = shape.slices();
  detail::check_written_apart(
      where, {named_buffer("lse", lse, slices * shape.n_q)},
      {named_buffer("q", q, slices * shape.n_q * shape.d),
       named_buffer("k", k, slices * shape.n_k * shape.d),
       named_buffer("v", v, slices * shape.n_k * shape.dv),
       named_buffer("out", out, slices * shape.n_q * shape.dv)});
  detail::exact_batched<Scalar>(where, q, k, v, out, lse, shape, opt);
}

// exact_attention_backward over contiguous row-major buffers: q, dq (batch, heads, n_q, d); k, dk
// (batch, heads, n_k, d); v, dv (batch, heads, n_k, dv); out, grad_out (batch, heads, n_q, dv);
// lse (batch, heads, n_q), from exact_attention_forward_batched. Every slice is checked before any
// gradient is written. Slices run in parallel (one slice: its tiles do), with results that do not
// depend on the thread count.
template <typename Scalar>
void exact_attention_backward_batched(const Scalar* q, const Scalar* k, const Scalar* v,
                                      const Scalar* out, const Scalar* lse, const Scalar* grad_out,
                                      Scalar* dq, Scalar* dk, Scalar* dv, const BatchShape& shape,
                                      const ExactOptions& opt = {}) {
  const char* where = "exact_attention_backward_batched";
  detail::check_batch_shape(where, shape);
  const Index slices = shape.slices();
  const Index n_q = shape.n_q, n_k = shape.n_k, d = shape.d, dv_cols = shape.dv;
  const bool keys = slices > 0 && n_k > 0;
  detail::require(
      slices == 0 || n_q == 0 || (q && k && v && out && lse && grad_out && dq && dk && dv), where,
      "null data pointer");
  detail::require(!keys || n_q > 0 || (dk && dv), where, "null data pointer (dk or dv)");
  using detail::named_buffer;
  detail::check_written_apart(
      where,
      {named_buffer("dq", dq, slices * n_q * d), named_buffer("dk", dk, slices * n_k * d),
       named_buffer("dv", dv, slices * n_k * dv_cols)},
      {named_buffer("q", q, slices * n_q * d), named_buffer("k", k, slices * n_k * d),
       named_buffer("v", v, slices * n_k * dv_cols), named_buffer("out", out, slices * n_q * dv_cols),
       named_buffer("lse", lse, slices * n_q),
       named_buffer("grad_out", grad_out, slices * n_q * dv_cols)});
  using detail::slice_of;
  const auto lse_of = [&](Index s) {
    return Eigen::Map<const Vector<Scalar>>(lse + s * n_q, n_q);
  };
  detail::for_each_slice(
      where, shape, true,
      [&](Index s) {
        detail::check_exact_backward_inputs<Scalar>(
            where, slice_of(q, s, n_q, d), slice_of(k, s, n_k, d), slice_of(v, s, n_k, dv_cols),
            slice_of(out, s, n_q, dv_cols), lse_of(s), slice_of(grad_out, s, n_q, dv_cols), opt);
      },
      [&](Index s) {
        // The checks above passed for every slice: the scale is the same for each.
        const Scalar scale = check_exact_options<Scalar>(where, opt, n_q, d);
        detail::exact_backward_slice<Scalar>(
            slice_of(q, s, n_q, d), slice_of(k, s, n_k, d), slice_of(v, s, n_k, dv_cols),
            slice_of(out, s, n_q, dv_cols), lse_of(s), slice_of(grad_out, s, n_q, dv_cols),
            slice_of(dq, s, n_q, d), slice_of(dk, s, n_k, d), slice_of(dv, s, n_k, dv_cols), scale,
            opt);
      });
  // No queries: no slice ran, and the key gradients are zero.
  if (n_q == 0 && keys) {
    std::fill(dk, dk + slices * n_k * d, Scalar(0));
    std::fill(dv, dv + slices * n_k * dv_cols, Scalar(0));
  }
}

}  // namespace randattn
