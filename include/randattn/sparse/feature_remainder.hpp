#pragma once
// The low-rank remainder of sparse + low-rank attention (Scatterbrain, arXiv 2110.15343): with
// feature estimates φ(q)ᵀφ(k) ≈ exp(scale q·k), the keys outside the support S_i are estimated by
//   R_i = φ(q_i)ᵀ (Σ_{valid j} φ(k_j) [v_j | 1]) − Σ_{j ∈ S_i} φ(q_i)ᵀ φ(k_j) [v_j | 1],
// unbiased for Σ_{valid j ∉ S_i} exp(scale q_i·k_j) [v_j | 1] whenever the features are, and
// exactly zero where S_i holds every valid key (such rows skip the estimate). The first term is
// random-feature attention's accumulator (causal prefix sums under causal masking: keys j <= i
// only), the second a correction over the support, O(|S_i| M) per query; q and k are mapped
// once for both.
//
// Denominator rule. The true remainder denominator is a sum of positive weights, but its estimate
// can come out <= 0 (signed features, or cancellation in the difference when the support holds
// almost all of the estimated mass). Such a row drops its remainder (numerator and denominator:
// the output is the support's exact softmax) and is counted in `clamped_rows`. This is the one
// source of bias of the estimate.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../attention/random_feature_attention.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../lsh/lsh_attention.hpp"

namespace randattn {

namespace detail {

// Subtracts Σ_{j ∈ S_i} φ(q_i)ᵀ φ(k_j) [v_j | 1] from row i of (nd, log_scale), S_i the explicit
// target set, key by key: O(|S_i| M) per query.
template <typename Scalar>
void subtract_on_targets(const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
                         const Vector<Scalar>& signs, const Eigen::Ref<const RowMatrix<Scalar>>& v,
                         const TargetSets& sets, RowMatrix<Scalar>& nd, Vector<Scalar>& log_scale) {
  const Index n_q = qf.rows(), dv = v.cols();
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  parallel_for((n_q + 63) / 64, [&](Index t) {
    Vector<Scalar> fq(qf.dim());
    RowMatrix<Scalar> correction(1, dv + 1);
    for (Index i = t * 64; i < std::min(n_q, (t + 1) * 64); ++i) {
      if (sets.size(i) == 0) continue;
      fq = qf.values.row(i).transpose();
      if (signs.size() > 0) fq.array() *= signs.array();
      Scalar top = kNegInf;
      for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j)
        top = std::max(top, kf.log_scale(*j));
      correction.setZero();
      for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j) {
        const Scalar w = kf.values.row(*j).dot(fq) * std::exp(kf.log_scale(*j) - top);
        correction.leftCols(dv).noalias() += w * v.row(*j);
        correction(0, dv) += w;
      }
      correction = -correction;
      merge_scaled(nd.row(i), log_scale(i), correction, qf.log_scale(i) + top);
    }
  });
}

