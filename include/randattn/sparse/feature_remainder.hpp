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

namespace randattn {

// The remainder estimate as an accumulator: q n_q x d, k n_k x d, v n_k x dv; opt.causal and
// opt.scale as for random_feature_attention. *clamped_rows (if given) counts the rows dropped by
// the denominator rule.
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> feature_remainder_accumulate(
    const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v, const TargetSets& sets,
    const RandomFeatureOptions& opt, Index* clamped_rows = nullptr) {
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
  const Index n_q = q.rows(), n_k = k.rows(), dv = v.cols();
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  std::vector<char> clamped(static_cast<std::size_t>(n_q), 0);
  const Index tasks = (n_q + 63) / 64;
  detail::parallel_for(tasks, [&](Index t) {
    Vector<Scalar> fq(qf.dim());
    RowMatrix<Scalar> correction(1, dv + 1);
    for (Index i = t * 64; i < std::min(n_q, (t + 1) * 64); ++i) {
      if (sets.size(i) == valid_keys(i, n_k, opt.causal)) {  // nothing outside the support
        nd.row(i).setZero();
        log_scale(i) = kNegInf;
        continue;
      }
      if (sets.size(i) > 0) {
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
        detail::merge_scaled(nd.row(i), log_scale(i), correction, qf.log_scale(i) + top);
      }
      if (!(nd(i, dv) > Scalar(0))) {  // the denominator rule (NaN included)
        nd.row(i).setZero();
        log_scale(i) = kNegInf;
        clamped[std::size_t(i)] = 1;
      }
    }
  });
  if (clamped_rows) *clamped_rows += Index(std::count(clamped.begin(), clamped.end(), 1));
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

}  // namespace randattn
