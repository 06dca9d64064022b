#pragma once
// The low-rank remainder of sparse + low-rank attention (Scatterbrain, arXiv 2110.15343): with
// feature estimates φ(q)ᵀφ(k) ≈ exp(scale q·k), the keys outside the support S_i are estimated by
//   R_i = φ(q_i)ᵀ (Σ_{valid j} φ(k_j) [v_j | 1]) − Σ_{j ∈ S_i} φ(q_i)ᵀ φ(k_j) [v_j | 1],
// unbiased for Σ_{valid j ∉ S_i} exp(scale q_i·k_j) [v_j | 1] whenever the features are, and
// exactly zero where S_i holds every valid key (such rows skip the estimate). The first term is
// random-feature attention's accumulator (causal prefix sums under causal masking: keys j <= i
// only), the second a correction over the support, O(|S_i| M) per query.
//
// Denominator rule. The true remainder denominator is a sum of positive weights, but its estimate
// can come out <= 0 (signed features, or cancellation in the difference when the support holds
// almost all of the estimated mass). Such a row drops its remainder (numerator and denominator:
// the output is the support's exact softmax) and is counted in `clamped_rows`. This is the one
// source of bias of the estimate.

#include <algorithm>
#include <cmath>
#include <limits>

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
// so the pair counts once over the rounds) and masked to j <= i under causal masking. Rows merge
// round after round; within a round each row belongs to one chunk, so results do not depend on
// the thread count.
template <typename Scalar>
void subtract_on_chunks(const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
                        const Vector<Scalar>& signs, const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const LshChunks& l, bool causal, RowMatrix<Scalar>& nd,
                        Vector<Scalar>& log_scale) {
  const Index m = qf.dim(), dv = v.cols();
  for (Index rho = 0; rho < l.rounds; ++rho) {
    const std::int32_t* qr = l.qperm.data() + rho * l.n_q;
    const std::int32_t* kr = l.kperm.data() + rho * l.n_k;
    parallel_for(l.chunks, [&](Index g) {
      const Index r0 = g * l.c, nr = std::min(l.c, l.n_q - r0);
      std::vector<std::int32_t> cols(kr + g * l.ck, kr + g * l.ck + l.key_count(g));
      if (l.chunks > 1) {
        const Index p = l.previous(g);
        cols.insert(cols.end(), kr + p * l.ck, kr + p * l.ck + l.key_count(p));
      }
      const Index nc = Index(cols.size());
      if (nc == 0) return;
      RowMatrix<Scalar> fq(nr, m), fk(nc, m), values(nc, dv + 1);
      for (Index u = 0; u < nr; ++u) fq.row(u) = qf.values.row(qr[r0 + u]);
      if (signs.size() > 0) fq.array().rowwise() *= signs.transpose().array();
      Scalar top = -std::numeric_limits<Scalar>::infinity();
      for (Index t = 0; t < nc; ++t) top = std::max(top, kf.log_scale(cols[t]));
      for (Index t = 0; t < nc; ++t) {
        const Scalar w = std::exp(kf.log_scale(cols[t]) - top);
        fk.row(t) = w * kf.values.row(cols[t]);
        values.row(t).head(dv) = v.row(cols[t]);
        values(t, dv) = 1;
      }
      RowMatrix<Scalar> weights = fq * fk.transpose();
      for (Index u = 0; u < nr; ++u) {
        const Index i = qr[r0 + u];
        for (Index t = 0; t < nc; ++t)
          weights(u, t) = (causal && cols[t] > i)
                              ? Scalar(0)
                              : weights(u, t) / Scalar(l.rounds_sharing(i, cols[t]));
      }
      const RowMatrix<Scalar> correction = -(weights * values);
      for (Index u = 0; u < nr; ++u) {
        const Index i = qr[r0 + u];
        merge_scaled(nd.row(i), log_scale(i), correction.row(u), qf.log_scale(i) + top);
      }
    });
  }
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
  const auto settings = detail::feature_attention_settings(where, map, opt);
  const SoftmaxAccumulator<Scalar> all =
      detail::feature_attention_slice(where, map, q, k, v, settings, opt.check_finite);
  RowMatrix<Scalar> nd = all.numden();
  Vector<Scalar> log_scale = all.log_scale();
  if (q.rows() == 0) return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
  const auto [qf, kf] = detail::map_slice(where, map, q, k, v, settings, false);
  const Vector<Scalar> signs = map.signs();
  if (chunks)
    detail::subtract_on_chunks(qf, kf, signs, v, *chunks, opt.causal, nd, log_scale);
  else
    detail::subtract_on_targets(qf, kf, signs, v, sets, nd, log_scale);
  const Index n_q = q.rows(), n_k = k.rows(), dv = v.cols();
  Index clamped = 0;
  for (Index i = 0; i < n_q; ++i) {
    const bool full = sets.size(i) == valid_keys(i, n_k, opt.causal);  // nothing outside
    if (full || !(nd(i, dv) > Scalar(0))) {  // the denominator rule (NaN included)
      nd.row(i).setZero();
      log_scale(i) = -std::numeric_limits<Scalar>::infinity();
      clamped += !full;
    }
  }
  if (clamped_rows) *clamped_rows += clamped;
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

}  // namespace randattn
