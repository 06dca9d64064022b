#pragma once
// Hybrid random features (Choromanski et al., "Hybrid Random Features", ICLR 2022): with base
// estimators SM̂_1..SM̂_{p+1} (feature maps φ_k) and weight estimators λ̂_k(x, y) = ξ_k(x)ᵀ diag(σ_k)
// ξ_k(y), independent of the bases,
//
//   SM̂(x, y) = Σ_{k≤p} λ̂_k SM̂_k + (1 − Σ_k λ̂_k) SM̂_{p+1}
//
// is unbiased for exp(xᵀy) and is one signed inner product Ψ(x)ᵀ diag(σ) Ψ(y) with
//
//   Ψ = [ξ_1 ⊗ φ_1, …, ξ_p ⊗ φ_p,  ξ_1 ⊗ φ_{p+1}, …, ξ_p ⊗ φ_{p+1},  φ_{p+1}]
//   σ = [σ_1 ⊗ s_1, …, σ_p ⊗ s_p,  −σ_1 ⊗ s_{p+1}, …, −σ_p ⊗ s_{p+1},  s_{p+1}]
//
// ((aᵀb)(cᵀd) = (a ⊗ c)ᵀ(b ⊗ d); a subtracted term is a block with negated signs, which is how
// the imaginary unit of the complex formulation appears; s_k are the bases' own signs).
// Feature dimension Σ_k dim ξ_k · (dim φ_k + dim φ_{p+1}) + dim φ_{p+1}: feature_dim() reports
// it so it can be budgeted. Each row carries one log-scale, the maximum of its terms'
// log-scales (a per-row stabiliser, safe for causal attention).
//
// Weight estimators provided here:
//  - AngularWeight: λ = θ/π (θ the angle between x and y) estimated by
//    λ̂ = ½ − 1/(2n) Σ_r sgn(τ_rᵀx) sgn(τ_rᵀy), τ_r ~ N(0, I): ξ = [sgn(τᵀx)/√(2n), 1/√2] with
//    signs [−1, …, −1, +1]. Exact at θ = 0 (λ̂ = 0) and θ = π (λ̂ = 1).
//  - GaussianWeight: λ = exp(−s²‖x − y‖²/2) estimated with trig features of the Gaussian
//    kernel, [sin(s τᵀx), cos(s τᵀx)]/√n.
// Both act on the normalised rows (data normaliser applied), like the bases.
//
// Gradients (features_vjp, the interface of ProjectedFeatureMap). Ψ is a product of its parts'
// features, so the VJP hands each part the cotangent of its own features (the Kronecker blocks
// contracted with the other factor) and sums the parts' VJPs into dx. The angular λ̂ is built
// from sgn(τᵀx), piecewise constant in x and τ: its derivative is zero almost everywhere, so the
// angular hybrid's gradient flows through the base estimators with the λ̂ features held at their
// values (and the gradient to τ is zero). The Gaussian λ̂ is made of trig features of the
// Gaussian kernel, smooth in x and τ, and is differentiated like the bases. The gradient to the
// projections is the stack of every part's dω in the order weights, then bases (see
// HybridFeatures::projections()).
//
// Hybrid estimates are signed: attention with them uses the denominator guard of the core
// (random_feature_attention.hpp), or random_feature_attention_clipped, which clips negative
// kernel estimates at zero (biased, quadratic cost).

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../core/scaled_features.hpp"
#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/validation.hpp"
#include "feature_maps.hpp"
#include "projection.hpp"

