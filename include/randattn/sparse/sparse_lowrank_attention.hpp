#pragma once
// Sparse + low-rank attention (Scatterbrain, arXiv 2110.15343; HyperAttention, arXiv 2310.05869):
// output i = (E_i + R_i) split as [num | den], where
//   E_i = Σ_{j ∈ S_i} exp(scale q_i·k_j) [v_j | 1]   exact terms on a support S_i, and
//   R_i ≈ Σ_{valid j ∉ S_i} exp(scale q_i·k_j) [v_j | 1]   an unbiased estimate of the rest:
//         none (R = 0), random features (feature_remainder.hpp) or sampled keys
//         (sampled_remainder.hpp).
// Both parts are partial [num | den] pairs with per-row log-scales, merged in the core's
// log-scaled form (core/softmax_accumulator.hpp), then divided.
//
// The support is the union of the parts given in SupportSpec: LSH (separate-key sort-and-chunk or
// exact buckets, exactly the target sets of lsh_attention), LSF filters, a window with sinks,
// Quest-style key blocks, and key clusters (cluster_support.hpp; with them the sampled remainder
// draws from the clusters). The clusters alone with every cluster probed are exact attention,
// computed by exact attention's own tiles, bit for bit. With one hashing support alone, E is computed by that method's own
// kernel, so without remainder the result is lsh_attention's or lsf_attention's bit for bit;
// otherwise E is computed over the explicit target sets (sparse/target_attention.hpp).
//
// Key centring (centre_keys): the hashing, filter and block supports (and the sampling bounds)
// see k - μ (sparse/key_centring.hpp): μ the mean of all keys, or under causal masking of the
// first centre_prefix keys or of the given key_mean; logits always use the raw keys (the shift
// changes each query's logits by one constant, so E is unchanged up to rounding).
//
// Self-exclusion (exclude_self; queries and keys are the same positions): query i neither scores
// nor estimates key i unless it has no other valid key, and then attends to key i alone (the rule
// of core/detail/self_rule.hpp). E is then computed over explicit target sets without key i, and
// the remainder leaves out S_i ∪ {i}.
//
// Causal: every part uses keys j <= i only. Window, block and cluster supports with no remainder, the
// sampled remainder or a feature remainder make output i independent of keys after i (bit for
// bit, key centring from a fixed prefix aside); hashing supports sort every key, so there the
// promise is only that no pair j > i is scored or estimated.

#include <randattn/detail/intrinsics.hpp>

#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../attention/random_feature_attention.hpp"
#include "../core/detail/output_check.hpp"
#include "../core/exact_attention.hpp"
#include "../core/detail/self_rule.hpp"
#include "../core/options.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/fresh_matrix.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/seconds_since.hpp"
#include "../detail/validation.hpp"
#include "../lsf/lsf_attention.hpp"
#include "../lsh/lsh_attention.hpp"
#include "../random/streams.hpp"
#include "block_support.hpp"
#include "cluster_support.hpp"
#include "feature_remainder.hpp"
#include "key_centring.hpp"
#include "sampled_remainder.hpp"
#include "target_attention.hpp"
#include "window_support.hpp"

namespace randattn {

// The parts of the support; at least one. The lsh and lsf options' causal, scale, check_finite
// and exclude_self are taken from SparseLowRankOptions.
template <typename Scalar>
struct SupportSpec {
  const CrossPolytopeHash<Scalar>* lsh = nullptr;  // separate-key LSH with lsh_options
  LshOptions lsh_options;
  const LocalitySensitiveFilters<Scalar>* lsf = nullptr;  // LSF with lsf_options
  LsfOptions lsf_options;
  std::optional<WindowSupport> window;
  std::optional<BlockSupport> blocks;
  std::optional<ClusterSupport> clusters;  // k-means seeded by SparseLowRankOptions::seed

