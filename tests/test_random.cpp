#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::Index;
using randattn::Philox;
using randattn::RowMatrix;
using randattn::Vector;

TEST_CASE("Philox stream matches Random123's published known-answer vectors", "[random]") {
  // kat_vectors, philox4x32 10: counter (4 words), key (2 words) -> output (4 words).
  // Our mapping: key = (seed low, seed high), counter = (j, i low, i high, stream).
  struct Kat {
    std::uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const std::uint64_t seed = (std::uint64_t(k.key[1]) << 32) | k.key[0];
    const std::uint64_t i = (std::uint64_t(k.ctr[2]) << 32) | k.ctr[1];
    const Philox rng(seed, k.ctr[3]);
    const auto b = rng.bits(i, k.ctr[0]);
    for (int w = 0; w < 4; ++w) CHECK(b[w] == k.out[w]);
  }
}

TEMPLATE_TEST_CASE("Fills are pure functions of (seed, stream, i, j)", "[random][threads]", RANDATTN_TEST_SCALARS) {
  const Philox rng(20261130, 3);
  RowMatrix<TestType> row_major(37, 23);
  Eigen::Matrix<TestType, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor> col_major(37, 23);
  randattn::fill_gaussian(rng, row_major);
  randattn::fill_gaussian(rng, col_major);
  CHECK((row_major.array() == col_major.array()).all());

  // A sub-block generated on its own equals the same block cut from the whole fill.
  RowMatrix<TestType> block(10, 4);
  randattn::fill_gaussian(rng, block, 5, 7);
  CHECK((block.array() == row_major.block(5, 7, 10, 4).array()).all());

  // Writing into a block expression of a larger matrix, with offsets.
  RowMatrix<TestType> big = RowMatrix<TestType>::Zero(40, 30);
  randattn::fill_gaussian(rng, big.block(2, 3, 37, 23));
  CHECK((big.block(2, 3, 37, 23).array() == row_major.array()).all());

  // Different streams and seeds give different values.
  RowMatrix<TestType> other(37, 23);
  randattn::fill_gaussian(rng.with_stream(4), other);
  CHECK((other.array() != row_major.array()).count() > 37 * 23 - 5);
  randattn::fill_gaussian(Philox(20261131, 3), other);
  CHECK((other.array() != row_major.array()).count() > 37 * 23 - 5);

#if defined(_OPENMP)
  // Large enough to take the parallel path; the thread count must not matter.
  RowMatrix<TestType> one(600, 300), two(600, 300);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  randattn::fill_gaussian(rng, one);
  omp_set_num_threads(2);
  randattn::fill_gaussian(rng, two);
  omp_set_num_threads(saved);
  CHECK((one.array() == two.array()).all());
#endif
}

TEST_CASE("Gaussian fill has the moments of a standard normal", "[random][statistical]") {
  // N draws; each moment estimate is compared with its exact value within 4 standard errors,
  // the standard error computed from the known higher moments of N(0, 1).
  const Index rows = 1000, cols = 1000;
  const double n = double(rows * cols);
  RowMatrix<double> z(rows, cols);
  randattn::fill_gaussian(Philox(7), z);
  const Eigen::ArrayXd x = Eigen::Map<const Eigen::ArrayXd>(z.data(), z.size());
  const double m1 = x.mean(), m2 = x.square().mean(), m3 = x.cube().mean(),
               m4 = x.square().square().mean();
  CHECK(std::abs(m1) < 4 * std::sqrt(1.0 / n));       // Var z = 1
  CHECK(std::abs(m2 - 1) < 4 * std::sqrt(2.0 / n));   // Var z^2 = 3 - 1
  CHECK(std::abs(m3) < 4 * std::sqrt(15.0 / n));      // Var z^3 = 15
  CHECK(std::abs(m4 - 3) < 4 * std::sqrt(96.0 / n));  // Var z^4 = 105 - 9
  const double p = 0.6826894921370859;                // P(|z| <= 1)
  const double frac = (x.abs() <= 1.0).cast<double>().mean();
  CHECK(std::abs(frac - p) < 4 * std::sqrt(p * (1 - p) / n));
  const double p2 = 0.9544997361036416;  // P(|z| <= 2)
  const double frac2 = (x.abs() <= 2.0).cast<double>().mean();
  CHECK(std::abs(frac2 - p2) < 4 * std::sqrt(p2 * (1 - p2) / n));
  CHECK(x.allFinite());
}

