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
// Hybrid estimates are signed: attention with them uses the denominator guard of the core
// (random_feature_attention.hpp), or random_feature_attention_clipped, which clips negative
// kernel estimates at zero (biased, quadratic cost).

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
  Vector<Scalar> signs() const { return self_->signs(); }
  void features_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                     Eigen::Ref<RowMatrix<Scalar>> values, Eigen::Ref<Vector<Scalar>> log_scale,
                     FeatureSide side = FeatureSide::query) const {
    self_->features_into(x, normaliser, values, log_scale, side);
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
    virtual Vector<Scalar> signs() const = 0;
    virtual void features_into(const Eigen::Ref<const RowMatrix<Scalar>>&, Scalar,
                               Eigen::Ref<RowMatrix<Scalar>>, Eigen::Ref<Vector<Scalar>>,
                               FeatureSide) const = 0;
    virtual void redraw(std::uint64_t) = 0;
    virtual std::shared_ptr<Concept> clone() const = 0;
  };

  template <typename Map, typename = void>
  struct can_redraw : std::false_type {};
  template <typename Map>
  struct can_redraw<Map, std::void_t<decltype(std::declval<Map&>().redraw(std::uint64_t()))>>
      : std::true_type {};

  template <typename Map>
  struct Model final : Concept {
    explicit Model(Map m) : map(std::move(m)) {}
    Index input_dim() const override { return map.input_dim(); }
    Index feature_dim() const override { return map.feature_dim(); }
    Vector<Scalar> signs() const override { return map.signs(); }
    void features_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar c,
                       Eigen::Ref<RowMatrix<Scalar>> values, Eigen::Ref<Vector<Scalar>> log_scale,
                       FeatureSide side) const override {
      map.features_into(x, c, values, log_scale, side);
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
    const Index n = x.rows(), p = this->p(), parts = 2 * p + 1;
    detail::require(values.rows() == n && values.cols() == feature_dim() && log_scale.size() == n,
                    "HybridFeatures", "values (", detail::shape_of(values), ") and log_scale (",
                    log_scale.size(), ") must be ", n, "x", feature_dim(), " and ", n);
    // Part j: weight estimator j for j < p, then the bases; part 2p is the last base.
    const auto part = [&](Index j) -> const Component& {
      return j < p ? weights_[std::size_t(j)] : bases_[std::size_t(j - p)];
    };
    // Every part's n x dim features and its n log-scales, one block after another in one buffer
    // of the calling thread's pool, then the rows' log-scales (a second call with the same shapes
    // allocates nothing). Each block starts on a 64-byte boundary, as a matrix of its own would:
    // Eigen's vectorised loops over a row then split it the same way, and the features keep
    // their last bits.
    constexpr Index kAlign = Index(64 / sizeof(Scalar));
    const auto padded = [](Index size) { return (size + kAlign - 1) / kAlign * kAlign; };
    const auto start = [&](Index j) {  // offset of part j's features; its log-scales follow
      Index o = 0;
      for (Index i = 0; i < j; ++i) o += padded(n * part(i).feature_dim()) + padded(n);
      return o;
    };
    detail::Scratch<Vector<Scalar>> storage(start(parts) + padded(n) + kAlign);
    const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(storage.data()) % 64;
    Scalar* const base = storage.data() + (misaligned ? (64 - misaligned) / sizeof(Scalar) : 0);
    const auto values_of = [&](Index j) {
      return Eigen::Map<RowMatrix<Scalar>>(base + start(j), n, part(j).feature_dim());
    };
    const auto log_of = [&](Index j) {
      return Eigen::Map<Vector<Scalar>>(base + start(j) + padded(n * part(j).feature_dim()), n);
    };
    for (Index j = 0; j < parts; ++j)
      part(j).features_into(x, normaliser, values_of(j), log_of(j), side);

    // Each row's log-scale: the largest of its terms' log-scales.
    const Index last = 2 * p;
    const auto last_log = log_of(last);
    Eigen::Map<Vector<Scalar>> top(base + start(parts), n);
    top = last_log;
    for (Index k = 0; k < p; ++k) {
      const auto weight_log = log_of(k), base_log = log_of(p + k);
      for (Index i = 0; i < n; ++i) {
        top(i) = std::max(top(i), weight_log(i) + base_log(i));
        top(i) = std::max(top(i), weight_log(i) + last_log(i));
      }
    }
    // The blocks of Ψ, one pair of parts at a time over every row.
    Index offset = 0;
    const auto kron = [&](Index a, Index c) {
      const auto va = values_of(a), vc = values_of(c);
      const auto la = log_of(a), lc = log_of(c);
      const Index da = va.cols(), dc = vc.cols();
      for (Index i = 0; i < n; ++i) {
        const Scalar scale = std::exp(la(i) + lc(i) - top(i));
        for (Index r = 0; r < da; ++r)
          values.row(i).segment(offset + r * dc, dc) = (scale * va(i, r)) * vc.row(i);
      }
      offset += da * dc;
    };
    for (Index k = 0; k < p; ++k) kron(k, p + k);
    for (Index k = 0; k < p; ++k) kron(k, last);
    const auto vl = values_of(last);
    for (Index i = 0; i < n; ++i)
      values.row(i).tail(vl.cols()) = std::exp(last_log(i) - top(i)) * vl.row(i);
    log_scale = top;
  }

  ScaledFeatures<Scalar> features(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                                  Scalar normaliser = 1,
                                  FeatureSide side = FeatureSide::query) const {
    ScaledFeatures<Scalar> f{RowMatrix<Scalar>(x.rows(), feature_dim()), Vector<Scalar>(x.rows())};
    features_into(x, normaliser, f.values, f.log_scale, side);
    return f;
  }

 private:
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

}  // namespace randattn
