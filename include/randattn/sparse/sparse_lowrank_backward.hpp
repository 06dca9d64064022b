#pragma once
// The backward of sparse + low-rank attention (sparse_lowrank_attention.hpp): dq, dk and dv of
// <dO, o> for an incoming gradient dO, for every support and remainder.
//
// Merged normalisation. Every part of the forward is a sum of terms c [v_j | 1] (exact terms
// c = exp(s_ij), s_ij = scale q_i·k_j; sampled terms c = w_ij exp(s_ij), w_ij = 1/p_ij; feature
// terms c = φ(q_i)ᵀ diag(σ) φ(k_j), with a minus sign on the support's correction), and
// o_i = Σ c v_j / Σ c over all parts merged. So whatever part a term belongs to,
//   ∂<dO, o>/∂c = (dO_i·v_j − δ_i) / D_i,   ∂<dO, o>/∂v_j = (c / D_i) dO_i,
// with δ_i = dO_i·o_i and D_i = exp(L_i) the merged denominator: each part's log-scale cancels
// against the merged one, so every part is differentiated as one softmax with the merged row
// log-sum-exp L_i and δ_i, both kept or recomputed from the forward.
//  - Exact and sampled terms: P_ij = w_ij exp(s_ij − L_i), dS_ij = P_ij (dO_i·v_j − δ_i) (the
//    softmax backward of FlashAttention, on gathered pairs), dq_i += scale Σ_j dS_ij k_j,
//    dk_j += scale Σ_i dS_ij q_i, dv_j += Σ_i P_ij dO_i.
//  - The feature remainder R_i = φ(q_i)ᵀ σ Σ_{valid j} φ(k_j) [v_j | 1] − Σ_{j ∈ S'_i} (the same
//    pair terms), S'_i the keys it leaves out. Its linear part goes through the linear core's
//    backward (core/linear_backward.hpp), which forms the cotangent [dO_i | −dO_i·O_i] / D^lin_i
//    from its (out, grad_out) and its own denominator D^lin_i: given (o, λ dO) with
//    λ_i = D^lin_i / D_i it forms exactly the merged cotangent (one recomputation of the linear
//    part's denominators). The correction's pairs are summed like the softmax pairs, with
//    weights φ(q_i)ᵀσφ(k_j) / D_i in place of P_ij. The feature cotangents then go through the
//    map's vector–Jacobian product (features_vjp; maps with has_features_vjp).
//  - The sampled remainder's probabilities: in the proportional regime of its rule,
//    p_ib = s u_ib / Σ_b' n_ib' u_ib' with u_ib = exp(scale ub_ib) and ub_ib = q_i⁺·M_b + q_i⁻·m_b
//    the bound of key block b (block_bounds.hpp), so ∂L/∂log w_ij = dS_ij reaches q_i through the
//    bound (M_b where q_ic > 0, m_b where q_ic < 0) and the keys holding each block's largest and
//    smallest coordinates. With a clusters support the groups are clusters and u_ic = exp(B_ic),
//    B_ic = scale·q_i·c + |scale|·‖q_i‖·r_c: the gradient reaches q_i, the centroid (a mean of
//    keys) and the key at the radius (cluster_support.hpp). The floor s / N_i and the cap 1 are
//    constants. This is the gradient of the same estimate, drawn with the same random numbers.
//
// What is held constant: the forward's discrete choices, kept by sparse_lowrank_forward: every
// support set (hash chunks or buckets, filters, window, block ranking, the fallback, the self
// rule), the drawn keys, each sampling probability's regime (cap, floor or proportional), the
// rows whose feature remainder the denominator rule dropped, and the keys holding the block
// bounds' extremes. Away from ties (a 1e-5 perturbation flips none of them with any real
// probability) the result is the gradient of the forward, equal to central finite differences
// of the same seeded call. Key centring (centre_keys) changes only these choices: the logits
// use the raw keys and the sampling bounds of a row all shift by the same −scale q_i·μ, which
// cancels in p; the mean μ is held constant, and its continuous effect is zero. The forward
// merges the remainder without a denominator guard (a remainder whose denominator is not
// positive is dropped instead; FeatureRemainder::denominator_epsilon is only validated), so there
// is no guard to differentiate.
//
// Not supported: LSH with exact buckets alone as the support over multiset rounds
// (exact_buckets, dedupe = false), whose own kernel weighs a pair by its round count: the backward
// throws std::invalid_argument. (Sort-and-chunk LSH alone, multiset or not, is differentiated on
// its own chunks, below.) A feature map without features_vjp does not compile.
//
// Execution, never n_q x n_k. With sort-and-chunk LSH alone as the support the forward computed
// E with LSH's own kernel and a feature correction chunk by chunk, and the backward walks the same
// chunks: E through LSH's backward (lsh_gradient.hpp, on the tiles of lsh/detail/
// target_gradient.hpp) with the merged L_i, the correction as one pair tile per query chunk and
// its key chunks; both as matrix products. Otherwise the pairs (the support's, the drawn keys, the
// correction's) are listed per query row (CSR): pass A, query rows in parallel, gathers each row's
// keys and values, keeps every pair's weight and derivative and sums the query's gradient; pass
// B, keys in parallel, sums the keys' gradients over the pairs transposed (every key's rows in
// increasing order). No two tasks write one row: results do not depend on the thread count.
// Memory O(pairs) scalars and indices plus O(n (d + dv + M)), M the feature dimension.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../attention/random_feature_backward.hpp"
#include "../core/linear_backward.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/gemm.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/validation.hpp"
#include "../lsh/lsh_gradient.hpp"  // detail::check_separate_key_backward
#include "block_bounds.hpp"
#include "key_centring.hpp"
#include "sparse_lowrank_attention.hpp"

