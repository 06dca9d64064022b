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
//   x. O(p log p) per vector and round. The rounds are the blocks of one StructuredRotation
//   (linalg/structured_rotation.hpp).
//
// Which one hashes faster at a given shape: see default_rotation in lsh/cross_polytope.hpp.
// Shared by LSH (cross-polytope hashing) and LSF (Hadamard filters).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/gemm.hpp"
#include "../detail/validation.hpp"
#include "../linalg/structured_rotation.hpp"
#include "../random/fill.hpp"
#include "../random/philox.hpp"
#include "../random/streams.hpp"

namespace randattn {

// The two rotation families (see the top of this file); default_rotation in lsh/cross_polytope.hpp
// picks the faster one for cross-polytope hashing at a given shape.
enum class RotationKind { dense, hadamard };

namespace detail {

inline void check_rotation_shape(const char* where, Index dim, Index buckets, Index rounds) {
  require(dim >= 1, where, "dim must be >= 1, got ", dim);
  require(rounds >= 1, where, "rounds must be >= 1, got ", rounds);
  require(buckets >= 2 && buckets % 2 == 0 && buckets <= (Index(1) << 24), where,
          "buckets must be even and in [2, 2^24], got ", buckets);
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
    detail::require(rounds >= 1 && r_.cols() % rounds == 0 && r_.cols() / rounds >= 1, where, "R (",
                    detail::shape_of(r_),
                    ") must have rounds * (buckets / 2) columns, rounds = ", rounds);
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
  // A `work` with h rows and at least B columns is kept: resizing it would reallocate.
  template <typename X>
  auto project_round(const Eigen::MatrixBase<X>& x_block, Index round,
                     RowMatrix<Scalar>& work) const {
    const Index cols = x_block.rows();
    if (work.rows() != half_ || work.cols() < cols) work.resize(half_, cols);
    auto out = work.topLeftCorner(half_, cols);
    detail::gemm_fixed_depth(out, rt_.middleRows(round * half_, half_), x_block.transpose(),
                             false);
    return out;
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

  // Round `round` is block `round` of a StructuredRotation (linalg/structured_rotation.hpp):
  // diagonal k (0, 1, 2) of the round has entry Philox(seed, stream).rademacher(3 * round + k, i).
  HadamardRotation(Index dim, Index buckets, Index rounds, std::uint64_t seed)
      : half_(buckets / 2) {
    detail::check_rotation_shape("HadamardRotation", dim, buckets, rounds);
    rotation_ =
        StructuredRotation<Scalar>(dim, rounds, Philox(seed, streams::lsh_hadamard_rotation),
                                   SignIndexing::by_diagonal, half_);
  }

  Index dim() const { return rotation_.dim(); }
  Index rounds() const { return rotation_.blocks(); }
  Index buckets() const { return 2 * half_; }
  Index padded_dim() const { return rotation_.padded_dim(); }

  // Row 3 * round + k holds the +-1 diagonal D_{k+1} of that round.
  const RowMatrix<Scalar>& diagonals() const { return rotation_.diagonals(); }
  // The rounds as blocks of one structured rotation.
  const StructuredRotation<Scalar>& structured() const { return rotation_; }

  // The first h rotated coordinates of round `round` for a block of tokens: h x B, a view into
  // `work`.
  auto project_round(const Eigen::Ref<const RowMatrix<Scalar>>& x_block, Index round,
                     RowMatrix<Scalar>& work) const {
    const Index cols = x_block.rows();
    work.resize(padded_dim(), cols);
    if (cols > 0)
      rotation_.transform_tile(x_block.data(), x_block.outerStride(), cols, round,
                               next_power_of_two(half_), work.data(), cols);
    work.topRows(half_) *= rotation_.scale();
    return work.topRows(half_);
  }

  // Rotated copies of the rows of x (n x p), e.g. to check that norms are preserved.
  RowMatrix<Scalar> rotate(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index round) const {
    detail::require(x.cols() == dim() && round >= 0 && round < rounds(), "HadamardRotation::rotate",
                    "x is ", detail::shape_of(x), " and round ", round, "; expected ", dim(),
                    " columns and a round in [0, ", rounds(), ")");
    RowMatrix<Scalar> out(x.rows(), padded_dim());
    rotation_.apply_block(x, round, out);
    return out;
  }

 private:
  Index half_ = 0;
  StructuredRotation<Scalar> rotation_;
};

}  // namespace randattn