namespace randattn {

// Angular weight estimator λ̂ of θ/π from n_lambda sign features (sgn(0) counts as +1).
template <typename Scalar, typename Projection = GaussianProjection<Scalar>>
class AngularWeight
    : public ProjectedFeatureMap<AngularWeight<Scalar, Projection>, Scalar, Projection> {
  using Base = ProjectedFeatureMap<AngularWeight, Scalar, Projection>;

 public:
  static constexpr Index features_for(Index n) { return n + 1; }
  static constexpr bool nonnegative = false;
  using Base::Base;

  Vector<Scalar> signs() const {
    Vector<Scalar> s = Vector<Scalar>::Constant(this->feature_dim(), Scalar(-1));
    s(this->projections()) = 1;
    return s;
  }

  template <typename Row>
  Scalar finish_row(Row&& row, Scalar, Scalar) const {
    const Index n = this->projections();
    const Scalar unit = Scalar(1 / std::sqrt(2.0 * double(n)));
    row.head(n) = row.head(n).unaryExpr([unit](Scalar u) { return u < 0 ? -unit : unit; });
    row(n) = Scalar(1 / std::sqrt(2.0));
    return 0;
  }

  // Backward: sgn is piecewise constant and the log-scale is 0, so nothing flows to x or τ
  // (almost everywhere).
  template <typename Values, typename DValues, typename Du>
  Scalar vjp_row(const Values&, const DValues&, Scalar, Scalar, Du&& du) const {
    du.setZero();
    return 0;
  }
};

// Gaussian-kernel weight estimator of exp(−s²‖x − y‖²/2), s = bandwidth.
template <typename Scalar, typename Projection = GaussianProjection<Scalar>>
class GaussianWeight
    : public ProjectedFeatureMap<GaussianWeight<Scalar, Projection>, Scalar, Projection> {
  using Base = ProjectedFeatureMap<GaussianWeight, Scalar, Projection>;

 public:
  static constexpr Index features_for(Index n) { return 2 * n; }
  static constexpr bool nonnegative = false;

  GaussianWeight(Projection projection, double bandwidth)
      : Base(std::move(projection)), bandwidth_(static_cast<Scalar>(bandwidth)) {
    detail::require(bandwidth > 0 && std::isfinite(bandwidth_), "GaussianWeight",
                    "bandwidth must be positive and finite in the scalar type, got ", bandwidth);
  }
  Scalar bandwidth() const { return bandwidth_; }

  template <typename Row>
  Scalar finish_row(Row&& row, Scalar, Scalar c) const {
    const Index n = this->projections();
    auto u = row.head(n);
    u *= c * bandwidth_;
    row.tail(n) = u.array().cos().matrix();
    u = u.array().sin().matrix();
    return -this->log_sqrt(n);
  }

  // Backward of finish_row: du_r = s c (D^sin_r cos(s c u_r) − D^cos_r sin(s c u_r)); the
  // log-scale is a constant.
  template <typename Values, typename DValues, typename Du>
  Scalar vjp_row(const Values& values, const DValues& d_values, Scalar, Scalar c, Du&& du) const {
    const Index n = this->projections();
    du = (c * bandwidth_ *
          (d_values.head(n).array() * values.tail(n).array() -
           d_values.tail(n).array() * values.head(n).array()))
             .matrix();
    return 0;
  }

 private:
  Scalar bandwidth_;
};

// Any feature map (or weight estimator) behind one type, so that a hybrid can combine maps of
// different types and p is a run-time number. Copies share the map until redraw().
template <typename Scalar_>
class AnyFeatureMap {
 public:
  using Scalar = Scalar_;

  template <typename Map,
            typename = std::enable_if_t<!std::is_same<std::decay_t<Map>, AnyFeatureMap>::value>>
  AnyFeatureMap(Map map)
      : self_(std::make_shared<Model<Map>>(std::move(map))) {}  // NOLINT: implicit by design

