#pragma once
// The backward of LSH attention (lsh_attention.hpp): dq, dk and dv of <dO, o> for an incoming
// gradient dO, all variants (shared QK and separate keys, sort-and-chunk and exact buckets, union
// and multiset rounds, causal, self rule, fallback).
//
// What is held constant: the hash codes, the sort orders and chunks, and the rows that needed
// the self rule or the fallback, all from the forward (LshResiduals). They are piecewise constant
// in the inputs, so away from ties of the hash the result is the gradient of the forward, equal to
// central finite differences of the same seeded call. The softmax over each row's union of
// targets is recomputed tile by tile from the row log-sum-exp L_i the forward kept: the backward
// walks the forward's own chunks and bucket tiles (for_each_chunk, BucketTiles) with the same
// masks and duplicate counts −log N_ij, so P_ij = exp(s_ij − log N_ij − L_i) (multiset: without
// the correction) and the tile backward of lsh/detail/tile_gradient.hpp applies.
//
// Shared QK: the keys are k̂_j = q_j / |q_j|, so dq_j also receives the path through k̂_j,
// (I − k̂_j k̂_jᵀ) dk̂_j / |q_j| (a zero row, whose key is 0, receives nothing on that path).
// A row that attended to its own key alone has o_i = v_i: dv_i += dO_i and nothing else.
//
// Determinism and memory: a round's chunks hold disjoint queries and disjoint keys, and each key
// is read by its own query chunk and by the next one; the first adds its key gradients to dk, dv,
// the second to a second pair of buffers, summed at the end, so no two tasks write one row and the
// result does not depend on the thread count. Exact buckets: a task owns whole buckets. Memory
// O(n (d + dv)) per slice beyond the forward's choices; never n x n.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/validation.hpp"
#include "detail/target_gradient.hpp"
#include "lsh_attention.hpp"