  int parts() const {
    return int(lsh != nullptr) + int(lsf != nullptr) + int(window.has_value()) +
           int(blocks.has_value()) + int(clusters.has_value());
  }
};

// causal, scale (default 1/sqrt(d)) and check_finite: see core/options.hpp.
struct SparseLowRankOptions : AttentionOptions {
  bool centre_keys = false;
  Index centre_prefix = 64;  // causal centring: mean of the first centre_prefix keys ...
  std::optional<Eigen::RowVectorXd> key_mean;  // ... unless given (e.g. of calibration keys)
  std::uint64_t seed = 0;   // sampled remainder draws, k-means of a clusters support
  std::uint64_t row_offset = 0;  // draws of query i keyed by row_offset + i (batched slices)
  bool exclude_self = false;  // the self rule (see above); needs as many queries as keys
};

// The remainders.
struct NoRemainder {};
template <typename Map>
struct FeatureRemainder {
  const Map& map;
  std::optional<double> denominator_epsilon;  // finalize guard; default as the map's attention
};
// SampledRemainder: sampled_remainder.hpp.

// What a call did: pairs scored exactly (Σ |S_i|), keys drawn, rows dropped by the remainder's
// denominator rule, and the seconds of each part.
struct SparseLowRankStats {
  Index pairs_scored = 0;
  Index samples = 0;
  Index clamped_rows = 0;
  double support_seconds = 0, exact_seconds = 0, remainder_seconds = 0;
};

namespace detail {

// The single hashing support whose own kernel computes E, if that is the whole support.
template <typename Scalar>
bool hashed_alone(const SupportSpec<Scalar>& s) {
  return s.parts() == 1 && (s.lsh || s.lsf);
}

// The clusters support alone with every cluster probed: every valid key, exact attention.
template <typename Scalar>
bool clusters_all_probed(const SupportSpec<Scalar>& s) {
  return s.parts() == 1 && s.clusters && s.clusters->probe >= s.clusters->clusters;
}

// The union of the support's parts; `chunks`: the LSH part's sort-and-chunk layout, if cut;
// `clusters`: the clusters part's index, if any.
template <typename Scalar>
TargetSets support_sets(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                        const Eigen::Ref<const RowMatrix<Scalar>>& hash_keys,
                        const SupportSpec<Scalar>& s, const LshOptions& lsh_opt,
                        const LsfOptions& lsf_opt, bool causal, const LshChunks* chunks,
                        const KeyClusterIndex<Scalar>* clusters) {
  TargetSets parts[5];
  std::size_t count = 0;
  if (s.lsh)
    parts[count++] = chunks ? lsh_target_sets(*chunks, causal)
                            : lsh_target_sets<Scalar>(*s.lsh, q, hash_keys, lsh_opt);
  if (s.lsf) parts[count++] = lsf_target_sets<Scalar>(*s.lsf, q, hash_keys, lsf_opt);
  if (s.window) parts[count++] = window_target_sets(q.rows(), hash_keys.rows(), *s.window, causal);
  if (s.blocks) parts[count++] = block_target_sets<Scalar>(q, hash_keys, *s.blocks, causal);
  if (clusters) parts[count++] = clusters->target_sets();
  if (count == 1) return std::move(parts[0]);
  const TargetSets* ptrs[5];
  for (std::size_t p = 0; p < count; ++p) ptrs[p] = &parts[p];
  return union_of(ptrs, count);
}

// The discrete choices of one call, kept by sparse_lowrank_forward for its backward
// (sparse_lowrank_backward.hpp).
template <typename Scalar>
struct SparseLowRankChoices {
  TargetSets exact;             // the keys E scores (after the self rule); see below
  TargetSets left_out;          // exclude_self: the keys the remainder leaves out, S_i ∪ {i}
  Eigen::RowVectorXd key_mean;  // centre_keys: the mean the supports and the sampling bounds saw
  // E by sort-and-chunk LSH's own kernel: its chunks and the rows its rounds left without a target
  // (the fallback), so that the backward walks the same tiles, and the LSH options it ran with.
  // `exact` is then kept only if the call built it.
  std::optional<LshChoices> lsh_kernel;
  LshOptions lsh_options;
  bool multiset = false;                 // E by LSH's own exact-bucket kernel over multiset rounds
  SampledDraws<Scalar> draws;            // sampled remainder: what was drawn
  RandomFeatureOptions feature_options;  // feature remainder: the options it ran with
  std::vector<char> remainder_kept;      // feature remainder: rows whose estimate was kept
  // Sampled remainder with a clusters support: the clusters it drew from (their bounds' backward).
  std::optional<KeyClusterIndex<Scalar>> clusters;