  Index input_dim() const { return self_->input_dim(); }
  Index feature_dim() const { return self_->feature_dim(); }
  // Rows of the map's projection ω (0 for a map without one).
  Index projections() const { return self_->projections(); }
  // The map's projection as a dense matrix (projections() × input_dim(); empty without one).
  RowMatrix<Scalar> projection_matrix() const { return self_->projection_matrix(); }
  Vector<Scalar> signs() const { return self_->signs(); }
  void features_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                     Eigen::Ref<RowMatrix<Scalar>> values, Eigen::Ref<Vector<Scalar>> log_scale,
                     FeatureSide side = FeatureSide::query) const {
    self_->features_into(x, normaliser, values, log_scale, side);
  }
  // The map's features_vjp (see ProjectedFeatureMap); throws std::invalid_argument for a map
  // without a backward.
  void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                    const Eigen::Ref<const RowMatrix<Scalar>>& values,
                    const Eigen::Ref<const Vector<Scalar>>& log_scale,
                    const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                    const Eigen::Ref<const Vector<Scalar>>& d_log_scale,
                    Eigen::Ref<RowMatrix<Scalar>> dx, RowMatrix<Scalar>* d_omega = nullptr,
                    FeatureSide side = FeatureSide::query) const {
    self_->features_vjp(x, normaliser, values, log_scale, d_values, d_log_scale, dx, d_omega,
                        side);
  }
  // Throws std::invalid_argument for maps on a user projection.
  void redraw(std::uint64_t seed) {
    std::shared_ptr<Concept> copy = self_->clone();
    copy->redraw(seed);
    self_ = std::move(copy);
  }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual Index input_dim() const = 0;
    virtual Index feature_dim() const = 0;
    virtual Index projections() const = 0;
    virtual RowMatrix<Scalar> projection_matrix() const = 0;
    virtual Vector<Scalar> signs() const = 0;
    virtual void features_into(const Eigen::Ref<const RowMatrix<Scalar>>&, Scalar,
                               Eigen::Ref<RowMatrix<Scalar>>, Eigen::Ref<Vector<Scalar>>,
                               FeatureSide) const = 0;
    virtual void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>&, Scalar,
                              const Eigen::Ref<const RowMatrix<Scalar>>&,
                              const Eigen::Ref<const Vector<Scalar>>&,
                              const Eigen::Ref<const RowMatrix<Scalar>>&,
                              const Eigen::Ref<const Vector<Scalar>>&,
                              Eigen::Ref<RowMatrix<Scalar>>, RowMatrix<Scalar>*,
                              FeatureSide) const = 0;
    virtual void redraw(std::uint64_t) = 0;
    virtual std::shared_ptr<Concept> clone() const = 0;
  };

  // ProjectedFeatureMap declares redraw() whatever its projection: a map built directly on a
  // user projection (which cannot redraw) is told apart by its base.
  template <typename Map, typename = void>
  struct can_redraw : std::false_type {};
  template <typename Map>
  struct can_redraw<Map, std::void_t<decltype(std::declval<Map&>().redraw(std::uint64_t()))>>
      : std::bool_constant<!std::is_base_of<
                               ProjectedFeatureMap<Map, typename Map::Scalar,
                                                   UserProjection<typename Map::Scalar>>,
                               Map>::value> {};
  template <typename Map, typename = void>
  struct has_projections : std::false_type {};
  template <typename Map>
  struct has_projections<Map, std::void_t<decltype(std::declval<const Map&>().projections())>>
      : std::true_type {};

  template <typename Map>
  struct Model final : Concept {
    explicit Model(Map m) : map(std::move(m)) {}
    Index input_dim() const override { return map.input_dim(); }
    Index feature_dim() const override { return map.feature_dim(); }
    Index projections() const override {
      if constexpr (has_projections<Map>::value) return map.projections();
      return 0;
    }
    RowMatrix<Scalar> projection_matrix() const override {
      if constexpr (has_projections<Map>::value) return map.projection().matrix();
      return RowMatrix<Scalar>(0, map.input_dim());
    }
    Vector<Scalar> signs() const override { return map.signs(); }
    void features_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar c,
                       Eigen::Ref<RowMatrix<Scalar>> values, Eigen::Ref<Vector<Scalar>> log_scale,
                       FeatureSide side) const override {
      map.features_into(x, c, values, log_scale, side);
    }
    void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar c,
                      const Eigen::Ref<const RowMatrix<Scalar>>& values,
                      const Eigen::Ref<const Vector<Scalar>>& log_scale,
                      const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                      const Eigen::Ref<const Vector<Scalar>>& d_log_scale,
                      Eigen::Ref<RowMatrix<Scalar>> dx, RowMatrix<Scalar>* d_omega,
                      FeatureSide side) const override {
      if constexpr (has_features_vjp<Map>::value) {
        map.features_vjp(x, c, values, log_scale, d_values, d_log_scale, dx, d_omega, side);
      } else {
        detail::fail("AnyFeatureMap::features_vjp", "this map has no backward");
      }
    }
    void redraw(std::uint64_t seed) override {
      if constexpr (can_redraw<Map>::value) {
        map.redraw(seed);
      } else {
        detail::fail("AnyFeatureMap::redraw", "this map has a fixed (user) projection");
      }
    }
    std::shared_ptr<Concept> clone() const override { return std::make_shared<Model>(*this); }
    Map map;
  };

  std::shared_ptr<const Concept> self_;
};

