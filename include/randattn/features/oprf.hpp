#pragma once
// Optimal positive random features (OPRF; Likhosherstov, Choromanski et al., "Chefs' Random
// Tables: Non-Trigonometric Random Features", NeurIPS 2022) of the softmax kernel exp(xᵀy).
//
// Generalised exponential features f(ω, x) = D exp(A‖ω‖² + B ωᵀx + C‖x‖²), ω ~ N(0, I_d), used
// on both sides. With E exp(a‖ω‖² + bᵀω) = (1 − 2a)^{−d/2} exp(‖b‖²/(2(1 − 2a))) (a < 1/2):
//
//   E f(ω,x) f(ω,y) = exp(xᵀy)   iff   B² = 1 − 4A,  C = −1/2,  D = (1 − 4A)^{d/4},
//
// for every A < 1/4; A = 0 is FAVOR+. Writing t = 1 − 8A (> 0 for a finite second moment) and
// z = x + y, the second moment relative to the kernel squared is
//
//   E[f(ω,x)² f(ω,y)²] / exp(2xᵀy) = exp(L),  L = d·g(t) + ‖z‖²/t,  g(t) = log((1+t)/2) − ½ log t,
//
// so m i.i.d. draws give the relative MSE E[(K̂ − K)²]/K² = (e^L − 1)/m (for FAVOR+, t = 1:
// (e^{‖z‖²} − 1)/m, Performer Lemma 2). The paper's variance-optimal A minimises the mean of
// L over the query-key pairs, which depends on the data through ρ = mean_{i,j} ‖x_i + y_j‖²
// only: dL/dt = 0 gives d t² − (d + 2ρ) t − 2ρ = 0, i.e. t = σ_opt(ρ/d) with
//
//   t = ((1 + 2σ) + √((1 + 2σ)² + 8σ)) / 2,   σ = ρ/d, (optimal_precision)
//
// so t >= 1 and A = (1 − t)/8 <= 0: the features are bounded (exp(A‖ω‖² + Bωᵀx) <=
// exp(B²‖x‖²/(4|A|))), and the optimum is never worse than FAVOR+ (A = 0 is a candidate).
//
// ρ is a statistic of the normalised inputs (the rows times the data normaliser c; for attention
// c = scale^{1/2}, so ρ = scale · mean ‖q_i + k_j‖²). pair_sum_sq_norm computes it in
// O((n_q + n_k)·d) from the row norms and the two mean rows:
// mean ‖x_i + y_j‖² = mean ‖x_i‖² + mean ‖y_j‖² + 2 x̄ᵀȳ.
//
// Fitting and causal attention. The parameters are fixed when the map is built or fitted
// (`fit(q, k, c)` or `set_rho(ρ)`); features_into never looks at other rows, so each row's
// features depend on that row and the parameters alone. Fitting on the sequence being attended
// makes every output depend on every key through ρ: for causal attention (and decoding) take ρ
// from given values or from calibration data, never from the sequence itself. Any A gives an
// unbiased estimate; ρ only steers the variance.
//
// Gradients (features_vjp, the interface of ProjectedFeatureMap). A feature is exp(A‖ω_r‖² +
// B c ω_rᵀx − ½c²‖x‖²) up to constants, so ∂/∂x = (B c ω_r − c² x) times the feature, and
// ∂/∂ω_r = (2A ω_r + B c x) times the feature. A and B are constants of the call: with ρ given
// (set_rho, or fit on calibration rows) the gradient is that of the map and equals finite
// differences; with the map fitted to the sequence being attended (fit(q, k, c), the registry's
// fit "queries+keys") it is the gradient of the estimate at the fitted A held constant — the path
// through ρ is not differentiated.
//
// Projections: unbiased when the rows of ω are marginally N(0, I_d) (i.i.d. Gaussian, or
// orthogonal blocks with χ(d) row norms). Rows of fixed norm √d (RowNorm::sqrt_d) make A‖ω‖²
// a constant and bias the estimate, as they do for FAVOR+. Any projection kind works (the map
// keeps the projection's fast apply and only needs its row norms).

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/packet_load.hpp"
#include "../detail/validation.hpp"
#include "feature_maps.hpp"
#include "projection.hpp"

