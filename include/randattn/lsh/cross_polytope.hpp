#pragma once
// Cross-polytope LSH with b buckets and r rounds: h(x) = argmax([x R; -x R]) per round, R the
// round's rotation restricted to its first b/2 coordinates (see rotation.hpp). Bucket k < b/2
// means coordinate k is the largest in absolute value and positive, bucket b/2 + k that it is
// negative. Ties go to the first entry of [x R; -x R] (so a zero vector lands in bucket 0).
// The hash is invariant to positive scaling of x, which is why Reformer's normalised keys and
// their unnormalised queries share buckets.
//
// Hashing is vectorised over blocks of tokens: one product (dense) or one block transform
// (Hadamard) per block and round, then an argmax along contiguous rows of tokens. Blocks are
// independent, so they run in parallel and the codes do not depend on the thread count.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <variant>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "rotation.hpp"

namespace randattn {

enum class RotationKind { dense, hadamard };

// Bucket codes: one row per token, one column per round; entries in [0, buckets).
using HashCodes = Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

namespace detail {

constexpr Index kHashBlock = 64;  // tokens per block: the rotation work buffer stays in cache

// argmax over [y; -y] for tokens t0 .. t0 + W of the h x B block `proj`, token by token into
// codes[t * stride]. The comparisons are strict, so the first maximal entry wins, positive part
// before negative. A strip of W tokens keeps its running maxima in registers while the loop walks
// down the coordinates; indices are kept in Scalar (exact, h <= 2^23) so each step is one
// compare-and-blend per lane.
template <int W, typename Proj>
void cross_polytope_argmax_strip(const Proj& proj, Index t0, std::int32_t* codes, Index stride) {
  using Scalar = typename Proj::Scalar;
  Scalar pos[W], pos_arg[W], neg[W], neg_arg[W];
  for (int l = 0; l < W; ++l) {
    pos[l] = neg[l] = -std::numeric_limits<Scalar>::infinity();
    pos_arg[l] = neg_arg[l] = 0;
  }
  const Index half = proj.rows();
  for (Index k = 0; k < half; ++k) {
    const Scalar* y = &proj.coeffRef(k, t0);
    const auto kk = static_cast<Scalar>(k);
    for (int l = 0; l < W; ++l) {
      const bool up = y[l] > pos[l], un = -y[l] > neg[l];
      pos[l] = up ? y[l] : pos[l];
      pos_arg[l] = up ? kk : pos_arg[l];
      neg[l] = un ? -y[l] : neg[l];
      neg_arg[l] = un ? kk : neg_arg[l];
    }
  }
  for (int l = 0; l < W; ++l)
    codes[(t0 + l) * stride] = static_cast<std::int32_t>(pos[l] >= neg[l] ? pos_arg[l] : neg_arg[l] + Scalar(half));
}

// Bucket codes of the B tokens whose projections are the columns of `proj` (h x B, rows
// contiguous), written to codes[t * stride].
template <typename Proj>
void cross_polytope_argmax(const Proj& proj, std::int32_t* codes, Index stride) {
  constexpr int kStrip = 16;
  const Index cols = proj.cols();
  Index t0 = 0;
  for (; t0 + kStrip <= cols; t0 += kStrip) cross_polytope_argmax_strip<kStrip>(proj, t0, codes, stride);
  for (; t0 < cols; ++t0) cross_polytope_argmax_strip<1>(proj, t0, codes, stride);
}

}  // namespace detail

template <typename Scalar_>
class CrossPolytopeHash {
 public:
  using Scalar = Scalar_;
  static_assert(std::is_floating_point<Scalar>::value, "Scalar must be float or double");

  explicit CrossPolytopeHash(DenseRotation<Scalar> rotation) : rotation_(std::move(rotation)) {}
  explicit CrossPolytopeHash(HadamardRotation<Scalar> rotation) : rotation_(std::move(rotation)) {}

  // A rotation of the given kind drawn from `seed`.
  CrossPolytopeHash(RotationKind kind, Index dim, Index buckets, Index rounds, std::uint64_t seed)
      : rotation_(kind == RotationKind::dense ? Rotation(DenseRotation<Scalar>(dim, buckets, rounds, seed))
                                              : Rotation(HadamardRotation<Scalar>(dim, buckets, rounds, seed))) {}

  // A user-supplied dense R of shape (d, rounds, buckets / 2), given as a d x (rounds * buckets / 2)
  // row-major matrix (the C-order array).
  CrossPolytopeHash(RowMatrix<Scalar> r, Index rounds) : rotation_(DenseRotation<Scalar>(std::move(r), rounds)) {}

  RotationKind kind() const { return rotation_.index() == 0 ? RotationKind::dense : RotationKind::hadamard; }
  Index dim() const { return visit([](const auto& r) { return r.dim(); }); }
  Index buckets() const { return visit([](const auto& r) { return r.buckets(); }); }
  Index rounds() const { return visit([](const auto& r) { return r.rounds(); }); }

  // nullptr when the rotation is of the other kind.
  const DenseRotation<Scalar>* dense_rotation() const { return std::get_if<0>(&rotation_); }
  const HadamardRotation<Scalar>* hadamard_rotation() const { return std::get_if<1>(&rotation_); }

  // Bucket codes of the rows of x (n x dim): n x rounds.
  HashCodes hash(const Eigen::Ref<const RowMatrix<Scalar>>& x, bool check_finite = true) const {
    const char* where = "CrossPolytopeHash::hash";
    detail::require(x.rows() == 0 || x.cols() == dim(), where, "x is ", detail::shape_of(x),
                    " but the hash was built for dimension ", dim());
    detail::require_finite(x, where, "x", check_finite);
    const Index n = x.rows(), r = rounds();
    HashCodes codes(n, r);
    const Index blocks = (n + detail::kHashBlock - 1) / detail::kHashBlock;
    detail::parallel_for(blocks, [&](Index b) {
      const Index i0 = b * detail::kHashBlock, rows = std::min(detail::kHashBlock, n - i0);
      RowMatrix<Scalar> work;
      for (Index round = 0; round < r; ++round) {
        visit([&](const auto& rot) {
          detail::cross_polytope_argmax(rot.project_round(x.middleRows(i0, rows), round, work),
                                        codes.data() + i0 * r + round, r);
        });
      }
    });
    return codes;
  }

 private:
  using Rotation = std::variant<DenseRotation<Scalar>, HadamardRotation<Scalar>>;

  template <typename Fn>
  decltype(auto) visit(Fn&& fn) const {
    return std::visit(std::forward<Fn>(fn), rotation_);
  }

  Rotation rotation_;
};

}  // namespace randattn
