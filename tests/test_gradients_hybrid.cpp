// Backward of the hybrid (features/hybrid.hpp), OPRF (features/oprf.hpp) and SDERF
// (features/dense_exponential.hpp) feature maps: each map's vector–Jacobian product against
// finite differences in double (to the rows, to the log-scale cotangent's path, to ω), then
// attention through the linear core's backward, float against double.

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <Eigen/QR>

#include <randattn/core/linear_backward.hpp>
#include <randattn/randattn.hpp>

#include "gradient_check.hpp"
#include "support.hpp"

namespace {

using randattn::AngularWeight;
using randattn::DenseExponentialFeatures;
using randattn::FeatureSide;
using randattn::GaussianWeight;
using randattn::HybridFeatures;
using randattn::Index;
using randattn::OptimalPositiveFeatures;
using randattn::RowMatrix;
using randattn::UserProjection;
using randattn::Vector;

template <typename Scalar>
using User = UserProjection<Scalar>;

// L(values, ℓ) = Σ_ir G_ir values_ir e^{ℓ_i − ℓ⁰_i} + Σ_i λ_i ℓ_i: at the point ℓ⁰ its cotangents
// are d_values = G and, at fixed φ = e^ℓ values, d_log_scale = λ (the form features_vjp takes).
template <typename Map>
double cotangent_loss(const Map& map, const RowMatrix<double>& x, double c, FeatureSide side,
                      const RowMatrix<double>& g, const Vector<double>& lambda,
                      const Vector<double>& log0) {
  const auto f = map.features(x, c, side);
  const Eigen::ArrayXd shift = (f.log_scale - log0).array();
  return ((g.array() * f.values.array()).rowwise().sum() * shift.exp()).sum() +
         lambda.dot(f.log_scale - log0);
}

// Checks map(ω).features_vjp against finite differences of cotangent_loss, to x and (when
// make_omega is given) to ω.
template <typename Map>
void check_map_vjp(const std::string& what, const std::function<Map(const RowMatrix<double>&)>& make,
                   RowMatrix<double> omega, Index n, bool with_omega, bool log_cotangent,
                   FeatureSide side, std::uint64_t seed) {
  const Index d = omega.cols();
  const double c = 0.8;
  RowMatrix<double> x = testing::gaussian<double>(seed, n, d, 0.7);
  const Map map = make(omega);
  const auto f0 = map.features(x, c, side);
  const RowMatrix<double> g = testing::gaussian<double>(seed + 1, n, map.feature_dim());
  const Vector<double> lambda = log_cotangent
                                    ? Vector<double>(testing::gaussian<double>(seed + 2, n, 1))
                                    : Vector<double>(Vector<double>::Zero(n));
  RowMatrix<double> dx = RowMatrix<double>::Zero(n, d);
  RowMatrix<double> d_omega = RowMatrix<double>::Zero(omega.rows(), d);
  map.features_vjp(x, c, f0.values, f0.log_scale, g, lambda, dx,
                   with_omega ? &d_omega : nullptr, side);
  testing::check_gradient(what + " dx", x, dx, [&] {
    return cotangent_loss(map, x, c, side, g, lambda, f0.log_scale);
  });
  if (with_omega)
    testing::check_gradient(what + " domega", omega, d_omega, [&] {
      return cotangent_loss(make(omega), x, c, side, g, lambda, f0.log_scale);
    });
}

template <typename Scalar>
struct AttentionGradient {
  RowMatrix<Scalar> dq, dk, dv;
};

// Random-feature attention's backward composed from the linear core's backward and the map's
// VJPs: features of q and k, the core's cotangents, then features_vjp on each side.
template <typename Map>
AttentionGradient<typename Map::Scalar> attention_backward(
    const Map& map, const RowMatrix<typename Map::Scalar>& q,
    const RowMatrix<typename Map::Scalar>& k, const RowMatrix<typename Map::Scalar>& v,
    const RowMatrix<typename Map::Scalar>& grad_out, const randattn::RandomFeatureOptions& opt) {
  using Scalar = typename Map::Scalar;
  const Scalar c = Scalar(std::sqrt(*opt.scale));
  const auto qf = map.features(q, c, FeatureSide::query);
  const auto kf = map.features(k, c, FeatureSide::key);
  randattn::LinearOptions lin;
  lin.causal = opt.causal;
  lin.block_size = opt.block_size;
  lin.denominator_epsilon = *opt.denominator_epsilon;
  const Vector<Scalar> signs = map.signs();
  const RowMatrix<Scalar> out = randattn::linear_attention(qf, kf, v, lin, signs);
  randattn::ScaledFeatureGradient<Scalar> gq, gk;
  AttentionGradient<Scalar> r{RowMatrix<Scalar>::Zero(q.rows(), q.cols()),
                              RowMatrix<Scalar>::Zero(k.rows(), k.cols()),
                              RowMatrix<Scalar>(v.rows(), v.cols())};
  randattn::linear_attention_backward(qf, kf, v, out, grad_out, gq, gk, r.dv, lin, signs);
  // The core returns ∂L/∂ℓ at fixed values; features_vjp takes the part at fixed φ.
  const Vector<Scalar> q_extra =
      gq.log_scale - (gq.values.array() * qf.values.array()).rowwise().sum().matrix();
  const Vector<Scalar> k_extra =
      gk.log_scale - (gk.values.array() * kf.values.array()).rowwise().sum().matrix();
  map.features_vjp(q, c, qf.values, qf.log_scale, gq.values, q_extra, r.dq, nullptr,
                   FeatureSide::query);
  map.features_vjp(k, c, kf.values, kf.log_scale, gk.values, k_extra, r.dk, nullptr,
                   FeatureSide::key);
  return r;
}

struct AttentionCase {
  Index n, chunk;
  bool causal;
};

// Rows checked entry by entry: all of them at n = 37; at n = 300 the first and last rows, rows
// on both sides of a chunk boundary (the default chunk is 32) and one in the middle.
std::vector<Index> checked_rows(Index n) {
  if (n <= 64) {
    std::vector<Index> all;
    for (Index i = 0; i < n; ++i) all.push_back(i);
    return all;
  }
  return {0, 31, 32, 150, n - 2, n - 1};
}

// Finite differences of <G, random_feature_attention(map, q, k, v)> against attention_backward,
// on the rows of checked_rows, for q, k and v.
template <typename Map>
void check_attention(const std::string& what, const Map& map, const AttentionCase& c,
                     double epsilon, std::uint64_t seed) {
  const Index d = map.input_dim(), dv = 3;
  CAPTURE(what, c.n, c.chunk, c.causal);
  RowMatrix<double> q = testing::gaussian<double>(seed, c.n, d, 0.8);
  RowMatrix<double> k = testing::gaussian<double>(seed + 1, c.n, d, 0.8);
  RowMatrix<double> v = testing::gaussian<double>(seed + 2, c.n, dv);
  const RowMatrix<double> g = testing::gaussian<double>(seed + 3, c.n, dv);
  randattn::RandomFeatureOptions opt;
  opt.causal = c.causal;
  opt.block_size = c.chunk;
  opt.scale = 1 / std::sqrt(double(d));
  opt.denominator_epsilon = epsilon;
  const auto grad = attention_backward(map, q, k, v, g, opt);
  const std::vector<Index> rows = checked_rows(c.n);
  const auto check = [&](const char* name, RowMatrix<double>& x, const RowMatrix<double>& dx) {
    RowMatrix<double> sub(Index(rows.size()), x.cols()), dsub(sub.rows(), x.cols());
    for (std::size_t r = 0; r < rows.size(); ++r) {
      sub.row(Index(r)) = x.row(rows[r]);
      dsub.row(Index(r)) = dx.row(rows[r]);
    }
    testing::check_gradient(what + " " + name, sub, dsub, [&] {
      for (std::size_t r = 0; r < rows.size(); ++r) x.row(rows[r]) = sub.row(Index(r));
      return testing::contract(g, randattn::random_feature_attention(map, q, k, v, opt));
    });
    for (std::size_t r = 0; r < rows.size(); ++r) x.row(rows[r]) = sub.row(Index(r));
  };
  check("dq", q, grad.dq);
  check("dk", k, grad.dk);
  check("dv", v, grad.dv);
}

// max |a − b| / max |b| over the three gradients.
template <typename A, typename B>
double relative_difference(const AttentionGradient<A>& a, const AttentionGradient<B>& b) {
  double worst = 0;
  const auto one = [&](const RowMatrix<A>& x, const RowMatrix<B>& y) {
    const RowMatrix<double> yd = y.template cast<double>();
    worst = std::max(worst, (x.template cast<double>() - yd).cwiseAbs().maxCoeff() /
                                yd.cwiseAbs().maxCoeff());
  };
  one(a.dq, b.dq);
  one(a.dk, b.dk);
  one(a.dv, b.dv);
  return worst;
}

// The same attention gradient in float and in double (maps from the same draws or parameters).
template <typename MapF, typename MapD>
double float_error(const MapF& map_f, const MapD& map_d, bool causal, double epsilon) {
  const Index n = 300, d = map_d.input_dim(), dv = 3;
  const RowMatrix<double> q = testing::gaussian<double>(41, n, d, 0.8),
                          k = testing::gaussian<double>(42, n, d, 0.8),
                          v = testing::gaussian<double>(43, n, dv),
                          g = testing::gaussian<double>(44, n, dv);
  randattn::RandomFeatureOptions opt;
  opt.causal = causal;
  opt.scale = 1 / std::sqrt(double(d));
  opt.denominator_epsilon = epsilon;
  const auto gd = attention_backward(map_d, q, k, v, g, opt);
  const auto gf = attention_backward(map_f, RowMatrix<float>(q.cast<float>()),
                                     RowMatrix<float>(k.cast<float>()),
                                     RowMatrix<float>(v.cast<float>()),
                                     RowMatrix<float>(g.cast<float>()), opt);
  return relative_difference(gf, gd);
}

const AttentionCase kCases[] = {{37, 8, false}, {37, 8, true}, {300, 0, false}, {300, 0, true}};

// float gradients against double ones, relative to the largest entry: float rounding (6e-8)
// amplified by the features' exponentials and the sums over 300 rows stays far below this.
constexpr double kFloatTolerance = 2e-4;

}  // namespace