  // Keeps the feature remainder's rows that the denominator rule (and a full support) left, and
  // hands the remainder on.
  const SoftmaxAccumulator<Scalar>& note_remainder(const SoftmaxAccumulator<Scalar>& r) {
    constexpr Scalar kNone = -std::numeric_limits<Scalar>::infinity();
    remainder_kept.resize(std::size_t(r.rows()));
    for (Index i = 0; i < r.rows(); ++i) remainder_kept[std::size_t(i)] = r.log_scale()(i) != kNone;
    return r;
  }
};

// Every valid key scored by exact attention's tiles (the clusters support with every cluster
// probed): no remainder is left. `keep` receives the sets of all valid keys.
template <typename Scalar>
SoftmaxAccumulator<Scalar> all_keys_exact(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                          const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                          const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                          Scalar scale, bool causal, SparseLowRankStats& st,
                                          SparseLowRankChoices<Scalar>* keep) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  ExactOptions eopt;
  eopt.causal = causal;
  eopt.scale = double(scale);
  eopt.check_finite = false;  // checked by the caller
  SoftmaxAccumulator<Scalar> acc = exact_attention_accumulate<Scalar>(q, k, v, eopt);
  const Index n_q = q.rows(), n_k = k.rows();
  for (Index i = 0; i < n_q; ++i) st.pairs_scored += valid_keys(i, n_k, causal);
  st.exact_seconds += seconds_since(start);
  if (keep) {
    keep->exact = gather_target_sets(n_q, n_k, [&](Index i, auto&& add) {
      for (Index j = 0; j < valid_keys(i, n_k, causal); ++j) add(std::int32_t(j));
    });
    keep->draws.start(n_q, 0);
    keep->remainder_kept.assign(std::size_t(n_q), 0);
  }
  return acc;
}

}  // namespace detail

