#pragma once
// Random-feature maps of the softmax kernel SM(x, y) = exp(xᵀy) (Choromanski et al., "Rethinking
// Attention with Performers", ICLR 2021):
//
//   trig        (2m): φ(x) = e^{‖x‖²/2}/√m  · [sin(ω_iᵀx)]_i ⊕ [cos(ω_iᵀx)]_i
//   positive     (m): φ(x) = e^{−‖x‖²/2}/√m · [exp(ω_iᵀx)]_i                  (FAVOR+)
//   hyperbolic  (2m): φ(x) = e^{−‖x‖²/2}/√(2m) · [exp(ω_iᵀx)]_i ⊕ [exp(−ω_iᵀx)]_i
//
// Each is unbiased, E[φ(x)ᵀφ(y)] = exp(xᵀy), when the ω_i are N(0, I_d) (i.i.d. or orthogonal
// rows with χ(d) norms). A map is a template on Scalar and on its projection (projection.hpp)
// and maps the rows of an n×d block, each first multiplied by a data normaliser c > 0, to
// ScaledFeatures: row i stands for exp(log_scale(i)) · values.row(i). For attention the
// normaliser is scale^{1/2}, so that the estimated kernel is exp(scale · qᵀk).
//
// Stabiliser. All magnitudes live in the log-scale: positive values are exp(u_i − max_j u_j)
// ∈ (0, 1] with u = c ωᵀx, hyperbolic values exp(±u_i − max_j |u_j|), trig values are sin/cos.
// The stabiliser is per row, so a row's features depend on that row alone (safe for causal
// attention), and no finite input overflows: with ‖c x‖ = 20 the positive and hyperbolic
// features are finite in float and double. No additive epsilon enters the features (it would
// bias the estimate); only the attention denominator is guarded, in the core.
//
// Trig at large norms. The trig estimate has standard deviation e^{(‖x‖²+‖y‖²)/2}(1 −
// e^{−‖x−y‖²})/√(2m) against a kernel value e^{xᵀy}: its relative error grows like
// e^{‖x−y‖²/2}/√m and it is not positive, so attention denominators can be tiny or negative.
// The guard: the magnitude e^{‖x‖²/2} is kept in the log-scale (the features are finite for
// every finite input), and trig attention always uses a positive denominator guard (see
// random_feature_attention.hpp), so outputs are finite; they are, however, dominated by noise
// once scale·‖q − k‖² reaches a few units. Prefer the positive or hyperbolic maps there.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <utility>

#include <Eigen/Core>

#include "../core/scaled_features.hpp"
#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/row_exp.hpp"
#include "../detail/validation.hpp"
#include "projected_feature_map.hpp"
#include "projection.hpp"

