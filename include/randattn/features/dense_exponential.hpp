#pragma once
// Symmetric dense-exponential random features (SDERF; Likhosherstov, Choromanski et al.,
// "FAVOR#: Sharp Attention Kernel Approximations via New Classes of Positive Random Features",
// 2023) of the softmax kernel exp(xᵀy).
//
// f(ω, x) = D exp(ωᵀAω + ωᵀBx − ½‖x‖²), ω ~ N(0, I_d), with a symmetric d×d matrix A (I − 8A
// positive definite) and B, used on both sides. With E exp(ωᵀMω + bᵀω) = det(I − 2M)^{−1/2}
// exp(½ bᵀ(I − 2M)^{−1} b), the estimate is unbiased iff Bᵀ(I − 4A)^{−1}B = I and
// D = det(I − 4A)^{1/4}, and, z = x + y,
//
//   E[f(ω,x)² f(ω,y)²] / exp(2xᵀy) = det(I − 4A) det(I − 8A)^{−1/2} exp(zᵀ[2Bᵀ(I − 8A)^{−1}B −
//   I]z).
//
// The mean of the log over the query-key pairs depends on the data through the second moment
// M = mean_{i,j} (x_i + y_j)(x_i + y_j)ᵀ only. With M = V diag(σ) Vᵀ, the minimiser is
// A = V diag(a) Vᵀ, B = V diag(√(1 − 4a)) Vᵀ with a_l = (1 − t_l)/8, t_l = optimal_precision(σ_l)
// (the one-dimensional OPRF optimum along each eigenvector; for B = (I − 4A)^{1/2}O the
// trace term is tr((I − 8A)^{−1} O M Oᵀ), minimised by aligning O M Oᵀ with A, von Neumann's
// trace inequality, after which the problem separates by direction). Then
//
//   log of the ratio = L(z) = Σ_l [g(t_l) + (v_lᵀz)²/t_l],   g(t) = log((1+t)/2) − ½ log t,
//
// and m i.i.d. draws give the relative MSE (e^L − 1)/m. An isotropic M = (ρ/d) I gives the
// OPRF of oprf.hpp; M = 0 gives FAVOR+.
//
// Computation. Writing ω' = Vᵀω (again N(0, I)), ωᵀAω = Σ_l a_l ω'_l² and ωᵀBx = ω'ᵀ diag(b) Vᵀ x.
// So the rows of the given projection serve as ω' directly, and the map stores the dense
// m×d matrix W = Ω diag(b) Vᵀ (one d×d eigendecomposition and an m·d² product per fit or
// redraw) and quad_r = Σ_l a_l Ω_rl²: per row it costs exactly what FAVOR+ costs on a dense
// projection (structured projections lose their fast apply, since W is dense). Unbiased when
// the projection's rows are marginally N(0, I_d) (i.i.d., or orthogonal with χ(d) norms).
//
// Gradients (features_vjp). Per row the map is the OPRF form on the dense W, so dx comes from
// the shared backward of oprf.hpp. M — and with it V, a and b — is a constant of the call: with
// M given (set_moment, or fit on calibration rows) the gradient equals finite differences; with
// the map fitted to the sequence being attended (the registry's fit "queries+keys") it is the
// gradient of the estimate at the fitted M held constant. *d_omega, when given, is the gradient
// with respect to the source projection's matrix Ω (W = Ω diag(b) Vᵀ and quad_r = Σ_l a_l Ω_rl²):
// dΩ = dW V diag(b) + 2 diag(∂L/∂quad) Ω diag(a).
//
// M is a statistic of the normalised inputs (rows times the data normaliser c = scale^{1/2} for
// attention). pair_sum_second_moment computes it in O((n_x + n_y)·d²):
// M = mean x xᵀ + mean y yᵀ + x̄ȳᵀ + ȳx̄ᵀ. As for OPRF, the map never looks at other rows
// once fitted: for causal attention and decoding fit on calibration rows (or pass M), never
// on the sequence being attended.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>
#include <utility>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "feature_maps.hpp"
#include "oprf.hpp"
#include "projection.hpp"

