#pragma once
// The Hedgehog feature map (Zhang, Bhatia, Kumbong and Ré, "The Hedgehog & the Porcupine:
// Expressive Linear Attentions with Softmax Mimicry", ICLR 2024): a learned map
//
//   φ(x) = [softmax(u) ; softmax(−u)],   u = W (c·x) + b   (2m features),
//
// with W ∈ R^{m×d} and b ∈ R^m trained so that φ(q)ᵀφ(k) mimics softmax attention weights. As
// every map of the library, it sees the rows already multiplied by the data normaliser c
// (c = scale^{1/2} in attention, see feature_maps.hpp), so u = c·(W x) + b for a raw row x.
// The kernel φ(q)ᵀφ(k) is a sum of products of probabilities, positive and not an estimate of
// exp(qᵀk): attention through the linear core then normalises it like any feature kernel.
//
// The features are the two softmaxes themselves (each half sums to 1, log_scale 0), each
// stabilised by its own extreme (u − max u, min u − u), so every finite u gives finite
// features; an infinite u (an overflowing W x at extreme scales) gives the softmax's limit, the
// mass shared by the entries at the extreme. Each row's features depend on that row alone
// (safe for causal attention).
//
// Without a given W (HedgehogFeatures(m, d, seed)), W is the block-orthogonal draw of
// OrthogonalProjection(m, d, seed) (made in double, the same numbers for float and double and
// every thread count) and b = 0: an untrained map, the registry's default with m = 64.
//
// Backward. features_vjp has the signature of ProjectedFeatureMap::features_vjp (so
// random_feature_attention_backward runs unchanged): it adds dx and, in the d_omega slot, dW.
// With s = softmax(u), t = softmax(−u) and cotangents D⁺, D⁻ of the two halves,
//   g = ∂L/∂u = s ⊙ (D⁺ − ⟨D⁺, s⟩) − t ⊙ (D⁻ − ⟨D⁻, t⟩),
// dx = c Wᵀg, dW = c g xᵀ, and db = Σ_rows g: the overload with a d_bias pointer adds it, and a
// map from with_bias_gradient(&d_bias) adds it from the standard signature, for the backward
// passes that take the map alone. The log-scale is constant (0), so d_log_scale contributes
// nothing. Cost O(n·m·d) forward and backward, as the projected maps.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "projected_feature_map.hpp"
#include "projection.hpp"

namespace randattn {

template <typename Scalar>
class HedgehogFeatures
    : public ProjectedFeatureMap<HedgehogFeatures<Scalar>, Scalar, UserProjection<Scalar>> {
  using Base = ProjectedFeatureMap<HedgehogFeatures, Scalar, UserProjection<Scalar>>;

 public:
  static constexpr Index features_for(Index m) { return 2 * m; }
  static constexpr bool nonnegative = true;

  // The map of a given W (m × d) and b (m entries, a row or a column).
  template <typename W, typename B>
  HedgehogFeatures(const Eigen::MatrixBase<W>& weight, const Eigen::MatrixBase<B>& bias)
      : Base(UserProjection<Scalar>(weight)) {
    const Index m = weight.rows();
    detail::require((bias.rows() == 1 || bias.cols() == 1) && bias.size() == m, "HedgehogFeatures",
                    "bias is ", bias.rows(), "x", bias.cols(), ", expected a vector of ", m,
                    " entries (one per row of the weight)");
    if (bias.cols() == 1)
      bias_ = bias.col(0).template cast<Scalar>();
    else
      bias_ = bias.row(0).transpose().template cast<Scalar>();
    detail::require_finite(bias_, "HedgehogFeatures", "bias");
  }

  // The untrained map of the seed: W = OrthogonalProjection(m, d, seed), b = 0.
  HedgehogFeatures(Index m, Index d, std::uint64_t seed = 0)
      : Base(UserProjection<Scalar>(OrthogonalProjection<double>(m, d, seed).matrix())),
        bias_(Vector<Scalar>::Zero(m)) {}

  const RowMatrix<Scalar>& weight() const { return this->projection().matrix(); }
  const Vector<Scalar>& bias() const { return bias_; }

  // Row p = W x (m entries) to [softmax(c p + b) | softmax(−(c p + b))]; the log-scale is 0.
  template <typename Row>
  Scalar finish_row(Row&& row, Scalar, Scalar c) const {
    const Index m = this->projections();
    auto u = row.head(m);
    auto neg = row.tail(m);
    u = (c * u.array() + bias_.transpose().array()).matrix();
    const Scalar top = u.maxCoeff(), low = u.minCoeff();
    if (std::isfinite(low))
      neg = (low - u.array()).exp().matrix();
    else  // the limit: the mass on the entries at −∞
      neg = (u.array() == low).template cast<Scalar>().matrix();
    if (std::isfinite(top))
      u = (u.array() - top).exp().matrix();
    else
      u = (u.array() == top).template cast<Scalar>().matrix();
    u /= u.sum();  // each sum is at least 1: its extreme entry is exp(0)
    neg /= neg.sum();
    return Scalar(0);
  }

  // Backward of finish_row (see ProjectedFeatureMap): du = ∂L/∂(W x) = c g; ‖x‖² does not enter.
  template <typename Values, typename DValues, typename Du>
  Scalar vjp_row(const Values& values, const DValues& d_values, Scalar, Scalar c, Du&& du) const {
    cotangent(values, d_values, du);
    du *= c;
    return Scalar(0);
  }

  // The standard vector–Jacobian product (ProjectedFeatureMap::features_vjp): dx, and dW added
  // to *d_weight; db added to the with_bias_gradient() target, if any.
  void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                    const Eigen::Ref<const RowMatrix<Scalar>>& values,
                    const Eigen::Ref<const Vector<Scalar>>& log_scale,
                    const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                    const Eigen::Ref<const Vector<Scalar>>& d_log_scale,
                    Eigen::Ref<RowMatrix<Scalar>> dx, RowMatrix<Scalar>* d_weight = nullptr,
                    FeatureSide side = FeatureSide::query) const {
    features_vjp(x, normaliser, values, log_scale, d_values, d_log_scale, dx, d_weight,
                 bias_gradient_, side);
  }