namespace randattn {

// What sparse_lowrank_forward keeps for sparse_lowrank_backward: the options and scale, the
// discrete choices of the forward (support sets, draws, dropped rows), the remainder (a feature
// remainder refers to its map, which must outlive this) and the merged row log-sum-exps.
template <typename Scalar, typename Remainder = NoRemainder>
struct SparseLowRankSaved {
  Scalar scale = 0;
  SparseLowRankOptions options;
  Index n_q = 0, n_k = 0, dim = 0, value_dim = 0;
  std::optional<Remainder> remainder;
  detail::SparseLowRankChoices<Scalar> choices;
  TargetSets drawn;                  // sampled remainder: each row's drawn keys
  std::vector<Scalar> drawn_weight;  // their weights 1/p, in the order of drawn.keys
  Vector<Scalar> row_lse;  // L_i = log of row i's merged denominator; −inf: a row without weight
  // E by sort-and-chunk LSH's own kernel: what its backward needs, with the merged L_i.
  std::optional<LshResiduals<Scalar>> lsh_kernel;
};

namespace detail {

// The pairs of per-row key lists, transposed: for every key the entries that list it, rows
// increasing, each with its position in the row-major list.
struct PairsByKey {
  PooledVector<Index> start;       // n_k + 1
  PooledVector<std::int32_t> row;  // per entry: the query row
  PooledVector<Index> pair;        // per entry: the position in pairs.keys
};

inline PairsByKey pairs_by_key(const TargetSets& pairs, Index n_k) {
  const std::size_t total = pairs.keys.size();
  PairsByKey t{PooledVector<Index>(std::size_t(n_k) + 1), PooledVector<std::int32_t>(total),
               PooledVector<Index>(total)};
  for (std::int32_t j : pairs.keys) ++t.start[std::size_t(j) + 1];
  for (Index j = 0; j < n_k; ++j) t.start[std::size_t(j) + 1] += t.start[std::size_t(j)];
  PooledVector<Index> next(static_cast<std::size_t>(n_k));
  std::copy(t.start.begin(), t.start.end() - 1, next.begin());
  for (Index i = 0; i < pairs.rows(); ++i)
    for (Index p = pairs.start[std::size_t(i)]; p < pairs.start[std::size_t(i) + 1]; ++p) {
      const Index at = next[std::size_t(pairs.keys[std::size_t(p)])]++;
      t.row[std::size_t(at)] = static_cast<std::int32_t>(i);
      t.pair[std::size_t(at)] = p;
    }
  return t;
}

constexpr Index kGradientKeysPerTask = 256;

// Gradients through pair terms on per-row key lists `pairs` (n_q rows over the rows of y): row
// i's term for key j is c_ij [v_j | 1] with c_ij a function of the product x_i·y_j.
// terms(i, cols, count, dots, dp, c, z) gets row i's keys cols[0, count) with dots = x_i·y_j and
// dp = dO_i·v_j and writes c = c_ij / D_i (what dv_j receives per unit of dO_i) and
// z = ∂L/∂(x_i·y_j); rows with live(i) false carry nothing. Adds Σ_j z_ij y_j to dx_i,
// Σ_i z_ij x_i to dy_j and Σ_i (c_ij / D_i) dO_i to dv_j, and leaves z per pair (in the order of
// pairs.keys) in `z`. Pass A (query rows in parallel) keeps c and z per pair; pass B (keys in
// parallel) sums them over the transposed pairs: the result does not depend on the thread count.
template <typename Scalar, typename Live, typename Terms>
void pair_gradients(const TargetSets& pairs, const Eigen::Ref<const RowMatrix<Scalar>>& x,
                    const Eigen::Ref<const RowMatrix<Scalar>>& y,
                    const Eigen::Ref<const RowMatrix<Scalar>>& v,
                    const Eigen::Ref<const RowMatrix<Scalar>>& go, Live&& live, Terms&& terms,
                    Eigen::Ref<RowMatrix<Scalar>> dx, Eigen::Ref<RowMatrix<Scalar>> dy,
                    Eigen::Ref<RowMatrix<Scalar>> dv, Eigen::Ref<Vector<Scalar>> z) {
  const Index n_q = pairs.rows(), n_k = y.rows(), dim = y.cols(), dvs = v.cols();
  if (pairs.pairs() == 0) return;
  Scratch<Vector<Scalar>> c(pairs.pairs());
  Index widest = 0;
  for (Index i = 0; i < n_q; ++i) widest = std::max(widest, pairs.size(i));
  struct Rows {  // one row's gathered keys and values, and its products
    Scratch<RowMatrix<Scalar>> keys, values;
    Scratch<Vector<Scalar>> dots, dp;
  };
  const auto make = [&] {
    return Rows{Scratch<RowMatrix<Scalar>>(widest, dim), Scratch<RowMatrix<Scalar>>(widest, dvs),
                Scratch<Vector<Scalar>>(widest), Scratch<Vector<Scalar>>(widest)};
  };
  // Pass A: row i's pairs, its gradient, and c and z kept per pair.
  const auto row = [&](Index i, Rows& s) {
    const Index p0 = pairs.start[std::size_t(i)], count = pairs.size(i);
    if (count == 0) return;
    auto ci = c.segment(p0, count);
    auto zi = z.segment(p0, count);
    if (!live(i)) {
      ci.setZero();
      zi.setZero();
      return;
    }
    const std::int32_t* cols = pairs.begin(i);
    auto keys = s.keys.topRows(count);
    auto values = s.values.topRows(count);
    for (Index u = 0; u < count; ++u) {
      keys.row(u) = y.row(cols[u]);
      values.row(u) = v.row(cols[u]);
    }
    auto dots = s.dots.head(count);
    auto dp = s.dp.head(count);
    dots.noalias() = keys * x.row(i).transpose();
    dp.noalias() = values * go.row(i).transpose();
    terms(i, cols, count, dots, dp, ci, zi);
    dx.row(i).noalias() += zi.transpose() * keys;
  };
  parallel_for_with((n_q + kTargetRowsPerTask - 1) / kTargetRowsPerTask, make,
                    [&](Index t, Rows& s) {
                      const Index end = std::min(n_q, (t + 1) * kTargetRowsPerTask);
                      for (Index i = t * kTargetRowsPerTask; i < end; ++i) row(i, s);
                    });
  // Pass B: every key's pairs, rows increasing.
  const PairsByKey by_key = pairs_by_key(pairs, n_k);
  parallel_for((n_k + kGradientKeysPerTask - 1) / kGradientKeysPerTask, [&](Index t) {
    for (Index j = t * kGradientKeysPerTask; j < std::min(n_k, (t + 1) * kGradientKeysPerTask); ++j)
      for (Index e = by_key.start[std::size_t(j)]; e < by_key.start[std::size_t(j) + 1]; ++e) {
        const Index i = by_key.row[std::size_t(e)], p = by_key.pair[std::size_t(e)];
        dy.row(j) += z(p) * x.row(i);
        dv.row(j) += c(p) * go.row(i);
      }
  });
}

// The terms of softmax pairs for pair_gradients, x the scaled queries and y the keys: c = P_ij =
// w_ij exp(s_ij − L_i) and z = dS_ij = P_ij (dO_i·v_j − δ_i); `weight` (per pair of `pairs`, or
// null for all 1) the sampled keys' 1/p.
template <typename Scalar>
auto softmax_terms(const TargetSets& pairs, const Scalar* weight, const Vector<Scalar>& lse,
                   const Vector<Scalar>& delta) {
  return [&pairs, weight, &lse, &delta](Index i, const std::int32_t*, Index count, const auto& dots,
                                        const auto& dp, auto&& c, auto&& z) {
    c = (dots.array() - lse(i)).exp().matrix();
    if (weight)
      c.array() *=
          Eigen::Map<const Vector<Scalar>>(weight + pairs.start[std::size_t(i)], count).array();
    z = (c.array() * (dp.array() - delta(i))).matrix();
  };
}

// The keys holding each block's largest and smallest coordinate (the first of equal ones), and
// those coordinates: where the block bounds' derivatives go.
template <typename Scalar>
struct BlockExtremes {
  Scratch<RowMatrix<Scalar>> hi, lo;  // blocks x d
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> arg_hi, arg_lo;