namespace detail {

// Seed of component j of a hybrid redrawn with `seed` (SplitMix64 finaliser): components
// never share random numbers, so the weights are independent of the bases.
inline std::uint64_t component_seed(std::uint64_t seed, std::size_t j) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (std::uint64_t(j) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace detail

template <typename Scalar_>
class HybridFeatures {
 public:
  using Scalar = Scalar_;
  using Component = AnyFeatureMap<Scalar>;
  static constexpr bool nonnegative = false;

  // p = weights.size() >= 1 weight estimators and p + 1 bases, all on the same input dimension.
  HybridFeatures(std::vector<Component> weights, std::vector<Component> bases)
      : weights_(std::move(weights)), bases_(std::move(bases)) {
    const char* where = "HybridFeatures";
    detail::require(!weights_.empty() && bases_.size() == weights_.size() + 1, where,
                    "need p >= 1 weight estimators and p + 1 bases, got ", weights_.size(), " and ",
                    bases_.size());
    for (const Component* c : components())
      detail::require(c->input_dim() == input_dim(), where, "every component must take inputs of ",
                      "dimension ", input_dim(), ", got one of ", c->input_dim());
    build_signs();
  }

  Index input_dim() const { return bases_.front().input_dim(); }
  Index feature_dim() const { return signs_.size(); }
  Index p() const { return Index(weights_.size()); }
  const Vector<Scalar>& signs() const { return signs_; }
  const std::vector<Component>& weights() const { return weights_; }
  const std::vector<Component>& bases() const { return bases_; }

  // Redraws every component with its own seed derived from `seed`.
  void redraw(std::uint64_t seed) {
    std::size_t j = 0;
    for (Component& c : weights_) c.redraw(detail::component_seed(seed, j++));
    for (Component& c : bases_) c.redraw(detail::component_seed(seed, j++));
  }

  void features_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                     Eigen::Ref<RowMatrix<Scalar>> values, Eigen::Ref<Vector<Scalar>> log_scale,
                     FeatureSide side = FeatureSide::query) const {
    const Index n = x.rows(), p = this->p();
    detail::require(values.rows() == n && values.cols() == feature_dim() && log_scale.size() == n,
                    "HybridFeatures", "values (", detail::shape_of(values), ") and log_scale (",
                    log_scale.size(), ") must be ", n, "x", feature_dim(), " and ", n);
    const Parts parts(*this, n);
    map_parts(x, normaliser, side, parts);
    const auto top = parts.top();
    // The blocks of Ψ, one pair of parts at a time over every row.
    Index offset = 0;
    const auto kron = [&](Index a, Index c) {
      const auto va = parts.values(a), vc = parts.values(c);
      const auto la = parts.log_scale(a), lc = parts.log_scale(c);
      const Index da = va.cols(), dc = vc.cols();
      for (Index i = 0; i < n; ++i) {
        const Scalar scale = std::exp(la(i) + lc(i) - top(i));
        for (Index r = 0; r < da; ++r)
          values.row(i).segment(offset + r * dc, dc) = (scale * va(i, r)) * vc.row(i);
      }
      offset += da * dc;
    };
    const Index last = 2 * p;
    for (Index k = 0; k < p; ++k) kron(k, p + k);
    for (Index k = 0; k < p; ++k) kron(k, last);
    const auto vl = parts.values(last);
    const auto last_log = parts.log_scale(last);
    for (Index i = 0; i < n; ++i)
      values.row(i).tail(vl.cols()) = std::exp(last_log(i) - top(i)) * vl.row(i);
    log_scale = top;
  }

  // Rows of the stacked projections of the parts, weights then bases (each part's ω, τ):
  // the rows of the d_omega of features_vjp.
  Index projections() const {
    Index rows = 0;
    for (const Component* c : components()) rows += c->projections();
    return rows;
  }

  // Every part's projection stacked in that order (projections() × input_dim()): the ω whose
  // gradient features_vjp returns, and what angular_hybrid_on / gaussian_hybrid_on take.
  RowMatrix<Scalar> projection_matrix() const {
    RowMatrix<Scalar> omega(projections(), input_dim());
    Index row = 0;
    for (const Component* c : components()) {
      omega.middleRows(row, c->projections()) = c->projection_matrix();
      row += c->projections();
    }
    return omega;
  }

  // Vector–Jacobian product of features_into (the interface of ProjectedFeatureMap::
  // features_vjp): adds to dx the gradient of L(values, log_scale) with respect to the raw rows
  // and, when d_omega is given (projections() × input_dim()), to each part's block of it the
  // gradient with respect to that part's projection matrix. The parts' features are recomputed
  // from x; λ̂ of the angular weight is held at its value (see the header comment).
  void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                    const Eigen::Ref<const RowMatrix<Scalar>>& values,
                    const Eigen::Ref<const Vector<Scalar>>& log_scale,
                    const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                    const Eigen::Ref<const Vector<Scalar>>& d_log_scale,
                    Eigen::Ref<RowMatrix<Scalar>> dx, RowMatrix<Scalar>* d_omega = nullptr,
                    FeatureSide side = FeatureSide::query) const {
    const char* where = "HybridFeatures backward";
    const Index n = x.rows(), p = this->p(), parts_count = 2 * p + 1, d = input_dim();
    detail::require(x.cols() == d && dx.rows() == n && dx.cols() == d, where, "x (",
                    detail::shape_of(x), ") and dx (", detail::shape_of(dx), ") must be n x ", d);
    detail::require(values.rows() == n && values.cols() == feature_dim() && d_values.rows() == n &&
                        d_values.cols() == feature_dim() && log_scale.size() == n &&
                        (d_log_scale.size() == 0 || d_log_scale.size() == n),
                    where, "values (", detail::shape_of(values), "), d_values (",
                    detail::shape_of(d_values), "), log_scale (", log_scale.size(),
                    ") and d_log_scale (", d_log_scale.size(), ") must be ", n, "x",
                    feature_dim(), ", ", n, "x", feature_dim(), ", ", n, " and ", n, " or 0");
    detail::require(!d_omega || (d_omega->rows() == projections() && d_omega->cols() == d), where,
                    "d_omega is ", d_omega ? d_omega->rows() : 0, "x", d_omega ? d_omega->cols() : 0,
                    ", expected ", projections(), "x", d);
    if (n == 0) return;
    const Parts parts(*this, n);
    map_parts(x, normaliser, side, parts);
    const auto top = parts.top();
    // Each part's cotangent (values at its own log-scale, and an extra one on that log-scale)
    // in a second buffer of the same layout.
    const Parts grads(*this, n);
    grads.set_zero();
    Index offset = 0;
    // Block a ⊗ c of row i is scale · va ⊗ vc with scale = e^{la + lc − top}; its cotangent D
    // (da × dc) gives va the cotangent scale · D vc and vc the cotangent scale · Dᵀ va.
    const auto kron = [&](Index a, Index c) {
      const auto va = parts.values(a), vc = parts.values(c);
      const auto la = parts.log_scale(a), lc = parts.log_scale(c);
      auto ga = grads.values(a), gc = grads.values(c);
      const Index da = va.cols(), dc = vc.cols();
      for (Index i = 0; i < n; ++i) {
        const Scalar scale = std::exp(la(i) + lc(i) - top(i));
        const Eigen::Map<const RowMatrix<Scalar>> block(
            d_values.data() + i * d_values.outerStride() + offset, da, dc);
        ga.row(i).noalias() += scale * (vc.row(i) * block.transpose());
        gc.row(i).noalias() += scale * (va.row(i) * block);
      }
      offset += da * dc;
    };
    const Index last = 2 * p;
    for (Index k = 0; k < p; ++k) kron(k, p + k);
    for (Index k = 0; k < p; ++k) kron(k, last);
    {
      const auto last_log = parts.log_scale(last);
      auto gl = grads.values(last);
      const Index dl = gl.cols();
      for (Index i = 0; i < n; ++i)
        gl.row(i) += std::exp(last_log(i) - top(i)) * d_values.row(i).tail(dl);
    }
    // The log-scale is the largest term's: its extra cotangent goes to that term's parts, the
    // first maximum in the order map_parts takes them.
    for (Index i = 0; i < d_log_scale.size(); ++i) {
      if (d_log_scale(i) == 0) continue;
      const auto [a, c] = largest_term(parts, i);
      grads.log_scale(a)(i) += d_log_scale(i);
      if (c >= 0) grads.log_scale(c)(i) += d_log_scale(i);
    }
    Index row = 0;  // part j's first row in d_omega
    for (Index j = 0; j < parts_count; ++j) {
      const Component& c = part(j);
      const Index rows = c.projections();
      if (!d_omega) {
        c.features_vjp(x, normaliser, parts.values(j), parts.log_scale(j), grads.values(j),
                       grads.log_scale(j), dx, nullptr, side);
      } else {
        RowMatrix<Scalar> d_part = d_omega->middleRows(row, rows);
        c.features_vjp(x, normaliser, parts.values(j), parts.log_scale(j), grads.values(j),
                       grads.log_scale(j), dx, &d_part, side);
        d_omega->middleRows(row, rows) = d_part;
      }
      row += rows;
    }
  }

