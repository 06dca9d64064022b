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

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../core/scaled_features.hpp"
#include "../core/types.hpp"
#include "../detail/gemm.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/row_exp.hpp"
#include "../detail/validation.hpp"

namespace randattn {

namespace detail {

// Whether Map's rows have a vector–Jacobian product (Map::vjp_row; see ProjectedFeatureMap).
template <typename Map, typename = void>
struct has_vjp_row : std::false_type {};
template <typename Map>
struct has_vjp_row<
    Map, std::void_t<decltype(std::declval<const Map&>().vjp_row(
             std::declval<const RowMatrix<typename Map::Scalar>&>().row(0),
             std::declval<const RowMatrix<typename Map::Scalar>&>().row(0),
             typename Map::Scalar(), typename Map::Scalar(),
             std::declval<RowMatrix<typename Map::Scalar>&>().row(0)))>> : std::true_type {};

}  // namespace detail

// Which side of the kernel a feature row stands for: φ(q)ᵀ diag(σ) φ(k). The maps of
// feature_maps.hpp are symmetric; hybrid maps may differ between the sides.
enum class FeatureSide { query, key };

// What the projected maps share: the projection, validation, the tiled projection product and
// the allocating front ends. Derived supplies `features_for(m)` (feature dimension for m
// projections), `nonnegative` and `finish_row(row, ‖x‖², c)`, which turns the projections u = ωᵀx
// (the first m entries of a feature row) into the row's values in place, without allocating, and
// returns its log-scale.
//
// Backward. A map whose Derived also supplies
//   Scalar vjp_row(values, d_values, d_log_scale, c, du)
// gets features_vjp (below). For one row it writes du = ∂L/∂u (m entries, u = ωᵀx of the raw row)
// and returns ∂L/∂‖x‖², where L(values, log_scale) is differentiated through the row's values and
// its log-scale exactly as finish_row computes them: d_values = ∂L/∂values at a fixed log-scale
// (that is exp(log_scale) · ∂L/∂φ, of order one whatever the log-scale), and d_log_scale an
// additional ∂L/∂log_scale at a fixed φ (zero unless the attention denominator guard is active).
// Since every feature depends on x only through c·u and c²‖x‖², the chain rule then ends in
// dx = du ω + 2 (∂L/∂‖x‖²) x and dω = duᵀ x, two products per tile of rows.
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

