// The top eigenvectors of a symmetric matrix by tridiagonalisation, bisection and inverse
// iteration (linalg/symmetric_top_eigen.hpp), against Eigen's full solver run in double.
//
// Tolerances follow LAPACK's eigensolver tests: errors are measured in units of d eps ||A||
// (eps of the input's Scalar), the size of the backward error of a Householder
// tridiagonalisation, and eigenvectors in the units of the sin-Theta theorem, residual / gap.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "scalars.hpp"

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <Eigen/QR>
#include <Eigen/SVD>

#include <randattn/linalg/symmetric_top_eigen.hpp>
#include <randattn/random/fill.hpp>

using randattn::Index;
using randattn::RowMatrix;
using randattn::Vector;

namespace {

// (G + G^T) / 2 for a Gaussian G: a semicircle of eigenvalues, closely spaced.
template <typename Scalar>
RowMatrix<Scalar> random_symmetric(std::uint64_t seed, Index d) {
  const RowMatrix<double> g = randattn::gaussian_matrix<double>(randattn::Philox(seed), d, d);
  return ((g + g.transpose()) / 2).cast<Scalar>();
}

// Q diag(spectrum) Q^T for a random orthogonal Q, exactly symmetric.
template <typename Scalar>
RowMatrix<Scalar> with_spectrum(std::uint64_t seed, const Eigen::VectorXd& spectrum) {
  const Index d = spectrum.size();
  const Eigen::MatrixXd q = Eigen::HouseholderQR<Eigen::MatrixXd>(
                                randattn::gaussian_matrix<double>(randattn::Philox(seed), d, d))
                                .householderQ();
  const Eigen::MatrixXd a = q * spectrum.asDiagonal() * q.transpose();
  return ((a + a.transpose()) / 2).cast<Scalar>();
}

// The HOSVD's Gram matrices: G = M M^T for M (d x n) of rank 5 plus noise, so five large
// eigenvalues and a bulk.
template <typename Scalar>
RowMatrix<Scalar> low_rank_gram(std::uint64_t seed, Index d, Index n, double noise) {
  const randattn::Philox rng(seed);
  const Eigen::MatrixXd m = randattn::gaussian_matrix<double>(rng.with_stream(0), d, 5) *
                                randattn::gaussian_matrix<double>(rng.with_stream(1), 5, n) +
                            randattn::gaussian_matrix<double>(rng.with_stream(2), d, n, noise);
  return (m * m.transpose()).cast<Scalar>();
}

// sin of the largest principal angle between the column spans of U and V (orthonormal columns).
double sin_theta(const Eigen::MatrixXd& u, const Eigen::MatrixXd& v) {
  if (v.cols() == 0) return 0;
  const Eigen::MatrixXd residual = v - u * (u.transpose() * v);
  return Eigen::JacobiSVD<Eigen::MatrixXd>(residual).singularValues()(0);
}

// All eigenpairs of `a` in double, in decreasing order of eigenvalue.
struct Reference {
  Eigen::VectorXd values;
  Eigen::MatrixXd vectors;