// Unnormalised result as an accumulator: q n_q x d, k n_k x d, v n_k x dv. `stats` (if given)
// receives what the call did; pairs are counted only then or when the remainder needs them.
// `keep` (if given; sparse_lowrank_forward) receives the call's discrete choices for a backward,
// the result unchanged.
template <typename Scalar, typename Remainder = NoRemainder>
SoftmaxAccumulator<Scalar> sparse_lowrank_accumulate(
    const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
    const Eigen::Ref<const RowMatrix<Scalar>>& v, const SupportSpec<Scalar>& support,
    const Remainder& remainder = {}, const SparseLowRankOptions& opt = {},
    SparseLowRankStats* stats = nullptr, detail::SparseLowRankChoices<Scalar>* keep = nullptr) {
  const char* where = "sparse_lowrank_attention";
  using Clock = std::chrono::steady_clock;
  detail::require(support.parts() >= 1, where, "the support needs at least one part");
  detail::require(q.cols() == k.cols() || k.rows() == 0 || q.rows() == 0, where, "q (",
                  detail::shape_of(q), ") and k (", detail::shape_of(k),
                  ") must have the same number of columns d");
  detail::require(v.rows() == k.rows(), where, "v (", detail::shape_of(v),
                  ") must have one row per key (", k.rows(), ")");
  detail::require(!opt.causal || q.rows() == k.rows(), where,
                  "causal attention needs as many queries (", q.rows(), ") as keys (", k.rows(),
                  ")");
  detail::require(!opt.exclude_self || q.rows() == k.rows(), where,
                  "exclude_self needs as many queries (", q.rows(), ") as keys (", k.rows(), ")");
  detail::require(q.rows() == 0 || k.rows() > 0, where,
                  "attention over zero keys is undefined (q ", detail::shape_of(q), ", k ",
                  detail::shape_of(k), ")");
  detail::require(opt.centre_prefix >= 1, where, "centre_prefix must be >= 1, got ",
                  opt.centre_prefix);
  detail::require_finite(q, where, "q", opt.check_finite);
  detail::require_finite(k, where, "k", opt.check_finite);
  detail::require_finite(v, where, "v", opt.check_finite);
  const Scalar scale =
      detail::resolve_scale<Scalar>(where, opt, detail::inverse_sqrt_dim(q.cols()));
  SparseLowRankStats local;
  SparseLowRankStats& st = stats ? *stats : local;
  if (support.clusters) detail::check_cluster_support(*support.clusters, where);
  if (q.rows() == 0) return SoftmaxAccumulator<Scalar>(0, v.cols());
  if (detail::clusters_all_probed(support) && !opt.exclude_self) {
    SoftmaxAccumulator<Scalar> acc =
        detail::all_keys_exact<Scalar>(q, k, v, scale, opt.causal, st, keep);
    if (keep) {  // as a feature remainder would have run, for its (zero) backward
      keep->feature_options.causal = opt.causal;
      keep->feature_options.scale = double(scale);
      keep->feature_options.check_finite = false;
    }
    detail::check_accumulator_finite(where, acc, opt.check_finite, [] {}, true);
    return acc;
  }

  // The keys the supports see; working storage from the thread's pool.
  auto start = Clock::now();
  detail::Scratch<Eigen::RowVectorXd> mean(1, opt.centre_keys ? k.cols() : 0);
  detail::Scratch<RowMatrix<Scalar>> centred_keys(opt.centre_keys ? k.rows() : 0, k.cols());
  if (opt.centre_keys) {
    if (opt.key_mean) {
      detail::require(opt.key_mean->size() == k.cols(), where, "key_mean has ",
                      opt.key_mean->size(), " entries for keys of dimension ", k.cols());
      mean = *opt.key_mean;
    } else {
      key_mean_into<Scalar>(k, opt.causal ? opt.centre_prefix : 0, mean);
    }
    centred_into<Scalar>(k, mean, centred_keys);
  }
  const Eigen::Ref<const RowMatrix<Scalar>> hash_keys =
      opt.centre_keys ? Eigen::Ref<const RowMatrix<Scalar>>(centred_keys) : k;
  LshOptions lsh_opt = support.lsh_options;
  LsfOptions lsf_opt = support.lsf_options;
  for (AttentionOptions* o : {static_cast<AttentionOptions*>(&lsh_opt),
                              static_cast<AttentionOptions*>(&lsf_opt)}) {
    o->causal = opt.causal;
    o->scale = double(scale);
    o->check_finite = false;  // checked above
  }
  lsh_opt.exclude_self = lsf_opt.exclude_self = opt.exclude_self;
  constexpr bool no_remainder = std::is_same<Remainder, NoRemainder>::value;
  constexpr bool sampled = std::is_same<Remainder, SampledRemainder>::value;
  constexpr bool features = !no_remainder && !sampled;
  // An LSH part in sort-and-chunk mode is hashed and cut once: the chunks serve its target sets,
  // its own kernel and the feature correction.
  std::optional<LshChunks> chunks;
  if (support.lsh && !lsh_opt.exact_buckets) {
    check_lsh_inputs<Scalar>(where, q, hash_keys, v, *support.lsh, lsh_opt);
    chunks = lsh_chunks<Scalar>(*support.lsh, q, hash_keys, lsh_opt);
  }
  // A clusters part is clustered once: its index serves its target sets and the sampled
  // remainder's proposal.
  std::optional<detail::KeyClusterIndex<Scalar>> clusters;
  if (support.clusters) clusters.emplace(q, hash_keys, *support.clusters, scale, opt.causal, opt.seed);
  const detail::KeyClusterIndex<Scalar>* cluster_index = clusters ? &*clusters : nullptr;
  // A single hashing support computes E with its own kernel (not under the self rule, whose E
  // and remainder need the explicit sets). LSH chunks alone with no remainder or a feature
  // remainder: the sizes |S_i| suffice (the correction runs chunk by chunk), so the sets are
  // never built.
  const bool own_kernel = detail::hashed_alone(support) && !opt.exclude_self;
  const bool sizes_only = chunks && own_kernel && !sampled;
  const bool need_sets = !sizes_only && (!no_remainder || stats || !own_kernel);
  // |S_i| without the sets: counted by a feature remainder as it runs, or for the stats.
  detail::PooledVector<Index> sizes(0, sizes_only && features ? std::size_t(q.rows()) : 0);
  TargetSets sets;      // the keys E scores
  TargetSets left_out;  // under the self rule: the keys the remainder leaves out, S_i ∪ {i}
  if (sizes_only && !features && stats) {  // a feature remainder counts them as it runs
    sizes = lsh_target_sizes(*chunks, opt.causal);
    for (Index s : sizes) st.pairs_scored += s;
  } else if (need_sets) {
    sets = detail::support_sets<Scalar>(q, hash_keys, support, lsh_opt, lsf_opt, opt.causal,
                                        chunks ? &*chunks : nullptr, cluster_index);
    if (opt.exclude_self) {
      left_out = detail::sets_with_self(sets);
      sets = detail::sets_under_self_rule(sets, opt.causal);
    }
    st.pairs_scored += sets.pairs();
  }
  const TargetSets& remainder_sets = opt.exclude_self ? left_out : sets;
  st.support_seconds += detail::seconds_since(start);

  // E: the exact part.
  start = Clock::now();
  SoftmaxAccumulator<Scalar> acc;
  if (own_kernel) {
    acc = chunks ? lsh_attention_accumulate<Scalar>(*chunks, *support.lsh, q, hash_keys, v, lsh_opt)
          : support.lsh
              ? lsh_attention_accumulate<Scalar>(*support.lsh, q, hash_keys, v, lsh_opt)
              : lsf_attention_accumulate<Scalar>(*support.lsf, q, hash_keys, v, lsf_opt);
    if (opt.centre_keys) {  // back to the raw keys' logits: + scale q_i·μ
      auto [nd, log_scale] = std::move(acc).release();
      detail::Scratch<Vector<Scalar>> mu(k.cols());
      mu = mean.transpose().template cast<Scalar>();
      log_scale.noalias() += scale * (q * mu);
      acc = SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
    }
  } else {
    acc = target_attention_accumulate<Scalar>(q, k, v, sets, scale);
  }
  st.exact_seconds += detail::seconds_since(start);

  // R: the remainder.
  start = Clock::now();
  if constexpr (sampled) {
    st.samples += sampled_remainder_merge<Scalar>(
        q, k, hash_keys, v, remainder_sets, remainder, scale, opt.causal,
        Philox(opt.seed, streams::sparse_remainder_draws), opt.row_offset, acc,
        keep ? &keep->draws : nullptr, cluster_index);
  } else if constexpr (features) {
    RandomFeatureOptions fopt;
    fopt.causal = opt.causal;
    fopt.scale = double(scale);
    fopt.check_finite = false;
    fopt.denominator_epsilon = remainder.denominator_epsilon;
    if (keep) keep->feature_options = fopt;
    if (sizes_only) {
      const auto r = feature_remainder_accumulate(remainder.map, q, k, v, *chunks, fopt,
                                                  &st.clamped_rows, &sizes);
      acc.merge(keep ? keep->note_remainder(r) : r);
      for (Index s : sizes) st.pairs_scored += s;
    } else {
      const auto r = feature_remainder_accumulate(remainder.map, q, k, v, remainder_sets, fopt,
                                                  &st.clamped_rows);
      acc.merge(keep ? keep->note_remainder(r) : r);
    }
  }
  st.remainder_seconds += detail::seconds_since(start);
  if (keep) {
    if (opt.exclude_self) keep->left_out = std::move(left_out);
    if (opt.centre_keys) keep->key_mean = mean;
    keep->multiset = own_kernel && support.lsh && !lsh_opt.dedupe && !chunks;
    if (own_kernel && chunks) {
      keep->lsh_kernel.emplace();
      keep->lsh_kernel->chunks = *chunks;
      // The fallback rows: no valid key in any of their chunks.
      const auto found = gather_target_sizes(
          q.rows(), k.rows(), detail::chunk_targets(*chunks, opt.causal), false, opt.causal);
      for (Index i = 0; i < q.rows(); ++i)
        if (found[std::size_t(i)] == 0)
          keep->lsh_kernel->fallback_rows.push_back(static_cast<std::int32_t>(i));
      keep->lsh_options = lsh_opt;
    }
    // The sets, built here if the call did not need them (E by a hashing kernel; none for LSH
    // chunks, whose backward walks the chunks).
    if (need_sets)
      keep->exact = std::move(sets);
    else if (!keep->lsh_kernel)
      keep->exact = detail::support_sets<Scalar>(q, hash_keys, support, lsh_opt, lsf_opt,
                                                 opt.causal, chunks ? &*chunks : nullptr,
                                                 cluster_index);
    if (sampled && clusters) keep->clusters = std::move(clusters);  // last use of the index
  }
  // The parts ran unchecked (inputs were checked above): their overflow is reported here.
  detail::check_accumulator_finite(where, acc, opt.check_finite, [] {}, true);
  return acc;
}

