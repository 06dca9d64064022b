// Hybrid random features (features/hybrid.hpp) and hybrid attention.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "support.hpp"

using randattn::AngularWeight;
using randattn::GaussianProjection;
using randattn::GaussianWeight;
using randattn::HybridFeatures;
using randattn::HyperbolicFeatures;
using randattn::Index;
using randattn::OrthogonalProjection;
using randattn::PositiveFeatures;
using randattn::RandomFeatureOptions;
using randattn::RowMatrix;
using randattn::ScaledFeatures;
using randattn::TrigFeatures;
using randattn::Vector;
using testing::Moments;
using testing::rel_error;

namespace {

using testing::kPi;

// (φ(x)ᵀ diag(σ) φ(y)) · e^{ℓ(x) + ℓ(y)} for rows a, b of features f, in double.
template <typename Scalar>
double signed_product(const ScaledFeatures<Scalar>& f, const Vector<Scalar>& signs, Index a,
                      Index b) {
  const Eigen::VectorXd s = signs.size() ? Eigen::VectorXd(signs.template cast<double>())
                                         : Eigen::VectorXd::Ones(f.dim());
  const double dot = (f.values.row(a).template cast<double>().array() * s.transpose().array() *
                      f.values.row(b).template cast<double>().array())
                         .sum();
  return std::exp(double(f.log_scale(a)) + double(f.log_scale(b))) * dot;
}

// The hybrid estimate term by term from its components, for rows a, b of x.
template <typename Scalar>
double term_by_term(const HybridFeatures<Scalar>& h, const RowMatrix<Scalar>& x, Index a, Index b) {
  std::vector<double> lambda, base;
  for (const auto& w : h.weights()) {
    ScaledFeatures<Scalar> f{RowMatrix<Scalar>(x.rows(), w.feature_dim()),
                             Vector<Scalar>(x.rows())};
    w.features_into(x, 1, f.values, f.log_scale);
    lambda.push_back(signed_product(f, w.signs(), a, b));
  }
  for (const auto& c : h.bases()) {
    ScaledFeatures<Scalar> f{RowMatrix<Scalar>(x.rows(), c.feature_dim()),
                             Vector<Scalar>(x.rows())};
    c.features_into(x, 1, f.values, f.log_scale);
    base.push_back(signed_product(f, c.signs(), a, b));
  }
  double est = base.back(), lambda_sum = 0;
  for (std::size_t k = 0; k < lambda.size(); ++k) {
    est += lambda[k] * base[k];
    lambda_sum += lambda[k];
  }
  return est - lambda_sum * base.back();
}

// Unit vectors at angle theta (first two coordinates) as rows 0 and 1.
template <typename Scalar>
RowMatrix<Scalar> unit_pair(double theta, Index d) {
  RowMatrix<Scalar> x = RowMatrix<Scalar>::Zero(2, d);
  x(0, 0) = 1;
  x(1, 0) = Scalar(std::cos(theta));
  x(1, 1) = Scalar(std::sin(theta));
  return x;
}

// Mean and squared error of the kernel estimates of a map over `draws` redraws.
template <typename Map>
void sample(Map map, const RowMatrix<typename Map::Scalar>& x, int draws, Moments& mean,
            Moments& sq) {
  const double truth =
      std::exp(x.row(0).template cast<double>().dot(x.row(1).template cast<double>()));
  for (int r = 1; r <= draws; ++r) {
    map.redraw(std::uint64_t(r));
    const auto f = map.features(x);
    const double est = signed_product(f, Vector<typename Map::Scalar>(map.signs()), 0, 1);
    mean.add(est);
    sq.add((est - truth) * (est - truth));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("hybrid: signed inner product equals the estimate term by term (p = 1, 2)",
                   "[hybrid]", RANDATTN_TEST_SCALARS) {
  const Index d = 6;
  const RowMatrix<TestType> x = testing::gaussian<TestType>(7, 8, d, 0.5);
  const auto p1 = randattn::angular_hybrid<TestType>(8, 5, d, 3);
  const auto g1 = randattn::gaussian_hybrid<TestType>(8, 5, d, 0.7, 3);
  const HybridFeatures<TestType> p2(
      {AngularWeight<TestType>(GaussianProjection<TestType>(4, d, 1)),
       GaussianWeight<TestType>(GaussianProjection<TestType>(3, d, 2), 0.8)},
      {HyperbolicFeatures<TestType>(OrthogonalProjection<TestType>(5, d, 3)),
       PositiveFeatures<TestType>(OrthogonalProjection<TestType>(7, d, 4)),
       TrigFeatures<TestType>(OrthogonalProjection<TestType>(6, d, 5))});
  CHECK(p1.feature_dim() == 2 * (5 + 1) * 16 + 16);
  CHECK(g1.feature_dim() == 10 * (16 + 8) + 8);
  CHECK(p2.p() == 2);
  CHECK(p2.feature_dim() == 5 * 10 + 6 * 7 + (5 + 6) * 12 + 12);
  for (const HybridFeatures<TestType>* h : {&p1, &g1, &p2}) {
    const auto f = h->features(x);
    for (Index a = 0; a < 4; ++a) {
      for (Index b = 4; b < 8; ++b) {
        const double expected = term_by_term(*h, x, a, b);
        // Rounding: a few hundred products of numbers of size O(1) relative to the row scale.
        CHECK(signed_product(f, h->signs(), a, b) ==
              Approx(expected)
                  .epsilon(100 * testing::tolerance<TestType>())
                  .margin(100 * testing::tolerance<TestType>()));
      }
    }
  }
}

TEMPLATE_TEST_CASE("hybrid: unbiased over angles, MSE = (λ²+v)MSE_hyp + ((1−λ)²+v)MSE_trig",
                   "[hybrid][statistical]", RANDATTN_TEST_SCALARS) {
  // i.i.d. bases so that the closed forms of Performer Lemma 2 hold; ‖x‖ = ‖y‖ = 1. Tolerances: 4
  // standard errors of the R-draw sample mean (resp. mean squared error), plus a rounding
  // allowance tolerance<Scalar>() · exp(xᵀy) for the exact cases θ = 0 and θ = π.
  const Index d = 3, m = 8, n_lambda = 8;
  const int draws = 20000;
  std::vector<double> hybrid_rel, hyp_rel, trig_rel;
  for (double theta : {0.0, kPi / 4, kPi / 2, 3 * kPi / 4, kPi}) {
    const RowMatrix<TestType> x = unit_pair<TestType>(theta, d);
    const double sm = std::exp(std::cos(theta));
    const double lambda = theta / kPi, v = lambda * (1 - lambda) / n_lambda;
    const double sum2 = 2 + 2 * std::cos(theta), diff2 = 2 - 2 * std::cos(theta);
    const double mse_pos = std::exp(sum2) * sm * sm * (1 - std::exp(-sum2)) / m;
    const double mse_hyp = 0.5 * (1 - std::exp(-sum2)) * mse_pos;
    const double mse_trig = std::exp(2.0) * std::pow(1 - std::exp(-diff2), 2) / (2 * m);
    const double expected =
        (lambda * lambda + v) * mse_hyp + ((1 - lambda) * (1 - lambda) + v) * mse_trig;
    Moments mean, sq;
    sample(randattn::angular_hybrid<TestType, GaussianProjection<TestType>>(m, n_lambda, d), x,
           draws, mean, sq);
    const double rounding = testing::tolerance<TestType>() * sm;
    INFO("theta " << theta << ": mean " << mean.mean << " vs " << sm << " (se "
                  << mean.standard_error() << "), mse " << sq.mean << " vs " << expected << " (se "
                  << sq.standard_error() << ")");
    CHECK(std::abs(mean.mean - sm) <= 4 * mean.standard_error() + rounding);
    CHECK(std::abs(sq.mean - expected) <= 4 * sq.standard_error() + rounding * rounding);
    if (theta == 0.0 || theta == kPi) CHECK(sq.mean <= rounding * rounding);  // exact to rounding
    // The bases alone, with the same m, on the same pair.
    Moments hm, hs, tm, ts;
    sample(HyperbolicFeatures<TestType, GaussianProjection<TestType>>(
               GaussianProjection<TestType>(m, d)),
           x, draws, hm, hs);
    sample(TrigFeatures<TestType, GaussianProjection<TestType>>(GaussianProjection<TestType>(m, d)),
           x, draws, tm, ts);
    hybrid_rel.push_back(std::sqrt(sq.mean) / sm);
    hyp_rel.push_back(std::sqrt(hs.mean) / sm);
    trig_rel.push_back(std::sqrt(ts.mean) / sm);
  }
  const double worst_hybrid = *std::max_element(hybrid_rel.begin(), hybrid_rel.end());
  const double worst_hyp = *std::max_element(hyp_rel.begin(), hyp_rel.end());
  const double worst_trig = *std::max_element(trig_rel.begin(), trig_rel.end());
  INFO("worst relative RMSE: hybrid " << worst_hybrid << ", hyperbolic " << worst_hyp << ", trig "
                                      << worst_trig);
  CHECK(worst_hybrid < worst_hyp);
  CHECK(worst_hybrid < worst_trig);
}

TEMPLATE_TEST_CASE("hybrid attention: finite, causal without leaks, batched, clipped", "[hybrid]",
                   RANDATTN_TEST_SCALARS) {
  const Index n = 160, d = 8, dv = 3;
  const auto h = randattn::angular_hybrid<TestType>(16, 4, d, 9);
  const RowMatrix<TestType> v = testing::gaussian<TestType>(63, n, dv);
  for (double sd : {0.3, 5.0}) {  // ‖x‖ ≈ 1 and ‖x‖ ≈ 14 (norms up to 20)
    const RowMatrix<TestType> q = testing::gaussian<TestType>(61, n, d, sd),
                              k = testing::gaussian<TestType>(62, n, d, sd);
    for (bool causal : {false, true}) {
      INFO("sd " << sd << ", causal " << causal);
      RandomFeatureOptions opt;
      opt.causal = causal;
      const RowMatrix<TestType> o = randattn::random_feature_attention(h, q, k, v, opt);
      CHECK(o.allFinite());
      // Clipped estimates are nonnegative: outputs are convex combinations of the values.
      const RowMatrix<TestType> c = randattn::random_feature_attention_clipped(h, q, k, v, opt);
      REQUIRE(c.allFinite());
      CHECK(testing::within_value_ranges(c, v));
      if (causal) {
        RowMatrix<TestType> k2 = k;
        k2.row(100) *= TestType(3);
        CHECK(testing::rows_bit_identical(o, randattn::random_feature_attention(h, q, k2, v, opt),
                                          100));
      }
    }
  }
  // Without negative estimates clipping changes nothing: positive features, clipped or not.
  const PositiveFeatures<TestType> pos(OrthogonalProjection<TestType>(16, d, 1));
  const RowMatrix<TestType> q = testing::gaussian<TestType>(64, n, d, 0.5),
                            k = testing::gaussian<TestType>(65, n, d, 0.5);
  for (bool causal : {false, true}) {
    RandomFeatureOptions opt;
    opt.causal = causal;
    CHECK(rel_error(randattn::random_feature_attention_clipped(pos, q, k, v, opt),
                    randattn::random_feature_attention(pos, q, k, v, opt)) <
          10 * testing::tolerance<TestType>());
  }
  // Batched over (2, 1) slices equals the single calls.
  RowMatrix<TestType> qq = testing::gaussian<TestType>(66, 2 * n, d, 0.5),
                      kk = testing::gaussian<TestType>(67, 2 * n, d, 0.5),
                      vv = testing::gaussian<TestType>(68, 2 * n, dv), out(2 * n, dv);
  randattn::random_feature_attention_batched(h, qq.data(), kk.data(), vv.data(), out.data(),
                                             randattn::BatchShape{2, 1, n, n, d, dv});
  for (Index s = 0; s < 2; ++s)
    CHECK(RowMatrix<TestType>(out.middleRows(s * n, n)) ==
          randattn::random_feature_attention(h, qq.middleRows(s * n, n), kk.middleRows(s * n, n),
                                             vv.middleRows(s * n, n)));
}

TEST_CASE("hybrid: argument errors", "[hybrid]") {
  using H = HybridFeatures<double>;
  const PositiveFeatures<double> a(OrthogonalProjection<double>(4, 3)),
      b(OrthogonalProjection<double>(4, 5));
  const AngularWeight<double> w(GaussianProjection<double>(4, 3));
  CHECK_THROWS_WITH(H({w}, {a}), Catch::Contains("p + 1 bases"));
  CHECK_THROWS_WITH(H({w}, {a, b}), Catch::Contains("dimension 3"));
  CHECK_THROWS_WITH(GaussianWeight<double>(GaussianProjection<double>(4, 3), 0.0),
                    Catch::Contains("bandwidth"));
  RandomFeatureOptions opt;
  opt.denominator_epsilon = 0.0;
  const RowMatrix<double> x = testing::gaussian<double>(1, 4, 3);
  CHECK_THROWS_WITH(
      randattn::random_feature_attention(randattn::angular_hybrid<double>(4, 2, 3), x, x, x, opt),
      Catch::Contains("denominator_epsilon must be > 0"));
}
