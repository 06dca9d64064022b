#pragma once
// Random rotations for cross-polytope hashing with b buckets (h = b/2 coordinates) and r rounds.
//
// Both rotations map a block of B tokens (B x d, row-major) to the first h rotated coordinates
// of round `round`, laid out coordinates x tokens (h x B): the hash's argmax over coordinates
// then runs along contiguous vectors of tokens.
//
// DenseRotation: the Reformer's R of shape (d, r, h), a random Gaussian matrix per round (not
//   orthogonal; the argmax only needs a rotation-invariant distribution). Users may supply R,
//   e.g. a rotation buffer exported from a trained model. O(d h) per vector and round.
// HadamardRotation: the pseudo-random rotation of Andoni et al. (FALCONN),
//   y = H D3 H D2 H D1 [x; 0] / p^{3/2}, with independent random +-1 diagonals D1, D2, D3 per
//   round, H the Walsh-Hadamard matrix and p = next power of two >= max(d, h) (x is padded with
//   zeros; the h taken coordinates must exist). H / sqrt(p) is orthogonal, so y has the norm of
//   x. O(p log p) per vector and round.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/gemm.hpp"
#include "../detail/validation.hpp"
#include "../linalg/hadamard.hpp"
#include "../random/fill.hpp"
#include "../random/philox.hpp"
#include "../random/streams.hpp"

namespace randattn {

namespace detail {

inline void check_rotation_shape(const char* where, Index dim, Index buckets, Index rounds) {
  require(dim >= 1, where, "dim must be >= 1, got ", dim);
  require(rounds >= 1, where, "rounds must be >= 1, got ", rounds);
  require(buckets >= 2 && buckets % 2 == 0 && buckets <= (Index(1) << 24), where,
          "buckets must be even and in [2, 2^24], got ", buckets);
}

// Radix-2^M step of a column-wise Walsh-Hadamard transform on V adjacent tokens: levels h, 2h,
// ..., 2^{M-1} h at once on 2^M rows spaced `stride` apart, kept in registers across the levels.
// With Scaled, row m is first multiplied by sign[m] = +-1 (exact). Only exact products and the
// adds of the plain radix-2 levels occur, in the same order, so neither the grouping of levels
// nor the vector width changes a bit of the result.
#if defined(__GNUC__)
#define RANDATTN_ALWAYS_INLINE inline __attribute__((always_inline))
#define RANDATTN_UNROLL _Pragma("GCC unroll 8")
#else
#define RANDATTN_ALWAYS_INLINE inline
#define RANDATTN_UNROLL
#endif

template <int M, int V, bool Scaled, typename Scalar>
RANDATTN_ALWAYS_INLINE void fwht_strip(Scalar* __restrict base, Index stride, const Scalar* sign) {
  constexpr int kRows = 1 << M;
  Scalar a[kRows][V];
  RANDATTN_UNROLL
  for (int m = 0; m < kRows; ++m)
    for (int l = 0; l < V; ++l) a[m][l] = Scaled ? base[m * stride + l] * sign[m] : base[m * stride + l];
  RANDATTN_UNROLL
  for (int level = 1; level < kRows; level <<= 1) {
    RANDATTN_UNROLL
    for (int m = 0; m < kRows; ++m) {
      if (m & level) continue;
      for (int l = 0; l < V; ++l) {
        const Scalar x = a[m][l], y = a[m | level][l];
        a[m][l] = x + y;
        a[m | level][l] = x - y;
      }
    }
  }
  RANDATTN_UNROLL
  for (int m = 0; m < kRows; ++m)
    for (int l = 0; l < V; ++l) base[m * stride + l] = a[m][l];
}

template <int M, bool Scaled, typename Scalar>
void fwht_columns_step(Scalar* w, Index p, Index cols, Index h, const Scalar* diag) {
  constexpr int kRows = 1 << M, kWidth = int(128 / sizeof(Scalar));  // 8 rows x kWidth fit the vector registers
  const Index stride = h * cols;
  Scalar sign[kRows];
  for (Index i0 = 0; i0 < p; i0 += kRows * h) {
    for (Index j = i0; j < i0 + h; ++j) {
      for (int m = 0; m < kRows; ++m) sign[m] = Scaled ? diag[j + m * h] : Scalar(1);
      Scalar* row = w + j * cols;
      Index t = 0;
      for (; t + kWidth <= cols; t += kWidth) fwht_strip<M, kWidth, Scaled>(row + t, stride, sign);
      for (; t < cols; ++t) fwht_strip<M, 1, Scaled>(row + t, stride, sign);
    }
  }
}

// Walsh-Hadamard transform H diag(sign) of every column of a p x B row-major block (p a power of
// two, sign a +-1 vector or null): the butterflies combine whole rows, so the work runs along
// contiguous tokens, three levels per pass over the block.
template <typename Scalar>
void fwht_columns(Scalar* w, Index p, Index cols, const Scalar* sign = nullptr) {
  if (p == 1) {
    if (sign) Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>(w, cols) *= sign[0];
    return;
  }
  for (Index h = 1; h < p;) {
    const int levels = p / h >= 8 ? 3 : (p / h == 4 ? 2 : 1);
    if (levels == 3)
      sign ? fwht_columns_step<3, true>(w, p, cols, h, sign) : fwht_columns_step<3, false>(w, p, cols, h, sign);
    else if (levels == 2)
      sign ? fwht_columns_step<2, true>(w, p, cols, h, sign) : fwht_columns_step<2, false>(w, p, cols, h, sign);
    else
      sign ? fwht_columns_step<1, true>(w, p, cols, h, sign) : fwht_columns_step<1, false>(w, p, cols, h, sign);
    h <<= levels;
    sign = nullptr;
  }
}

}  // namespace detail

template <typename Scalar_>
class DenseRotation {
 public:
  using Scalar = Scalar_;

