#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::Index;
using randattn::Philox;
using randattn::RowMatrix;

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

TEMPLATE_TEST_CASE("Fills are pure functions of (seed, stream, i, j)", "[random][threads]", float, double) {
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
  CHECK(std::abs(m1) < 4 * std::sqrt(1.0 / n));             // Var z = 1
  CHECK(std::abs(m2 - 1) < 4 * std::sqrt(2.0 / n));         // Var z^2 = 3 - 1
  CHECK(std::abs(m3) < 4 * std::sqrt(15.0 / n));            // Var z^3 = 15
  CHECK(std::abs(m4 - 3) < 4 * std::sqrt(96.0 / n));        // Var z^4 = 105 - 9
  const double p = 0.6826894921370859;                      // P(|z| <= 1)
  const double frac = (x.abs() <= 1.0).cast<double>().mean();
  CHECK(std::abs(frac - p) < 4 * std::sqrt(p * (1 - p) / n));
  const double p2 = 0.9544997361036416;                     // P(|z| <= 2)
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

TEST_CASE("Fast Walsh-Hadamard transform", "[linalg]") {
  // H_n H_n = n I, and the transform of a unit vector is a row of the Sylvester matrix.
  for (Index n : {1, 2, 8, 64}) {
    RowMatrix<double> x = testing::gaussian<double>(5, 3, n);
    RowMatrix<double> y = x;
    randattn::fwht_rows<double>(y);
    CHECK(std::abs(y.squaredNorm() - n * x.squaredNorm()) < 1e-12 * n * x.squaredNorm());
    randattn::fwht_rows<double>(y);
    CHECK((y / double(n) - x).norm() < 1e-12 * x.norm());
  }
  std::vector<double> e(8, 0.0);
  e[3] = 1;
  randattn::fwht_inplace(e.data(), 8);
  for (int k = 0; k < 8; ++k) CHECK(e[k] == (__builtin_popcount(3 & k) % 2 ? -1.0 : 1.0));
  std::vector<double> bad(6);
  CHECK_THROWS_AS(randattn::fwht_inplace(bad.data(), 6), std::invalid_argument);
}