  ScaledFeatures<Scalar> features(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                                  Scalar normaliser = 1,
                                  FeatureSide side = FeatureSide::query) const {
    ScaledFeatures<Scalar> f{RowMatrix<Scalar>(x.rows(), feature_dim()), Vector<Scalar>(x.rows())};
    features_into(x, normaliser, f.values, f.log_scale, side);
    return f;
  }

 private:
  // Part j: weight estimator j for j < p, then the bases; part 2p is the last base.
  const Component& part(Index j) const {
    return j < p() ? weights_[std::size_t(j)] : bases_[std::size_t(j - p())];
  }
  // Every part's n × dim features and its n log-scales, one block after another in one buffer
  // of the calling thread's pool, then n more entries (the rows' log-scales); a second use with
  // the same shapes allocates nothing. Each block starts on a 64-byte boundary, as a matrix of
  // its own would: Eigen's vectorised loops over a row then split it the same way, and the
  // features keep their last bits.
  class Parts {
   public:
    Parts(const HybridFeatures& h, Index n)
        : h_(h), n_(n), storage_(start(2 * h.p() + 1) + padded(n) + kAlign) {
      const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(storage_.data()) % 64;
      base_ = storage_.data() + (misaligned ? (64 - misaligned) / sizeof(Scalar) : 0);
    }
    Eigen::Map<RowMatrix<Scalar>> values(Index j) const {
      return {base_ + start(j), n_, h_.part(j).feature_dim()};
    }
    Eigen::Map<Vector<Scalar>> log_scale(Index j) const {
      return {base_ + start(j) + padded(n_ * h_.part(j).feature_dim()), n_};
    }
    Eigen::Map<Vector<Scalar>> top() const { return {base_ + start(2 * h_.p() + 1), n_}; }
    void set_zero() const {
      Eigen::Map<Vector<Scalar>>(base_, start(2 * h_.p() + 1) + n_).setZero();
    }