TEST_CASE("hybrid backward: each map's VJP to the rows and to ω equals finite differences",
          "[gradients][hybrid]") {
  const Index d = 4, m = 3, n_lambda = 2, n = 7;
  const RowMatrix<double> omega = testing::gaussian<double>(3, n_lambda + 2 * m, d);
  using H = HybridFeatures<double>;
  const std::function<H(const RowMatrix<double>&)> angular = [&](const RowMatrix<double>& w) {
    return randattn::angular_hybrid_on<double>(w, n_lambda);
  };
  const std::function<H(const RowMatrix<double>&)> gaussian = [&](const RowMatrix<double>& w) {
    return randattn::gaussian_hybrid_on<double>(w, n_lambda, 0.9);
  };
  for (const bool log_cotangent : {false, true}) {
    for (const FeatureSide side : {FeatureSide::query, FeatureSide::key}) {
      CAPTURE(log_cotangent, side == FeatureSide::key);
      check_map_vjp<H>("angular hybrid", angular, omega, n, true, log_cotangent, side, 10);
      check_map_vjp<H>("gaussian hybrid", gaussian, omega, n, true, log_cotangent, side, 20);
    }
  }
  // The weights alone: the angular one has no gradient at all, the Gaussian one a smooth one.
  using GW = GaussianWeight<double, User<double>>;
  check_map_vjp<GW>(
      "gaussian weight",
      [](const RowMatrix<double>& w) { return GW(User<double>(w), 1.3); },
      testing::gaussian<double>(4, 5, d), n, true, true, FeatureSide::query, 30);
  using AW = AngularWeight<double, User<double>>;
  const AW aw(User<double>(omega.topRows(n_lambda)));
  const RowMatrix<double> x = testing::gaussian<double>(5, n, d);
  const auto f = aw.features(x, 1);
  RowMatrix<double> dx = RowMatrix<double>::Zero(n, d), dw = RowMatrix<double>::Zero(n_lambda, d);
  aw.features_vjp(x, 1, f.values, f.log_scale, testing::gaussian<double>(6, n, aw.feature_dim()),
                  Vector<double>::Ones(n), dx, &dw);
  CHECK(dx.isZero(0));
  CHECK(dw.isZero(0));
  // The registered construction (orthogonal draws) has the same backward, and rebuilt on its
  // own stacked projection it gives the same features, bit for bit.
  const H drawn = randattn::angular_hybrid<double>(3, 2, d, 9);
  check_map_vjp<H>(
      "angular_hybrid", [&](const RowMatrix<double>&) { return drawn; }, omega, n, false, true,
      FeatureSide::key, 40);
  const RowMatrix<double> stacked = drawn.projection_matrix();
  CHECK(stacked.rows() == drawn.projections());
  const auto rebuilt = randattn::angular_hybrid_on<double>(stacked, 2).features(x, 0.8);
  const auto original = drawn.features(x, 0.8);
  CHECK(rebuilt.values == original.values);
  CHECK(rebuilt.log_scale == original.log_scale);
}

