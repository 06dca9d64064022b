#pragma once
// Shared helpers for the test suite: reproducible inputs (never Eigen's std::rand-based
// Random()) and error measures.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <randattn/randattn.hpp>  // before Eigen (randattn/detail/intrinsics.hpp says why)

#include <Eigen/Core>
#include <Eigen/QR>

#include "scalars.hpp"

namespace testing {

inline constexpr double kPi = 3.141592653589793238462643383279502884;

using randattn::Index;
using randattn::RowMatrix;
using randattn::Vector;

template <typename Scalar>
RowMatrix<Scalar> gaussian(std::uint64_t seed, Index rows, Index cols, double sd = 1.0) {
  return randattn::gaussian_matrix<Scalar>(randattn::Philox(seed), rows, cols, sd);
}

template <typename Scalar>
RowMatrix<Scalar> uniform(std::uint64_t seed, Index rows, Index cols, double lo, double hi) {
  return randattn::uniform_matrix<Scalar>(randattn::Philox(seed), rows, cols, lo, hi);
}

// Rows with Gaussian directions and the given norms.
template <typename Scalar>
RowMatrix<Scalar> rows_with_norms(std::uint64_t seed, const Eigen::VectorXd& norms, Index d) {
  RowMatrix<double> x = gaussian<double>(seed, norms.size(), d);
  for (Index i = 0; i < x.rows(); ++i) x.row(i) *= norms(i) / x.row(i).norm();
  return x.template cast<Scalar>();
}

// Tokens around a few directions, so that buckets and filters fill
// unevenly and attention is peaked.
template <typename Scalar>
RowMatrix<Scalar> clustered(std::uint64_t seed, Index n, Index d, Index clusters, double spread) {
  const RowMatrix<Scalar> centres = gaussian<Scalar>(seed, clusters, d, 2.0);
  RowMatrix<Scalar> x = gaussian<Scalar>(seed + 1, n, d, spread);
  for (Index i = 0; i < n; ++i) x.row(i) += centres.row((i * 5 + i / 7) % clusters);
  return x;
}

// Row i of softmax attention restricted to a target set, in double: sum over the targets j of
// count_j · exp(scale · q_i·k_j) v_j, divided by the same sum without v_j. The reference of
// every method that attends to a subset of the keys (LSH buckets, LSF filters).
inline Eigen::RowVectorXd softmax_over_targets(const Eigen::MatrixXd& q, Index i,
                                               const Eigen::MatrixXd& keys,
                                               const Eigen::MatrixXd& v,
                                               const std::map<Index, int>& targets, double scale) {
  double top = -INFINITY;
  for (const auto& [j, count] : targets) top = std::max(top, scale * q.row(i).dot(keys.row(j)));
  Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(v.cols());
  double den = 0;
  for (const auto& [j, count] : targets) {
    const double w = count * std::exp(scale * q.row(i).dot(keys.row(j)) - top);
    den += w;
    num += w * v.row(j);
  }
  return num / den;
}

// True when every column of `out` lies within the range of the same column of v (and 0): what
// a convex combination of v's rows, or a zero row, satisfies.
template <typename Scalar>
bool within_value_ranges(const RowMatrix<Scalar>& out, const RowMatrix<Scalar>& v) {
  for (Index c = 0; c < v.cols(); ++c) {
    if (out.col(c).maxCoeff() > std::max(v.col(c).maxCoeff(), Scalar(0)) ||
        out.col(c).minCoeff() < std::min(v.col(c).minCoeff(), Scalar(0)))
      return false;
  }
  return true;
}

// Running mean and variance (Welford) of a sample.
struct Moments {
  double count = 0, mean = 0, m2 = 0;
  void add(double x) {
    count += 1;
    const double delta = x - mean;
    mean += delta / count;
    m2 += delta * (x - mean);
  }
  double standard_error() const { return std::sqrt(m2 / (count - 1) / count); }
};

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

// True when a and b have the same shape and the same bits.
template <typename Scalar>
bool bit_identical(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  return a.rows() == b.rows() && rows_bit_identical(a, b, a.rows());
}

// Checks an `_into` form against the result of its allocating form. run(inputs, out) calls the
// `_into` form on the given inputs (in the order of `inputs`, named by `names`) with out an
// Eigen::Ref<RowMatrix<Scalar>>. It must equal `expected` bit for bit, written into a matrix of
// its own and into a block (outer stride) of a larger one whose border stays untouched; a wrong
// shape, and an out overlapping any input by even one entry, must throw and leave out as it was;
// an out that ends where an input starts or starts where it ends is fine.
template <typename Scalar, typename Run>
void check_into_form(const RowMatrix<Scalar>& expected, const std::vector<RowMatrix<Scalar>>& inputs,
                     const std::vector<std::string>& names, Run run) {
  using Refs = std::vector<Eigen::Ref<const RowMatrix<Scalar>>>;
  using OutRef = Eigen::Ref<RowMatrix<Scalar>>;
  using OutMap = Eigen::Map<RowMatrix<Scalar>>;
  const Index n_q = expected.rows(), dv = expected.cols();
  const Scalar sentinel(-12345.5);
  const auto refs_of = [](const std::vector<RowMatrix<Scalar>>& in) {
    Refs r;
    for (const auto& m : in) r.emplace_back(m);
    return r;
  };
  const Refs refs = refs_of(inputs);
  {
    RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(n_q, dv, sentinel);
    OutRef o(out);
    run(refs, o);
    CHECK(out == expected);
  }
  {
    RowMatrix<Scalar> big = RowMatrix<Scalar>::Constant(n_q + 3, dv + 5, sentinel);
    auto block = big.block(1, 2, n_q, dv);
    OutRef o(block);
    CHECK(o.outerStride() == dv + 5);
    run(refs, o);
    CHECK(RowMatrix<Scalar>(block) == expected);
    block.setConstant(sentinel);
    CHECK((big.array() == sentinel).all());
  }
  for (const auto& [rows, cols] : {std::pair<Index, Index>{n_q + 1, dv}, {n_q, dv + 1}}) {
    RowMatrix<Scalar> out = RowMatrix<Scalar>::Constant(rows, cols, sentinel);
    OutRef o(out);
    CHECK_THROWS_WITH(run(refs, o), Catch::Contains("out is " + std::to_string(rows) + "x" +
                                                    std::to_string(cols) + ", expected " +
                                                    std::to_string(n_q) + "x" + std::to_string(dv)));
    CHECK((out.array() == sentinel).all());
  }
  if (n_q * dv == 0) return;
  // Each input in turn placed at the start of a buffer with room for out around it: out starting
  // at the input's last entry (or ending at its first) overlaps it; one entry later (earlier) not.
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const RowMatrix<Scalar>& x = inputs[i];
    if (x.size() == 0) continue;
    INFO("out aliasing " << names[i]);
    const Index room = n_q * dv;
    Eigen::Matrix<Scalar, Eigen::Dynamic, 1> buffer =
        Eigen::Matrix<Scalar, Eigen::Dynamic, 1>::Constant(room + x.size() + room, sentinel);
    Eigen::Map<RowMatrix<Scalar>> placed(buffer.data() + room, x.rows(), x.cols());
    placed = x;
    Refs r;
    for (std::size_t j = 0; j < inputs.size(); ++j) {
      if (j == i) {
        r.emplace_back(placed);
      } else {
        r.emplace_back(inputs[j]);
      }
    }
    CHECK(r[i].data() == buffer.data() + room);
    const Eigen::Matrix<Scalar, Eigen::Dynamic, 1> before = buffer;
    for (const Index start : {Index(1), room + x.size() - 1}) {
      OutMap out(buffer.data() + start, n_q, dv);
      OutRef o(out);
      CHECK_THROWS_WITH(run(r, o), Catch::Contains("shares memory with the input " + names[i]));
      CHECK(buffer == before);
    }
    for (const Index start : {Index(0), room + x.size()}) {
      OutMap out(buffer.data() + start, n_q, dv);
      OutRef o(out);
      run(r, o);
      CHECK(RowMatrix<Scalar>(out) == expected);
      CHECK(placed == x);
    }
  }
}

