#pragma once
// Random-feature (linear) attention over sequence-parallel shards, for every feature map
// (positive, hyperbolic, trig, hybrids): the map's features_into and the pieces of the linear
// core (core/linear_attention.hpp) run on each rank's rows; only key summaries move.
//
//   bidirectional  every rank summarises its keys, S_r = φ(K_r)ᵀ diag(σ) [V_r | 1] relative to
//                  exp(c_r); one MPI_Allreduce merges the (S_r, c_r) with the online-softmax rule
//                  (detail/reduce.hpp), and every rank's queries read the total. M (dv + 1) + 1
//                  values per rank, whatever n.
//   causal         one MPI_Exscan of the same summaries gives rank r the state of all keys of
//                  ranks 0..r−1; the rank's chunked causal prefix runs on its rows and its queries
//                  also read that carried state. Same volume as bidirectional.
// Rows are in the contiguous layout (partition.hpp). Each rank draws the map from the seed
// itself: no ω is broadcast. Ranks check that they hold the same map (a checksum of the
// features of a fixed probe, compared across ranks) and throw on every rank if not.
// The result equals random_feature_attention on the whole sequence up to rounding (the key
// summaries are summed by rank, then by chunk). Errors on any rank are thrown on every rank.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include <Eigen/Core>

#include "../attention/random_feature_attention.hpp"
#include "../core/input_checks.hpp"
#include "../core/linear_attention.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "communicator.hpp"
#include "detail/reduce.hpp"
#include "partition.hpp"

namespace randattn::mpi {

namespace detail {

// A fingerprint of the map: the features of the identity rows and of a row of ones, which
// depend on every entry of every projection. Equal maps give equal bits on every rank.
template <typename Map>
std::uint64_t map_fingerprint(const Map& map) {
  using Scalar = typename Map::Scalar;
  const Index d = map.input_dim();
  RowMatrix<Scalar> probe(d + 1, d);
  probe.topRows(d).setIdentity();
  probe.row(d).setOnes();
  RowMatrix<Scalar> values(d + 1, map.feature_dim());
  Vector<Scalar> log_scale(d + 1);
  map.features_into(probe, Scalar(1), values, log_scale, FeatureSide::key);
  const Vector<Scalar> signs = map.signs();
  std::uint64_t h = fnv1a(values.data(), std::size_t(values.size()));
  h = fnv1a(log_scale.data(), std::size_t(log_scale.size()), h);
  return fnv1a(signs.data(), std::size_t(signs.size()), h);
}

}  // namespace detail

// Unnormalised result for the local query rows (to merge with other partial results).
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> random_feature_attention_accumulate(
    Communicator& comm, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const RandomFeatureOptions& opt = {}) {
  using Scalar = typename Map::Scalar;
  const char* where = "random_feature_attention (MPI)";
  const RowPartition q_part =
      detail::gather_partition(comm, q.rows(), RowLayout::contiguous, where, "q");
  const RowPartition k_part =
      detail::gather_partition(comm, k.rows(), RowLayout::contiguous, where, "k");
  detail::require_same_everywhere<Index>(comm, v.cols(), where, "the number of columns dv of v");
  detail::require_same_everywhere<std::uint64_t>(
      comm, detail::map_fingerprint(map), where,
      "the feature map (fingerprint of its projections; draw it from the same seed and shape on "
      "every rank)");
  std::optional<FeatureAttentionParts<Map>> parts;
  comm.agree([&] {
    check_attention_counts(where, q_part.rows(), k_part.rows(), opt.causal);
    parts.emplace(where, map, q, k, v, opt);
  });

  // This rank's key summary (causal: with the local causal part, which computes it anyway),
  // then the merge of all ranks' summaries (bidirectional) or of the earlier ranks' (causal).
  const Index dim = map.feature_dim(), dv = v.cols();
  SoftmaxAccumulator<Scalar> acc(q.rows(), dv);
  KeySummary<Scalar> local{RowMatrix<Scalar>::Zero(dim, dv + 1)};
  if (opt.causal) {
    if (q.rows() > 0) std::tie(acc, local) = parts->causal_with_key_summary();
  } else if (k.rows() > 0) {
    local = parts->key_summary();
  }
  detail::ScaledSummary<Scalar> summary(local.state, local.log_scale);
  detail::merge_across_ranks(
      comm, summary, opt.causal ? detail::Reduction::exclusive_scan : detail::Reduction::all);
  const KeySummary<Scalar> merged{summary.state(dim, dv + 1), summary.log_scale()};
  if (q.rows() > 0) {
    if (!opt.causal) {
      acc = parts->queries_against(merged);
    } else if (merged.log_scale != -std::numeric_limits<Scalar>::infinity()) {
      acc.merge(parts->queries_against(merged));
    }
  }
  comm.agree(
      [&] { randattn::detail::check_result_finite(where, acc.numden(), opt.check_finite, [] {}); });
  return acc;
}

// softmax(scale · Q Kᵀ [masked]) V estimated with the map, for the local query rows; q, k, v are
// this rank's rows of the global operands in the contiguous layout.
template <typename Map>
RowMatrix<typename Map::Scalar> random_feature_attention(
    Communicator& comm, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const RandomFeatureOptions& opt = {}) {
  SoftmaxAccumulator<typename Map::Scalar> acc =
      random_feature_attention_accumulate(comm, map, q, k, v, opt);
  // The denominator guard of this map and these options (the inputs were checked above).
  RandomFeatureOptions checked = opt;
  checked.check_finite = false;
  return acc.finalize(
      FeatureAttentionParts<Map>("random_feature_attention (MPI)", map, q, k, v, checked)
          .denominator_epsilon());
}

}  // namespace randattn::mpi
