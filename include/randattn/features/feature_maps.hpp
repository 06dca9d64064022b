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

#include <cmath>
#include <utility>

#include <Eigen/Core>

#include "../core/scaled_features.hpp"
#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "projection.hpp"

namespace randattn {

// Which side of the kernel a feature row stands for: φ(q)ᵀ diag(σ) φ(k). The maps of this
// header are symmetric; hybrid maps may differ between the sides.
enum class FeatureSide { query, key };

namespace detail {

// What the three maps share: the projection, validation, the tiled projection product and
// the allocating front ends. Derived supplies `features_for(m)` (feature dimension for m
// projections), `nonnegative` and `finish_row(row, ‖x‖², c)`, which turns the projections u = ωᵀx
// (the first m entries of a feature row) into the row's values in place, without allocating, and
// returns its log-scale.
template <typename Derived, typename Scalar_, typename Projection_>
class ProjectedFeatureMap {
 public:
  using Scalar = Scalar_;
  using Projection = Projection_;

  explicit ProjectedFeatureMap(Projection projection) : projection_(std::move(projection)) {}

  const Projection& projection() const { return projection_; }
  // Draws a new ω of the same kind and shape (random projections only).
  void redraw(std::uint64_t seed) { projection_.redraw(seed); }

  Index input_dim() const { return projection_.input_dim(); }
  Index projections() const { return projection_.features(); }
  Index feature_dim() const { return Derived::features_for(projection_.features()); }
  // Sign vector of φ(q)ᵀ diag(σ) φ(k): empty, i.e. all +1.
  Vector<Scalar> signs() const { return Vector<Scalar>(); }

  // Features of the rows of normaliser · x into preallocated storage (values n × feature_dim,
  // log_scale n). The side does not matter for these maps.
  void features_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                     Eigen::Ref<RowMatrix<Scalar>> values, Eigen::Ref<Vector<Scalar>> log_scale,
                     FeatureSide = FeatureSide::query) const {
    const char* where = "feature map";
    const Index n = x.rows(), m = projections();
    require(x.cols() == input_dim(), where, "x is ", shape_of(x), " but the projection expects ",
            input_dim(), " columns");
    require(values.rows() == n && values.cols() == feature_dim() && log_scale.size() == n, where,
            "values (", shape_of(values), ") and log_scale (", log_scale.size(), ") must be ", n,
            "x", feature_dim(), " and ", n);
    require(normaliser > 0 && std::isfinite(normaliser), where,
            "normaliser must be positive and finite, got ", normaliser);
    const Index tiles = (n + kTile - 1) / kTile;
    // Fixed tiles: each row's rounding depends on the shapes only, not on the thread count.
    parallel_for(tiles, [&](Index t) {
      const Index i0 = t * kTile, rows = std::min(kTile, n - i0);
      const auto xt = x.middleRows(i0, rows);
      auto vt = values.middleRows(i0, rows);
      projection_.apply(xt, vt.leftCols(m));
      for (Index r = 0; r < rows; ++r)
        log_scale(i0 + r) = derived().finish_row(vt.row(r), xt.row(r).squaredNorm(), normaliser);
    });
  }

  ScaledFeatures<Scalar> features(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                                  Scalar normaliser = 1,
                                  FeatureSide side = FeatureSide::query) const {
    ScaledFeatures<Scalar> f{RowMatrix<Scalar>(x.rows(), feature_dim()), Vector<Scalar>(x.rows())};
    features_into(x, normaliser, f.values, f.log_scale, side);
    return f;
  }
  ScaledFeatures<Scalar> operator()(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                                    Scalar normaliser = 1) const {
    return features(x, normaliser);
  }

 protected:
  static constexpr Index kTile = 256;
  static Scalar log_sqrt(Index count) { return Scalar(0.5 * std::log(double(count))); }
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
  Projection projection_;
};

}  // namespace detail

// FAVOR+ positive features (m of them). Nonnegative: attention denominators are positive.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class PositiveFeatures
    : public detail::ProjectedFeatureMap<PositiveFeatures<Scalar, Projection>, Scalar, Projection> {
  using Base = detail::ProjectedFeatureMap<PositiveFeatures, Scalar, Projection>;

 public:
  static constexpr Index features_for(Index m) { return m; }
  static constexpr bool nonnegative = true;
  using Base::Base;

  // Row u = ωᵀx (m entries) to exp(c(u − max u)); returns the row's log-scale.
  template <typename Row>
  Scalar finish_row(Row&& row, Scalar sq_norm, Scalar c) const {
    const Scalar top = row.maxCoeff();
    row = ((row.array() - top) * c).exp().matrix();
    return c * top - Scalar(0.5) * c * c * sq_norm - this->log_sqrt(this->projections());
  }
};

// Hyperbolic positive features (2m of them): exp(±ω_iᵀx), half the positive map's variance
// per projection row (Performer, Lemma 1). Nonnegative.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class HyperbolicFeatures
    : public detail::ProjectedFeatureMap<HyperbolicFeatures<Scalar, Projection>, Scalar,
                                         Projection> {
  using Base = detail::ProjectedFeatureMap<HyperbolicFeatures, Scalar, Projection>;

 public:
  static constexpr Index features_for(Index m) { return 2 * m; }
  static constexpr bool nonnegative = true;
  using Base::Base;

  // Row [u | ·] to [exp(c(u − max|u|)) | exp(c(−u − max|u|))]; returns the log-scale.
  template <typename Row>
  Scalar finish_row(Row&& row, Scalar sq_norm, Scalar c) const {
    const Index m = this->projections();
    auto u = row.head(m);
    const Scalar top = std::max(u.maxCoeff(), -u.minCoeff());
    row.tail(m) = ((-u.array() - top) * c).exp().matrix();
    u = ((u.array() - top) * c).exp().matrix();
    return c * top - Scalar(0.5) * c * c * sq_norm - this->log_sqrt(2 * m);
  }
};

// Trigonometric features (2m of them): sin ⊕ cos. Not positive; see the header comment for
// the large-norm behaviour and its guard.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class TrigFeatures
    : public detail::ProjectedFeatureMap<TrigFeatures<Scalar, Projection>, Scalar, Projection> {
  using Base = detail::ProjectedFeatureMap<TrigFeatures, Scalar, Projection>;

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