   private:
    static constexpr Index kAlign = Index(64 / sizeof(Scalar));
    static Index padded(Index size) { return (size + kAlign - 1) / kAlign * kAlign; }
    Index start(Index j) const {  // offset of part j's features; its log-scales follow
      Index o = 0;
      for (Index i = 0; i < j; ++i) o += padded(n_ * h_.part(i).feature_dim()) + padded(n_);
      return o;
    }
    const HybridFeatures& h_;
    Index n_;
    detail::Scratch<Vector<Scalar>> storage_;
    Scalar* base_;
  };

  // Every part's features of x, and each row's log-scale: the largest of its terms'.
  void map_parts(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser, FeatureSide side,
                 const Parts& parts) const {
    const Index n = x.rows(), p = this->p(), count = 2 * p + 1;
    for (Index j = 0; j < count; ++j)
      part(j).features_into(x, normaliser, parts.values(j), parts.log_scale(j), side);
    const auto last_log = parts.log_scale(2 * p);
    auto top = parts.top();
    top = last_log;
    for (Index k = 0; k < p; ++k) {
      const auto weight_log = parts.log_scale(k), base_log = parts.log_scale(p + k);
      for (Index i = 0; i < n; ++i) {
        top(i) = std::max(top(i), weight_log(i) + base_log(i));
        top(i) = std::max(top(i), weight_log(i) + last_log(i));
      }
    }
  }