  DenseRotation() = default;

  // Draws R with i.i.d. N(0, 1) entries: entry (i, round, k) is Philox(seed, stream).gaussian(i,
  // round * h + k), so it does not depend on Scalar beyond rounding.
  DenseRotation(Index dim, Index buckets, Index rounds, std::uint64_t seed) {
    detail::check_rotation_shape("DenseRotation", dim, buckets, rounds);
    rounds_ = rounds;
    half_ = buckets / 2;
    r_ = gaussian_matrix<Scalar>(Philox(seed, streams::lsh_dense_rotation), dim, rounds * half_);
    rt_ = r_.transpose();
  }

  // Uses R as given: a C-order (d, rounds, h) array, i.e. a d x (rounds * h) row-major matrix
  // whose column block [round * h, (round + 1) * h) is round `round`.
  DenseRotation(RowMatrix<Scalar> r, Index rounds) : r_(std::move(r)) {
    const char* where = "DenseRotation";
    detail::require(rounds >= 1 && r_.cols() % rounds == 0 && r_.cols() / rounds >= 1, where,
                    "R (", detail::shape_of(r_), ") must have rounds * (buckets / 2) columns, rounds = ",
                    rounds);
    detail::check_rotation_shape(where, r_.rows(), 2 * (r_.cols() / rounds), rounds);
    detail::require_finite(r_, where, "R");
    rounds_ = rounds;
    half_ = r_.cols() / rounds;
    rt_ = r_.transpose();
  }

  Index dim() const { return r_.rows(); }
  Index rounds() const { return rounds_; }
  Index buckets() const { return 2 * half_; }

  // d x (rounds * h), the C-order (d, rounds, h) array.
  const RowMatrix<Scalar>& matrix() const { return r_; }

  // (x_block R_round)^T: h x B, written into `work` (resized as needed) and returned as a view.
  template <typename X>
  auto project_round(const Eigen::MatrixBase<X>& x_block, Index round, RowMatrix<Scalar>& work) const {
    work.resize(half_, x_block.rows());
    detail::gemm_fixed_depth(work, rt_.middleRows(round * half_, half_), x_block.transpose(), false);
    return work.topRows(half_);
  }

 private:
  Index rounds_ = 0;
  Index half_ = 0;
  RowMatrix<Scalar> r_;   // d x (rounds * h)
  RowMatrix<Scalar> rt_;  // its transpose, the left factor of the h x B projections
};

template <typename Scalar_>
class HadamardRotation {
 public:
  using Scalar = Scalar_;

