#pragma once
// Shared helpers for the test suite: reproducible inputs (never Eigen's std::rand-based
// Random()) and error measures.

#include <cstring>

#include <Eigen/Core>

#include <randattn/randattn.hpp>

namespace testing {

using randattn::Index;
using randattn::RowMatrix;
using randattn::Vector;

template <typename Scalar>
RowMatrix<Scalar> gaussian(std::uint64_t seed, Index rows, Index cols, double sd = 1.0) {
  RowMatrix<Scalar> m = randattn::gaussian_matrix<Scalar>(randattn::Philox(seed), rows, cols);
  return (m.array() * static_cast<Scalar>(sd)).matrix();
}

template <typename Scalar>
RowMatrix<Scalar> uniform(std::uint64_t seed, Index rows, Index cols, double lo, double hi) {
  RowMatrix<Scalar> m(rows, cols);
  randattn::fill_uniform(randattn::Philox(seed), m);
  return (m.array().template cast<double>() * (hi - lo) + lo).matrix().template cast<Scalar>();
}

template <typename A, typename B>
double rel_error(const Eigen::MatrixBase<A>& approx, const Eigen::MatrixBase<B>& exact) {
  const Eigen::MatrixXd a = approx.template cast<double>();
  const Eigen::MatrixXd e = exact.template cast<double>();
  return (a - e).norm() / e.norm();
}

// True when the first `rows` rows of a and b are identical bit for bit.
template <typename Scalar>
bool rows_bit_identical(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b, Index rows) {
  return a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(Scalar) * std::size_t(rows * a.cols())) == 0;
}

template <typename Scalar>
constexpr double tolerance() {
  return std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
}

}  // namespace testing
