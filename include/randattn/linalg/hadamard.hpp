#pragma once
// Fast Walsh–Hadamard transform, the building block of structured projections and of
// pseudo-random rotations. Unnormalised: applying it twice multiplies by n.

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/validation.hpp"

namespace randattn {

constexpr bool is_power_of_two(Index n) { return n > 0 && (n & (n - 1)) == 0; }

constexpr Index next_power_of_two(Index n) {
  Index p = 1;
  while (p < n) p <<= 1;
  return p;
}

// In-place transform of x[0..n), n a power of two; O(n log n).
template <typename Scalar>
void fwht_inplace(Scalar* x, Index n) {
  detail::require(is_power_of_two(n), "fwht_inplace", "length must be a power of two, got ", n);
  for (Index h = 1; h < n; h <<= 1) {
    for (Index i = 0; i < n; i += 2 * h) {
      Scalar* lo = x + i;
      Scalar* hi = x + i + h;
      for (Index j = 0; j < h; ++j) {
        const Scalar a = lo[j], b = hi[j];
        lo[j] = a + b;
        hi[j] = a - b;
      }
    }
  }
}

// Transforms every row of a row-major matrix whose column count is a power of two.
template <typename Scalar>
void fwht_rows(Eigen::Ref<RowMatrix<Scalar>> m) {
  detail::require(is_power_of_two(m.cols()), "fwht_rows", "column count must be a power of two, got ",
                  m.rows(), "x", m.cols());
  for (Index r = 0; r < m.rows(); ++r) fwht_inplace(m.row(r).data(), m.cols());
}

}  // namespace randattn