namespace randattn {

namespace detail {

// Σ_i (c x_i)(c x_i)ᵀ / n in double, accumulated over blocks of rows (bounded temporaries).
template <typename Scalar>
Eigen::MatrixXd normalised_mean_outer(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                                      double normaliser) {
  const Index n = x.rows(), d = x.cols(), block = 512;
  Eigen::MatrixXd gram = Eigen::MatrixXd::Zero(d, d);
  Eigen::MatrixXd xb(d, block);
  for (Index i0 = 0; i0 < n; i0 += block) {
    const Index rows = std::min(block, n - i0);
    xb.leftCols(rows) = x.middleRows(i0, rows).transpose().template cast<double>();
    gram.selfadjointView<Eigen::Lower>().rankUpdate(xb.leftCols(rows));
  }
  gram = gram.selfadjointView<Eigen::Lower>();
  return (normaliser * normaliser / double(n)) * gram;
}

}  // namespace detail

// mean over all pairs (i, j) of c²(x_i + y_j)(x_i + y_j)ᵀ (d×d, symmetric positive
// semidefinite), in O((n_x + n_y)·d²). Its trace is pair_sum_sq_norm.
template <typename Scalar>
Eigen::MatrixXd pair_sum_second_moment(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                                       const Eigen::Ref<const RowMatrix<Scalar>>& y,
                                       double normaliser = 1) {
  detail::check_pair_inputs<Scalar>("pair_sum_second_moment", x, y, normaliser);
  const Eigen::VectorXd mx = detail::normalised_row_moments<Scalar>(x, normaliser).first;
  const Eigen::VectorXd my = detail::normalised_row_moments<Scalar>(y, normaliser).first;
  Eigen::MatrixXd m = detail::normalised_mean_outer<Scalar>(x, normaliser) +
                      detail::normalised_mean_outer<Scalar>(y, normaliser);
  m.noalias() += mx * my.transpose();
  m.noalias() += my * mx.transpose();
  detail::check_result_finite("pair_sum_second_moment", m, true, [] {});
  return m;
}

// SDERF: m positive features with A, B fitted to the second moment M (M = 0: FAVOR+).
// Projection is the source of the draws ω' (redraw() redraws it).
template <typename Scalar, typename Projection = OrthogonalProjection<Scalar>>
class DenseExponentialFeatures
    : public QuadraticExponentialMap<DenseExponentialFeatures<Scalar, Projection>, Scalar,
                                     UserProjection<Scalar>> {
  using Base = QuadraticExponentialMap<DenseExponentialFeatures, Scalar, UserProjection<Scalar>>;

 public:
  // moment: d×d second moment M of the normalised inputs; empty means 0.
  explicit DenseExponentialFeatures(Projection source, const Eigen::MatrixXd& moment = {})
      : Base(UserProjection<Scalar>(source.matrix())), source_(std::move(source)) {
    set_moment(moment.size() ? moment
                             : Eigen::MatrixXd::Zero(this->input_dim(), this->input_dim()));
  }

  // M must be d×d, finite and symmetric positive semidefinite (tiny negative eigenvalues from
  // rounding count as 0).
  void set_moment(const Eigen::MatrixXd& moment) {
    const char* where = "DenseExponentialFeatures";
    const Index d = this->input_dim();
    detail::require(moment.rows() == d && moment.cols() == d, where, "the second moment is ",
                    detail::shape_of(moment), ", expected ", d, "x", d);
    detail::require_finite(moment, where, "the second moment");
    const double size = moment.cwiseAbs().maxCoeff();
    detail::require((moment - moment.transpose()).cwiseAbs().maxCoeff() <= 1e-9 * size, where,
                    "the second moment must be symmetric");
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(moment);
    detail::require(eig.eigenvalues().minCoeff() >= -1e-9 * size, where,
                    "the second moment must be positive semidefinite, its smallest eigenvalue is ",
                    eig.eigenvalues().minCoeff());
    moment_ = moment;
    basis_ = eig.eigenvectors();
    precisions_ = eig.eigenvalues().unaryExpr(
        [](double s) { return detail::optimal_precision(std::max(s, 0.0)); });
    update();
  }
  // M of normaliser·q and normaliser·k (rows of sample queries and keys). See the header
  // comment before fitting on the sequence of a causal attention.
  void fit(const Eigen::Ref<const RowMatrix<Scalar>>& q,
           const Eigen::Ref<const RowMatrix<Scalar>>& k, double normaliser) {
    set_moment(pair_sum_second_moment<Scalar>(q, k, normaliser));
  }

  void redraw(std::uint64_t seed) {
    source_.redraw(seed);
    update();
  }

  // Backward: see the header comment.
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
    if (!d_omega) {
      Base::features_vjp(x, normaliser, values, log_scale, d_values, d_log_scale, dx, nullptr,
                         side);
      return;
    }
    detail::require(d_omega->rows() == this->projections() && d_omega->cols() == this->input_dim(),
                    "feature map backward", "d_omega is ", detail::shape_of(*d_omega),
                    ", expected ", this->projections(), "x", this->input_dim());
    RowMatrix<Scalar> d_w = RowMatrix<Scalar>::Zero(this->projections(), this->input_dim());
    Base::features_vjp(x, normaliser, values, log_scale, d_values, d_log_scale, dx, &d_w, side);
    const Eigen::ArrayXd a = (1 - precisions_.array()) / 8;
    const Eigen::ArrayXd b = (0.5 * (1 + precisions_.array())).sqrt();
    const Eigen::VectorXd g =
        detail::quadratic_term_gradient<Scalar>(values, d_values, d_log_scale).template cast<double>();
    const RowMatrix<double> omega = source_.matrix().template cast<double>();
    RowMatrix<double> d_source = d_w.template cast<double>() * basis_ * b.matrix().asDiagonal();
    d_source += 2 * g.asDiagonal() * omega * a.matrix().asDiagonal();
    *d_omega += d_source.template cast<Scalar>();
  }

