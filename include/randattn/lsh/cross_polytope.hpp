#pragma once
// Cross-polytope LSH with b buckets and r rounds: h(x) = argmax([x R; -x R]) per round, R the
// round's rotation restricted to its first b/2 coordinates (see hashing/rotation.hpp). Bucket k <
// b/2 means coordinate k is the largest in absolute value and positive, bucket b/2 + k that it is
// negative. Ties go to the first entry of [x R; -x R] (so a zero vector lands in bucket 0).
// The hash is invariant to positive scaling of x, which is why Reformer's normalised keys and
// their unnormalised queries share buckets.
//
// Hashing is vectorised over tiles of 64 tokens: one product (dense) or one batched transform
// (Hadamard, SIMD across the tile's vectors) per tile and round into a coordinate-major buffer
// that the tile reuses, then the argmax over [y; -y] along contiguous rows of tokens, fused with
// the rotation's scale. Tiles are independent, so they run in parallel and the codes do not
// depend on the thread count.
//
// Which rotation. Per vector and round the dense rotation costs d h multiply-adds (one GEMM),
// the Hadamard rotation about 3 p log2(p) additions (three transforms of length p =
// next_power_of_two(max(d, h))) plus a transpose. Measured on one core (bench/bench_lsh, Hash
// rows, float, AVX-512) the dense rotation is faster while d h <= 6 p log2(p), e.g. d = 64 with
// b <= 64 buckets, and the Hadamard one beyond: about 1.3x at d = 64, b = 128, 3-4x at d = 256
// or 1024 with b = 512. default_rotation(d, b) applies that rule; the constructor without a
// RotationKind uses it. The two kinds draw different random functions from the same seed.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <variant>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/column_argmax.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "../hashing/detail/tiles.hpp"
#include "../hashing/hash_codes.hpp"
#include "../hashing/rotation.hpp"
#include "../linalg/hadamard.hpp"

namespace randattn {

namespace detail {

// Bucket codes of the `count` vectors whose h = half projections, times `scale` > 0, are the
// columns of y (h rows of stride ld), written to codes[t * stride]: the first maximum of
// [s y; -s y] down each column.
template <typename Scalar>
void cross_polytope_argmax(const Scalar* y, Index ld, Index half, Index count, Scalar scale,
                           std::int32_t* codes, Index stride) {
  column_argmax<true>(y, ld, half, count, scale, codes, stride);
}

}  // namespace detail

// The faster rotation at this shape (see the header comment): dense while
// dim * buckets / 2 <= 6 p log2(p), p = next_power_of_two(max(dim, buckets / 2)), else Hadamard.
inline RotationKind default_rotation(Index dim, Index buckets) {
  const Index half = std::max<Index>(buckets / 2, 1),
              p = next_power_of_two(std::max<Index>({dim, half, 1}));
  Index log2p = 0;
  while ((Index(1) << log2p) < p) ++log2p;
  return double(dim) * double(half) <= 6.0 * double(p) * double(log2p) ? RotationKind::dense
                                                                       : RotationKind::hadamard;
}

template <typename Scalar_>
class CrossPolytopeHash {
 public:
  using Scalar = Scalar_;
  static_assert(std::is_floating_point<Scalar>::value, "Scalar must be float or double");

  explicit CrossPolytopeHash(DenseRotation<Scalar> rotation) : rotation_(std::move(rotation)) {}
  explicit CrossPolytopeHash(HadamardRotation<Scalar> rotation) : rotation_(std::move(rotation)) {}

  // A rotation of the given kind drawn from `seed`.
  CrossPolytopeHash(RotationKind kind, Index dim, Index buckets, Index rounds, std::uint64_t seed)
      : rotation_(kind == RotationKind::dense
                      ? Rotation(DenseRotation<Scalar>(dim, buckets, rounds, seed))
                      : Rotation(HadamardRotation<Scalar>(dim, buckets, rounds, seed))) {}

  // The rotation of default_rotation(dim, buckets) drawn from `seed`.
  CrossPolytopeHash(Index dim, Index buckets, Index rounds, std::uint64_t seed)
      : CrossPolytopeHash(default_rotation(dim, buckets), dim, buckets, rounds, seed) {}

  // A user-supplied dense R of shape (d, rounds, buckets / 2), given as a d x (rounds * buckets /
  // 2) row-major matrix (the C-order array).
  CrossPolytopeHash(RowMatrix<Scalar> r, Index rounds)
      : rotation_(DenseRotation<Scalar>(std::move(r), rounds)) {}