// softmax(scale q kᵀ) v estimated as sparse + low-rank, written into `out` (n_q x dv, sharing no
// memory with q, k or v). A rejected `out` is not written.
template <typename Scalar, typename Remainder = NoRemainder, typename DO>
void sparse_lowrank_attention_into(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                   const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                   const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                   const SupportSpec<Scalar>& support,
                                   const Eigen::MatrixBase<DO>& out,
                                   const Remainder& remainder = {},
                                   const SparseLowRankOptions& opt = {},
                                   SparseLowRankStats* stats = nullptr) {
  detail::check_attention_output<Scalar>("sparse_lowrank_attention", out, q, k, v);
  sparse_lowrank_accumulate<Scalar, Remainder>(q, k, v, support, remainder, opt, stats)
      .finalize_into(out);
}

// softmax(scale q kᵀ) v estimated as sparse + low-rank: q n_q x d, k n_k x d, v n_k x dv ->
// n_q x dv. A row with no weight at all (empty support and its remainder dropped) is zero.
template <typename Scalar, typename Remainder = NoRemainder>
RowMatrix<Scalar> sparse_lowrank_attention(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                           const SupportSpec<Scalar>& support,
                                           const Remainder& remainder = {},
                                           const SparseLowRankOptions& opt = {},
                                           SparseLowRankStats* stats = nullptr) {
  auto out = detail::fresh_matrix<RowMatrix<Scalar>>(q.rows(), v.cols());
  sparse_lowrank_attention_into<Scalar, Remainder>(q, k, v, support, out, remainder, opt, stats);
  return out;
}

}  // namespace randattn