  // The parts (a, c) of the term that set row i's log-scale in map_parts (c = −1: the last base
  // alone, a = 2p).
  std::pair<Index, Index> largest_term(const Parts& parts, Index i) const {
    const Index p = this->p(), last = 2 * p;
    Scalar top = parts.log_scale(last)(i);
    std::pair<Index, Index> term{last, -1};
    for (Index k = 0; k < p; ++k) {
      const Scalar w = parts.log_scale(k)(i);
      if (top < w + parts.log_scale(p + k)(i)) {
        top = w + parts.log_scale(p + k)(i);
        term = {k, p + k};
      }
      if (top < w + parts.log_scale(last)(i)) {
        top = w + parts.log_scale(last)(i);
        term = {k, last};
      }
    }
    return term;
  }

  std::vector<const Component*> components() const {
    std::vector<const Component*> all;
    for (const Component& c : weights_) all.push_back(&c);
    for (const Component& c : bases_) all.push_back(&c);
    return all;
  }

  static Vector<Scalar> signs_of(const Component& c) {
    Vector<Scalar> s = c.signs();
    return s.size() ? s : Vector<Scalar>::Ones(c.feature_dim());
  }

  void build_signs() {
    const Vector<Scalar> last = signs_of(bases_.back());
    std::vector<Vector<Scalar>> blocks;
    auto kron = [&](const Vector<Scalar>& a, const Vector<Scalar>& c, Scalar sign) {
      Vector<Scalar> out(a.size() * c.size());
      for (Index r = 0; r < a.size(); ++r) out.segment(r * c.size(), c.size()) = (sign * a(r)) * c;
      blocks.push_back(std::move(out));
    };
    for (std::size_t k = 0; k < weights_.size(); ++k)
      kron(signs_of(weights_[k]), signs_of(bases_[k]), Scalar(1));
    for (std::size_t k = 0; k < weights_.size(); ++k) kron(signs_of(weights_[k]), last, Scalar(-1));
    blocks.push_back(last);
    Index total = 0;
    for (const auto& blk : blocks) total += blk.size();
    signs_.resize(total);
    Index offset = 0;
    for (const auto& blk : blocks) {
      signs_.segment(offset, blk.size()) = blk;
      offset += blk.size();
    }
  }

  std::vector<Component> weights_, bases_;
  Vector<Scalar> signs_;
};