  template <typename Scalar>
  explicit Reference(const RowMatrix<Scalar>& a) {
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(a.template cast<double>());
    REQUIRE(eig.info() == Eigen::Success);
    values = eig.eigenvalues().reverse();
    vectors = eig.eigenvectors().rowwise().reverse();
  }
  double norm() const { return values.size() ? values.cwiseAbs().maxCoeff() : 0.0; }
};

// Checks an output of top_eigenvectors for `a` and r against the reference, in units of
// d eps ||A||: eigenvalues, residuals, orthonormality, order, sign rule, and the distance of
// the eigenvectors (and of the top-r subspace) to the reference's, bounded by the sin-Theta
// theorem by residual / gap wherever the gap is resolvable.
template <typename Scalar>
void check_top_eigen(const RowMatrix<Scalar>& a, Index r, const RowMatrix<Scalar>& vectors,
                     const Vector<Scalar>& values) {
  // LAPACK's eigensolver tests accept ratios of this kind up to 20; with GCC these stay below 1,
  // with clang the full solver's orthonormality at d = 7 measured above 1 (a few d eps).
  constexpr double kThreshold = 20;
  const Index d = a.rows();
  const Reference ref(a);
  const double eps = std::numeric_limits<Scalar>::epsilon();
  const double unit = double(d) * eps;  // of orthonormality; of the rest times ||A||
  const double tolerance = kThreshold * unit * ref.norm();
  REQUIRE(vectors.rows() == d);
  REQUIRE(vectors.cols() == r);
  REQUIRE(values.size() == r);
  const Eigen::MatrixXd ad = a.template cast<double>(), v = vectors.template cast<double>();
  const Eigen::VectorXd w = values.template cast<double>();

  for (Index t = 0; t < r; ++t) {
    CAPTURE(d, r, t, w(t), ref.values(t), ref.norm());
    CHECK(std::abs(w(t) - ref.values(t)) <= tolerance);
    CHECK((ad * v.col(t) - w(t) * v.col(t)).stableNorm() <= tolerance);
    if (t > 0) CHECK(w(t) <= w(t - 1));
    Index big = 0;
    v.col(t).cwiseAbs().maxCoeff(&big);
    CHECK(v(big, t) > 0);
    // One eigenvector, where its eigenvalue is apart from the others.
    double gap = std::numeric_limits<double>::infinity();
    if (t > 0) gap = std::min(gap, ref.values(t - 1) - ref.values(t));
    if (t + 1 < d) gap = std::min(gap, ref.values(t) - ref.values(t + 1));
    if (gap > 2 * tolerance) {
      const Eigen::VectorXd u = ref.vectors.col(t);
      CHECK((v.col(t) - u.dot(v.col(t)) * u).norm() <= tolerance / (gap - tolerance) + unit);
    }
  }
  if (r > 0)
    CHECK((v.transpose() * v - Eigen::MatrixXd::Identity(r, r)).cwiseAbs().maxCoeff() <=
          kThreshold * unit);
  // The top-r subspace, where it is apart from the rest of the spectrum.
  if (r > 0 && r < d) {
    const double gap = ref.values(r - 1) - ref.values(r);
    if (gap > 2 * tolerance) {
      CAPTURE(d, r, gap);
      CHECK(sin_theta(ref.vectors.leftCols(r), v) <=
            std::sqrt(double(r)) * tolerance / (gap - tolerance) + unit);
    }
  }
}

// Both entry points: the dispatcher (which may take the full solver) and inverse iteration
// forced for any d and r.
template <typename Scalar>
void check_both_paths(const RowMatrix<Scalar>& a, Index r) {
  RowMatrix<Scalar> vectors;
  Vector<Scalar> values;
  randattn::detail::top_eigenvectors(a, r, vectors, values);
  check_top_eigen(a, r, vectors, values);
  REQUIRE(randattn::detail::top_eigenvectors_by_inverse_iteration(a, r, vectors, values));
  check_top_eigen(a, r, vectors, values);
}

}  // namespace

TEMPLATE_TEST_CASE("top_eigenvectors agrees with the full eigensolver on random symmetric matrices",
                   "[eigen]", RANDATTN_TEST_SCALARS) {
  for (Index d : {1, 2, 7, 50, 200})
    for (Index r : {Index(1), Index(3), Index(5), d}) {
      if (r > d) continue;
      CAPTURE(d, r);
      check_both_paths(random_symmetric<TestType>(100 + std::uint64_t(d), d), r);
    }
}

TEMPLATE_TEST_CASE("top_eigenvectors on the Gram matrices of a HOSVD", "[eigen]", RANDATTN_TEST_SCALARS) {
  const RowMatrix<TestType> gram = low_rank_gram<TestType>(7, 200, 4000, 0.3);
  for (Index r : {1, 3, 5, 8}) {
    CAPTURE(r);
    check_both_paths(gram, r);
  }
  // The same signed vectors as the full solver, to the sin-Theta bound (the five are well apart).
  RowMatrix<TestType> fast, full;
  Vector<TestType> fast_values, full_values;
  randattn::detail::top_eigenvectors(gram, 5, fast, fast_values);
  randattn::detail::top_eigenvectors_full(gram, 5, full, full_values);
  const Reference ref(gram);
  const double eps = std::numeric_limits<TestType>::epsilon();
  const double gap = (ref.values.head(5) - ref.values.segment(1, 5)).minCoeff();
  CHECK((fast - full).template cast<double>().cwiseAbs().maxCoeff() <=
        2 * 200 * eps * ref.norm() / gap + 2 * 200 * eps);
}