namespace randattn {

namespace detail {

// t = 1 − 8a minimising g(t) + σ/t, the per-direction part of L (see the header comment), for
// a direction whose squared projection of x + y has mean σ >= 0.
inline double optimal_precision(double sigma) {
  const double b = 1 + 2 * sigma;
  return 0.5 * (b + std::sqrt(b * b + 8 * sigma));
}

// g(t) = log((1 + t)/2) − ½ log t: the ω-only part of L per dimension (0 at t = 1).
inline double precision_penalty(double t) { return std::log1p(0.5 * (t - 1)) - 0.5 * std::log(t); }

#if defined(__GNUC__)
#pragma GCC diagnostic push
// Eigen's packet types carry alignment attributes that do not survive as template arguments.
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

// Rows times the data normaliser: their mean and mean squared norm, accumulated in double.
template <typename Scalar>
std::pair<Eigen::VectorXd, double> normalised_row_moments(
    const Eigen::Ref<const RowMatrix<Scalar>>& x, double normaliser) {
  // One pass over the rows (a column-wise sum of a row-major matrix would stride through it d
  // times).
  const Index d = x.cols();
  Eigen::VectorXd sum = Eigen::VectorXd::Zero(d);
  double sq = 0;
  if constexpr (std::is_same<Scalar, double>::value) {
    // Nothing to widen: Eigen's own sums are packet code at any optimisation level.
    for (Index i = 0; i < x.rows(); ++i) {
      sum.noalias() += x.row(i).transpose();
      sq += x.row(i).squaredNorm();
    }
  } else {
    // Packets of doubles widened in registers (GCC 12 vectorises the widening loop at -O3 only);
    // the squared norms are summed per lane, the lanes last.
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<double>::type;
    constexpr Index kP = ei::unpacket_traits<Packet>::size;
    const Index full = d - d % kP;
    Packet sq_lanes = ei::pset1<Packet>(0.0);
    for (Index i = 0; i < x.rows(); ++i) {
      const Scalar* row = x.data() + i * x.outerStride();  // no entry to index when d = 0
      for (Index j = 0; j < full; j += kP) {
        const Packet v = load_packet<Packet>(row + j);
        ei::pstoreu(sum.data() + j, ei::padd(ei::ploadu<Packet>(sum.data() + j), v));
        sq_lanes = ei::pmadd(v, v, sq_lanes);
      }
      for (Index j = full; j < d; ++j) {
        const double v = double(row[j]);
        sum(j) += v;
        sq += v * v;
      }
    }
    sq += ei::predux(sq_lanes);
  }
  const double n = double(x.rows());
  return {normaliser * sum / n, normaliser * normaliser * sq / n};
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

template <typename Scalar>
void check_pair_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& x,
                       const Eigen::Ref<const RowMatrix<Scalar>>& y, double normaliser) {
  require(x.rows() >= 1 && y.rows() >= 1 && x.cols() == y.cols(), where, "need x (", shape_of(x),
          ") and y (", shape_of(y), ") with at least one row each and equal columns");
  require(normaliser > 0 && std::isfinite(normaliser), where,
          "normaliser must be positive and finite, got ", normaliser);
  require_finite(x, where, "x");
  require_finite(y, where, "y");
}

// Backward of QuadraticExponentialMap::finish_row, the shared form of OPRF and SDERF: the
// exponent of feature r is quad_r + slope·c·u_r − ½c²‖x‖² (u = ωᵀx of the raw row), and the
// row's log-scale is its maximum plus constants. Writes du = slope·c·(∂L/∂exponent) and returns
// ∂L/∂‖x‖² (see ProjectedFeatureMap::features_vjp).
template <typename Scalar, typename Values, typename DValues, typename Du>
Scalar quadratic_exponential_vjp_row(const Values& values, const DValues& d_values,
                                     Scalar d_log_scale, Scalar slope, Scalar c, Du&& du) {
  du = ((slope * c) * (d_values.array() * values.array())).matrix();
  if (d_log_scale != 0) {
    Index top;
    values.maxCoeff(&top);  // the exponent's maximum is where the value is 1
    du(top) += slope * c * d_log_scale;
  }
  return Scalar(-0.5) * c * c * (d_values.dot(values) + d_log_scale);
}

// Σ_i ∂L/∂quad_r over the rows: the cotangent of the exponents' ω-only terms (m entries).
template <typename Scalar>
Vector<Scalar> quadratic_term_gradient(const Eigen::Ref<const RowMatrix<Scalar>>& values,
                                       const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                                       const Eigen::Ref<const Vector<Scalar>>& d_log_scale) {
  Vector<Scalar> g = (d_values.array() * values.array()).colwise().sum().transpose();
  for (Index i = 0; i < d_log_scale.size(); ++i) {
    if (d_log_scale(i) == 0) continue;
    Index top;
    values.row(i).maxCoeff(&top);
    g(top) += d_log_scale(i);
  }
  return g;
}

}  // namespace detail

// mean over all pairs (i, j) of ‖c(x_i + y_j)‖², in O((n_x + n_y)·d).
template <typename Scalar>
double pair_sum_sq_norm(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                        const Eigen::Ref<const RowMatrix<Scalar>>& y, double normaliser = 1) {
  detail::check_pair_inputs<Scalar>("pair_sum_sq_norm", x, y, normaliser);
  const auto mx = detail::normalised_row_moments<Scalar>(x, normaliser);
  const auto my = detail::normalised_row_moments<Scalar>(y, normaliser);
  const double rho = mx.second + my.second + 2 * mx.first.dot(my.first);
  detail::check_result_finite("pair_sum_sq_norm", rho);
  return rho;
}

// OPRF: m positive features with the variance-optimal A for the statistic ρ (ρ = 0: FAVOR+).
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class OptimalPositiveFeatures
    : public QuadraticExponentialMap<OptimalPositiveFeatures<Scalar, Projection>, Scalar,
                                     Projection> {
  using Base = QuadraticExponentialMap<OptimalPositiveFeatures, Scalar, Projection>;

 public:
  explicit OptimalPositiveFeatures(Projection projection, double rho = 0)
      : Base(std::move(projection)) {
    set_rho(rho);
  }

  // ρ = mean over the pairs of ‖x_i + y_j‖² of the normalised inputs (>= 0, finite).
  void set_rho(double rho) {
    detail::require(rho >= 0 && std::isfinite(rho), "OptimalPositiveFeatures",
                    "rho must be finite and >= 0, got ", rho);
    rho_ = rho;
    t_ = detail::optimal_precision(rho / double(this->input_dim()));
    update();
  }
  // ρ of normaliser·q and normaliser·k (rows of sample queries and keys). See the header
  // comment before fitting on the sequence of a causal attention.
  void fit(const Eigen::Ref<const RowMatrix<Scalar>>& q,
           const Eigen::Ref<const RowMatrix<Scalar>>& k, double normaliser) {
    detail::require(q.cols() == this->input_dim(), "OptimalPositiveFeatures::fit", "q is ",
                    detail::shape_of(q), ", expected ", this->input_dim(), " columns");
    set_rho(pair_sum_sq_norm<Scalar>(q, k, normaliser));
  }

  void redraw(std::uint64_t seed) {
    this->projection_.redraw(seed);
    update();
  }

  // Backward: see the header comment (A and B held constant). *d_omega, when given, is the
  // gradient with respect to projection().matrix(), the path through A‖ω_r‖² included.
  template <typename Values, typename DValues, typename Du>
  Scalar vjp_row(const Values& values, const DValues& d_values, Scalar d_log_scale, Scalar c,
                 Du&& du) const {
    return detail::quadratic_exponential_vjp_row(values, d_values, d_log_scale, this->slope_, c,
                                                 du);
  }
  void features_vjp(const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                    const Eigen::Ref<const RowMatrix<Scalar>>& values,
                    const Eigen::Ref<const Vector<Scalar>>& log_scale,
                    const Eigen::Ref<const RowMatrix<Scalar>>& d_values,
                    const Eigen::Ref<const Vector<Scalar>>& d_log_scale,
                    Eigen::Ref<RowMatrix<Scalar>> dx, RowMatrix<Scalar>* d_omega = nullptr,
                    FeatureSide side = FeatureSide::query) const {
    Base::features_vjp(x, normaliser, values, log_scale, d_values, d_log_scale, dx, d_omega, side);
    if (!d_omega || x.rows() == 0) return;
    // quad_r = A‖ω_r‖²: ∂quad_r/∂ω_r = 2A ω_r.
    const Vector<Scalar> g = detail::quadratic_term_gradient<Scalar>(values, d_values, d_log_scale);
    *d_omega += (Scalar(2 * a()) * g).asDiagonal() * this->projection_.matrix();
  }

  double rho() const { return rho_; }
  double precision() const { return t_; }                 // t = 1 − 8A
  double a() const { return (1 - t_) / 8; }               // A
  double b() const { return std::sqrt(0.5 * (1 + t_)); }  // B = √(1 − 4A)

  // log of E[f(ω,x)² f(ω,y)²]/exp(2xᵀy) for one draw, z = x + y of normalised inputs.
  double log_second_moment_ratio(const Eigen::Ref<const Eigen::VectorXd>& z) const {
    return double(this->input_dim()) * detail::precision_penalty(t_) + z.squaredNorm() / t_;
  }

 private:
  void update() {
    const Eigen::VectorXd sq =
        this->projection_.matrix().template cast<double>().rowwise().squaredNorm();
    this->quad_ = (a() * sq).template cast<Scalar>();
    this->slope_ = Scalar(b());
    this->log_d_ = Scalar(0.25 * double(this->input_dim()) * std::log(0.5 * (1 + t_)));
  }

  double rho_ = 0, t_ = 1;
};

template <typename P>
OptimalPositiveFeatures(P) -> OptimalPositiveFeatures<typename P::Scalar, P>;
template <typename P>
OptimalPositiveFeatures(P, double) -> OptimalPositiveFeatures<typename P::Scalar, P>;

}  // namespace randattn