// The angular hybrid λ̂·SM̂_hyp + (1 − λ̂)·SM̂_trig (Hybrid Random Features, the angular case): m
// projections per base, n_lambda sign features; 2·(n_lambda + 1)·2m + 2m features.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
HybridFeatures<Scalar> angular_hybrid(Index m, Index n_lambda, Index d, std::uint64_t seed = 0) {
  HybridFeatures<Scalar> h({AngularWeight<Scalar>(GaussianProjection<Scalar>(n_lambda, d))},
                           {HyperbolicFeatures<Scalar, Projection>(Projection(m, d)),
                            TrigFeatures<Scalar, Projection>(Projection(m, d))});
  h.redraw(seed);
  return h;
}

// The Gaussian hybrid λ̂·SM̂_trig + (1 − λ̂)·SM̂_pos with λ = exp(−s²‖x − y‖²/2), s = bandwidth
// (on normalised rows); 2n_lambda·(2m + m) + m features.
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
HybridFeatures<Scalar> gaussian_hybrid(Index m, Index n_lambda, Index d, double bandwidth,
                                       std::uint64_t seed = 0) {
  HybridFeatures<Scalar> h(
      {GaussianWeight<Scalar>(GaussianProjection<Scalar>(n_lambda, d), bandwidth)},
      {TrigFeatures<Scalar, Projection>(Projection(m, d)),
       PositiveFeatures<Scalar, Projection>(Projection(m, d))});
  h.redraw(seed);
  return h;
}

namespace detail {

// Rows [r0, r0 + rows) of a stacked hybrid projection as a user projection.
template <typename Scalar, typename Derived>
UserProjection<Scalar> projection_rows(const Eigen::MatrixBase<Derived>& omega, Index r0,
                                       Index rows) {
  return UserProjection<Scalar>(omega.middleRows(r0, rows));
}

inline Index hybrid_base_rows(const char* where, Index rows, Index n_lambda) {
  require(n_lambda >= 1 && rows > n_lambda && (rows - n_lambda) % 2 == 0, where,
          "a stacked projection has n_lambda + 2m rows (m >= 1), got ", rows,
          " rows for n_lambda = ", n_lambda);
  return (rows - n_lambda) / 2;
}

}  // namespace detail

// The angular hybrid on given projections: omega stacks τ (n_lambda rows), the hyperbolic
// base's ω and the trig base's ω (m rows each), as HybridFeatures::projection_matrix() returns
// them — e.g. a projection learned through features_vjp's d_omega. Cannot be redrawn.
template <typename Scalar, typename Derived>
HybridFeatures<Scalar> angular_hybrid_on(const Eigen::MatrixBase<Derived>& omega, Index n_lambda) {
  const Index m = detail::hybrid_base_rows("angular_hybrid_on", omega.rows(), n_lambda);
  using User = UserProjection<Scalar>;
  return HybridFeatures<Scalar>(
      {AngularWeight<Scalar, User>(detail::projection_rows<Scalar>(omega, 0, n_lambda))},
      {HyperbolicFeatures<Scalar, User>(detail::projection_rows<Scalar>(omega, n_lambda, m)),
       TrigFeatures<Scalar, User>(detail::projection_rows<Scalar>(omega, n_lambda + m, m))});
}

// The Gaussian hybrid on given projections: omega stacks τ (n_lambda rows), the trig base's ω
// and the positive base's ω (m rows each), as HybridFeatures::projection_matrix() returns them.
template <typename Scalar, typename Derived>
HybridFeatures<Scalar> gaussian_hybrid_on(const Eigen::MatrixBase<Derived>& omega, Index n_lambda,
                                          double bandwidth) {
  const Index m = detail::hybrid_base_rows("gaussian_hybrid_on", omega.rows(), n_lambda);
  using User = UserProjection<Scalar>;
  return HybridFeatures<Scalar>(
      {GaussianWeight<Scalar, User>(detail::projection_rows<Scalar>(omega, 0, n_lambda),
                                    bandwidth)},
      {TrigFeatures<Scalar, User>(detail::projection_rows<Scalar>(omega, n_lambda, m)),
       PositiveFeatures<Scalar, User>(detail::projection_rows<Scalar>(omega, n_lambda + m, m))});
}

}  // namespace randattn