  RotationKind kind() const {
    return rotation_.index() == 0 ? RotationKind::dense : RotationKind::hadamard;
  }
  Index dim() const {
    return visit([](const auto& r) { return r.dim(); });
  }
  Index buckets() const {
    return visit([](const auto& r) { return r.buckets(); });
  }
  Index rounds() const {
    return visit([](const auto& r) { return r.rounds(); });
  }

  // nullptr when the rotation is of the other kind.
  const DenseRotation<Scalar>* dense_rotation() const { return std::get_if<0>(&rotation_); }
  const HadamardRotation<Scalar>* hadamard_rotation() const { return std::get_if<1>(&rotation_); }

  // Bucket codes of the rows of x (n x dim): n x rounds.
  HashCodes hash(const Eigen::Ref<const RowMatrix<Scalar>>& x, bool check_finite = true) const {
    HashCodes codes(x.rows(), rounds());
    hash_into(x, codes, check_finite);
    return codes;
  }

  // The same into `codes` (x.rows() x rounds(), e.g. from detail::MatrixPool).
  void hash_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, HashCodes& codes,
                 bool check_finite = true) const {
    const char* where = "CrossPolytopeHash::hash";
    detail::require(x.rows() == 0 || x.cols() == dim(), where, "x is ", detail::shape_of(x),
                    " but the hash was built for dimension ", dim());
    detail::require_finite(x, where, "x", check_finite);
    const Index n = x.rows(), r = rounds();
    detail::require(codes.rows() == n && codes.cols() == r, where, "codes are ",
                    codes.rows(), "x", codes.cols(), ", expected ", n, "x", r);
    const Index chunks = (n + detail::kHashChunk - 1) / detail::kHashChunk;
    visit([&](const auto& rot) {
      detail::parallel_for(chunks, [&](Index c) {
        detail::Scratch<RowMatrix<Scalar>> work(work_rows(rot), detail::kHashTile);
        const Index end = std::min(n, (c + 1) * detail::kHashChunk);
        for (Index i0 = c * detail::kHashChunk; i0 < end; i0 += detail::kHashTile) {
          const Index count = std::min(detail::kHashTile, end - i0);
          for (Index round = 0; round < r; ++round)
            hash_tile(rot, x.middleRows(i0, count), round, work, &codes(i0, round));
        }
      });
    });
  }

 private:
  using Rotation = std::variant<DenseRotation<Scalar>, HadamardRotation<Scalar>>;

  // Rows of a tile's work buffer (its columns: detail::kHashTile vectors).
  Index work_rows(const DenseRotation<Scalar>&) const { return buckets() / 2; }
  Index work_rows(const HadamardRotation<Scalar>& rot) const {
    return rot.structured().padded_dim();
  }

  // Codes of one round for a tile of vectors, into codes[t * rounds]. The Hadamard rotation's
  // p^{-3/2} is applied inside the argmax, so its coordinates are read once.
  void hash_tile(const DenseRotation<Scalar>& rot,
                 const Eigen::Ref<const RowMatrix<Scalar>>& x_tile, Index round,
                 RowMatrix<Scalar>& work, std::int32_t* codes) const {
    const auto proj = rot.project_round(x_tile, round, work);
    detail::cross_polytope_argmax(proj.data(), proj.outerStride(), proj.rows(), proj.cols(),
                                  Scalar(1), codes, rounds());
  }
  void hash_tile(const HadamardRotation<Scalar>& rot,
                 const Eigen::Ref<const RowMatrix<Scalar>>& x_tile, Index round,
                 RowMatrix<Scalar>& work, std::int32_t* codes) const {
    const StructuredRotation<Scalar>& s = rot.structured();
    const Index count = x_tile.rows(), half = buckets() / 2;
    work.resize(s.padded_dim(), detail::kHashTile);
    s.transform_tile(x_tile.data(), x_tile.outerStride(), count, round, next_power_of_two(half),
                     work.data(), detail::kHashTile);
    detail::cross_polytope_argmax(work.data(), detail::kHashTile, half, count, s.scale(), codes,
                                  rounds());
  }

  template <typename Fn>
  decltype(auto) visit(Fn&& fn) const {
    return std::visit(std::forward<Fn>(fn), rotation_);
  }

  Rotation rotation_;
};

}  // namespace randattn