template <typename Scalar>
struct LinearProblem {
  RowMatrix<Scalar> qf, kf, v;
  Vector<Scalar> q_log, k_log, signs;
};

// Inputs of the linear core: positive features, log-scales spread over [-log_spread, log_spread], and (optionally) signs
// that flip a few small features so the signed denominators stay well away from zero.
template <typename Scalar>
LinearProblem<Scalar> linear_problem(std::uint64_t seed, Index n, Index m, Index dv,
                                     double log_spread, bool with_signs) {
  LinearProblem<Scalar> p;
  p.qf = uniform<Scalar>(seed, n, m, 0.1, 1.0);
  p.kf = uniform<Scalar>(seed + 1, n, m, 0.1, 1.0);
  p.v = gaussian<Scalar>(seed + 2, n, dv);
  if (log_spread > 0) {
    p.q_log = uniform<Scalar>(seed + 3, n, 1, -log_spread, log_spread).col(0);
    p.k_log = uniform<Scalar>(seed + 4, n, 1, -log_spread, log_spread).col(0);
  }
  if (with_signs) {
    p.signs = Vector<Scalar>::Ones(m);
    for (Index i = 0; i < m; i += 4) {
      p.signs(i) = -1;
      p.qf.col(i) *= Scalar(0.1);
    }
  }
  return p;
}

template <typename Scalar>
constexpr double tolerance() {
  return std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
}

// Heap allocations of every thread between start and stop (main.cpp). allocations_counted() is
// false where they are not counted (sanitizer builds, non-glibc systems): stop then returns 0.
bool allocations_counted();
void start_counting_allocations();
long stop_counting_allocations();
long counted_bytes();  // bytes requested by the allocations of the last counted stretch

// A second moment with distinct eigenvalues (2.5, 1, 0.3, 0) in a rotated basis (d = 4).
inline Eigen::MatrixXd anisotropic_moment() {
  const Eigen::MatrixXd g = gaussian<double>(7, 4, 4);
  const Eigen::MatrixXd basis = Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ();
  return basis * Eigen::Vector4d(2.5, 1.0, 0.3, 0.0).asDiagonal() * basis.transpose();
}

}  // namespace testing