  const Projection& source() const { return source_; }
  const Eigen::MatrixXd& moment() const { return moment_; }
  const Eigen::MatrixXd& basis() const { return basis_; }            // V (columns)
  const Eigen::VectorXd& precisions() const { return precisions_; }  // t_l = 1 − 8a_l

  // log of E[f(ω,x)² f(ω,y)²]/exp(2xᵀy) for one draw, z = x + y of normalised inputs.
  double log_second_moment_ratio(const Eigen::Ref<const Eigen::VectorXd>& z) const {
    const Eigen::VectorXd w = basis_.transpose() * z;
    return precisions_.unaryExpr([](double t) { return detail::precision_penalty(t); }).sum() +
           (w.array().square() / precisions_.array()).sum();
  }

 private:
  void update() {
    const Eigen::ArrayXd a = (1 - precisions_.array()) / 8;
    const Eigen::ArrayXd b = (0.5 * (1 + precisions_.array())).sqrt();
    const RowMatrix<double> omega = source_.matrix().template cast<double>();
    const RowMatrix<double> w = omega * b.matrix().asDiagonal() * basis_.transpose();
    this->projection_ = UserProjection<Scalar>(w);
    this->quad_ = (omega.array().square().matrix() * a.matrix()).template cast<Scalar>();
    this->slope_ = 1;
    this->log_d_ = Scalar(0.25 * (0.5 * (1 + precisions_.array())).log().sum());
  }

  Projection source_;
  Eigen::MatrixXd moment_, basis_;
  Eigen::VectorXd precisions_;
};

template <typename P>
DenseExponentialFeatures(P) -> DenseExponentialFeatures<typename P::Scalar, P>;
template <typename P>
DenseExponentialFeatures(P, Eigen::MatrixXd) -> DenseExponentialFeatures<typename P::Scalar, P>;

}  // namespace randattn