  // Vector–Jacobian product of features_into(x, normaliser, values, log_scale): adds to dx
  // (n × input_dim) the gradient of L with respect to the raw rows x, and to *d_omega
  // (projections × input_dim, unless null) its gradient with respect to the dense ω the projection
  // stands for (projection().matrix()). values and log_scale are what features_into wrote for x;
  // d_values (n × feature_dim) is ∂L/∂values at fixed log-scales, i.e. exp(log_scale_i) · ∂L/∂φ(x_i),
  // and d_log_scale (n, or empty) an additional ∂L/∂log_scale at fixed φ (see the class comment).
  // Tiles of rows are fixed and dω is summed from per-tile parts in tile order: the result does
  // not depend on the thread count. Only for maps whose Derived defines vjp_row.
  template <typename D = Derived, typename = std::enable_if_t<detail::has_vjp_row<D>::value>>
  void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                    const Eigen::Ref<const RowMatrix<Scalar>>& values,
                    const Eigen::Ref<const Vector<Scalar>>& log_scale,
                    const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                    const Eigen::Ref<const Vector<Scalar>>& d_log_scale,
                    Eigen::Ref<RowMatrix<Scalar>> dx, RowMatrix<Scalar>* d_omega = nullptr,
                    FeatureSide = FeatureSide::query) const {
    const char* where = "feature map backward";
    const Index n = x.rows(), m = projections(), d = input_dim();
    detail::require(x.cols() == d && dx.rows() == n && dx.cols() == d, where, "x (",
                    detail::shape_of(x), ") and dx (", detail::shape_of(dx), ") must be n x ", d);
    detail::require(values.rows() == n && values.cols() == feature_dim() &&
                        d_values.rows() == n && d_values.cols() == feature_dim() &&
                        log_scale.size() == n && (d_log_scale.size() == 0 || d_log_scale.size() == n),
                    where, "values (", detail::shape_of(values), "), d_values (",
                    detail::shape_of(d_values), "), log_scale (", log_scale.size(),
                    ") and d_log_scale (", d_log_scale.size(), ") must be ", n, "x",
                    feature_dim(), ", ", n, "x", feature_dim(), ", ", n, " and ", n, " or 0");
    detail::require(!d_omega || (d_omega->rows() == m && d_omega->cols() == d), where,
                    "d_omega is ", d_omega ? d_omega->rows() : 0, "x", d_omega ? d_omega->cols() : 0,
                    ", expected ", m, "x", d);
    detail::require(normaliser > 0 && std::isfinite(normaliser), where,
                    "normaliser must be positive and finite, got ", normaliser);
    if (n == 0) return;
    // A reference binds the dense ω of a dense projection and a Hadamard projection's rows alike.
    const RowMatrix<Scalar>& omega = projection_.matrix();
    const Index tiles = (n + kTile - 1) / kTile;
    detail::Scratch<RowMatrix<Scalar>> parts(d_omega ? tiles * m : 0, d);
    struct Work {
      detail::Scratch<RowMatrix<Scalar>> du;
      detail::Scratch<Vector<Scalar>> slope;
    };
    detail::parallel_for_with(
        tiles, [&] { return Work{detail::Scratch<RowMatrix<Scalar>>(kTile, m),
                                 detail::Scratch<Vector<Scalar>>(kTile)}; },
        [&](Index t, Work& w) {
          const Index i0 = t * kTile, rows = std::min(kTile, n - i0);
          auto du = w.du.topRows(rows);
          auto slope = w.slope.head(rows);
          for (Index r = 0; r < rows; ++r)
            slope(r) = 2 * derived().vjp_row(values.row(i0 + r), d_values.row(i0 + r),
                                             d_log_scale.size() ? d_log_scale(i0 + r) : Scalar(0),
                                             normaliser, du.row(r));
          const auto xt = x.middleRows(i0, rows);
          auto dxt = dx.middleRows(i0, rows);
          detail::gemm_fixed_depth(dxt, du, omega, true);
          dxt += slope.asDiagonal() * xt;
          if (d_omega) detail::gemm_fixed_depth(parts.middleRows(t * m, m), du.transpose(), xt, false);
        });
    if (d_omega)
      for (Index t = 0; t < tiles; ++t) *d_omega += parts.middleRows(t * m, m);
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

// Whether a feature map has a backward: map.features_vjp(x, c, values, log_scale, d_values,
// d_log_scale, dx, d_omega, side) as ProjectedFeatureMap::features_vjp.
template <typename Map, typename = void>
struct has_features_vjp : std::false_type {};
template <typename Map>
struct has_features_vjp<
    Map, std::void_t<decltype(std::declval<const Map&>().features_vjp(
             std::declval<const RowMatrix<typename Map::Scalar>&>(), typename Map::Scalar(),
             std::declval<const RowMatrix<typename Map::Scalar>&>(),
             std::declval<const Vector<typename Map::Scalar>&>(),
             std::declval<const RowMatrix<typename Map::Scalar>&>(),
             std::declval<const Vector<typename Map::Scalar>&>(),
             std::declval<RowMatrix<typename Map::Scalar>&>(),
             std::declval<RowMatrix<typename Map::Scalar>*>(), FeatureSide::query))>>
    : std::true_type {};

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
    const Scalar top = detail::row_max(row.data(), row.size());
    detail::row_exp(row.data(), row.data(), row.size(), top, Scalar(1));
    return top + log_d_ - Scalar(0.5) * c * c * sq_norm - this->log_sqrt(this->projections());
  }

 protected:
  Vector<Scalar> quad_;  // m: ω_rᵀ A ω_r
  Scalar slope_ = 1;     // B (scalar) or 1 (B folded into the projection)
  Scalar log_d_ = 0;     // log D
};

}  // namespace randattn