  HadamardRotation() = default;

  // Diagonal k (0, 1, 2) of round `round` has entry Philox(seed, stream).rademacher(3 * round + k, i).
  HadamardRotation(Index dim, Index buckets, Index rounds, std::uint64_t seed)
      : dim_(dim), rounds_(rounds), half_(buckets / 2) {
    detail::check_rotation_shape("HadamardRotation", dim, buckets, rounds);
    padded_ = next_power_of_two(std::max(dim, half_));
    signs_.resize(3 * rounds, padded_);
    fill_rademacher(Philox(seed, streams::lsh_hadamard_rotation), signs_);
    scale_ = static_cast<Scalar>(std::pow(double(padded_), -1.5));
  }

  Index dim() const { return dim_; }
  Index rounds() const { return rounds_; }
  Index buckets() const { return 2 * half_; }
  Index padded_dim() const { return padded_; }

  // Row 3 * round + k holds the +-1 diagonal D_{k+1} of that round.
  const RowMatrix<Scalar>& diagonals() const { return signs_; }

  // The first `rows` rotated coordinates of round `round` (rows a power of two, <= p) for a
  // block of tokens: rows x B, in the top of `work`. Two identities of the Sylvester ordering,
  // H_p = H_{p/m} (x) H_m, skip work that cannot change the result: [u; 0] with u of length
  // m = next_pow2(d) transforms to p/m copies of H_m u, and the top m rows of H_p z are
  // H_m (sum of the m-blocks of z).
  template <typename X>
  void rotate_round(const Eigen::MatrixBase<X>& x_block, Index round, Index rows, RowMatrix<Scalar>& work) const {
    const Index cols = x_block.rows(), m = next_power_of_two(dim_);
    const Scalar* d1 = &signs_(3 * round, 0);
    const Scalar* d2 = &signs_(3 * round + 1, 0);
    const Scalar* d3 = &signs_(3 * round + 2, 0);
    work.resize(padded_, cols);
    work.topRows(dim_) = x_block.transpose();
    work.middleRows(dim_, m - dim_).setZero();
    detail::fwht_columns(work.data(), m, cols, d1);
    for (Index b = 1; b < padded_ / m; ++b) work.middleRows(b * m, m) = work.topRows(m);
    detail::fwht_columns(work.data(), padded_, cols, d2);
    if (rows == padded_) {
      detail::fwht_columns(work.data(), padded_, cols, d3);
    } else {
      for (Index i = 0; i < padded_; ++i) work.row(i) *= d3[i];
      for (Index b = 1; b < padded_ / rows; ++b) work.topRows(rows) += work.middleRows(b * rows, rows);
      detail::fwht_columns<Scalar>(work.data(), rows, cols);
    }
    work.topRows(rows) *= scale_;
  }

  // The first h rotated coordinates: h x B, a view into `work`.
  template <typename X>
  auto project_round(const Eigen::MatrixBase<X>& x_block, Index round, RowMatrix<Scalar>& work) const {
    rotate_round(x_block, round, next_power_of_two(half_), work);
    return work.topRows(half_);
  }

  // Rotated copies of the rows of x (n x p), e.g. to check that norms are preserved.
  RowMatrix<Scalar> rotate(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index round) const {
    detail::require(x.cols() == dim_ && round >= 0 && round < rounds_, "HadamardRotation::rotate",
                    "x is ", detail::shape_of(x), " and round ", round, "; expected ", dim_,
                    " columns and a round in [0, ", rounds_, ")");
    RowMatrix<Scalar> work;
    rotate_round(x, round, padded_, work);
    return work.transpose();
  }

 private:
  Index dim_ = 0;
  Index rounds_ = 0;
  Index half_ = 0;
  Index padded_ = 0;
  Scalar scale_ = 1;         // 1 / p^{3/2}: makes H D3 H D2 H D1 orthogonal
  RowMatrix<Scalar> signs_;  // (3 * rounds) x p, entries +-1
};

}  // namespace randattn