TEST_CASE("hybrid backward: arguments are checked before anything is written",
          "[gradients][hybrid]") {
  const auto h = randattn::gaussian_hybrid<double>(3, 2, 4, 0.9, 1);
  const RowMatrix<double> x = testing::gaussian<double>(1, 5, 4);
  const auto f = h.features(x, 1);
  const RowMatrix<double> g = RowMatrix<double>::Ones(5, h.feature_dim());
  RowMatrix<double> dx = RowMatrix<double>::Zero(5, 4);
  const Vector<double> none;
  CHECK_THROWS_AS(h.features_vjp(x, 1, f.values, f.log_scale, g.leftCols(3), none, dx),
                  std::invalid_argument);
  RowMatrix<double> wrong_omega = RowMatrix<double>::Zero(3, 4);
  CHECK_THROWS_AS(h.features_vjp(x, 1, f.values, f.log_scale, g, none, dx, &wrong_omega),
                  std::invalid_argument);
  CHECK(dx.isZero(0));
  CHECK(h.projections() == 2 + 3 + 3);
}

TEST_CASE("oprf backward: OPRF and SDERF VJPs to the rows and to ω equal finite differences",
          "[gradients][oprf]") {
  const Index d = 4, m = 5, n = 7;
  const RowMatrix<double> omega = testing::gaussian<double>(8, m, d);
  using O = OptimalPositiveFeatures<double, User<double>>;
  using S = DenseExponentialFeatures<double, User<double>>;
  const Eigen::MatrixXd moment = testing::anisotropic_moment();
  for (const bool log_cotangent : {false, true}) {
    CAPTURE(log_cotangent);
    check_map_vjp<O>(
        "oprf", [](const RowMatrix<double>& w) { return O(User<double>(w), 6.0); }, omega, n, true,
        log_cotangent, FeatureSide::query, 50);
    check_map_vjp<S>(
        "sderf", [&](const RowMatrix<double>& w) { return S(User<double>(w), moment); }, omega, n,
        true, log_cotangent, FeatureSide::key, 60);
  }
}