TEMPLATE_TEST_CASE("top_eigenvectors of small and special matrices", "[eigen]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  RowMatrix<Scalar> vectors;
  Vector<Scalar> values;

  SECTION("1 x 1") {
    RowMatrix<Scalar> a(1, 1);
    a << Scalar(-3.5);
    REQUIRE(randattn::detail::top_eigenvectors_by_inverse_iteration(a, 1, vectors, values));
    CHECK(values(0) == Scalar(-3.5));
    CHECK(vectors(0, 0) == Scalar(1));
    check_both_paths(a, 1);
  }
  SECTION("diagonal: exactly the unit vectors, in order of the diagonal") {
    const Index d = 50;
    Eigen::VectorXd diag(d);
    for (Index i = 0; i < d; ++i) diag(i) = double((i * 17) % d) - 20.0;  // distinct, shuffled
    const RowMatrix<Scalar> a = diag.cast<Scalar>().asDiagonal();
    for (Index r : {1, 3, 5, 50}) check_both_paths(a, r);
    REQUIRE(randattn::detail::top_eigenvectors_by_inverse_iteration(a, 5, vectors, values));
    std::vector<Index> order(static_cast<std::size_t>(d));
    for (Index i = 0; i < d; ++i) order[std::size_t(i)] = i;
    std::sort(order.begin(), order.end(), [&](Index i, Index j) { return diag(i) > diag(j); });
    for (Index t = 0; t < 5; ++t)
      CHECK(vectors.col(t) == Vector<Scalar>::Unit(d, order[std::size_t(t)]));
  }
  SECTION("identity: all eigenvalues equal, any orthonormal basis") {
    for (Index r : {1, 5, 12, 50}) check_both_paths(RowMatrix<Scalar>::Identity(50, 50).eval(), r);
  }
  SECTION("zero matrix") {
    for (Index r : {1, 5, 50}) check_both_paths(RowMatrix<Scalar>::Zero(50, 50).eval(), r);
    REQUIRE(randattn::detail::top_eigenvectors_by_inverse_iteration(
        RowMatrix<Scalar>::Zero(50, 50).eval(), 5, vectors, values));
    CHECK(values.isZero(0));
  }
  SECTION("repeated top eigenvalue: any basis of its eigenspace") {
    Eigen::VectorXd spectrum = Eigen::VectorXd::LinSpaced(60, -2.0, 1.0);
    spectrum.head(4).setConstant(5.0);
    const RowMatrix<Scalar> a = with_spectrum<Scalar>(11, spectrum);
    for (Index r : {1, 2, 4, 5, 15}) check_both_paths(a, r);
    // r = 2 of the four: the vectors lie in the eigenspace of 5.
    REQUIRE(randattn::detail::top_eigenvectors_by_inverse_iteration(a, 2, vectors, values));
    const Reference ref(a);
    const double eps = std::numeric_limits<Scalar>::epsilon();
    CHECK(sin_theta(ref.vectors.leftCols(4), vectors.template cast<double>()) <=
          60 * eps * ref.norm() / (5.0 - 1.0) * 2 + 60 * eps);
  }
  SECTION("negative definite, and eigenvalues of both signs") {
    const RowMatrix<double> b = randattn::gaussian_matrix<double>(randattn::Philox(12), 40, 60);
    const RowMatrix<Scalar> negative = (-(b * b.transpose()) / 60.0).cast<Scalar>();
    for (Index r : {1, 3, 10}) check_both_paths(negative, r);
    Eigen::VectorXd spectrum = Eigen::VectorXd::LinSpaced(40, -30.0, -1.0);
    spectrum.head(3) << 2.0, 0.5, 0.0;
    for (Index r : {1, 3, 5}) check_both_paths(with_spectrum<Scalar>(13, spectrum), r);
  }
  SECTION("close pairs: Wilkinson's W21+") {
    const Index d = 21;
    RowMatrix<Scalar> a = RowMatrix<Scalar>::Zero(d, d);
    for (Index i = 0; i < d; ++i) {
      a(i, i) = Scalar(std::abs(double(i) - 10.0));
      if (i + 1 < d) a(i, i + 1) = a(i + 1, i) = Scalar(1);
    }
    for (Index r : {1, 2, 4, 5, 21}) check_both_paths(a, r);
  }
  SECTION("no eigenvectors") { check_both_paths(random_symmetric<Scalar>(14, 30), 0); }
}

TEST_CASE("top_eigenvectors at huge and tiny scales", "[eigen]") {
  const RowMatrix<double> a = random_symmetric<double>(15, 60);
  for (double scale : {1e30, 1e-30, 1e200, 1e-200})
    for (Index r : {1, 5}) {
      CAPTURE(scale, r);
      check_both_paths(RowMatrix<double>(a * scale), r);
    }
  const RowMatrix<float> af = random_symmetric<float>(15, 60);
  for (float scale : {1e30f, 1e-30f})
    for (Index r : {1, 5}) {
      CAPTURE(scale, r);
      check_both_paths(RowMatrix<float>(af * scale), r);
    }
}

TEST_CASE("top_eigenvectors rejects bad arguments", "[eigen]") {
  RowMatrix<double> vectors;
  Vector<double> values;
  RowMatrix<double> a = random_symmetric<double>(16, 20);
  CHECK_THROWS_AS(randattn::detail::top_eigenvectors(a, 21, vectors, values),
                  std::invalid_argument);
  CHECK_THROWS_AS(randattn::detail::top_eigenvectors(a, -1, vectors, values),
                  std::invalid_argument);
  CHECK_THROWS_AS(
      randattn::detail::top_eigenvectors(RowMatrix<double>(a.leftCols(19)), 1, vectors, values),
      std::invalid_argument);
  a(7, 3) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(randattn::detail::top_eigenvectors(a, 1, vectors, values), std::invalid_argument);
  a(7, 3) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(randattn::detail::top_eigenvectors(a, 1, vectors, values), std::invalid_argument);
}