namespace randattn {

// What lsh_attention_forward keeps for lsh_attention_backward (one slice): the discrete choices of
// the forward, its options and scale, and the row log-sum-exp of its softmax. O(n r) integers and
// n scalars.
template <typename Scalar>
struct LshResiduals {
  LshOptions options;
  Scalar scale = 0;
  bool shared = false;
  Index n_q = 0, n_k = 0, dim = 0, value_dim = 0, buckets = 0;
  detail::LshChoices choices;
  Vector<Scalar> row_lse;  // L_i = log Σ_j (weights of row i), +inf for a row without weight
};

namespace detail {

// L_i = c_i + log den_i of a finished accumulator (+inf where den = 0: such a row has no weight,
// and exp(s − L) is 0 on it).
template <typename Scalar>
Vector<Scalar> row_log_sum_exp(const SoftmaxAccumulator<Scalar>& acc) {
  Vector<Scalar> lse(acc.rows());
  for (Index i = 0; i < acc.rows(); ++i) {
    const Scalar den = acc.denominator()(i);
    lse(i) = den > 0 ? acc.log_scale()(i) + std::log(den) : std::numeric_limits<Scalar>::infinity();
  }
  return lse;
}

// The checks of a backward call before anything is written: the shapes of grad_out and of the
// gradients against the forward's, and a finite grad_out.
template <typename Scalar>
void check_backward_shapes(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& out,
                           const Eigen::Ref<const RowMatrix<Scalar>>& grad_out, Index n_q, Index dv,
                           std::initializer_list<std::pair<const char*, std::pair<Index, Index>>>
                               gradients,
                           std::initializer_list<std::pair<Index, Index>> given) {
  require(out.rows() == n_q && out.cols() == dv, where, "out is ", shape_of(out), ", expected ",
          n_q, "x", dv, " (the forward's output)");
  require(grad_out.rows() == n_q && grad_out.cols() == dv, where, "grad_out is ",
          shape_of(grad_out), ", expected ", n_q, "x", dv, " (the output's shape)");
  auto g = given.begin();
  for (const auto& [name, shape] : gradients) {
    require(g->first == shape.first && g->second == shape.second, where, name, " is ", g->first,
            "x", g->second, ", expected ", shape.first, "x", shape.second);
    ++g;
  }
  require_finite(grad_out, where, "grad_out");
}

// The checks of a separate-key backward from a forward's saved state: q, k and v against the
// forward's shapes (n_q × dim, n_k × dim, n_k × value_dim), then out, grad_out and the gradients
// dq, dk, dv (check_backward_shapes).
template <typename Scalar>
void check_separate_key_backward(const char* where, Index n_q, Index n_k, Index dim,
                                 Index value_dim, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& out,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                                 const Eigen::Ref<RowMatrix<Scalar>>& dq,
                                 const Eigen::Ref<RowMatrix<Scalar>>& dk,
                                 const Eigen::Ref<RowMatrix<Scalar>>& dv) {
  require(q.rows() == n_q && q.cols() == dim && k.rows() == n_k && k.cols() == dim &&
              v.rows() == n_k && v.cols() == value_dim,
          where, "q (", shape_of(q), "), k (", shape_of(k), ") and v (", shape_of(v),
          ") are not the forward's shapes ", n_q, "x", dim, ", ", n_k, "x", dim, " and ", n_k, "x",
          value_dim);
  check_backward_shapes<Scalar>(
      where, out, grad_out, n_q, value_dim,
      {{"dq", {n_q, dim}}, {"dk", {n_k, dim}}, {"dv", {n_k, value_dim}}},
      {{dq.rows(), dq.cols()}, {dk.rows(), dk.cols()}, {dv.rows(), dv.cols()}});
}

// The backward of one slice; k null: shared QK (dk unused, dq carries both paths). Inputs
// checked by the caller; dq, dk, dv overwritten.
template <typename Scalar>
void lsh_backward(const LshResiduals<Scalar>& saved, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                  const Eigen::Ref<const RowMatrix<Scalar>>* k,
                  const Eigen::Ref<const RowMatrix<Scalar>>& v,
                  const Eigen::Ref<const RowMatrix<Scalar>>& out,
                  const Eigen::Ref<const RowMatrix<Scalar>>& grad_out, Eigen::Ref<RowMatrix<Scalar>> dq,
                  Eigen::Ref<RowMatrix<Scalar>>* dk, Eigen::Ref<RowMatrix<Scalar>> dv) {
  const LshOptions& opt = saved.options;
  const LshChoices& choice = saved.choices;
  const bool shared = k == nullptr;
  const Index n_q = q.rows(), n_k = shared ? n_q : k->rows(), d = q.cols(), dvs = v.cols();
  dq.setZero();
  if (dk) dk->setZero();
  dv.setZero();
  if (n_q == 0) return;
  Scratch<RowMatrix<Scalar>> queries(n_q, d), keys(n_k, d), values(n_k, dvs), go(n_q, dvs);
  lsh_operands(q, k, saved.scale, queries, keys);
  values = v;
  go = grad_out;
  Scratch<Vector<Scalar>> dot(n_q);
  dot = (go.array() * out.array()).rowwise().sum();
  // Gradients of the scaled queries and of the keys; the second pair takes, per round, what a
  // key gets from the query chunk after its own (sort-and-chunk).
  Scratch<RowMatrix<Scalar>> dqs(n_q, d), dks(n_k, d), dvk(n_k, dvs), dk_next(0, d),
      dv_next(0, dvs);
  dqs.setZero();
  dks.setZero();
  dvk.setZero();
  TargetProblem<Scalar> problem;
  problem.queries = &queries;
  problem.keys = &keys;
  problem.values = &values;
  problem.exclude_self = shared || opt.exclude_self;
  problem.causal = opt.causal;
  TargetRowGradients<Scalar> rows{&go, &saved.row_lse, &dot, &dqs};
  const KeyGradients<Scalar> own{&dks, &dvk};
  const auto make = [&] { return TargetBlockGradient<Scalar>(problem, rows); };
  if (!opt.exact_buckets) {
    const LshChunks& l = choice.chunks;
    const RoundSignatures sig = l.signatures();
    problem.dedupe = opt.dedupe ? &sig : nullptr;
    KeyGradients<Scalar> next = own;
    if (l.chunks > 1) {
      dk_next.resize(n_k, d);
      dv_next.resize(n_k, dvs);
      dk_next.setZero();
      dv_next.setZero();
      next = {&dk_next, &dv_next};
    }
    for (Index rho = 0; rho < l.rounds; ++rho)
      for_each_chunk(l, rho, make,
                     [&](TargetBlockGradient<Scalar>& kernel, const std::int32_t* r, Index nr,
                         const std::int32_t* cols, Index nc, Index split) {
                       kernel.backward(r, nr, cols, nc, split, own, next);
                     });
    if (l.chunks > 1) {
      dks += dk_next;
      dvk += dv_next;
    }
  } else {
    const HashCodes& qc = choice.query_codes;
    const HashCodes& kc = shared ? qc : choice.key_codes;
    const Index r = qc.cols(), b = saved.buckets;
    RoundSignatures sig{qc.data(), kc.data(), r, false, 0};
    TargetCounts counts;
    if (opt.dedupe && r > kCountTableRounds) {
      counts = bucket_target_counts(qc, kc, b);
      sig.counts = &counts;
    }
    problem.dedupe = opt.dedupe ? &sig : nullptr;
    BucketTiles tiles(n_q, n_k, b);
    PooledVector<Index> group_start;
    for (Index rho = 0; rho < r; ++rho) {
      tiles.sort(qc, kc, rho, shared);
      // Groups of whole buckets (a bucket's tiles share its keys), about as many rows as the
      // forward's tasks.
      const Index per_task = std::max<Index>(1, kChunkTokensPerTask / kTargetRowTile);
      group_start.assign(1, 0);
      for (Index t = 1; t < tiles.size(); ++t)
        if (tiles[t].k0 != tiles[t - 1].k0 && t - group_start.back() >= per_task)
          group_start.push_back(t);
      group_start.push_back(tiles.size());
      parallel_for(Index(group_start.size()) - 1, [&](Index g) {
        TargetBlockGradient<Scalar> kernel(problem, rows);
        for (Index t = group_start[g]; t < group_start[g + 1]; ++t)
          kernel.backward(tiles.rows(tiles[t]), tiles[t].nq, tiles.keys(tiles[t]), tiles[t].nk,
                          own);
      });
    }
  }
  problem.dedupe = nullptr;
  // The fallback rows against all keys, in one task (they share every key).
  if (!choice.fallback_rows.empty()) {
    PooledVector<std::int32_t> all(static_cast<std::size_t>(n_k));
    std::iota(all.begin(), all.end(), 0);
    TargetBlockGradient<Scalar> kernel(problem, rows);
    kernel.backward(choice.fallback_rows.data(), Index(choice.fallback_rows.size()), all.data(),
                    n_k, own);
  }
  for (std::int32_t i : choice.self_rows) dvk.row(i) += go.row(i);
  dq = saved.scale * dqs;
  dv = dvk;
  if (!shared) {
    *dk = dks;
    return;
  }
  // Through k̂ = x / |x|: (I − k̂ k̂ᵀ) dk̂ / |x|.
  for (Index j = 0; j < n_q; ++j) {
    const Scalar m = q.row(j).cwiseAbs().maxCoeff();
    if (m == Scalar(0)) continue;
    const Scalar norm = m * (q.row(j) / m).norm();
    const auto u = keys.row(j);
    dq.row(j) += (dks.row(j) - u.dot(dks.row(j)) * u) / norm;
  }
}

template <typename Scalar, typename DO>
LshResiduals<Scalar> lsh_forward(const CrossPolytopeHash<Scalar>& hash,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                 const Eigen::Ref<const RowMatrix<Scalar>>* k,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                 const Eigen::MatrixBase<DO>& out, const LshOptions& opt) {
  static_assert(std::is_same<Scalar, typename DO::Scalar>::value,
                "the inputs and out must share the scalar type");
  if (k) {
    check_output("lsh_attention_forward", out, q.rows(), v.cols(),
                 {named_input("q", q), named_input("k", *k), named_input("v", v)});
  } else {
    check_output("lsh_attention_forward", out, q.rows(), v.cols(),
                 {named_input("qk", q), named_input("v", v)});
  }
  LshResiduals<Scalar> saved;
  saved.options = opt;
  saved.scale = check_lsh_inputs<Scalar>("lsh_attention", q, k, v, hash, opt);
  saved.shared = k == nullptr;
  saved.n_q = q.rows();
  saved.n_k = k ? k->rows() : q.rows();
  saved.dim = q.cols();
  saved.value_dim = v.cols();
  saved.buckets = hash.buckets();
  int e = 0;
  const SoftmaxAccumulator<Scalar> acc =
      lsh_accumulate<Scalar>(q, k, v, hash, opt, &e, nullptr, &saved.choices);
  acc.finalize_into(out);
  unscale_output(out, e);
  saved.row_lse = row_log_sum_exp(acc);
  return saved;
}

}  // namespace detail

// Shared-QK LSH attention written into `out`, as lsh_attention_into (the same bits), keeping what
// lsh_attention_backward needs. qk n x d, v n x dv, out n x dv.
template <typename Scalar, typename DO>
LshResiduals<Scalar> lsh_attention_forward(const CrossPolytopeHash<Scalar>& hash,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& qk,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                           const Eigen::MatrixBase<DO>& out,
                                           const LshOptions& opt = {}) {
  return detail::lsh_forward<Scalar>(hash, qk, nullptr, v, out, opt);
}

// Separate keys: q n_q x d, k n_k x d, v n_k x dv, out n_q x dv.
template <typename Scalar, typename DO>
LshResiduals<Scalar> lsh_attention_forward(const CrossPolytopeHash<Scalar>& hash,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                           const Eigen::MatrixBase<DO>& out,
                                           const LshOptions& opt = {}) {
  return detail::lsh_forward<Scalar>(hash, q, &k, v, out, opt);
}

// The gradients of <grad_out, out> for shared-QK LSH attention: dqk (n x d, both the query and
// the key paths) and dv (n x dv), overwritten. qk, v and out as given to and written by
// lsh_attention_forward, unchanged since. Throws std::invalid_argument (nothing written) on shapes
// that disagree with the forward's or a non-finite grad_out.
template <typename Scalar>
void lsh_attention_backward(const LshResiduals<Scalar>& saved,
                            const Eigen::Ref<const RowMatrix<Scalar>>& qk,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v,
                            const Eigen::Ref<const RowMatrix<Scalar>>& out,
                            const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                            Eigen::Ref<RowMatrix<Scalar>> dqk, Eigen::Ref<RowMatrix<Scalar>> dv) {
  const char* where = "lsh_attention_backward";
  detail::require(saved.shared, where, "the forward had separate keys: pass q, k, dq and dk");
  detail::require(qk.rows() == saved.n_q && qk.cols() == saved.dim && v.rows() == saved.n_k &&
                      v.cols() == saved.value_dim,
                  where, "qk (", detail::shape_of(qk), ") and v (", detail::shape_of(v),
                  ") are not the forward's shapes ", saved.n_q, "x", saved.dim, " and ",
                  saved.n_k, "x", saved.value_dim);
  detail::check_backward_shapes<Scalar>(
      where, out, grad_out, saved.n_q, saved.value_dim,
      {{"dqk", {saved.n_q, saved.dim}}, {"dv", {saved.n_k, saved.value_dim}}},
      {{dqk.rows(), dqk.cols()}, {dv.rows(), dv.cols()}});
  detail::lsh_backward<Scalar>(saved, qk, nullptr, v, out, grad_out, dqk, nullptr, dv);
}

// Separate keys: dq (n_q x d), dk (n_k x d), dv (n_k x dv), overwritten.
template <typename Scalar>
void lsh_attention_backward(const LshResiduals<Scalar>& saved,
                            const Eigen::Ref<const RowMatrix<Scalar>>& q,
                            const Eigen::Ref<const RowMatrix<Scalar>>& k,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v,
                            const Eigen::Ref<const RowMatrix<Scalar>>& out,
                            const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                            Eigen::Ref<RowMatrix<Scalar>> dq, Eigen::Ref<RowMatrix<Scalar>> dk,
                            Eigen::Ref<RowMatrix<Scalar>> dv) {
  const char* where = "lsh_attention_backward";
  detail::require(!saved.shared, where, "the forward had shared QK: pass qk, dqk and no k");
  detail::check_separate_key_backward<Scalar>(where, saved.n_q, saved.n_k, saved.dim,
                                              saved.value_dim, q, k, v, out, grad_out, dq, dk, dv);
  detail::lsh_backward<Scalar>(saved, q, &k, v, out, grad_out, dq, &dk, dv);
}

}  // namespace randattn