  // The same, with db = Σ_rows ∂L/∂u added to *d_bias (m entries) unless null. The rows are
  // summed in order: the result does not depend on the thread count.
  void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                    const Eigen::Ref<const RowMatrix<Scalar>>& values,
                    const Eigen::Ref<const Vector<Scalar>>& log_scale,
                    const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                    const Eigen::Ref<const Vector<Scalar>>& d_log_scale,
                    Eigen::Ref<RowMatrix<Scalar>> dx, RowMatrix<Scalar>* d_weight,
                    Vector<Scalar>* d_bias, FeatureSide side = FeatureSide::query) const {
    const Index m = this->projections();
    detail::require(!d_bias || d_bias->size() == m, "feature map backward", "d_bias has ",
                    d_bias ? d_bias->size() : 0, " entries, expected ", m);
    Base::features_vjp(x, normaliser, values, log_scale, d_values, d_log_scale, dx, d_weight, side);
    if (!d_bias || x.rows() == 0) return;
    using Row = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;
    Row g(m), sum = Row::Zero(m);
    for (Index i = 0; i < x.rows(); ++i) {
      cotangent(values.row(i), d_values.row(i), g);
      sum += g;
    }
    *d_bias += sum.transpose();
  }

  // A copy of this map whose standard features_vjp also adds db to *d_bias (m entries), for
  // backward passes that take the map alone (random_feature_attention_backward). *d_bias must
  // outlive the copy's backward calls, which must not run concurrently.
  HedgehogFeatures with_bias_gradient(Vector<Scalar>* d_bias) const {
    detail::require(!d_bias || d_bias->size() == this->projections(), "HedgehogFeatures",
                    "d_bias has ", d_bias ? d_bias->size() : 0, " entries, expected ",
                    this->projections());
    HedgehogFeatures copy = *this;
    copy.bias_gradient_ = d_bias;
    return copy;
  }

 private:
  // g = ∂L/∂u of one row: the Jacobians of the two softmaxes applied to the row's cotangent.
  template <typename Values, typename DValues, typename Out>
  void cotangent(const Values& values, const DValues& d_values, Out&& g) const {
    const Index m = this->projections();
    const auto s = values.head(m).array(), t = values.tail(m).array();
    const auto ds = d_values.head(m).array(), dt = d_values.tail(m).array();
    const Scalar along_s = (ds * s).sum(), along_t = (dt * t).sum();
    g = (s * (ds - along_s) - t * (dt - along_t)).matrix();
  }

  Vector<Scalar> bias_;
  Vector<Scalar>* bias_gradient_ = nullptr;
};

}  // namespace randattn
