#pragma once
// The sampled remainder of sparse attention (as HyperAttention's sampled residual, arXiv
// 2310.05869, with importance probabilities): each valid key j outside the support S_i is drawn
// independently with probability p_ij and weighted by 1/p_ij, so
//   E[Σ_{drawn j} exp(scale q_i·k_j) [v_j | 1] / p_ij] = Σ_{valid j ∉ S_i} exp(scale q_i·k_j) [v_j | 1]
// exactly (unbiased numerator and denominator). The probabilities follow the keep-large /
// sample-moderate rule of Algorithm 1 of "Effective Tensor Sketching via Sparsification" applied
// to an upper bound u_b of the weight of each key block b (block_bounds.hpp: u_b =
// exp(scale · bound_b(q_i))):
//   p_ij = min(1, max(s u_b / U_i, s / N_i)),  U_i = Σ_{j ∉ S_i} u_b(j),  N_i = #{valid j ∉ S_i},
// so blocks that may carry much weight are kept whole and the rest sampled in proportion, with a
// uniform floor; about s keys are drawn per query (at most 2s in expectation). `uniform` uses
// p = min(1, s / N_i) for every key. Draws skip geometrically through a block's keys with
// counter-based uniforms (Philox, keyed by the query's row and the draw number), so results do
// not depend on the thread count.
// Causal: the blocks before query i's own block are sampled (all their keys precede i); the keys
// j <= i of its own block outside S_i are taken with p = 1, so nothing depends on a later key.
// With a clusters support (cluster_support.hpp) the groups are the query's clusters instead of
// key blocks, u_c = exp(bound_c) their bound (the proposal their cluster weights give), and
// under causal masking the keys of the query's own chunk are taken with p = 1.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../random/philox.hpp"
#include "block_bounds.hpp"
#include "cluster_support.hpp"
#include "target_attention.hpp"

namespace randattn {

struct SampledRemainder {
  double samples = 64;     // s > 0: keys drawn per query, about
  bool uniform = false;    // p = min(1, s / N_i) instead of the block-bound rule
  Index block_size = 64;   // key blocks of the bound
};

namespace detail {

// What sampled_remainder_merge drew, kept for a backward pass (sparse_lowrank_backward.hpp): per
// query its drawn keys with their weights 1/p, the blocks it sampled (the others' keys were taken
// with p = 1), and per sampled block the inclusion probability p and the keys it held outside
// the support. Each row is written by the thread that draws it.
template <typename Scalar>
struct SampledDraws {
  std::vector<std::vector<std::int32_t>> keys;
  std::vector<std::vector<Scalar>> weights;
  std::vector<Index> sampled_blocks;
  RowMatrix<double> probability;  // n_q x blocks
  Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> outside;  // n_q x blocks

  void start(Index n_q, Index blocks) {
    keys.assign(std::size_t(n_q), {});
    weights.assign(std::size_t(n_q), {});
    sampled_blocks.assign(std::size_t(n_q), 0);
    probability.setZero(n_q, blocks);
    outside.setZero(n_q, blocks);
  }
  void keep(Index i, const std::vector<std::int32_t>& cols, const Scalar* weight,
            const double* prob, const std::vector<Index>& outside_keys, Index sampled) {
    keys[std::size_t(i)].assign(cols.begin(), cols.end());
    weights[std::size_t(i)].assign(weight, weight + cols.size());
    sampled_blocks[std::size_t(i)] = sampled;
    for (Index b = 0; b < sampled; ++b) {
      probability(i, b) = prob[b];
      outside(i, b) = outside_keys[std::size_t(b)];
    }
  }
};

}  // namespace detail

namespace detail {

// The block proposal: groups of `block` consecutive keys, bounded by their per-coordinate
// minima and maxima (block_bounds.hpp). Causal: the blocks before query i's own block are
// sampled, the keys from there to i taken whole.
template <typename Scalar>
class BlockProposal {
 public:
  BlockProposal(const Eigen::Ref<const RowMatrix<Scalar>>& bound_keys, Index block, Scalar scale,
                bool causal)
      : bounds_(bound_keys, block), scale_(scale), causal_(causal), n_k_(bound_keys.rows()) {}

  Index groups() const { return bounds_.blocks(); }
  double bound_scale() const { return double(scale_); }  // the bounds are of q·k
  template <typename Out>
  void bounds_into(const Eigen::Ref<const RowMatrix<Scalar>>& q, Index i0, Out& out) const {
    bounds_.bounds_into(q.middleRows(i0, out.rows()), out);
  }
  Index sampled(Index i) const {
    return causal_ ? std::min(std::min(i, n_k_ - 1) / bounds_.block(), groups()) : groups();
  }
  KeySpan group(Index, Index b) const { return {nullptr, b * bounds_.block(), bounds_.block_size(b)}; }
  Index group_of(Index, Index j) const { return bounds_.block_of(j); }
  Index whole_from(Index i) const { return sampled(i) * bounds_.block(); }