// The same for LSH sort-and-chunk target sets, tile by tile: per round, query chunk g against key
// chunks g and g - 1 as one matrix product, each pair weighted by 1/N_ij (N_ij rounds share it,
// so the pair counts once over the rounds; looked up in the chunks' table beyond
// kCountTableRounds rounds, so the work stays linear in rounds) and masked to j <= i under causal
// masking. Rows merge round after round; within a round each row belongs to one chunk, so
// results do not depend on the thread count. Buffers are per thread, reused across chunks.
// `distinct` (if given, n_q entries) receives Σ 1/N_ij over the row's unmasked pairs: each
// distinct key of S_i once (before the fallback of a row left without keys), so |S_i| comes
// from the weights already counted.
template <typename Scalar>
void subtract_on_chunks(const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
                        const Vector<Scalar>& signs, const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const LshChunks& l, bool causal, RowMatrix<Scalar>& nd,
                        Vector<Scalar>& log_scale, std::vector<double>* distinct = nullptr) {
  const Index m = qf.dim(), dv = v.cols();
  // N_ij as the LSH kernel counts it (target_blocks.hpp): from the chunk signatures, or the table.
  const LshChunkPlan& kplan = l.key_plan();
  RoundSignatures sig{l.queries.chunk_of().data(), kplan.chunk_of().data(), l.rounds,
                      l.chunks > 1, static_cast<std::int32_t>(1 - l.chunks)};
  sig.counts = l.has_counts() ? &l.counts : nullptr;
  std::vector<double> inverse(std::size_t(l.rounds) + 1, 0.0);  // 1/N_ij, N_ij <= rounds
  for (std::size_t c = 1; c < inverse.size(); ++c) inverse[c] = 1.0 / double(c);
  struct Scratch {
    std::vector<std::int32_t> cols, count;
    RoundCounter::SignatureMatrix key_sig;
    RowMatrix<Scalar> fq, fk, values, weights, correction;
  };
  for (Index rho = 0; rho < l.rounds; ++rho) {
    parallel_for_with(
        l.chunks, [] { return Scratch(); },
        [&](Index g, Scratch& s) {
          const std::int32_t* rows = l.queries.chunk(rho, g);
          const Index nr = l.queries.chunk_size(g);
          s.cols.assign(l.key_chunk(rho, g), l.key_chunk(rho, g) + l.key_count(g));
          if (l.chunks > 1) {
            const Index p = l.previous(g);
            s.cols.insert(s.cols.end(), l.key_chunk(rho, p), l.key_chunk(rho, p) + l.key_count(p));
          }
          const Index nc = Index(s.cols.size());
          if (nc == 0 || nr == 0) return;
          s.fq.resize(nr, m);
          s.fk.resize(nc, m);
          s.values.resize(nc, dv + 1);
          for (Index u = 0; u < nr; ++u) s.fq.row(u) = qf.values.row(rows[u]);
          if (signs.size() > 0) s.fq.array().rowwise() *= signs.transpose().array();
          Scalar top = -std::numeric_limits<Scalar>::infinity();
          for (Index t = 0; t < nc; ++t) top = std::max(top, kf.log_scale(s.cols[t]));
          for (Index t = 0; t < nc; ++t) {
            const Scalar w = std::exp(kf.log_scale(s.cols[t]) - top);
            s.fk.row(t) = w * kf.values.row(s.cols[t]);
            s.values.row(t).head(dv) = v.row(s.cols[t]);
            s.values(t, dv) = 1;
          }
          s.weights.noalias() = s.fq * s.fk.transpose();
          s.key_sig.resize(sig.counts ? 0 : l.rounds, nc);
          if (!sig.counts)
            for (Index t = 0; t < nc; ++t)
              for (Index r = 0; r < l.rounds; ++r) s.key_sig(r, t) = kplan.chunk_of()(s.cols[t], r);
          const RoundCounter counter{&sig, &s.key_sig};
          const TileIndex col_index = TileIndex::gathered(s.cols.data(), nc);
          s.count.resize(std::size_t(nc));
          for (Index u = 0; u < nr; ++u) {
            const Index i = rows[u];
            std::fill(s.count.begin(), s.count.end(), 0);
            counter(i, col_index, s.count.data());
            for (Index t = 0; t < nc; ++t)  // negated: the product below is the correction
              s.weights(u, t) = (causal && s.cols[t] > i) ? Scalar(0)
                                                           : -s.weights(u, t) / Scalar(s.count[t]);
            if (!distinct) continue;
            const auto term = [&](Index t) {
              return (causal && s.cols[t] > i) ? 0.0 : inverse[std::size_t(s.count[t])];
            };
            double a = 0, b = 0;  // two sums: half the chain of dependent additions
            Index t = 0;
            for (; t + 1 < nc; t += 2) {
              a += term(t);
              b += term(t + 1);
            }
            if (t < nc) a += term(t);
            (*distinct)[std::size_t(i)] += a + b;
          }
          s.correction.noalias() = s.weights * s.values;
          for (Index u = 0; u < nr; ++u) {
            const Index i = rows[u];
            merge_scaled(nd.row(i), log_scale(i), s.correction.row(u), qf.log_scale(i) + top);
          }
        });
  }
}

