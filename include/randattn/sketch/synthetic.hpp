#pragma once
// Reproducible test tensors for sketching: a Tucker low-rank signal plus Gaussian noise, with
// optional spikes (a few large entries).
//
//   A = G x_0 U_0 x_1 U_1 ... x_{k-1} U_{k-1}  (scaled to ||.||_F = 1)
//       + noise * Z / sqrt(D)                  (Z standard Gaussian, so ||noise part||_F ~ noise)
//       + spike_size * (+-1 at `spikes` random positions)
// with U_j (d_j x r_j) orthonormal (QR of a Gaussian matrix) and G a Gaussian core. All draws come
// from one Philox seed (streams 0..k-1: U_j, k: G, k+1: Z, k+2: spikes).

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>
#include <vector>

#include <Eigen/Core>
#include <Eigen/QR>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "../random/fill.hpp"
#include "../random/philox.hpp"
#include "tensor_view.hpp"

namespace randattn {

template <typename Scalar>
struct SyntheticTensor {
  std::vector<Index> dims;
  Vector<Scalar> data;                     // row-major entries
  std::vector<RowMatrix<Scalar>> factors;  // the U_j of the signal

  TensorView<Scalar> view() const { return TensorView<Scalar>(data.data(), dims); }
};

struct SyntheticOptions {
  double noise = 0;       // Frobenius size of the noise relative to the unit-norm signal
  Index spikes = 0;       // number of spikes
  double spike_size = 0;  // magnitude of each spike
  bool flat_factors =
      false;  // U_j from random signs (entries near +-1/sqrt(d_j)) instead of Gaussians
};

template <typename Scalar>
SyntheticTensor<Scalar> low_rank_plus_noise(const std::vector<Index>& dims,
                                            const std::vector<Index>& ranks,
                                            const SyntheticOptions& opt, std::uint64_t seed) {
  const char* where = "low_rank_plus_noise";
  detail::require(dims.size() >= 2 && ranks.size() == dims.size(), where,
                  "need order >= 2 and one rank per mode, got shape ", detail::dims_str(dims),
                  " and ", ranks.size(), " ranks");
  const Index size = detail::checked_size(dims, where);
  for (std::size_t j = 0; j < dims.size(); ++j) {
    detail::require(ranks[j] >= 1 && ranks[j] <= dims[j], where, "rank ", ranks[j], " of mode ", j,
                    " must be in [1, ", dims[j], "]");
  }
  detail::require(opt.spikes >= 0 && opt.spikes <= size, where, "spikes must be in [0, ", size,
                  "]");
  const Philox rng(seed);
  const auto k = std::uint32_t(dims.size());

  SyntheticTensor<Scalar> out;
  out.dims = dims;
  // Core, then one mode product per mode: the current tensor is outer x r_j x inner, and each
  // slice X_p (r_j x inner) becomes U_j X_p (d_j x inner).
  std::vector<Index> cur = ranks;
  Index core_size = detail::checked_size(ranks, where);
  Eigen::VectorXd t(core_size);
  fill_gaussian(rng.with_stream(k), t);
  for (std::uint32_t j = 0; j < k; ++j) {
    Eigen::MatrixXd g(dims[j], ranks[j]);
    if (opt.flat_factors) {
      fill_rademacher(rng.with_stream(j), g);
    } else {
      fill_gaussian(rng.with_stream(j), g);
    }
    const Eigen::MatrixXd u = Eigen::HouseholderQR<Eigen::MatrixXd>(g).householderQ() *
                              Eigen::MatrixXd::Identity(dims[j], ranks[j]);
    out.factors.push_back(u.cast<Scalar>());
    const detail::ModeSplit split(cur, j);
    cur[j] = dims[j];
    Eigen::VectorXd next(split.outer * dims[j] * split.inner);
    using Map = Eigen::Map<RowMatrix<double>>;
    for (Index p = 0; p < split.outer; ++p) {
      Map(next.data() + p * dims[j] * split.inner, dims[j], split.inner).noalias() =
          u * Map(t.data() + p * split.dim * split.inner, split.dim, split.inner);
    }
    t.swap(next);
  }
  t /= t.norm();
  if (opt.noise != 0) {
    Eigen::VectorXd z(size);
    fill_gaussian(rng.with_stream(k + 1), z);
    t += (opt.noise / std::sqrt(double(size))) * z;
  }
  const Philox spikes = rng.with_stream(k + 2);
  for (Index s = 0; s < opt.spikes; ++s) {
    const Philox::Bits b = spikes.bits(std::uint64_t(s));
    const std::uint64_t r = (std::uint64_t(b[1]) << 32) | b[0];
    t(Index(r % std::uint64_t(size))) += (b[2] & 1u ? 1 : -1) * opt.spike_size;
  }
  out.data = t.cast<Scalar>();
  return out;
}

}  // namespace randattn