  BlockExtremes(const Eigen::Ref<const RowMatrix<Scalar>>& k, Index block, Index blocks)
      : hi(blocks, k.cols()),
        lo(blocks, k.cols()),
        arg_hi(blocks, k.cols()),
        arg_lo(blocks, k.cols()) {
    for (Index b = 0; b < blocks; ++b) {
      const Index j0 = b * block, j1 = std::min(k.rows(), j0 + block);
      hi.row(b) = lo.row(b) = k.row(j0);
      arg_hi.row(b).setConstant(std::int32_t(j0));
      arg_lo.row(b).setConstant(std::int32_t(j0));
      for (Index j = j0 + 1; j < j1; ++j)
        for (Index c = 0; c < k.cols(); ++c) {
          if (k(j, c) > hi(b, c)) {
            hi(b, c) = k(j, c);
            arg_hi(b, c) = std::int32_t(j);
          }
          if (k(j, c) < lo(b, c)) {
            lo(b, c) = k(j, c);
            arg_lo(b, c) = std::int32_t(j);
          }
        }
    }
  }
};

// ∂L/∂(bound of group b) per query (gamma, n_q x groups, in the units of the proposal's bounds),
// through the sampled remainder's probabilities: with ds = ∂L/∂log w per drawn pair (w = 1/p, so
// ∂L/∂log p = −ds) and, for a group b in the proportional regime, log p_ib = log s + f ub_ib −
// log Σ_b' n_ib' exp(f ub_ib') (f the proposal's bound_scale):
//   ∂L/∂ub_ib' = f (π_ib' Σ_{b prop.} Z_ib − [b' prop.] Z_ib'),
// Z_ib the sum of ds over the row's keys drawn from group b and π_ib' = n_ib' exp(f ub_ib') /
// Σ_b n_ib exp(f ub_ib). The floor s / N_i and the cap 1 are constants. Rows in parallel, each
// written by one thread.
template <typename Scalar, typename Proposal>
void sampling_gamma(const Eigen::Ref<const RowMatrix<Scalar>>& q, const Proposal& proposal,
                    const SampledDraws<Scalar>& draws, const TargetSets& drawn,
                    const Eigen::Ref<const Vector<Scalar>>& ds, const SampledRemainder& rule,
                    Eigen::Ref<RowMatrix<Scalar>> gamma) {
  const Index n_q = q.rows(), groups = proposal.groups();
  const double f = proposal.bound_scale();
  gamma.setZero();
  constexpr Index kRows = 64;
  parallel_for((n_q + kRows - 1) / kRows, [&](Index t) {
    const Index i0 = t * kRows, rows = std::min(kRows, n_q - i0);
    Scratch<RowMatrix<Scalar>> ub(rows, groups);
    proposal.bounds_into(q, i0, ub);
    Scratch<Eigen::VectorXd> zb(groups), pi(groups);
    for (Index i = i0; i < i0 + rows; ++i) {
      const Index sampled = draws.sampled_blocks[std::size_t(i)];
      if (sampled == 0 || drawn.size(i) == 0) continue;
      zb.head(sampled).setZero();
      for (Index p = drawn.start[std::size_t(i)]; p < drawn.start[std::size_t(i) + 1]; ++p) {
        const Index b = proposal.group_of(i, drawn.keys[std::size_t(p)]);
        if (b >= 0 && b < sampled) zb(b) += double(ds(p));  // keys taken whole have p = 1
      }
      // The regime of each group's p = min(1, max(s u / U, s / N)), as the forward left it.
      double count = 0;
      for (Index b = 0; b < sampled; ++b) count += double(draws.outside(i, b));
      const double at_floor = rule.samples / count;
      double total = 0, top = -std::numeric_limits<double>::infinity();
      bool any = false;
      for (Index b = 0; b < sampled; ++b) {
        const double p = draws.probability(i, b);
        const bool proportional = draws.outside(i, b) > 0 && p < 1 && p != at_floor;
        if (!proportional) zb(b) = 0;
        total += zb(b);
        any = any || zb(b) != 0;
        if (draws.outside(i, b) > 0) top = std::max(top, f * double(ub(i - i0, b)));
      }
      if (!any) continue;
      double mass = 0;
      for (Index b = 0; b < sampled; ++b) {
        pi(b) = draws.outside(i, b) > 0
                    ? double(draws.outside(i, b)) * std::exp(f * ub(i - i0, b) - top)
                    : 0.0;
        mass += pi(b);
      }
      for (Index b = 0; b < sampled; ++b)
        gamma(i, b) = static_cast<Scalar>(f * (pi(b) / mass * total - zb(b)));
    }
  });
}

// The gradient through the sampled remainder's probabilities (see sampling_gamma), added to dq
// (raw queries) and dk. Key blocks: ub_ib = q_i⁺·M_b + q_i⁻·m_b, so q_i receives M_bc where
// q_ic > 0 and m_bc where q_ic < 0, and the key holding M_bc (m_bc) receives Σ_i ∂L/∂ub_ib q_ic⁺
// (q_ic⁻). Clusters (`clusters` given): through the cluster bounds
// (KeyClusterIndex::bound_gradients). bound_keys: the keys the bounds saw (centred or not; the
// mean is held constant).
template <typename Scalar>
void sampling_bound_gradients(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                              const Eigen::Ref<const RowMatrix<Scalar>>& bound_keys,
                              const SampledDraws<Scalar>& draws, const TargetSets& drawn,
                              const Eigen::Ref<const Vector<Scalar>>& ds,
                              const SampledRemainder& rule, Scalar scale, bool causal,
                              const KeyClusterIndex<Scalar>* clusters,
                              Eigen::Ref<RowMatrix<Scalar>> dq, Eigen::Ref<RowMatrix<Scalar>> dk) {
  const Index n_q = q.rows(), d = q.cols();
  if (clusters) {
    Scratch<RowMatrix<Scalar>> gamma(n_q, clusters->groups());
    sampling_gamma<Scalar>(q, *clusters, draws, drawn, ds, rule, gamma);
    clusters->bound_gradients(q, bound_keys, gamma, scale, dq, dk);
    return;
  }
  const BlockProposal<Scalar> proposal(bound_keys, rule.block_size, scale, causal);
  const Index blocks = proposal.groups();
  const BlockExtremes<Scalar> extremes(bound_keys, rule.block_size, blocks);
  Scratch<RowMatrix<Scalar>> gamma(n_q, blocks);  // ∂L/∂ub_ib
  sampling_gamma<Scalar>(q, proposal, draws, drawn, ds, rule, gamma);
  constexpr Index kRows = 64;
  parallel_for((n_q + kRows - 1) / kRows, [&](Index t) {
    for (Index i = t * kRows; i < std::min(n_q, (t + 1) * kRows); ++i) {
      const Index sampled = draws.sampled_blocks[std::size_t(i)];
      const auto g = gamma.row(i).head(sampled);
      for (Index c = 0; c < d && sampled > 0; ++c) {
        const Scalar qc = q(i, c);
        if (qc > 0) dq(i, c) += g.dot(extremes.hi.col(c).head(sampled));
        if (qc < 0) dq(i, c) += g.dot(extremes.lo.col(c).head(sampled));
      }
    }
  });
  // The keys' side, Γᵀ q⁺ and Γᵀ q⁻ summed over the rows in fixed panels.
  Scratch<RowMatrix<Scalar>> pos(n_q, d), neg(n_q, d), d_hi(blocks, d), d_lo(blocks, d);
  pos = q.cwiseMax(Scalar(0));
  neg = q.cwiseMin(Scalar(0));
  gemm_fixed_depth(d_hi, gamma.transpose(), pos, false);
  gemm_fixed_depth(d_lo, gamma.transpose(), neg, false);
  for (Index b = 0; b < blocks; ++b)
    for (Index c = 0; c < d; ++c) {
      dk(extremes.arg_hi(b, c), c) += d_hi(b, c);
      dk(extremes.arg_lo(b, c), c) += d_lo(b, c);
    }
}

// The feature correction's pair terms, for pair_gradients or a tile of
// feature_correction_on_chunks: for row i's keys cols[0, count) with dots = (σ ∘ values of
// q_i)·(values of k_j) and dp = dO_i·v_j, c = −dots ω_ij and z = −(dp − δ_i) ω_ij, ω_ij = e^{ℓ(q_i)
// + ℓ(k_j) − L_i} times `weight(u)` (a pair's share, 1/N_ij on LSH chunks).
template <typename Scalar>
struct FeatureCorrectionTerms {
  const Vector<Scalar>& q_log;
  const Vector<Scalar>& k_log;
  const Vector<Scalar>& lse;
  const Vector<Scalar>& delta;