namespace randattn {

// FAVOR+ positive features (m of them). Nonnegative: attention denominators are positive.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class PositiveFeatures
    : public ProjectedFeatureMap<PositiveFeatures<Scalar, Projection>, Scalar, Projection> {
  using Base = ProjectedFeatureMap<PositiveFeatures, Scalar, Projection>;

 public:
  static constexpr Index features_for(Index m) { return m; }
  static constexpr bool nonnegative = true;
  using Base::Base;

  // Row u = ωᵀx (m entries) to exp(c(u − max u)); returns the row's log-scale.
  template <typename Row>
  Scalar finish_row(Row&& row, Scalar sq_norm, Scalar c) const {
    const Scalar top = detail::row_max(row.data(), row.size());
    detail::row_exp(row.data(), row.data(), row.size(), top, c);
    return c * top - Scalar(0.5) * c * c * sq_norm - this->log_sqrt(this->projections());
  }

  // Backward of finish_row (see ProjectedFeatureMap): φ_r ∝ exp(c u_r − ½c²‖x‖²), so
  // du_r = c D_r F_r; the log-scale c·max u − ½c²‖x‖² adds c λ at the maximum.
  template <typename Values, typename DValues, typename Du>
  Scalar vjp_row(const Values& values, const DValues& d_values, Scalar d_log_scale, Scalar c,
                 Du&& du) const {
    du = (c * (d_values.array() * values.array())).matrix();
    const Scalar through_log = d_values.dot(values) + d_log_scale;
    if (d_log_scale != 0) {
      Index top;
      values.maxCoeff(&top);
      du(top) += c * d_log_scale;
    }
    return Scalar(-0.5) * c * c * through_log;
  }
};

// Hyperbolic positive features (2m of them): exp(±ω_iᵀx), half the positive map's variance
// per projection row (Performer, Lemma 1). Nonnegative.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class HyperbolicFeatures
    : public ProjectedFeatureMap<HyperbolicFeatures<Scalar, Projection>, Scalar, Projection> {
  using Base = ProjectedFeatureMap<HyperbolicFeatures, Scalar, Projection>;

 public:
  static constexpr Index features_for(Index m) { return 2 * m; }
  static constexpr bool nonnegative = true;
  using Base::Base;

  // Row [u | ·] to [exp(c(u − max|u|)) | exp(c(−u − max|u|))]; returns the log-scale.
  template <typename Row>
  Scalar finish_row(Row&& row, Scalar sq_norm, Scalar c) const {
    const Index m = this->projections();
    auto u = row.head(m);
    const Scalar top = detail::row_max<true>(u.data(), m);
    detail::row_exp<true>(u.data(), row.data() + m, m, top, c);
    detail::row_exp(u.data(), u.data(), m, top, c);
    return c * top - Scalar(0.5) * c * c * sq_norm - this->log_sqrt(2 * m);
  }

  // Backward of finish_row: du_r = c (D⁺_r F⁺_r − D⁻_r F⁻_r); the log-scale c·max|u| − ½c²‖x‖²
  // adds ±c λ at the largest |u_r|.
  template <typename Values, typename DValues, typename Du>
  Scalar vjp_row(const Values& values, const DValues& d_values, Scalar d_log_scale, Scalar c,
                 Du&& du) const {
    const Index m = this->projections();
    du = (c * (d_values.head(m).array() * values.head(m).array() -
               d_values.tail(m).array() * values.tail(m).array()))
             .matrix();
    const Scalar through_log = d_values.dot(values) + d_log_scale;
    if (d_log_scale != 0) {
      Index top;
      values.maxCoeff(&top);
      if (top < m) du(top) += c * d_log_scale;
      else du(top - m) -= c * d_log_scale;
    }
    return Scalar(-0.5) * c * c * through_log;
  }
};

// Trigonometric features (2m of them): sin ⊕ cos. Not positive; see the header comment for
// the large-norm behaviour and its guard.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class TrigFeatures
    : public ProjectedFeatureMap<TrigFeatures<Scalar, Projection>, Scalar, Projection> {
  using Base = ProjectedFeatureMap<TrigFeatures, Scalar, Projection>;

 public:
  static constexpr Index features_for(Index m) { return 2 * m; }
  static constexpr bool nonnegative = false;
  using Base::Base;

  // Row [u | ·] to [sin(cu) | cos(cu)]; returns the log-scale ‖cx‖²/2 − log √m.
  template <typename Row>
  Scalar finish_row(Row&& row, Scalar sq_norm, Scalar c) const {
    const Index m = this->projections();
    auto u = row.head(m);
    u *= c;
    row.tail(m) = u.array().cos().matrix();
    u = u.array().sin().matrix();
    return Scalar(0.5) * c * c * sq_norm - this->log_sqrt(m);
  }

  // Backward of finish_row: du_r = c (D^sin_r cos(cu_r) − D^cos_r sin(cu_r)); the log-scale
  // ½c²‖x‖² (the magnitude e^{‖cx‖²/2}) carries the rest.
  template <typename Values, typename DValues, typename Du>
  Scalar vjp_row(const Values& values, const DValues& d_values, Scalar d_log_scale, Scalar c,
                 Du&& du) const {
    const Index m = this->projections();
    du = (c * (d_values.head(m).array() * values.tail(m).array() -
               d_values.tail(m).array() * values.head(m).array()))
             .matrix();
    return Scalar(0.5) * c * c * (d_values.dot(values) + d_log_scale);
  }
};

// A map deduces its scalar from the projection: PositiveFeatures
// favor(OrthogonalProjection<float>(m, d)).
template <typename P>
PositiveFeatures(P) -> PositiveFeatures<typename P::Scalar, P>;
template <typename P>
HyperbolicFeatures(P) -> HyperbolicFeatures<typename P::Scalar, P>;
template <typename P>
TrigFeatures(P) -> TrigFeatures<typename P::Scalar, P>;

}  // namespace randattn