TEST_CASE("hybrid backward: attention gradients equal finite differences, float near double",
          "[gradients][hybrid]") {
  const Index d = 4;
  const auto angular = randattn::angular_hybrid<double>(4, 2, d, 3);
  const auto gaussian = randattn::gaussian_hybrid<double>(4, 2, d, 0.8, 3);
  for (const AttentionCase& c : kCases) {
    check_attention("hybrid", angular, c, 1e-6, 100);
    check_attention("hybrid-gaussian", gaussian, c, 1e-6, 200);
  }
  for (const bool causal : {false, true}) {
    const double angular_error =
        float_error(randattn::angular_hybrid<float>(4, 2, d, 3), angular, causal, 1e-6);
    const double gaussian_error =
        float_error(randattn::gaussian_hybrid<float>(4, 2, d, 0.8, 3), gaussian, causal, 1e-6);
    CAPTURE(causal, angular_error, gaussian_error);
    CHECK(angular_error < kFloatTolerance);
    CHECK(gaussian_error < kFloatTolerance);
  }
}

TEST_CASE("oprf backward: attention gradients with given parameters equal finite differences",
          "[gradients][oprf]") {
  const Index d = 4, m = 6;
  const RowMatrix<double> calibration = testing::gaussian<double>(9, 32, d, 0.8);
  const double c = std::pow(double(d), -0.25);
  const randattn::OrthogonalProjection<double> proj(m, d, 5);
  OptimalPositiveFeatures<double> oprf(proj);
  DenseExponentialFeatures<double> sderf(proj);
  oprf.fit(calibration, calibration, c);
  sderf.fit(calibration, calibration, c);
  for (const AttentionCase& cs : kCases) {
    check_attention("oprf", oprf, cs, 0, 300);
    check_attention("sderf", sderf, cs, 0, 400);
  }
  const randattn::OrthogonalProjection<float> proj_f(m, d, 5);
  OptimalPositiveFeatures<float> oprf_f(proj_f);
  DenseExponentialFeatures<float> sderf_f(proj_f);
  oprf_f.set_rho(oprf.rho());
  sderf_f.set_moment(sderf.moment());
  for (const bool causal : {false, true}) {
    const double oprf_error = float_error(oprf_f, oprf, causal, 0);
    const double sderf_error = float_error(sderf_f, sderf, causal, 0);
    CAPTURE(causal, oprf_error, sderf_error);
    CHECK(oprf_error < kFloatTolerance);
    CHECK(sderf_error < kFloatTolerance);
  }
}

TEST_CASE("oprf backward: fitted to the queries and keys, the gradient is the estimate's at the "
          "fitted parameters",
          "[gradients][oprf]") {
  // fit "queries+keys": the map is fitted once to the sequence, then held: finite differences of
  // the same fitted map agree, while refitting at every perturbation would move ρ and M too.
  const Index d = 4, m = 6, n = 37;
  const double c = std::pow(double(d), -0.25);
  const RowMatrix<double> q = testing::gaussian<double>(500, n, d, 0.8),
                          k = testing::gaussian<double>(501, n, d, 0.8);
  const randattn::OrthogonalProjection<double> proj(m, d, 6);
  OptimalPositiveFeatures<double> oprf(proj);
  DenseExponentialFeatures<double> sderf(proj);
  oprf.fit(q, k, c);
  sderf.fit(q, k, c);
  CHECK(oprf.rho() > 0);
  for (const AttentionCase& cs : {AttentionCase{37, 8, false}}) {
    check_attention("oprf fitted", oprf, cs, 0, 500);
    check_attention("sderf fitted", sderf, cs, 0, 500);
  }
}