  template <typename Dots, typename Dp, typename C, typename Z, typename Weight>
  void operator()(Index i, const std::int32_t* cols, Index count, const Dots& dots, const Dp& dp,
                  C&& c, Z&& z, Weight&& weight) const {
    const Scalar base = q_log(i) - lse(i);
    for (Index u = 0; u < count; ++u) {
      const Scalar w = std::exp(base + k_log(cols[u])) * weight(u);
      c(u) = -dots(u) * w;
      z(u) = -(dp(u) - delta(i)) * w;
    }
  }
};

// The feature correction's gradients when the forward subtracted it chunk by chunk on the LSH
// chunks `l` (subtract_on_chunks): the same chunks, per round the pair tile of each query chunk and
// its two key chunks (lsh_attention.hpp's for_each_chunk), each pair weighed by 1/N_ij (so a pair
// counts once over the rounds) and masked causally, as products: A = X Yᵀ, dP = dO Vᵀ, then
// dX += Z Y, dY += Zᵀ X, dV += Cᵀ dO. Within a round the tiles hold disjoint queries; a key chunk
// is read by its own query chunk and by the next one, whose key gradients go to a second pair of
// buffers summed at the end (as lsh_gradient.hpp): the result does not depend on the thread count.
// x n_q x M (σ ∘ values of q), y n_k x M (values of k); adds to dx, dy, dv.
template <typename Scalar, typename Live>
void feature_correction_on_chunks(
    const LshChunks& l, bool causal, const Eigen::Ref<const RowMatrix<Scalar>>& x,
    const Eigen::Ref<const RowMatrix<Scalar>>& y, const Eigen::Ref<const RowMatrix<Scalar>>& v,
    const Eigen::Ref<const RowMatrix<Scalar>>& go, Live&& live,
    const FeatureCorrectionTerms<Scalar>& terms, Eigen::Ref<RowMatrix<Scalar>> dx,
    Eigen::Ref<RowMatrix<Scalar>> dy, Eigen::Ref<RowMatrix<Scalar>> dv) {
  const Index m = x.cols(), dvs = v.cols(), n_k = y.rows();
  const Index rows_max = l.c, cols_max = 2 * std::min(l.ck, l.n_k);
  Scratch<RowMatrix<Scalar>> dy_next(l.chunks > 1 ? n_k : 0, m),
      dv_next(l.chunks > 1 ? n_k : 0, dvs);
  dy_next.setZero();
  dv_next.setZero();
  struct Work {
    ChunkPairCounts pairs;
    PooledVector<std::int32_t> cols;
    Scratch<RowMatrix<Scalar>> xr, gr, yc, vc, a, dp, dxr, dyc, dvc;
  };
  const auto make = [&] {
    return Work{ChunkPairCounts(l, cols_max),
                PooledVector<std::int32_t>(0, std::size_t(cols_max)),
                Scratch<RowMatrix<Scalar>>(rows_max, m),
                Scratch<RowMatrix<Scalar>>(rows_max, dvs),
                Scratch<RowMatrix<Scalar>>(cols_max, m),
                Scratch<RowMatrix<Scalar>>(cols_max, dvs),
                Scratch<RowMatrix<Scalar>>(rows_max, cols_max),
                Scratch<RowMatrix<Scalar>>(rows_max, cols_max),
                Scratch<RowMatrix<Scalar>>(rows_max, m),
                Scratch<RowMatrix<Scalar>>(cols_max, m),
                Scratch<RowMatrix<Scalar>>(cols_max, dvs)};
  };
  // One tile: query chunk rows[0, nr) against its key columns cols[0, nc), those from `split` on
  // being the previous key chunk's.
  const auto tile = [&](Work& s, const std::int32_t* rows, Index nr, const std::int32_t* cols,
                        Index nc, Index split) {
    if (nr == 0 || nc == 0) return;
    auto xr = s.xr.topRows(nr);
    auto gr = s.gr.topRows(nr);
    auto yc = s.yc.topRows(nc);
    auto vc = s.vc.topRows(nc);
    for (Index u = 0; u < nr; ++u) {
      xr.row(u) = x.row(rows[u]);
      gr.row(u) = go.row(rows[u]);
    }
    for (Index t = 0; t < nc; ++t) {
      yc.row(t) = y.row(cols[t]);
      vc.row(t) = v.row(cols[t]);
    }
    auto a = s.a.topLeftCorner(nr, nc);    // products, then c
    auto dp = s.dp.topLeftCorner(nr, nc);  // dO_i·v_j, then z
    gemm_fixed_depth(a, xr, yc.transpose(), false);
    gemm_fixed_depth(dp, gr, vc.transpose(), false);
    s.cols.assign(cols, cols + nc);
    s.pairs.set_columns(s.cols);
    for (Index u = 0; u < nr; ++u) {
      const Index i = rows[u];
      if (!live(i)) {
        a.row(u).setZero();
        dp.row(u).setZero();
        continue;
      }
      s.pairs.of_row(i);
      const auto share = [&](Index t) {
        return causal && cols[t] > i ? Scalar(0)
                                     : Scalar(1) / Scalar(s.pairs.count[std::size_t(t)]);
      };
      terms(i, cols, nc, a.row(u), dp.row(u), a.row(u), dp.row(u), share);
    }
    auto dxr = s.dxr.topRows(nr);
    auto dyc = s.dyc.topRows(nc);
    auto dvc = s.dvc.topRows(nc);
    gemm_fixed_depth(dxr, dp, yc, false);
    gemm_fixed_depth(dyc, dp.transpose(), xr, false);
    gemm_fixed_depth(dvc, a.transpose(), gr, false);
    for (Index u = 0; u < nr; ++u) dx.row(rows[u]) += dxr.row(u);
    for (Index t = 0; t < nc; ++t) {
      (t < split ? dy : dy_next).row(cols[t]) += dyc.row(t);
      (t < split ? dv : dv_next).row(cols[t]) += dvc.row(t);
    }
  };
  for (Index rho = 0; rho < l.rounds; ++rho) for_each_chunk(l, rho, make, tile);
  if (l.chunks > 1) {
    dy += dy_next;
    dv += dv_next;
  }
}

// The feature remainder's gradients, added to dq, dk, dv (see the top of this file): the linear
// part through the linear core's backward with (o, λ dO), the correction on the left-out keys
// `left_out` through pair_gradients (or on the LSH chunks `chunks`, when the forward subtracted it
// there), both into the features' cotangents, then the map's features_vjp. Rows the forward
// dropped (kept[i] == 0) or without weight carry nothing.
template <typename Map>
void feature_remainder_gradients(const char* where, const Map& map,
                                 const FeatureAttentionSettings<typename Map::Scalar>& settings,
                                 const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
                                 const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
                                 const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
                                 const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& out,
                                 const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& go,
                                 const Vector<typename Map::Scalar>& lse,
                                 const Vector<typename Map::Scalar>& delta,
                                 const std::vector<char>& kept, const TargetSets& left_out,
                                 const LshChunks* chunks,
                                 Eigen::Ref<RowMatrix<typename Map::Scalar>> dq,
                                 Eigen::Ref<RowMatrix<typename Map::Scalar>> dk,
                                 Eigen::Ref<RowMatrix<typename Map::Scalar>> dv) {
  using Scalar = typename Map::Scalar;
  const Index n_q = q.rows(), n_k = k.rows(), m = map.feature_dim(), dvs = v.cols();
  const auto live = [&](Index i) { return kept[std::size_t(i)] && std::isfinite(lse(i)); };
  PooledFeatures<Scalar> qf(n_q, m), kf(n_k, m);
  map_features(map, q, k, settings, qf, kf);
  const Scratch<Vector<Scalar>> signs = pooled_copy(map.signs());
  // λ_i = D^lin_i / D_i from the linear part recomputed on the same features.
  Scratch<RowMatrix<Scalar>> scaled_go(n_q, dvs);
  {
    const GivenFeatureRows<Scalar> q_rows(qf.values, qf.log_scale), k_rows(kf.values, kf.log_scale);
    const LinearOperands<GivenFeatureRows<Scalar>, GivenFeatureRows<Scalar>> in{
        q_rows, k_rows, v, signs, linear_chunk(settings.linear)};
    const SoftmaxAccumulator<Scalar> linear =
        linear_accumulate(where, in, settings.linear.causal, false);
    for (Index i = 0; i < n_q; ++i) {
      const Scalar lambda =
          live(i) ? linear.denominator()(i) * std::exp(linear.log_scale()(i) - lse(i)) : Scalar(0);
      scaled_go.row(i) = lambda * go.row(i);
    }
  }
  LinearOptions linear_options = settings.linear;
  linear_options.denominator_epsilon = 0;  // merged unguarded (see the top of this file)
  Scratch<RowMatrix<Scalar>> dqf(n_q, m), dkf(n_k, m), dv_linear(n_k, dvs), dx(n_q, m), x(n_q, m);
  Scratch<Vector<Scalar>> dq_log(n_q), dk_log(n_k);
  linear_backward_impl<Scalar>(qf.values, qf.log_scale, kf.values, kf.log_scale, v, signs, out,
                               scaled_go, linear_options, {dqf, dkf, dv_linear, dq_log, dk_log});
  dv += dv_linear;
  // The correction, subtracted in the forward: pairs c_ij = −φ(q_i)ᵀσφ(k_j) / D_i on the values,
  // x = σ ∘ values of q, so that dx comes back through σ.
  x = qf.values;
  if (signs.size() > 0) x.array().rowwise() *= signs.transpose().array();
  dx.setZero();
  const FeatureCorrectionTerms<Scalar> terms{qf.log_scale, kf.log_scale, lse, delta};
  if (chunks) {
    feature_correction_on_chunks<Scalar>(*chunks, settings.linear.causal, x, kf.values, v, go, live,
                                         terms, dx, dkf, dv);
  } else {
    Scratch<Vector<Scalar>> z(left_out.pairs());
    const auto correction = [&](Index i, const std::int32_t* cols, Index count, const auto& dots,
                                const auto& dp, auto&& c, auto&& zi) {
      terms(i, cols, count, dots, dp, c, zi, [](Index) { return Scalar(1); });
    };
    pair_gradients<Scalar>(left_out, x, kf.values, v, go, live, correction, dx, dkf, dv, z);
  }
  if (signs.size() > 0) dx.array().rowwise() *= signs.transpose().array();
  dqf += dx;
  map.features_vjp(q, settings.normaliser, qf.values, qf.log_scale, dqf, dq_log, dq, nullptr,
                   FeatureSide::query);
  map.features_vjp(k, settings.normaliser, kf.values, kf.log_scale, dkf, dk_log, dk, nullptr,
                   FeatureSide::key);
}

}  // namespace detail

// Sparse + low-rank attention written into `out` as sparse_lowrank_attention_into (the same
// bits), keeping what sparse_lowrank_backward needs: q n_q x d, k n_k x d, v n_k x dv, out
// n_q x dv. The support's hash or filters need not outlive the result; a feature remainder's map
// must.
template <typename Scalar, typename Remainder = NoRemainder, typename DO>
SparseLowRankSaved<Scalar, Remainder> sparse_lowrank_forward(
    const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
    const Eigen::Ref<const RowMatrix<Scalar>>& v, const SupportSpec<Scalar>& support,
    const Eigen::MatrixBase<DO>& out, const Remainder& remainder = {},
    const SparseLowRankOptions& opt = {}, SparseLowRankStats* stats = nullptr) {
  const char* where = "sparse_lowrank_attention";
  detail::check_attention_output<Scalar>(where, out, q, k, v);
  SparseLowRankSaved<Scalar, Remainder> saved;
  const SoftmaxAccumulator<Scalar> acc = sparse_lowrank_accumulate<Scalar, Remainder>(
      q, k, v, support, remainder, opt, stats, &saved.choices);
  acc.finalize_into(out);
  saved.scale = detail::resolve_scale<Scalar>(where, opt, detail::inverse_sqrt_dim(q.cols()));
  saved.options = opt;
  saved.n_q = q.rows();
  saved.n_k = k.rows();
  saved.dim = q.cols();
  saved.value_dim = v.cols();
  saved.remainder.emplace(remainder);
  saved.row_lse.resize(q.rows());
  acc.log_sum_exp_into(saved.row_lse);
  // The draws as one CSR, for the pair kernels.
  detail::SampledDraws<Scalar>& draws = saved.choices.draws;
  saved.drawn = TargetSets(q.rows());
  for (std::size_t i = 0; i < draws.keys.size(); ++i) {
    saved.drawn.keys.insert(saved.drawn.keys.end(), draws.keys[i].begin(), draws.keys[i].end());
    saved.drawn_weight.insert(saved.drawn_weight.end(), draws.weights[i].begin(),
                              draws.weights[i].end());
    saved.drawn.start[i + 1] = Index(saved.drawn.keys.size());
  }
  std::vector<std::vector<std::int32_t>>().swap(draws.keys);
  std::vector<std::vector<Scalar>>().swap(draws.weights);
  if (saved.choices.lsh_kernel) {
    LshResiduals<Scalar>& lsh = saved.lsh_kernel.emplace();
    lsh.options = saved.choices.lsh_options;
    lsh.scale = saved.scale;
    lsh.n_q = q.rows();
    lsh.n_k = k.rows();
    lsh.dim = q.cols();
    lsh.value_dim = v.cols();
    lsh.choices = std::move(*saved.choices.lsh_kernel);
    saved.choices.lsh_kernel.reset();
    lsh.row_lse = saved.row_lse;  // with +inf for a row without weight, as LSH's backward reads it
    for (Index i = 0; i < lsh.row_lse.size(); ++i)
      if (lsh.row_lse(i) == -std::numeric_limits<Scalar>::infinity())
        lsh.row_lse(i) = std::numeric_limits<Scalar>::infinity();
  }
  return saved;
}

// The gradients of <grad_out, out>: dq (n_q x d), dk (n_k x d), dv (n_k x dv), overwritten. q, k,
// v and out as given to and written by sparse_lowrank_forward, unchanged since. Throws
// std::invalid_argument (nothing written) on shapes that disagree with the forward's, a
// non-finite grad_out, or a forward whose support was exact-bucket LSH alone over multiset rounds.
template <typename Scalar, typename Remainder>
void sparse_lowrank_backward(const SparseLowRankSaved<Scalar, Remainder>& saved,
                             const Eigen::Ref<const RowMatrix<Scalar>>& q,
                             const Eigen::Ref<const RowMatrix<Scalar>>& k,
                             const Eigen::Ref<const RowMatrix<Scalar>>& v,
                             const Eigen::Ref<const RowMatrix<Scalar>>& out,
                             const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                             Eigen::Ref<RowMatrix<Scalar>> dq, Eigen::Ref<RowMatrix<Scalar>> dk,
                             Eigen::Ref<RowMatrix<Scalar>> dv) {
  const char* where = "sparse_lowrank_backward";
  constexpr bool no_remainder = std::is_same<Remainder, NoRemainder>::value;
  constexpr bool sampled = std::is_same<Remainder, SampledRemainder>::value;
  constexpr bool features = !no_remainder && !sampled;
  const Index n_q = saved.n_q, n_k = saved.n_k, d = saved.dim, dvs = saved.value_dim;
  detail::require(saved.remainder.has_value() && saved.row_lse.size() == n_q, where,
                  "the saved state holds no forward (use sparse_lowrank_forward)");
  detail::check_separate_key_backward<Scalar>(where, n_q, n_k, d, dvs, q, k, v, out, grad_out, dq,
                                              dk, dv);
  const detail::SparseLowRankChoices<Scalar>& choices = saved.choices;
  detail::require(!choices.multiset, where,
                  "exact-bucket LSH alone as the support over multiset rounds (lsh_options."
                  "exact_buckets with dedupe = false) weighs a pair by its round count and has no "
                  "backward; use dedupe = true or sort-and-chunk LSH");
  const Scalar scale = saved.scale;
  // A feature remainder's settings, from the options the forward ran it with (checked again
  // before anything is written).
  const auto settings = [&] {
    if constexpr (features) {
      using Map = std::decay_t<decltype(saved.remainder->map)>;
      static_assert(has_features_vjp<Map>::value,
                    "this feature map has no backward (features_vjp)");
      return detail::feature_attention_settings(where, saved.remainder->map,
                                                choices.feature_options);
    } else {
      return 0;
    }
  }();
  if (n_q == 0) {
    dk.setZero();
    dv.setZero();
    return;
  }

  const Vector<Scalar>& lse = saved.row_lse;
  const auto live = [&](Index i) { return std::isfinite(lse(i)); };  // −inf: no weight
  detail::Scratch<RowMatrix<Scalar>> go(n_q, dvs), qs(n_q, d), dqs(n_q, d), dq_raw(n_q, d),
      dks(n_k, d), dvk(n_k, dvs);
  detail::Scratch<Vector<Scalar>> delta(n_q);
  go = grad_out;
  delta = (go.array() * out.array()).rowwise().sum();
  qs = scale * q;  // the logits' left operand: dqs is the scaled queries' gradient
  dqs.setZero();
  dq_raw.setZero();
  dks.setZero();
  dvk.setZero();

  // E: the support's exact terms; on LSH's own chunks when its kernel computed them (the same
  // softmax backward with the merged L_i and δ_i, on GEMM tiles, multiset rounds included).
  if (saved.lsh_kernel) {
    detail::Scratch<RowMatrix<Scalar>> dq_e(n_q, d), dk_e(n_k, d), dv_e(n_k, dvs);
    Eigen::Ref<RowMatrix<Scalar>> dk_ref(dk_e);
    detail::lsh_backward<Scalar>(*saved.lsh_kernel, q, &k, v, out, go, dq_e, &dk_ref, dv_e);
    dq_raw += dq_e;
    dks += dk_e;
    dvk += dv_e;
  } else {
    detail::Scratch<Vector<Scalar>> ds(choices.exact.pairs());
    detail::pair_gradients<Scalar>(
        choices.exact, qs, k, v, go, live,
        detail::softmax_terms<Scalar>(choices.exact, nullptr, lse, delta), dqs, dks, dvk, ds);
  }
  // R: the remainder.
  if constexpr (sampled) {
    const SampledRemainder& rule = *saved.remainder;
    detail::Scratch<Vector<Scalar>> ds(saved.drawn.pairs());
    detail::pair_gradients<Scalar>(
        saved.drawn, qs, k, v, go, live,
        detail::softmax_terms<Scalar>(saved.drawn, saved.drawn_weight.data(), lse, delta), dqs, dks,
        dvk, ds);
    if (!rule.uniform) {
      detail::Scratch<RowMatrix<Scalar>> centred(saved.options.centre_keys ? n_k : 0, d);
      if (saved.options.centre_keys) centred_into<Scalar>(k, choices.key_mean, centred);
      const Eigen::Ref<const RowMatrix<Scalar>> bound_keys =
          saved.options.centre_keys ? Eigen::Ref<const RowMatrix<Scalar>>(centred) : k;
      detail::sampling_bound_gradients<Scalar>(
          q, bound_keys, choices.draws, saved.drawn, ds, rule, scale, saved.options.causal,
          choices.clusters ? &*choices.clusters : nullptr, dq_raw, dks);
    }
  } else if constexpr (features) {
    const TargetSets& left_out = saved.options.exclude_self ? choices.left_out : choices.exact;
    // LSH chunks alone: the forward subtracted the correction on its chunks (no sets kept).
    const LshChunks* chunks = saved.lsh_kernel ? &saved.lsh_kernel->choices.chunks : nullptr;
    detail::feature_remainder_gradients(where, saved.remainder->map, settings, q, k, v, out, go,
                                        lse, delta, choices.remainder_kept, left_out, chunks,
                                        dq_raw, dks, dvk);
  }
  (void)settings;
  dq = scale * dqs + dq_raw;
  dk = dks;
  dv = dvk;
}

}  // namespace randattn
