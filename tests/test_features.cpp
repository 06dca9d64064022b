// Random-feature maps, projections and random-feature attention (features/, attention/).
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::FeatureSide;
using randattn::GaussianProjection;
using randattn::HadamardProjection;
using randattn::HyperbolicFeatures;
using randattn::Index;
using randattn::OrthogonalProjection;
using randattn::PositiveFeatures;
using randattn::RandomFeatureOptions;
using randattn::RowMatrix;
using randattn::RowNorm;
using randattn::TrigFeatures;
using randattn::UserProjection;
using randattn::Vector;
using testing::Moments;
using testing::rel_error;

namespace {

using testing::kPi;

// A pair (x, y) with ‖x‖ = rx, ‖y‖ = ry and angle theta, in the first two coordinates.
struct Pair {
  double rx, ry, theta;
};

template <typename Scalar>
RowMatrix<Scalar> pair_rows(const std::vector<Pair>& pairs, Index d) {
  RowMatrix<double> x = RowMatrix<double>::Zero(2 * Index(pairs.size()), d);
  for (std::size_t p = 0; p < pairs.size(); ++p) {
    x(2 * p, 0) = pairs[p].rx;
    x(2 * p + 1, 0) = pairs[p].ry * std::cos(pairs[p].theta);
    x(2 * p + 1, 1) = pairs[p].ry * std::sin(pairs[p].theta);
  }
  return x.template cast<Scalar>();
}

// φ(x)ᵀφ(y) of rows a and b of scaled features, in double.
template <typename Scalar>
double kernel_estimate(const randattn::ScaledFeatures<Scalar>& f, Index a, Index b) {
  return std::exp(double(f.log_scale(a)) + double(f.log_scale(b))) *
         f.values.row(a).template cast<double>().dot(f.values.row(b).template cast<double>());
}

// Closed-form MSE of one kernel estimate with m i.i.d. projection rows (Performer, Lemma 2).
enum class MapKind { trig, positive, hyperbolic };

double closed_form_mse(MapKind kind, const Pair& p, double m) {
  const double xy = p.rx * p.ry * std::cos(p.theta);
  const double nx2 = p.rx * p.rx, ny2 = p.ry * p.ry;
  const double sum2 = nx2 + ny2 + 2 * xy, diff2 = nx2 + ny2 - 2 * xy;
  const double sm = std::exp(xy);
  const double mse_pos = std::exp(sum2) * sm * sm * (1 - std::exp(-sum2)) / m;
  switch (kind) {
    case MapKind::trig:
      return std::exp(nx2 + ny2) * std::pow(1 - std::exp(-diff2), 2) / (2 * m);
    case MapKind::positive:
      return mse_pos;
    case MapKind::hyperbolic:
      return 0.5 * (1 - std::exp(-sum2)) * mse_pos;
  }
  return 0;
}

// Over `draws` independent ω (seeds 1..draws), the estimates of every pair: their mean and
// their squared error against exp(xᵀy).
template <typename Map>
void sample_estimates(Map map, const RowMatrix<typename Map::Scalar>& x, int draws,
                      std::vector<Moments>& mean, std::vector<Moments>& sq_error) {
  const Index pairs = x.rows() / 2;
  mean.assign(std::size_t(pairs), Moments());
  sq_error.assign(std::size_t(pairs), Moments());
  const RowMatrix<double> xd = x.template cast<double>();
  for (int r = 1; r <= draws; ++r) {
    map.redraw(std::uint64_t(r));
    const auto f = map.features(x);
    for (Index p = 0; p < pairs; ++p) {
      const double est = kernel_estimate(f, 2 * p, 2 * p + 1);
      const double truth = std::exp(xd.row(2 * p).dot(xd.row(2 * p + 1)));
      mean[std::size_t(p)].add(est);
      sq_error[std::size_t(p)].add((est - truth) * (est - truth));
    }
  }
}

// Unbiasedness and, for i.i.d. ω, the closed-form MSE. Tolerances: the sample mean of R
// independent estimates has standard error s/√R (s the sample standard deviation), so it must
// lie within 4 standard errors of exp(xᵀy); likewise the empirical MSE (the mean of R
// independent squared errors) must lie within 4 of its standard errors of the closed form.
template <typename Map>
void check_unbiased(Map map, MapKind kind, const std::vector<Pair>& pairs, int draws,
                    bool check_mse) {
  using Scalar = typename Map::Scalar;
  const RowMatrix<Scalar> x = pair_rows<Scalar>(pairs, map.input_dim());
  std::vector<Moments> mean, sq_error;
  sample_estimates(map, x, draws, mean, sq_error);
  for (std::size_t p = 0; p < pairs.size(); ++p) {
    const double truth = std::exp(pairs[p].rx * pairs[p].ry * std::cos(pairs[p].theta));
    INFO("pair " << p << ": |x| = " << pairs[p].rx << ", |y| = " << pairs[p].ry
                 << ", theta = " << pairs[p].theta << ", mean " << mean[p].mean << " vs " << truth
                 << " (se " << mean[p].standard_error() << "), mse " << sq_error[p].mean << " vs "
                 << closed_form_mse(kind, pairs[p], double(map.projections())) << " (se "
                 << sq_error[p].standard_error() << ")");
    // Where an estimator has zero variance (trig at x = y) it is exact up to rounding: the
    // allowance tolerance<Scalar>() · truth covers that and is far below every standard error
    // of the random cases.
    const double rounding = testing::tolerance<Scalar>() * truth;
    CHECK(std::abs(mean[p].mean - truth) <= 4 * mean[p].standard_error() + rounding);
    if (check_mse) {
      const double expected = closed_form_mse(kind, pairs[p], double(map.projections()));
      CHECK(std::abs(sq_error[p].mean - expected) <=
            4 * sq_error[p].standard_error() + rounding * rounding);
    }
  }
}

const std::vector<Pair> kPairs = {{0.5, 0.5, 0.0},     {0.5, 0.5, kPi / 2},
                                  {0.8, 0.6, kPi / 3}, {0.8, 0.8, 2 * kPi / 3},
                                  {1.0, 0.7, kPi},     {0.3, 1.0, kPi / 4}};

// The Performer feature formulas evaluated directly (no stabiliser) in long double for a given ω,
// then attention D⁻¹ A V with A_ij = φ(q_i)ᵀφ(k_j) (masked when causal).
template <typename Scalar>
RowMatrix<double> direct_attention(MapKind kind, const RowMatrix<Scalar>& omega,
                                   const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                                   const RowMatrix<Scalar>& v, double scale, bool causal) {
  using Long = long double;
  const Index m = omega.rows(), d = omega.cols();
  const Long c = std::sqrt(Long(scale));
  auto phi = [&](const RowMatrix<Scalar>& x, Index i) {
    std::vector<Long> f;
    Long sq = 0;
    for (Index t = 0; t < d; ++t) sq += Long(x(i, t)) * Long(x(i, t)) * c * c;
    for (Index r = 0; r < m; ++r) {
      Long u = 0;
      for (Index t = 0; t < d; ++t) u += Long(omega(r, t)) * Long(x(i, t)) * c;
      if (kind == MapKind::positive) f.push_back(std::exp(u - sq / 2) / std::sqrt(Long(m)));
      if (kind == MapKind::hyperbolic) f.push_back(std::exp(u - sq / 2) / std::sqrt(Long(2 * m)));
      if (kind == MapKind::trig) f.push_back(std::exp(sq / 2) * std::sin(u) / std::sqrt(Long(m)));
    }
    for (Index r = 0; r < m; ++r) {
      Long u = 0;
      for (Index t = 0; t < d; ++t) u += Long(omega(r, t)) * Long(x(i, t)) * c;
      if (kind == MapKind::hyperbolic) f.push_back(std::exp(-u - sq / 2) / std::sqrt(Long(2 * m)));
      if (kind == MapKind::trig) f.push_back(std::exp(sq / 2) * std::cos(u) / std::sqrt(Long(m)));
    }
    return f;
  };
  RowMatrix<double> out(q.rows(), v.cols());
  for (Index i = 0; i < q.rows(); ++i) {
    const auto fq = phi(q, i);
    std::vector<Long> num(std::size_t(v.cols()), 0);
    Long den = 0;
    for (Index j = 0; j < (causal ? i + 1 : k.rows()); ++j) {
      const auto fk = phi(k, j);
      Long a = 0;
      for (std::size_t t = 0; t < fq.size(); ++t) a += fq[t] * fk[t];
      den += a;
      for (Index t = 0; t < v.cols(); ++t) num[std::size_t(t)] += a * Long(v(j, t));
    }
    for (Index t = 0; t < v.cols(); ++t) out(i, t) = double(num[std::size_t(t)] / den);
  }
  return out;
}

template <typename Map>
RowMatrix<typename Map::Scalar> attend(const Map& map, const RowMatrix<typename Map::Scalar>& q,
                                       const RowMatrix<typename Map::Scalar>& k,
                                       const RowMatrix<typename Map::Scalar>& v, bool causal,
                                       double scale = 1.0) {
  RandomFeatureOptions opt;
  opt.causal = causal;
  opt.scale = scale;
  return randattn::random_feature_attention(map, q, k, v, opt);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Projections
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("projection: reproducible draws, redraw, scalar-independent", "[features]",
                   RANDATTN_TEST_SCALARS) {
  const GaussianProjection<TestType> g(10, 6, 5);
  CHECK(g.matrix() == GaussianProjection<TestType>(10, 6, 5).matrix());
  CHECK(g.matrix() == GaussianProjection<double>(10, 6, 5).matrix().template cast<TestType>());
  GaussianProjection<TestType> g2 = g;
  g2.redraw(6);
  CHECK(g2.seed() == 6);
  CHECK((g2.matrix() - g.matrix()).norm() > 1);
  g2.redraw(5);
  CHECK(g2.matrix() == g.matrix());

  OrthogonalProjection<TestType> o(13, 6, 5);
  const RowMatrix<TestType> o_first = o.matrix();
  CHECK(o_first == OrthogonalProjection<double>(13, 6, 5).matrix().template cast<TestType>());
  o.redraw(7);
  CHECK((o.matrix() - o_first).norm() > 1);

  HadamardProjection<TestType> h(20, 5, 5);
  const RowMatrix<TestType> h_first = h.matrix();
  h.redraw(7);
  CHECK((h.matrix() - h_first).norm() > 1);
  h.redraw(5);
  CHECK(h.matrix() == h_first);
}

TEMPLATE_TEST_CASE("projection: orthogonal blocks, chi and sqrt(d) row norms", "[features]", RANDATTN_TEST_SCALARS) {
  const Index d = 8, m = 20;  // blocks of 8, 8 and 4 rows
  for (RowNorm norm : {RowNorm::chi, RowNorm::sqrt_d}) {
    const RowMatrix<double> w =
        OrthogonalProjection<TestType>(m, d, 3, norm).matrix().template cast<double>();
    REQUIRE(w.rows() == m);
    REQUIRE(w.cols() == d);
    for (Index b0 = 0; b0 < m; b0 += d) {
      const Index rows = std::min(d, m - b0);
      const RowMatrix<double> block = w.middleRows(b0, rows);
      const Eigen::VectorXd norms = block.rowwise().norm();
      const RowMatrix<double> directions = norms.cwiseInverse().asDiagonal() * block;
      const RowMatrix<double> gram = directions * directions.transpose();
      CHECK((gram - RowMatrix<double>::Identity(rows, rows)).cwiseAbs().maxCoeff() <
            100 * testing::tolerance<TestType>());
      if (norm == RowNorm::sqrt_d) {
        CHECK((norms.array() - std::sqrt(double(d))).abs().maxCoeff() <
              10 * testing::tolerance<TestType>());
      }
    }
    if (norm == RowNorm::chi) {
      // χ(d) norms vary from row to row.
      const Eigen::VectorXd norms = w.rowwise().norm();
      CHECK(norms.maxCoeff() - norms.minCoeff() > 0.1);
    }
  }
}

TEST_CASE("projection: orthogonal blocks are Haar (sign-corrected QR)", "[features]") {
  // Under Haar measure the first row is uniform on the sphere, so E[ω₀₀/‖ω₀‖] = 0 and
  // E[(ω₀₀/‖ω₀‖)²] = 1/d. A QR without the sign correction fixes the sign of the first column
  // of Q, which moves the first mean by about 1/2. Tolerance: 4 standard errors of R draws.
  const Index d = 3;
  const int draws = 4000;
  Moments first, square;
  for (int r = 0; r < draws; ++r) {
    const RowMatrix<double> w = OrthogonalProjection<double>(d, d, std::uint64_t(r)).matrix();
    const double u = w(0, 0) / w.row(0).norm();
    first.add(u);
    square.add(u * u);
  }
  CHECK(std::abs(first.mean) <= 4 * first.standard_error());
  CHECK(std::abs(square.mean - 1.0 / d) <= 4 * square.standard_error());
}

TEMPLATE_TEST_CASE("projection: Hadamard rows apply as the dense matrix; orthogonal for d = 2^k",
                   "[features]", RANDATTN_TEST_SCALARS) {
  for (Index d : {Index(5), Index(8)}) {
    const Index m = 21;
    const HadamardProjection<TestType> h(m, d, 11, RowNorm::sqrt_d);
    const RowMatrix<TestType> w = h.matrix();
    REQUIRE(w.rows() == m);
    REQUIRE(w.cols() == d);
    const RowMatrix<TestType> x = testing::gaussian<TestType>(4, 300, d);
    RowMatrix<TestType> applied(300, m);
    h.apply(x, applied);
    const RowMatrix<TestType> dense = x * w.transpose();
    CHECK(rel_error(applied, dense) < 10 * testing::tolerance<TestType>());
    if (d == 8) {
      // p = d: each block is √d times an orthogonal matrix.
      const RowMatrix<double> block = w.topRows(d).template cast<double>();
      CHECK((block * block.transpose() - double(d) * RowMatrix<double>::Identity(d, d))
                .cwiseAbs()
                .maxCoeff() < 100 * testing::tolerance<TestType>());
    } else {
      // Padded: E‖ω_r‖² = d. Loose sanity bound, not a statistical test.
      const double mean_sq = w.template cast<double>().rowwise().squaredNorm().mean();
      CHECK(mean_sq > 0.5 * d);
      CHECK(mean_sq < 1.5 * d);
    }
  }
}

TEMPLATE_TEST_CASE("projection: user omega and argument errors", "[features]", RANDATTN_TEST_SCALARS) {
  const RowMatrix<TestType> omega = testing::uniform<TestType>(3, 7, 4, -1, 1);
  const UserProjection<TestType> user(omega);
  CHECK(user.matrix() == omega);
  CHECK(user.features() == 7);
  CHECK(user.input_dim() == 4);
  RowMatrix<TestType> bad = omega;
  bad(2, 1) = std::numeric_limits<TestType>::quiet_NaN();
  CHECK_THROWS_WITH(UserProjection<TestType>(bad), Catch::Contains("omega"));
  CHECK_THROWS_AS(GaussianProjection<TestType>(0, 4), std::invalid_argument);
  CHECK_THROWS_AS(OrthogonalProjection<TestType>(4, 0), std::invalid_argument);
  CHECK_THROWS_AS(HadamardProjection<TestType>(-1, 4), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Feature maps: unbiasedness, MSE, orthogonal vs i.i.d.
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("features: unbiased, and i.i.d. MSE matches the closed forms",
                   "[features][statistical]",
                   RANDATTN_TEST_SCALARS) {
  const Index d = 3, m = 8;
  const int draws = 20000;
  const GaussianProjection<TestType> iid(m, d, 1);
  SECTION("trig") {
    check_unbiased(TrigFeatures<TestType, GaussianProjection<TestType>>(iid), MapKind::trig, kPairs,
                   draws, true);
  }
  SECTION("positive") {
    check_unbiased(PositiveFeatures<TestType, GaussianProjection<TestType>>(iid), MapKind::positive,
                   kPairs, draws, true);
  }
  SECTION("hyperbolic") {
    check_unbiased(HyperbolicFeatures<TestType, GaussianProjection<TestType>>(iid),
                   MapKind::hyperbolic, kPairs, draws, true);
  }
  // Orthogonal rows with χ(d) norms are marginally N(0, I_d): still unbiased.
  const OrthogonalProjection<TestType> orth(m, d, 1);
  SECTION("positive, orthogonal") {
    check_unbiased(PositiveFeatures<TestType>(orth), MapKind::positive, kPairs, draws, false);
  }
  SECTION("trig, orthogonal") {
    check_unbiased(TrigFeatures<TestType>(orth), MapKind::trig, kPairs, draws, false);
  }
}

TEMPLATE_TEST_CASE("features: orthogonal projections beat i.i.d. at m = d",
                   "[features][statistical]", RANDATTN_TEST_SCALARS) {
  // Kernel MSE over R draws each; the orthogonal MSE must be lower by more than 4 standard
  // errors of the difference of the two independent empirical MSEs. The gain of orthogonal
  // rows is large for trig and a few per cent for positive features (whose squared errors
  // are heavy-tailed at larger norms), hence small norms and more draws for the latter.
  const Index d = 16, m = 16;
  auto compare = [&](auto iid_map, auto orth_map, const std::vector<Pair>& pairs, int draws) {
    using Scalar = typename decltype(iid_map)::Scalar;
    const RowMatrix<Scalar> x = pair_rows<Scalar>(pairs, d);
    std::vector<Moments> mean_i, se_i, mean_o, se_o;
    sample_estimates(iid_map, x, draws, mean_i, se_i);
    sample_estimates(orth_map, x, draws, mean_o, se_o);
    for (std::size_t p = 0; p < pairs.size(); ++p) {
      const double margin = 4 * std::hypot(se_i[p].standard_error(), se_o[p].standard_error());
      INFO("pair " << p << ": i.i.d. MSE " << se_i[p].mean << ", orthogonal MSE " << se_o[p].mean
                   << ", margin " << margin);
      CHECK(se_i[p].mean - se_o[p].mean > margin);
    }
  };
  SECTION("positive") {
    compare(PositiveFeatures<TestType, GaussianProjection<TestType>>(
                GaussianProjection<TestType>(m, d)),
            PositiveFeatures<TestType>(OrthogonalProjection<TestType>(m, d)),
            {{0.5, 0.5, 0.5}, {0.5, 0.5, 1.0}}, 16000);
  }
  SECTION("trig") {
    compare(
        TrigFeatures<TestType, GaussianProjection<TestType>>(GaussianProjection<TestType>(m, d)),
        TrigFeatures<TestType>(OrthogonalProjection<TestType>(m, d)),
        {{0.8, 0.8, 1.0}, {1.0, 1.0, 2.0}}, 3000);
  }
}

TEMPLATE_TEST_CASE("features: dimensions, sides and the data normaliser", "[features]", RANDATTN_TEST_SCALARS) {
  const OrthogonalProjection<TestType> proj(12, 5, 2);
  const PositiveFeatures<TestType> pos(proj);
  const HyperbolicFeatures<TestType> hyp(proj);
  const TrigFeatures<TestType> trig(proj);
  CHECK(pos.feature_dim() == 12);
  CHECK(hyp.feature_dim() == 24);
  CHECK(trig.feature_dim() == 24);
  CHECK(pos.signs().size() == 0);
  const RowMatrix<TestType> x = testing::gaussian<TestType>(9, 6, 5);
  // Normaliser c on x equals the map of c·x; the query and key sides agree for these maps.
  const TestType c = TestType(0.6);
  const RowMatrix<TestType> cx = c * x;
  const auto a = hyp.features(x, c), b = hyp.features(cx), s = hyp.features(x, c, FeatureSide::key);
  const Eigen::VectorXd ea = (a.log_scale.template cast<double>().array().exp()).matrix();
  const Eigen::VectorXd eb = (b.log_scale.template cast<double>().array().exp()).matrix();
  CHECK(rel_error(ea.asDiagonal() * a.values.template cast<double>(),
                  eb.asDiagonal() * b.values.template cast<double>()) <
        10 * testing::tolerance<TestType>());
  CHECK(s.values == a.values);
  CHECK(s.log_scale == a.log_scale);
  // Positive values lie in (0, 1] with maximum exactly 1: the magnitude is in the log-scale.
  const auto p = pos.features(testing::gaussian<TestType>(3, 50, 5, 8.0));
  CHECK(p.values.minCoeff() >= 0);
  CHECK((p.values.rowwise().maxCoeff().array() == TestType(1)).all());
  CHECK_THROWS_WITH(pos.features(testing::gaussian<TestType>(3, 5, 4)),
                    Catch::Contains("expects 5 columns"));
  CHECK_THROWS_WITH(pos.features(x, TestType(0)), Catch::Contains("normaliser"));
}

// ---------------------------------------------------------------------------------------------
// Random-feature attention
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("attention: a user omega gives exactly the Performer formulas", "[features]",
                   RANDATTN_TEST_SCALARS) {
  const Index n = 9, d = 5, m = 6, dv = 3;
  const RowMatrix<TestType> omega = testing::gaussian<TestType>(21, m, d);
  const RowMatrix<TestType> q = testing::gaussian<TestType>(22, n, d, 0.7),
                            k = testing::gaussian<TestType>(23, n, d, 0.7),
                            v = testing::gaussian<TestType>(24, n, dv);
  const UserProjection<TestType> user(omega);
  const double scale = 0.8;
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    // A few hundred float operations per entry, each within 2^-24 relative: rel. errors well
    // below 1e-5 (float) and 1e-12 (double) unless the formulas differ.
    CHECK(rel_error(attend(PositiveFeatures<TestType, UserProjection<TestType>>(user), q, k, v,
                           causal, scale),
                    direct_attention(MapKind::positive, omega, q, k, v, scale, causal)) <
          testing::tolerance<TestType>());
    CHECK(rel_error(attend(HyperbolicFeatures<TestType, UserProjection<TestType>>(user), q, k, v,
                           causal, scale),
                    direct_attention(MapKind::hyperbolic, omega, q, k, v, scale, causal)) <
          testing::tolerance<TestType>());
    CHECK(rel_error(attend(TrigFeatures<TestType, UserProjection<TestType>>(user), q, k, v, causal,
                           scale),
                    direct_attention(MapKind::trig, omega, q, k, v, scale, causal)) <
          testing::tolerance<TestType>());
  }
}

TEMPLATE_TEST_CASE("attention: causal outputs never see a changed future key", "[features]", RANDATTN_TEST_SCALARS) {
  // Norms up to 10 at scale 1: stabilising keys with their global maximum (as reference
  // Performer code does) would rescale every key when a future key grows.
  const Index n = 300, d = 16, m = 64, dv = 4;
  const Eigen::VectorXd nq = testing::uniform<double>(31, n, 1, 0.0, 10.0).col(0);
  const Eigen::VectorXd nk = testing::uniform<double>(32, n, 1, 0.0, 10.0).col(0);
  const RowMatrix<TestType> q = testing::rows_with_norms<TestType>(33, nq, d),
                            k = testing::rows_with_norms<TestType>(34, nk, d),
                            v = testing::gaussian<TestType>(35, n, dv);
  const OrthogonalProjection<TestType> proj(m, d, 36);
  // The changed key points along ω₀ with norm 10: it has the largest projection of all keys.
  const RowMatrix<TestType> spike =
      (TestType(10) / proj.matrix().row(0).norm()) * proj.matrix().row(0);
  for (Index j0 : {Index(130), Index(250)}) {  // inside a chunk and at a later one
    RowMatrix<TestType> k2 = k;
    k2.row(j0) = spike;
    auto check = [&](const auto& map) {
      const RowMatrix<TestType> a = attend(map, q, k, v, true), b = attend(map, q, k2, v, true);
      CHECK(testing::rows_bit_identical(a, b, j0));
      CHECK_FALSE(testing::rows_bit_identical(a, b, n));
      CHECK(a.allFinite());
      CHECK(b.allFinite());
    };
    check(PositiveFeatures<TestType>(proj));
    check(HyperbolicFeatures<TestType>(proj));
    check(TrigFeatures<TestType>(proj));

    // The same positive features stabilised with the maximum of ω_iᵀk_j over all keys (the
    // reference Performer stabiliser) do leak: this is the failure the per-row stabiliser
    // avoids, and shows that the comparison above can fail.
    auto global = [&](const RowMatrix<TestType>& keys) {
      const PositiveFeatures<TestType> pos(proj);
      auto fq = pos.features(q), fk = pos.features(keys);
      const TestType top = (keys * proj.matrix().transpose()).maxCoeff();
      const RowMatrix<TestType> vals =
          (fk.log_scale.array() - top).exp().matrix().asDiagonal() * fk.values;
      randattn::LinearOptions opt;
      opt.causal = true;
      return randattn::linear_attention_accumulate<TestType>(
                 fq.values, fq.log_scale, vals, Vector<TestType>(), v, Vector<TestType>(), opt)
          .finalize();
    };
    CHECK_FALSE(testing::rows_bit_identical(global(k), global(k2), j0));
  }
}

TEMPLATE_TEST_CASE("attention: no NaN or Inf for norms up to 20", "[features]", RANDATTN_TEST_SCALARS) {
  const Index n = 200, d = 16, m = 64, dv = 3;
  const Eigen::VectorXd nq = testing::uniform<double>(41, n, 1, 0.0, 20.0).col(0);
  const Eigen::VectorXd nk = testing::uniform<double>(42, n, 1, 0.0, 20.0).col(0);
  const RowMatrix<TestType> q = testing::rows_with_norms<TestType>(43, nq, d),
                            k = testing::rows_with_norms<TestType>(44, nk, d),
                            v = testing::gaussian<TestType>(45, n, dv);
  const OrthogonalProjection<TestType> proj(m, d, 46);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    // Positive maps give convex combinations of the values (or a zero row if a denominator
    // underflows to 0): every output lies within the range of v's column.
    for (const RowMatrix<TestType>& o :
         {attend(PositiveFeatures<TestType>(proj), q, k, v, causal),
          attend(HyperbolicFeatures<TestType>(proj), q, k, v, causal)}) {
      REQUIRE(o.allFinite());
      CHECK(testing::within_value_ranges(o, v));
    }
    // Trig: finite thanks to the log-scale and the denominator guard (not accurate here).
    CHECK(attend(TrigFeatures<TestType>(proj), q, k, v, causal).allFinite());
  }
}

TEMPLATE_TEST_CASE("attention: edge cases and argument errors", "[features]", RANDATTN_TEST_SCALARS) {
  const PositiveFeatures<TestType> map(OrthogonalProjection<TestType>(4, 3, 1));
  const TrigFeatures<TestType> trig(OrthogonalProjection<TestType>(4, 3, 1));
  const RowMatrix<TestType> q = testing::gaussian<TestType>(1, 5, 3),
                            k = testing::gaussian<TestType>(2, 6, 3),
                            v = testing::gaussian<TestType>(3, 6, 2);
  // n = 0 gives an empty result; n = 1 and d = 1 work.
  CHECK(randattn::random_feature_attention(map, RowMatrix<TestType>(0, 3), k, v).rows() == 0);
  const PositiveFeatures one_d(
      GaussianProjection<TestType>(3, 1, 1));  // deduced from the projection
  const RowMatrix<TestType> x1 = testing::gaussian<TestType>(4, 1, 1);
  const RowMatrix<TestType> o1 = randattn::random_feature_attention(one_d, x1, x1, v.topRows(1));
  CHECK(rel_error(o1, v.topRows(1)) < testing::tolerance<TestType>());  // one key: weight 1
  RandomFeatureOptions opt;
  CHECK_THROWS_WITH(
      randattn::random_feature_attention(map, testing::gaussian<TestType>(1, 5, 4), k, v),
      Catch::Contains("input dimension 3"));
  CHECK_THROWS_WITH(randattn::random_feature_attention(map, q, k, v.topRows(5)),
                    Catch::Contains("same number of rows"));
  opt.causal = true;
  CHECK_THROWS_WITH(randattn::random_feature_attention(map, q, k, v, opt),
                    Catch::Contains("causal"));
  opt = RandomFeatureOptions();
  opt.scale = -1.0;
  CHECK_THROWS_WITH(randattn::random_feature_attention(map, q, k, v, opt),
                    Catch::Contains("scale"));
  opt = RandomFeatureOptions();
  opt.denominator_epsilon = 0.0;
  CHECK_NOTHROW(randattn::random_feature_attention(map, q, k, v, opt));
  CHECK_THROWS_WITH(randattn::random_feature_attention(trig, q, k, v, opt),
                    Catch::Contains("denominator_epsilon must be > 0"));
  RowMatrix<TestType> bad = q;
  bad(1, 1) = std::numeric_limits<TestType>::infinity();
  CHECK_THROWS_WITH(randattn::random_feature_attention(map, bad, k, v), Catch::Contains("q (5x3)"));
}

TEMPLATE_TEST_CASE("random_feature_attention_into equals the allocating form bit for bit",
                   "[features][into]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using Refs = std::vector<Eigen::Ref<const RowMatrix<Scalar>>>;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(71, 23, 6),
                          k = testing::gaussian<Scalar>(72, 23, 6),
                          v = testing::gaussian<Scalar>(73, 23, 3);
  const PositiveFeatures<Scalar> positive(OrthogonalProjection<Scalar>(16, 6, 74));
  const TrigFeatures<Scalar> trig(OrthogonalProjection<Scalar>(16, 6, 75));
  for (const bool causal : {false, true}) {
    INFO("causal " << causal);
    RandomFeatureOptions opt;
    opt.causal = causal;
    testing::check_into_form<Scalar>(
        randattn::random_feature_attention(positive, q, k, v, opt), {q, k, v}, {"q", "k", "v"},
        [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
          randattn::random_feature_attention_into(positive, in[0], in[1], in[2], out, opt);
        });
    testing::check_into_form<Scalar>(
        randattn::random_feature_attention(trig, q, k, v, opt), {q, k, v}, {"q", "k", "v"},
        [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
          randattn::random_feature_attention_into(trig, in[0], in[1], in[2], out, opt);
        });
  }
}

// ---------------------------------------------------------------------------------------------
// Hedgehog (learned softmax feature map)
// ---------------------------------------------------------------------------------------------

namespace {

// [softmax(W c x + b); softmax(−(W c x + b))] of row i, from the definition in double (no
// stabiliser: the test inputs keep |u| small).
template <typename Scalar>
Eigen::RowVectorXd hedgehog_direct(const RowMatrix<Scalar>& w, const Vector<Scalar>& b,
                                   const RowMatrix<Scalar>& x, Index i, double c) {
  const Eigen::VectorXd u =
      w.template cast<double>() * (c * x.row(i).template cast<double>().transpose()) +
      b.template cast<double>();
  const Eigen::ArrayXd pos = u.array().exp(), neg = (-u.array()).exp();
  Eigen::RowVectorXd f(2 * u.size());
  f << (pos / pos.sum()).matrix().transpose(), (neg / neg.sum()).matrix().transpose();
  return f;
}

}  // namespace

TEMPLATE_TEST_CASE("hedgehog: features and attention equal the definition", "[hedgehog][features]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 37, d = 5, m = 7, dv = 3;
  const RowMatrix<Scalar> w = testing::gaussian<Scalar>(81, m, d, 0.5);
  const Vector<Scalar> b = testing::gaussian<Scalar>(82, m, 1).col(0);
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(83, n, d),
                          k = testing::gaussian<Scalar>(84, n, d),
                          v = testing::gaussian<Scalar>(85, n, dv);
  const randattn::HedgehogFeatures<Scalar> map(w, b);
  REQUIRE(map.feature_dim() == 2 * m);
  REQUIRE(map.projections() == m);
  const double scale = 0.6, c = std::sqrt(scale);
  const auto f = map.features(q, Scalar(c));
  CHECK(f.log_scale.isZero(0));
  RowMatrix<double> direct_q(n, 2 * m), direct_k(n, 2 * m);
  for (Index i = 0; i < n; ++i) {
    direct_q.row(i) = hedgehog_direct(w, b, q, i, c);
    direct_k.row(i) = hedgehog_direct(w, b, k, i, c);
  }
  // A softmax of m terms: a few roundings per entry.
  CHECK((f.values.template cast<double>() - direct_q).cwiseAbs().maxCoeff() <
        testing::tolerance<Scalar>());
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    RowMatrix<double> a = direct_q * direct_k.transpose();
    if (causal) a = a.template triangularView<Eigen::Lower>();
    const RowMatrix<double> expected =
        (a * v.template cast<double>()).array().colwise() / a.rowwise().sum().array();
    CHECK(rel_error(attend(map, q, k, v, causal, scale), expected) < testing::tolerance<Scalar>());
  }
  // The seeded map: W is OrthogonalProjection's draw (the same numbers in float and double),
  // b = 0.
  const randattn::HedgehogFeatures<Scalar> seeded(m, d, 9);
  CHECK(seeded.weight() == OrthogonalProjection<double>(m, d, 9).matrix().template cast<Scalar>());
  CHECK(seeded.bias().isZero(0));
  CHECK_THROWS_WITH(randattn::HedgehogFeatures<Scalar>(w, Vector<Scalar>::Zero(m + 1)),
                    Catch::Contains("expected a vector of 7 entries"));
  RowMatrix<Scalar> bad_w = w;
  bad_w(1, 2) = std::numeric_limits<Scalar>::quiet_NaN();
  CHECK_THROWS(randattn::HedgehogFeatures<Scalar>(bad_w, b));
}

TEMPLATE_TEST_CASE(
    "hedgehog: causal outputs never see a changed future key; huge inputs stay finite",
    "[hedgehog][features]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 300, d = 16, m = 32, dv = 4;
  const randattn::HedgehogFeatures<Scalar> map(m, d, 5);
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(91, n, d),
                          k = testing::gaussian<Scalar>(92, n, d),
                          v = testing::gaussian<Scalar>(93, n, dv);
  for (Index j0 : {Index(130), Index(250)}) {
    RowMatrix<Scalar> k2 = k, v2 = v;
    k2.bottomRows(n - j0) = testing::gaussian<Scalar>(94, n - j0, d, 30.0);
    v2.bottomRows(n - j0).array() += Scalar(5);
    const RowMatrix<Scalar> a = attend(map, q, k, v, true), b = attend(map, q, k2, v2, true);
    CHECK(testing::rows_bit_identical(a, b, j0));
    CHECK_FALSE(testing::rows_bit_identical(a, b, j0 + 1));
  }
  // |x| ~ 1e4 at scale 1: |u| ~ 1e5, far beyond exp's range; each softmax keeps its mass on its
  // largest entries, so outputs are convex combinations of the values.
  const RowMatrix<Scalar> hq = testing::gaussian<Scalar>(95, n, d, 1e4),
                          hk = testing::gaussian<Scalar>(96, n, d, 1e4);
  const auto f = map.features(hq, Scalar(1));
  REQUIRE(f.values.allFinite());
  CHECK((f.values.rowwise().sum().array() - Scalar(2)).abs().maxCoeff() < 1e-5);
  for (bool causal : {false, true}) {
    const RowMatrix<Scalar> o = attend(map, hq, hk, v, causal);
    REQUIRE(o.allFinite());
    CHECK(testing::within_value_ranges(o, v));
  }
}
