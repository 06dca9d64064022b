#pragma once
// Closed-form mean squared error of the kernel estimates, relative to the kernel squared:
// E[(K̂(x,y) − K(x,y))²] / K(x,y)² for K = exp(xᵀy), at a pair of normalised inputs (rows times
// the data normaliser), with the m projection rows i.i.d. N(0, I_d). With z = x + y:
//
//   positive (FAVOR+)  (e^{‖z‖²} − 1)/m                         (Performer, Lemma 2)
//   hyperbolic         (cosh ‖z‖² − 1)/m                         (one draw: e^{−…}cosh(ωᵀz))
//   trig               2 sinh²(‖x − y‖²/2)/m                     (Performer, Lemma 2)
//   OPRF, SDERF        (e^{L(z)} − 1)/m, L from oprf.hpp / dense_exponential.hpp
//
// (trig: Var cos(ωᵀΔ) = ½(1 − e^{−‖Δ‖²})², times e^{‖x‖²+‖y‖²}/m, over K² = e^{‖x‖²+‖y‖²−‖Δ‖²}.)
// Orthogonal rows with χ(d) norms have the same marginals and, for the positive maps, a lower
// MSE (Performer, Theorem 2; Chefs' Random Tables for OPRF): the i.i.d. value is then an upper
// bound. mean_kernel_relative_mse averages over query-key pairs, so that m can be chosen
// before running.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "../random/philox.hpp"
#include "../random/streams.hpp"
#include "dense_exponential.hpp"
#include "feature_maps.hpp"
#include "oprf.hpp"

namespace randattn {

namespace detail {
using PairVector = Eigen::Ref<const Eigen::VectorXd>;
}  // namespace detail

template <typename S, typename P>
double kernel_relative_mse(const PositiveFeatures<S, P>& map, const detail::PairVector& x,
                           const detail::PairVector& y) {
  return std::expm1((x + y).squaredNorm()) / double(map.projections());
}

template <typename S, typename P>
double kernel_relative_mse(const HyperbolicFeatures<S, P>& map, const detail::PairVector& x,
                           const detail::PairVector& y) {
  const double h = std::sinh(0.5 * (x + y).squaredNorm());
  return 2 * h * h / double(map.projections());
}

template <typename S, typename P>
double kernel_relative_mse(const TrigFeatures<S, P>& map, const detail::PairVector& x,
                           const detail::PairVector& y) {
  const double h = std::sinh(0.5 * (x - y).squaredNorm());
  return 2 * h * h / double(map.projections());
}

template <typename S, typename P>
double kernel_relative_mse(const OptimalPositiveFeatures<S, P>& map, const detail::PairVector& x,
                           const detail::PairVector& y) {
  return std::expm1(map.log_second_moment_ratio(x + y)) / double(map.projections());
}

template <typename S, typename P>
double kernel_relative_mse(const DenseExponentialFeatures<S, P>& map, const detail::PairVector& x,
                           const detail::PairVector& y) {
  return std::expm1(map.log_second_moment_ratio(x + y)) / double(map.projections());
}

// Mean of kernel_relative_mse over the pairs (normaliser·q_i, normaliser·k_j): every pair when
// n_q·n_k <= pairs, otherwise `pairs` pairs drawn uniformly (Philox(seed), a fixed sample).
template <typename Map>
double mean_kernel_relative_mse(const Map& map,
                                const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
                                const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
                                double normaliser, Index pairs = 1024, std::uint64_t seed = 0) {
  const char* where = "mean_kernel_relative_mse";
  detail::require(
      q.rows() >= 1 && k.rows() >= 1 && q.cols() == map.input_dim() && k.cols() == map.input_dim(),
      where, "q (", detail::shape_of(q), ") and k (", detail::shape_of(k),
      ") need rows and the map's input dimension ", map.input_dim());
  detail::require(pairs >= 1, where, "pairs must be >= 1, got ", pairs);
  detail::require(normaliser > 0 && std::isfinite(normaliser), where,
                  "normaliser must be positive and finite, got ", normaliser);
  const Index nq = q.rows(), nk = k.rows();
  const bool all = double(nq) * double(nk) <= double(pairs);
  const Index count = all ? nq * nk : pairs;
  const Philox rng(seed, streams::kernel_variance_pairs);
  Eigen::VectorXd x(map.input_dim()), y(map.input_dim());
  double sum = 0;
  for (Index p = 0; p < count; ++p) {
    const Index i =
        all ? p / nk : std::min(nq - 1, Index(rng.uniform(std::uint64_t(p), 0) * double(nq)));
    const Index j =
        all ? p % nk : std::min(nk - 1, Index(rng.uniform(std::uint64_t(p), 1) * double(nk)));
    x = normaliser * q.row(i).transpose().template cast<double>();
    y = normaliser * k.row(j).transpose().template cast<double>();
    sum += kernel_relative_mse(map, x, y);
  }
  return sum / double(count);
}

}  // namespace randattn