TEST_CASE("Uniform and Rademacher fills have the right moments", "[random][statistical]") {
  const Index rows = 500, cols = 1000;
  const double n = double(rows * cols);
  RowMatrix<double> u(rows, cols), r(rows, cols);
  randattn::fill_uniform(Philox(11), u);
  randattn::fill_rademacher(Philox(12), r);
  CHECK(u.minCoeff() >= 0.0);
  CHECK(u.maxCoeff() < 1.0);
  CHECK(std::abs(u.mean() - 0.5) < 4 * std::sqrt(1.0 / 12.0 / n));
  CHECK(std::abs(u.array().square().mean() - 1.0 / 3.0) < 4 * std::sqrt(4.0 / 45.0 / n));
  CHECK((r.array().abs() == 1.0).all());
  CHECK(std::abs(r.mean()) < 4 * std::sqrt(1.0 / n));
}

TEST_CASE("Fills reject negative offsets", "[random][validation]") {
  RowMatrix<double> m(3, 3);
  CHECK_THROWS_AS(randattn::fill_gaussian(Philox(1), m, -1, 0), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Walsh-Hadamard transform and structured rotations
// ---------------------------------------------------------------------------------------------

namespace {

// Explicit Sylvester matrix H_p: H(a, b) = (-1)^popcount(a & b).
Eigen::MatrixXd sylvester(Index p) {
  Eigen::MatrixXd h(p, p);
  for (Index a = 0; a < p; ++a)
    for (Index b = 0; b < p; ++b)
      h(a, b) = (__builtin_popcountll(std::uint64_t(a & b)) % 2) ? -1.0 : 1.0;
  return h;
}

constexpr int log2_of(Index p) {
  int l = 0;
  while ((Index(1) << l) < p) ++l;
  return l;
}

}  // namespace

TEMPLATE_TEST_CASE("Batched Walsh-Hadamard transform equals the Hadamard matrix product",
                   "[linalg]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const double eps = std::numeric_limits<Scalar>::epsilon();
  for (Index p : {1, 2, 4, 8, 16, 32, 64, 256}) {
    INFO("p " << p);
    // 37 vectors (strips of 32 plus a remainder) in a block with row stride 40.
    const Index cols = 37, ld = 40;
    const RowMatrix<Scalar> x = testing::gaussian<Scalar>(7, p, ld);
    const Eigen::MatrixXd h = sylvester(p);
    const Eigen::MatrixXd xd = x.leftCols(cols).template cast<double>();
    const Eigen::VectorXd sign = h.row(p - 1).transpose();  // a +-1 pattern with both signs
    const Vector<Scalar> sign_s = sign.template cast<Scalar>();

    RowMatrix<Scalar> y = x, ys = x;
    randattn::fwht_columns(y.data(), p, cols, ld);
    randattn::fwht_columns(ys.data(), p, cols, ld, sign_s.data());
    // Every output is a sum of p terms +-x_j formed by a tree of log2(p) additions, each with a
    // relative rounding error <= u = eps / 2: |error| <= log2(p) u sum_j |x_j| to first order;
    // eps instead of u covers the higher-order terms.
    const Eigen::MatrixXd exact = h * xd, exact_s = h * sign.asDiagonal() * xd;
    const Eigen::RowVectorXd abs_sums = xd.cwiseAbs().colwise().sum();
    for (Index j = 0; j < cols; ++j) {
      const double bound = log2_of(p) * eps * abs_sums(j);
      CHECK((y.col(j).template cast<double>() - exact.col(j)).cwiseAbs().maxCoeff() <= bound);
      CHECK((ys.col(j).template cast<double>() - exact_s.col(j)).cwiseAbs().maxCoeff() <= bound);
    }
    // Padding columns beyond cols are untouched.
    CHECK((y.rightCols(ld - cols).array() == x.rightCols(ld - cols).array()).all());

    // Batched equals one vector at a time, bit for bit: the same additions in the same order.
    for (Index j = 0; j < cols; ++j) {
      Vector<Scalar> v = x.col(j), vs = sign_s.cwiseProduct(x.col(j));
      randattn::fwht_inplace(v.data(), p);
      randattn::fwht_inplace(vs.data(), p);
      CHECK((v.array() == y.col(j).array()).all());
      CHECK((vs.array() == ys.col(j).array()).all());
    }
    // fwht_rows (token-major) agrees with the coordinate-major batch, bit for bit, also with more
    // rows than one tile.
    RowMatrix<Scalar> rows = x.leftCols(cols).transpose();
    randattn::fwht_rows<Scalar>(rows);
    CHECK((rows.transpose().array() == y.leftCols(cols).array()).all());
  }
  const Index big = (Index(1) << 16) / 8 + 5;  // several tiles of 8-wide rows
  RowMatrix<Scalar> many = testing::gaussian<Scalar>(8, big, 8), one = many;
  randattn::fwht_rows<Scalar>(many);
  for (Index i = 0; i < big; ++i) randattn::fwht_inplace(one.row(i).data(), 8);
  CHECK((many.array() == one.array()).all());

  // A unit vector transforms to a row of the Sylvester matrix.
  std::vector<Scalar> e(8, Scalar(0));
  e[3] = 1;
  randattn::fwht_inplace(e.data(), 8);
  for (int k = 0; k < 8; ++k) CHECK(e[k] == (__builtin_popcount(3 & k) % 2 ? -1 : 1));

  std::vector<Scalar> bad(12);
  CHECK_THROWS_AS(randattn::fwht_inplace(bad.data(), 6), std::invalid_argument);
  CHECK_THROWS_AS(randattn::fwht_columns(bad.data(), 3, 4, 4), std::invalid_argument);
  CHECK_THROWS_AS(randattn::fwht_columns(bad.data(), 2, 4, 3), std::invalid_argument);
  RowMatrix<Scalar> not_pow2(2, 6);
  CHECK_THROWS_AS(randattn::fwht_rows<Scalar>(not_pow2), std::invalid_argument);
}

TEMPLATE_TEST_CASE(
    "Structured rotation: documented draws, explicit product, orthogonality, threads",
    "[linalg][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using randattn::SignIndexing;
  using randattn::StructuredRotation;
  const double eps = std::numeric_limits<Scalar>::epsilon();
  struct Case {
    Index dim, blocks, min_padded;
    SignIndexing indexing;
  };
  for (const Case c :
       {Case{5, 3, 1, SignIndexing::by_block}, Case{8, 2, 1, SignIndexing::by_diagonal},
        Case{50, 2, 16, SignIndexing::by_diagonal}, Case{3, 2, 64, SignIndexing::by_diagonal},
        Case{1, 1, 1, SignIndexing::by_block}, Case{64, 1, 64, SignIndexing::by_diagonal}}) {
    INFO("dim " << c.dim << " blocks " << c.blocks << " min_padded " << c.min_padded);
    const Philox signs(42, 9);
    const StructuredRotation<Scalar> rot(c.dim, c.blocks, signs, c.indexing, c.min_padded);
    const Index p = rot.padded_dim();
    REQUIRE(p == randattn::next_power_of_two(std::max(c.dim, c.min_padded)));
    REQUIRE(rot.outputs() == c.blocks * p);

    // The diagonals are the documented Philox draws (the published rotations depend on them).
    for (Index b = 0; b < c.blocks; ++b)
      for (Index k = 0; k < 3; ++k)
        for (Index i = 0; i < p; ++i) {
          const int expected = c.indexing == SignIndexing::by_diagonal
                                   ? signs.rademacher(std::uint64_t(3 * b + k), std::uint32_t(i))
                                   : signs.rademacher(std::uint64_t(b), std::uint32_t(k * p + i));
          REQUIRE(rot.diagonals()(3 * b + k, i) == Scalar(expected));
        }

    // Explicit product in long double (its rounding is negligible next to the tested type's):
    // block b is p^{-3/2} H D3 H D2 H D1 applied to [x; 0].
    using MatrixL = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;
    const MatrixL h = sylvester(p).cast<long double>(),
                  diag = rot.diagonals().template cast<long double>();
    const Index n = 70;
    const RowMatrix<Scalar> x = testing::gaussian<Scalar>(3, n, c.dim, 2.0);
    MatrixL xp = MatrixL::Zero(n, p);
    xp.leftCols(c.dim) = x.template cast<long double>();
    MatrixL expected(n, c.blocks * p);
    for (Index b = 0; b < c.blocks; ++b) {
      const MatrixL r = h * diag.row(3 * b + 2).asDiagonal() * h *
                        diag.row(3 * b + 1).asDiagonal() * h * diag.row(3 * b).asDiagonal() /
                        std::pow((long double)p, 1.5L);
      expected.middleCols(b * p, p) = xp * r.transpose();
    }
    RowMatrix<Scalar> y(n, rot.outputs());
    rot.apply(x, y);
    // Normwise, each transform is sqrt(p) times an orthogonal map and each of its log2(p) levels
    // adds a relative error <= u = eps / 2; with the final scaling, ||error|| <= (3 log2 p + 1) u
    // ||x|| per block to first order (eps instead of u covers the rest). The same bound holds
    // for the deviation of the norm from ||x|| (the exact rotation is orthogonal).
    const double per_unit = (3 * log2_of(p) + 1) * eps;
    auto norm_l = [](const auto& v) { return double(v.template cast<long double>().norm()); };
    for (Index i = 0; i < n; ++i) {
      const double nx = norm_l(x.row(i));
      for (Index b = 0; b < c.blocks; ++b) {
        const auto yb = y.row(i).segment(b * p, p);
        CHECK(
            double((yb.template cast<long double>() - expected.row(i).segment(b * p, p)).norm()) <=
            per_unit * nx);
        CHECK(std::abs(norm_l(yb) - nx) <= per_unit * nx);
      }
    }

    // The first k outputs, one block, a uniform column scale: the same numbers bit for bit.
    const Index k = rot.outputs() - 3 > 0 ? rot.outputs() - 3 : rot.outputs();
    RowMatrix<Scalar> first(n, k);
    rot.apply(x, first);
    CHECK((first.array() == y.leftCols(k).array()).all());
    const Vector<Scalar> uniform = Vector<Scalar>::Constant(k, rot.scale());
    rot.apply(x, uniform, first);
    CHECK((first.array() == y.leftCols(k).array()).all());
    for (Index b = 0; b < c.blocks; ++b) {
      RowMatrix<Scalar> block(n, p);
      rot.apply_block(x, b, block);
      CHECK((block.array() == y.middleCols(b * p, p).array()).all());
    }

    // The folded tile (first `rows` coordinates only) agrees with the product. The fold sums
    // m = p/rows blocks z_i in order before a transform of size rows: at most (m - 1) u
    // sum ||z_i|| <= (m - 1) u sqrt(m) ||z|| of error, which the remaining sqrt(rows) p^{-3/2}
    // (with ||z|| = p ||x||) turns into (m - 1) u ||x||.
    for (Index rows = 1; rows < p; rows *= 2) {
      RowMatrix<Scalar> work(p, n);
      rot.transform_tile(x.data(), x.outerStride(), n, c.blocks - 1, rows, work.data(), n);
      const double fold = double(p / rows - 1) * eps / 2;
      for (Index i = 0; i < n; ++i) {
        const auto got = (work.col(i).head(rows) * rot.scale()).template cast<long double>();
        const auto want = expected.row(i).segment((c.blocks - 1) * p, rows).transpose();
        CHECK(double((got - want).norm()) <= (per_unit + fold) * norm_l(x.row(i)));
      }
    }

#if defined(_OPENMP)
    // Tiles are independent: the thread count does not change a bit (n spans several tiles).
    const RowMatrix<Scalar> many = testing::gaussian<Scalar>(4, 700, c.dim);
    RowMatrix<Scalar> one(700, rot.outputs()), two(700, rot.outputs());
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    rot.apply(many, one);
    omp_set_num_threads(2);
    rot.apply(many, two);
    omp_set_num_threads(saved);
    CHECK((one.array() == two.array()).all());
#endif
  }

  // Edge cases and argument errors.
  const StructuredRotation<Scalar> rot(6, 2, Philox(1));
  RowMatrix<Scalar> empty(0, 16);
  rot.apply(RowMatrix<Scalar>(0, 6), empty);
  RowMatrix<Scalar> out(4, 16);
  CHECK_THROWS_AS(rot.apply(RowMatrix<Scalar>::Zero(4, 5), out), std::invalid_argument);
  RowMatrix<Scalar> too_wide(4, 17);
  CHECK_THROWS_AS(rot.apply(RowMatrix<Scalar>::Zero(4, 6), too_wide), std::invalid_argument);
  RowMatrix<Scalar> block_out(4, 8);
  CHECK_THROWS_AS(rot.apply_block(RowMatrix<Scalar>::Zero(4, 6), 2, block_out),
                  std::invalid_argument);
  CHECK_THROWS_AS(rot.apply(RowMatrix<Scalar>::Zero(4, 6), Vector<Scalar>::Ones(3), out),
                  std::invalid_argument);
  CHECK_THROWS_AS(StructuredRotation<Scalar>(0, 1, Philox(1)), std::invalid_argument);
  CHECK_THROWS_AS(StructuredRotation<Scalar>(4, 0, Philox(1)), std::invalid_argument);
  CHECK_THROWS_AS(StructuredRotation<Scalar>(4, 1, Philox(1), SignIndexing::by_diagonal, 0),
                  std::invalid_argument);
}