 private:
  KeyBlockBounds<Scalar> bounds_;
  Scalar scale_;
  bool causal_;
  Index n_k_;
};

// The draws of every query from `proposal`'s groups into acc (see sampled_remainder_merge).
template <typename Scalar, typename Proposal>
Index sample_outside(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                     const Eigen::Ref<const RowMatrix<Scalar>>& k,
                     const Eigen::Ref<const RowMatrix<Scalar>>& v, const TargetSets& sets,
                     const SampledRemainder& rule, Scalar scale, bool causal, const Philox& rng,
                     std::uint64_t row_offset, SoftmaxAccumulator<Scalar>& acc,
                     SampledDraws<Scalar>* draws, const Proposal& proposal) {
  const Index n_q = q.rows(), n_k = k.rows(), groups = proposal.groups();
  const double f = proposal.bound_scale();
  constexpr Index kRows = 64;
  const Index tasks = (n_q + kRows - 1) / kRows;
  std::atomic<Index> drawn{0};
  if (draws) draws->start(n_q, groups);
  parallel_for(tasks, [&](Index t) {
    const Index i0 = t * kRows, rows = std::min(kRows, n_q - i0);
    // From the thread's pool. A query draws each valid key at most once.
    Scratch<RowMatrix<Scalar>> ub(rule.uniform ? 0 : rows, groups);
    if (!rule.uniform) proposal.bounds_into(q, i0, ub);
    PooledVector<Index> outside(static_cast<std::size_t>(groups));
    Scratch<Eigen::VectorXd> prob(groups);
    PooledVector<std::int32_t> cols(0, static_cast<std::size_t>(n_k));
    Scratch<Vector<Scalar>> weight(n_k);
    TargetRowKernel<Scalar> kernel(0, v.cols());
    for (Index i = i0; i < i0 + rows; ++i) {
      // Sampled groups [0, sampled); the other valid keys from whole_from on are taken whole.
      const Index sampled = proposal.sampled(i);
      std::fill(outside.begin(), outside.end(), 0);
      for (Index b = 0; b < sampled; ++b) outside[b] = proposal.group(i, b).size;
      for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j) {
        const Index b = proposal.group_of(i, *j);
        if (b >= 0 && b < sampled) --outside[b];
      }
      double count = 0, mass = 0, top = -std::numeric_limits<double>::infinity();
      for (Index b = 0; b < sampled; ++b)
        if (outside[b] > 0 && !rule.uniform) top = std::max(top, f * ub(i - i0, b));
      for (Index b = 0; b < sampled; ++b) {
        count += double(outside[b]);
        prob[b] = rule.uniform ? 1.0 : std::exp(f * ub(i - i0, b) - top);
        mass += double(outside[b]) * prob[b];
      }
      for (Index b = 0; b < sampled; ++b)
        prob[b] = rule.uniform ? std::min(1.0, rule.samples / count)
                               : std::min(1.0, std::max(rule.samples * prob[b] / mass,
                                                        rule.samples / count));
      cols.clear();
      std::uint32_t draw = 0;
      const std::uint64_t key = row_offset + std::uint64_t(i);
      for (Index b = 0; b < sampled; ++b) {
        if (outside[b] == 0) continue;
        const KeySpan span = proposal.group(i, b);
        const double p = prob[b];
        const double log_miss = std::log1p(-p);  // -inf for p = 1: every key
        for (Index u = 0;; ++u) {
          if (p < 1) {
            const double x = 1.0 - rng.uniform(key, draw++);  // (0, 1]
            const double skip = std::floor(std::log(x) / log_miss);  // keys passed over
            if (!(skip < double(span.size - u))) break;
            u += Index(skip);
          }
          if (u >= span.size) break;
          const Index j = span.at(u);
          if (sets.contains(i, j)) continue;
          weight(Index(cols.size())) = static_cast<Scalar>(1.0 / p);
          cols.push_back(static_cast<std::int32_t>(j));
        }
      }
      for (Index j = proposal.whole_from(i); j < valid_keys(i, n_k, causal); ++j)
        if (!sets.contains(i, j)) {
          weight(Index(cols.size())) = Scalar(1);
          cols.push_back(static_cast<std::int32_t>(j));
        }
      if (draws) draws->keep(i, cols, weight.data(), prob.data(), outside, sampled);
      drawn += Index(cols.size());
      kernel.attend(q, k, v, scale, i, cols.data(), weight.data(), Index(cols.size()), acc);
    }
  });
  return drawn;
}

}  // namespace detail

// Merges the sampled remainder of every query into acc: q n_q x d (raw), k n_k x d (raw, for the
// logits), bound_keys n_k x d (the keys the bounds see, centred or not), v n_k x dv. `rng` and
// row_offset + i key the draws of query i. Returns the number of keys drawn. `draws` (if given)
// receives what was drawn, for a backward pass. With `clusters` (a clusters support's index over
// bound_keys) the groups are the query's clusters instead of key blocks.
template <typename Scalar>
Index sampled_remainder_merge(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                              const Eigen::Ref<const RowMatrix<Scalar>>& k,
                              const Eigen::Ref<const RowMatrix<Scalar>>& bound_keys,
                              const Eigen::Ref<const RowMatrix<Scalar>>& v, const TargetSets& sets,
                              const SampledRemainder& rule, Scalar scale, bool causal,
                              const Philox& rng, std::uint64_t row_offset,
                              SoftmaxAccumulator<Scalar>& acc,
                              detail::SampledDraws<Scalar>* draws = nullptr,
                              const detail::KeyClusterIndex<Scalar>* clusters = nullptr) {
  const char* where = "sampled_remainder";
  detail::require(rule.samples > 0 && std::isfinite(rule.samples), where,
                  "samples must be positive and finite, got ", rule.samples);
  detail::require(sets.rows() == q.rows(), where, "target sets of ", sets.rows(),
                  " queries for ", q.rows(), " queries");
  if (q.rows() == 0 || k.rows() == 0) return 0;
  if (clusters)
    return detail::sample_outside<Scalar>(q, k, v, sets, rule, scale, causal, rng, row_offset, acc,
                                          draws, *clusters);
  return detail::sample_outside<Scalar>(
      q, k, v, sets, rule, scale, causal, rng, row_offset, acc, draws,
      detail::BlockProposal<Scalar>(bound_keys, rule.block_size, scale, causal));
}

}  // namespace randattn
