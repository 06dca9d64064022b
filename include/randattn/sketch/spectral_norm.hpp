#pragma once
// Tensor spectral norm ||A|| = sup <A, u_0 o ... o u_{k-1}> over unit vectors, and the
// error of a sketch in that norm and in the Frobenius norm.
//
// The spectral norm of a tensor of order >= 3 is NP-hard in general, so it is bracketed:
//   lower: the higher-order power method (alternating rank-1 updates
//          u_j <- A x_{l != j} u_l / ||.||) from the leading eigenvectors of the unfolding Grams
//          and from `random_starts` Gaussian starts: every start runs 10 sweeps, the best one
//          continues up to max_iterations sweeps. Its value is attained by unit vectors, so it is
//          a true lower bound up to rounding; it can lie below the norm when the method stops
//          in a local maximum or before convergence (on random-like error tensors it creeps up
//          slowly: a few per cent between 30 and 300 sweeps).
//   upper: min_j ||M_j(A)||_2, the smallest unfolding norm.
// For order 2 both are the exact matrix norm (exact = true), from the Gram of the shorter side.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "../random/philox.hpp"
#include "detail/mode_gram.hpp"
#include "sparse_tensor.hpp"
#include "tensor_view.hpp"

namespace randattn {

struct SpectralNormOptions {
  int random_starts = 4;     // Gaussian starts besides the unfolding start
  int max_iterations = 100;  // sweeps over the modes for the best start
  double tolerance = 1e-7;   // stop when the value changes by less than tolerance * value
  std::uint64_t seed = 0;    // Philox seed of the random starts
};

struct SpectralNormEstimate {
  double lower = 0;    // attained value of <A, u_0 o ... o u_{k-1}>
  double upper = 0;    // min_j ||M_j(A)||_2
  bool exact = false;  // order 2: lower == upper == ||A||_2
  double value() const { return lower; }
};

namespace detail {

// Contraction of a contiguous row-major tensor with u_l on every mode l != mode; returns a
// vector of length d_mode. Trailing modes are contracted with one matrix-vector product against
// their Kronecker product, then the leading ones likewise.
template <typename Scalar>
Vector<Scalar> contract_except(const Scalar* data, const std::vector<Index>& dims,
                               const std::vector<Vector<Scalar>>& u, Index mode) {
  const ModeSplit split(dims, mode);
  auto kron = [&](Index from, Index to) {
    Vector<Scalar> w = Vector<Scalar>::Ones(1);
    for (Index l = from; l < to; ++l) {
      const Vector<Scalar>& ul = u[std::size_t(l)];
      Vector<Scalar> next(w.size() * ul.size());
      for (Index i = 0; i < w.size(); ++i) next.segment(i * ul.size(), ul.size()) = w(i) * ul;
      w.swap(next);
    }
    return w;
  };
  using CMap = Eigen::Map<const RowMatrix<Scalar>>;
  Vector<Scalar> y(split.outer * split.dim);
  y.noalias() =
      CMap(data, split.outer * split.dim, split.inner) * kron(mode + 1, Index(dims.size()));
  Vector<Scalar> v(split.dim);
  v.noalias() = CMap(y.data(), split.outer, split.dim).transpose() * kron(0, mode);
  return v;
}

// Higher-order power method: `sweeps` rounds of u_j <- A x_{l != j} u_l / ||.|| over all modes
// (u is updated in place), stopping early once the value changes by less than tolerance * value.
// Returns the value <A, u_0 o ... o u_{k-1}> reached.
template <typename Scalar>
double power_method(const Scalar* data, const std::vector<Index>& dims,
                    std::vector<Vector<Scalar>>& u, int sweeps, double tolerance) {
  double value = 0;
  for (int it = 0; it < sweeps; ++it) {
    const double previous = value;
    for (Index j = 0; j < Index(dims.size()); ++j) {
      Vector<Scalar> v = contract_except(data, dims, u, j);
      value = double(v.norm());
      if (value == 0) return 0;  // the start is orthogonal to A
      u[std::size_t(j)] = v / Scalar(value);
    }
    if (it > 0 && std::abs(value - previous) <= tolerance * value) break;
  }
  return value;
}

constexpr int kProbeSweeps = 10;

}  // namespace detail

// Bounds on the spectral norm of a tensor (anything tensor_view() accepts); see the header.
template <typename T>
SpectralNormEstimate spectral_norm(const T& tensor, const SpectralNormOptions& opt = {}) {
  const auto a = tensor_view(tensor);
  using Scalar = typename std::decay_t<decltype(a)>::Scalar;
  const char* where = "spectral_norm";
  detail::require(opt.random_starts >= 0 && opt.max_iterations >= 1 && opt.tolerance >= 0, where,
                  "need random_starts >= 0, max_iterations >= 1 and tolerance >= 0");
  SpectralNormEstimate est;
  if (a.size() == 0) {
    est.exact = a.order() == 2;
    return est;
  }
  Vector<Scalar> storage;
  const Scalar* data = detail::row_major_data(a, storage);
  detail::require_finite(data, a.size(), where, "the tensor");

  const Index k = a.order();
  std::vector<Vector<Scalar>> start(static_cast<std::size_t>(k));
  est.upper = std::numeric_limits<double>::infinity();
  for (Index j = 0; j < k; ++j) {
    if (k == 2 && a.dim(j) > a.dim(1 - j)) continue;  // the shorter side's Gram suffices
    const RowMatrix<Scalar> g = detail::dense_mode_gram(data, a.dims(), j);
    RowMatrix<Scalar> vec;
    Vector<Scalar> val;
    detail::top_eigenvectors(g, 1, vec, val);
    start[std::size_t(j)] = vec.col(0);
    est.upper = std::min(est.upper, std::sqrt(std::max(0.0, double(val(0)))));
    if (k == 2) break;
  }
  if (k == 2) {
    est.lower = est.upper;
    est.exact = true;
    return est;
  }
  // Every start runs a few sweeps; the best one then runs to convergence.
  std::vector<std::vector<Vector<Scalar>>> starts{start};
  for (int s = 0; s < opt.random_starts; ++s) {
    const Philox rng(opt.seed, std::uint32_t(s));  // start s, entry i of mode j: draw (i, j)
    for (Index j = 0; j < k; ++j) {
      Vector<Scalar>& u = start[std::size_t(j)];
      for (Index i = 0; i < u.size(); ++i)
        u(i) = Scalar(rng.gaussian(std::uint64_t(i), std::uint32_t(j)));
      u.normalize();
    }
    starts.push_back(start);
  }
  const int probe = std::min(detail::kProbeSweeps, opt.max_iterations);
  std::size_t best = 0;
  for (std::size_t s = 0; s < starts.size(); ++s) {
    const double value = detail::power_method(data, a.dims(), starts[s], probe, opt.tolerance);
    if (value > est.lower) {
      est.lower = value;
      best = s;
    }
  }
  if (opt.max_iterations > probe) {
    est.lower =
        std::max(est.lower, detail::power_method(data, a.dims(), starts[best],
                                                 opt.max_iterations - probe, opt.tolerance));
  }
  est.lower = std::min(est.lower, est.upper);  // rounding can put an attained value a hair above
  return est;
}

// Errors of a sketch A_hat of A: ||A - A_hat||_F / ||A||_F (exact) and the spectral-norm ratio
// ||A - A_hat|| / ||A|| (exact for order 2, the ratio of the power-method estimates otherwise).
// Pass norm_a = spectral_norm(A, opt) to reuse it across several sketches of the same tensor.
struct SketchError {
  double relative_frobenius = 0;
  double relative_spectral = 0;
  bool spectral_exact = false;
};

template <typename T, typename Scalar>
SketchError sketch_error(const T& tensor, const SparseTensor<Scalar>& sketch,
                         const SpectralNormOptions& opt = {},
                         std::optional<SpectralNormEstimate> norm_a = std::nullopt) {
  const auto a = tensor_view(tensor);
  static_assert(std::is_same<typename std::decay_t<decltype(a)>::Scalar, Scalar>::value,
                "the tensor and the sketch must share the scalar type");
  const char* where = "sketch_error";
  detail::require(a.dims() == sketch.dims(), where, "the tensor has shape ",
                  detail::dims_str(a.dims()), " but the sketch ", detail::dims_str(sketch.dims()));
  Vector<Scalar> storage;
  const Scalar* data = detail::row_major_data(a, storage);
  const Eigen::Map<const Vector<Scalar>> dense(data, a.size());
  const Vector<Scalar> diff = dense - densify(sketch);
  const double fro_a = double(dense.norm());
  detail::require(fro_a > 0, where, "the tensor is all zero");
  if (!norm_a) norm_a = spectral_norm(TensorView<Scalar>(data, a.dims()), opt);
  SketchError err;
  err.relative_frobenius = double(diff.norm()) / fro_a;
  err.relative_spectral =
      spectral_norm(TensorView<Scalar>(diff.data(), a.dims()), opt).value() / norm_a->value();
  err.spectral_exact = norm_a->exact;
  return err;
}

}  // namespace randattn
