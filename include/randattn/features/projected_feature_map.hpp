#pragma once
// The bases of the feature maps that start from projections u = ωᵀx (projection.hpp), as CRTP
// templates: a new map supplies how a row of projections becomes its features, the base does
// the rest (validation, the tiled projection product, the allocating front ends).
//
//   ProjectedFeatureMap      the projection, input_dim / projections / feature_dim, features_into
//                            and features; used by the positive, hyperbolic, trig and hybrid
//                            weight maps.
//   QuadraticExponentialMap  features exp(quad_r + slope c u_r − ½c²‖x‖² + log D)/√m, the form
//                            OPRF and SDERF share.

#include <cmath>
#include <cstdint>
#include <utility>

#include <Eigen/Core>

#include "../core/scaled_features.hpp"
#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"

namespace randattn {

// Which side of the kernel a feature row stands for: φ(q)ᵀ diag(σ) φ(k). The maps of
// feature_maps.hpp are symmetric; hybrid maps may differ between the sides.
enum class FeatureSide { query, key };

// What the projected maps share: the projection, validation, the tiled projection product and
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
    detail::require(x.cols() == input_dim(), where, "x is ", detail::shape_of(x),
                    " but the projection expects ", input_dim(), " columns");
    detail::require(values.rows() == n && values.cols() == feature_dim() && log_scale.size() == n,
                    where, "values (", detail::shape_of(values), ") and log_scale (",
                    log_scale.size(), ") must be ", n, "x", feature_dim(), " and ", n);
    detail::require(normaliser > 0 && std::isfinite(normaliser), where,
                    "normaliser must be positive and finite, got ", normaliser);
    const Index tiles = (n + kTile - 1) / kTile;
    // Fixed tiles: each row's rounding depends on the shapes only, not on the thread count.
    detail::parallel_for(tiles, [&](Index t) {
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

// What OPRF and SDERF share: features exp(quad_r + slope·c·u_r − ½c²‖x‖² + log D)/√m with
// u = ωᵀx (the projection's output) and quad_r = ω_rᵀAω_r (rotated into the projection's
// coordinates for SDERF), stabilised per row by the maximum exponent. Derived sets quad_,
// slope_ and log_d_ from its parameters.
template <typename Derived, typename Scalar_, typename Projection_>
class QuadraticExponentialMap : public ProjectedFeatureMap<Derived, Scalar_, Projection_> {
  using Base = ProjectedFeatureMap<Derived, Scalar_, Projection_>;

 public:
  using Scalar = Scalar_;
  static constexpr Index features_for(Index m) { return m; }
  static constexpr bool nonnegative = true;
  using Base::Base;

  template <typename Row>
  Scalar finish_row(Row&& row, Scalar sq_norm, Scalar c) const {
    row = (quad_.transpose().array() + (slope_ * c) * row.array()).matrix();
    const Scalar top = row.maxCoeff();
    row = (row.array() - top).exp().matrix();
    return top + log_d_ - Scalar(0.5) * c * c * sq_norm - this->log_sqrt(this->projections());
  }

 protected:
  Vector<Scalar> quad_;  // m: ω_rᵀ A ω_r
  Scalar slope_ = 1;     // B (scalar) or 1 (B folded into the projection)
  Scalar log_d_ = 0;     // log D
};

}  // namespace randattn
