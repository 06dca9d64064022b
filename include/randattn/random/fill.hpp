#pragma once
// Fills of Eigen blocks where entry (r, c) of the block is the draw at logical index
// (row0 + r, col0 + c). A sub-block filled on its own equals the same block cut from a
// larger fill, row- and column-major storage agree, and the thread count does not matter.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <cstdint>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "philox.hpp"

namespace randattn {

namespace detail {

template <typename Derived, typename Draw>
void fill_indexed(const Eigen::MatrixBase<Derived>& out_, Index row0, Index col0, Draw draw) {
  // Eigen's idiom for writing into a block or a Map passed as an expression.
  auto& out = const_cast<Eigen::MatrixBase<Derived>&>(out_);
  using Scalar = typename Derived::Scalar;
  require(row0 >= 0 && col0 >= 0, "fill", "row0 and col0 must be non-negative, got (", row0, ", ",
          col0, ")");
  require(col0 + out.cols() <= Index(UINT32_MAX), "fill", "column index exceeds 2^32 - 1");
  const Index rows = out.rows(), cols = out.cols();
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
#endif
  for (Index r = 0; r < rows; ++r) {
    for (Index c = 0; c < cols; ++c) {
      out(r, c) = static_cast<Scalar>(
          draw(static_cast<std::uint64_t>(row0 + r), static_cast<std::uint32_t>(col0 + c)));
    }
  }
}

}  // namespace detail

// Standard normal entries.
template <typename Derived>
void fill_gaussian(const Philox& rng, const Eigen::MatrixBase<Derived>& out, Index row0 = 0,
                   Index col0 = 0) {
  detail::fill_indexed(out, row0, col0,
                       [&](std::uint64_t i, std::uint32_t j) { return rng.gaussian(i, j); });
}

// Uniform entries on [0, 1).
template <typename Derived>
void fill_uniform(const Philox& rng, const Eigen::MatrixBase<Derived>& out, Index row0 = 0,
                  Index col0 = 0) {
  detail::fill_indexed(out, row0, col0,
                       [&](std::uint64_t i, std::uint32_t j) { return rng.uniform(i, j); });
}

// Entries +1 / -1 with probability 1/2.
template <typename Derived>
void fill_rademacher(const Philox& rng, const Eigen::MatrixBase<Derived>& out, Index row0 = 0,
                     Index col0 = 0) {
  detail::fill_indexed(out, row0, col0,
                       [&](std::uint64_t i, std::uint32_t j) { return rng.rademacher(i, j); });
}

// rows x cols entries N(0, sd^2): standard normal draws, rounded to Scalar, times sd.
template <typename Scalar>
RowMatrix<Scalar> gaussian_matrix(const Philox& rng, Index rows, Index cols, double sd = 1.0) {
  detail::require(rows >= 0 && cols >= 0, "gaussian_matrix", "negative shape ", rows, "x", cols);
  RowMatrix<Scalar> m(rows, cols);
  fill_gaussian(rng, m);
  if (sd != 1.0) m *= static_cast<Scalar>(sd);
  return m;
}

// rows x cols entries uniform on [lo, hi): uniform draws on [0, 1) mapped in double.
template <typename Scalar>
RowMatrix<Scalar> uniform_matrix(const Philox& rng, Index rows, Index cols, double lo = 0.0,
                                 double hi = 1.0) {
  detail::require(rows >= 0 && cols >= 0, "uniform_matrix", "negative shape ", rows, "x", cols);
  detail::require(lo <= hi && std::isfinite(lo) && std::isfinite(hi), "uniform_matrix",
                  "need finite lo <= hi, got [", lo, ", ", hi, ")");
  RowMatrix<Scalar> m(rows, cols);
  fill_uniform(rng, m);
  return (m.array().template cast<double>() * (hi - lo) + lo).matrix().template cast<Scalar>();
}

}  // namespace randattn