// The remainder from the mapped features: the linear core over all valid keys, minus the
// correction `subtract` on the support, then the denominator rule; size(i) = |S_i|.
template <typename Map, typename Size, typename Subtract>
SoftmaxAccumulator<typename Map::Scalar> feature_remainder(
    const char* where, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v, const RandomFeatureOptions& opt,
    Index* clamped_rows, Size&& size, Subtract&& subtract) {
  using Scalar = typename Map::Scalar;
  const auto settings = feature_attention_settings(where, map, opt);
  // q and k mapped once: the same features serve the linear core and the correction.
  const auto mapped = map_slice(where, map, q, k, v, settings, opt.check_finite);
  const ScaledFeatures<Scalar>& qf = mapped.first;
  const ScaledFeatures<Scalar>& kf = mapped.second;
  if (q.rows() == 0) return SoftmaxAccumulator<Scalar>(0, v.cols());
  const Vector<Scalar> signs = map.signs();
  const GivenFeatureRows<Scalar> qrows(qf.values, qf.log_scale), krows(kf.values, kf.log_scale);
  const LinearOperands<GivenFeatureRows<Scalar>, GivenFeatureRows<Scalar>> in{
      qrows, krows, v, signs, linear_chunk(settings.linear)};
  auto [nd, log_scale] =
      linear_accumulate(where, in, settings.linear.causal, settings.linear.check_finite)
          .release();
  subtract(qf, kf, signs, nd, log_scale);
  const Index n_q = q.rows(), n_k = k.rows(), dv = v.cols();
  Index clamped = 0;
  for (Index i = 0; i < n_q; ++i) {
    const bool full = size(i) == valid_keys(i, n_k, opt.causal);  // nothing outside
    if (full || !(nd(i, dv) > Scalar(0))) {  // the denominator rule (NaN included)
      nd.row(i).setZero();
      log_scale(i) = -std::numeric_limits<Scalar>::infinity();
      clamped += !full;
    }
  }
  if (clamped_rows) *clamped_rows += clamped;
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

}  // namespace detail

// The remainder estimate as an accumulator: q n_q x d, k n_k x d, v n_k x dv; opt.causal and
// opt.scale as for random_feature_attention. *clamped_rows (if given) counts the rows dropped by
// the denominator rule. `chunks` (optional): the LSH sort-and-chunk layout whose target sets
// `sets` are, so that the correction runs as matrix products per chunk.
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> feature_remainder_accumulate(
    const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v, const TargetSets& sets,
    const RandomFeatureOptions& opt, Index* clamped_rows = nullptr,
    const LshChunks* chunks = nullptr) {
  using Scalar = typename Map::Scalar;
  const char* where = "feature_remainder";
  detail::require(sets.rows() == q.rows(), where, "target sets of ", sets.rows(),
                  " queries for ", q.rows(), " queries");
  return detail::feature_remainder(
      where, map, q, k, v, opt, clamped_rows, [&](Index i) { return sets.size(i); },
      [&](const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
          const Vector<Scalar>& signs, RowMatrix<Scalar>& nd, Vector<Scalar>& log_scale) {
        if (chunks)
          detail::subtract_on_chunks(qf, kf, signs, v, *chunks, opt.causal, nd, log_scale);
        else
          detail::subtract_on_targets(qf, kf, signs, v, sets, nd, log_scale);
      });
}

// The same on the target sets of sort-and-chunk LSH with the chunks `chunks`, which are never
// built: the correction counts each row's keys as it weighs them, and `sizes` (if given)
// receives |S_i|, lsh_target_sizes(chunks, opt.causal) without its pass over the keys.
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> feature_remainder_accumulate(
    const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v, const LshChunks& chunks,
    const RandomFeatureOptions& opt, Index* clamped_rows = nullptr,
    std::vector<Index>* sizes = nullptr) {
  using Scalar = typename Map::Scalar;
  const char* where = "feature_remainder";
  detail::require(chunks.n_q == q.rows() && chunks.n_k == k.rows(), where,
                  "the chunks were not cut from these q and k");
  std::vector<Index> counted(std::size_t(q.rows()), 0);
  auto acc = detail::feature_remainder(
      where, map, q, k, v, opt, clamped_rows, [&](Index i) { return counted[std::size_t(i)]; },
      [&](const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
          const Vector<Scalar>& signs, RowMatrix<Scalar>& nd, Vector<Scalar>& log_scale) {
        std::vector<double> distinct(std::size_t(q.rows()), 0.0);
        detail::subtract_on_chunks(qf, kf, signs, v, chunks, opt.causal, nd, log_scale,
                                   &distinct);
        for (Index i = 0; i < q.rows(); ++i) {  // Σ 1/N_ij sums to an integer; the fallback
          const Index keys = Index(std::llround(distinct[std::size_t(i)]));
          counted[std::size_t(i)] = keys > 0 ? keys : valid_keys(i, k.rows(), opt.causal);
        }
      });
  if (sizes) *sizes = std::move(counted);
  return acc;
}

}  // namespace randattn
