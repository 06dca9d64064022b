#pragma once
// Structured pseudo-random rotations R_b = p^{-3/2} H D_{b,3} H D_{b,2} H D_{b,1}, b = 0 .. B-1
// (Ailon and Chazelle's fast Johnson–Lindenstrauss transform iterated three times, as in the
// cross-polytope LSH of Andoni et al., 2015, and the structured random features of Yu et al.,
// 2016). H is the unnormalised Walsh–Hadamard matrix of size p, a power of two, and the D are
// independent random +-1 diagonals; H / sqrt(p) is orthogonal, so every R_b is. An input x of
// length d <= p is zero-padded: R_b [x; 0].
//
// The rotation maps vectors to the concatenation [R_0 x; R_1 x; ...] of B p coordinates, of
// which a caller takes the first k (apply), or reads one block (apply_block). Consumers that
// reduce the coordinates on the fly (a hash's argmax, a filter's threshold) call transform_tile,
// which leaves one block's coordinates of a tile of vectors in a coordinate-major buffer.
//
// The diagonals are a pure function of (Philox seed and stream, indexing): entry i of D_{b,k+1}
// (k = 0, 1, 2) is rademacher(3 b + k, i) with SignIndexing::by_diagonal, rademacher(b, k p + i)
// with SignIndexing::by_block. Both layouts exist so that earlier draws stay reproducible; they
// are equally good. Every coordinate is computed by the same additions whatever the tile size
// or thread count.
//
// Cost: O(p log p) per vector and block; a tile of vectors is transformed together, SIMD across
// vectors (linalg/hadamard.hpp).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/transpose.hpp"
#include "../detail/validation.hpp"
#include "../random/fill.hpp"
#include "../random/philox.hpp"
#include "hadamard.hpp"

namespace randattn {

// Philox counters of the +-1 diagonals; see the header comment.
enum class SignIndexing { by_diagonal, by_block };

template <typename Scalar_>
class StructuredRotation {
 public:
  using Scalar = Scalar_;

  StructuredRotation() = default;

  // B = blocks rotations of R^p, p = next_power_of_two(max(dim, min_padded_dim)): min_padded_dim
  // asks for at least that many coordinates per block.
  StructuredRotation(Index dim, Index blocks, const Philox& signs,
                     SignIndexing indexing = SignIndexing::by_diagonal, Index min_padded_dim = 1)
      : dim_(dim), blocks_(blocks) {
    const char* where = "StructuredRotation";
    detail::require(dim >= 1 && blocks >= 1 && min_padded_dim >= 1, where,
                    "need dim >= 1, blocks >= 1 and min_padded_dim >= 1, got dim = ", dim,
                    ", blocks = ", blocks, ", min_padded_dim = ", min_padded_dim);
    detail::require(std::max(dim, min_padded_dim) <= (Index(1) << 30), where,
                    "padded dimension above 2^30: dim = ", dim,
                    ", min_padded_dim = ", min_padded_dim);
    padded_ = next_power_of_two(std::max(dim, min_padded_dim));
    input_padded_ = next_power_of_two(dim);
    diagonals_.resize(3 * blocks, padded_);
    if (indexing == SignIndexing::by_diagonal) {
      fill_rademacher(signs, diagonals_);
    } else {
      // The blocks x 3p fill, row b = [D_{b,1} D_{b,2} D_{b,3}], stored as the (3 blocks) x p
      // matrix it is in row-major order.
      Eigen::Map<RowMatrix<Scalar>> by_block(diagonals_.data(), blocks, 3 * padded_);
      fill_rademacher(signs, by_block);
    }
    scale_ = static_cast<Scalar>(std::pow(double(padded_), -1.5));
  }

  Index dim() const { return dim_; }
  Index blocks() const { return blocks_; }
  Index padded_dim() const { return padded_; }
  Index outputs() const { return blocks_ * padded_; }
  // p^{-3/2}, the factor that makes H D H D H D orthogonal.
  Scalar scale() const { return scale_; }
  // (3 blocks) x p: row 3 b + k holds D_{b,k+1}.
  const RowMatrix<Scalar>& diagonals() const { return diagonals_; }

  // Rows of x (n x dim) to the first k = out.cols() <= outputs() coordinates of
  // [R_0 x_i; R_1 x_i; ...]: out is n x k (any row-major block).
  template <typename Out>
  void apply(const Eigen::Ref<const RowMatrix<Scalar>>& x, Out&& out) const {
    check_apply("StructuredRotation::apply", x, out, outputs());
    apply_blocks(x, 0, nullptr, out);
  }

  // As apply, with output column c multiplied by column_scale(c) in place of p^{-3/2}: the
  // unnormalised H D H D H D x times a per-output factor (one rounding per output).
  template <typename Out>
  void apply(const Eigen::Ref<const RowMatrix<Scalar>>& x,
             const Eigen::Ref<const Vector<Scalar>>& column_scale, Out&& out) const {
    const char* where = "StructuredRotation::apply";
    check_apply(where, x, out, outputs());
    detail::require(column_scale.size() == out.cols(), where, "column_scale has ",
                    column_scale.size(), " entries for ", out.cols(), " output columns");
    apply_blocks(x, 0, column_scale.data(), out);
  }

  // The first k = out.cols() <= p coordinates of R_block x_i: out is n x k.
  template <typename Out>
  void apply_block(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index block, Out&& out) const {
    const char* where = "StructuredRotation::apply_block";
    detail::require(block >= 0 && block < blocks_, where, "block ", block, " outside [0, ", blocks_,
                    ")");
    check_apply(where, x, out, padded_);
    apply_blocks(x, block, nullptr, out);
  }

  // The first `rows` coordinates (rows a power of two <= p) of the unnormalised
  // H D_{block,3} H D_{block,2} H D_{block,1} [x_t; 0] for the `count` vectors x_t at x (row
  // stride x_stride), coordinate-major: coordinate j of vector t lands in work[j * ld + t].
  // work must hold p rows of ld >= count scalars (all of them are used as scratch). Unchecked.
  //
  // Two identities of the Sylvester ordering, H_p = H_{p/m} (x) H_m, skip work that cannot change
  // the result: [u; 0] with u of length m transforms to p/m copies of H_m u (exactly: the
  // skipped butterflies add zeros), and the top `rows` coordinates of H_p z are
  // H_rows (z_0 + z_1 + ...), z_i the consecutive `rows`-blocks of z, summed in order.
  void transform_tile(const Scalar* x, Index x_stride, Index count, Index block, Index rows,
                      Scalar* work, Index ld) const {
    using WorkMap = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
    WorkMap w(work, padded_, count, Eigen::OuterStride<>(ld));
    const Scalar* d1 = &diagonals_(3 * block, 0);
    const Scalar* d2 = &diagonals_(3 * block + 1, 0);
    const Scalar* d3 = &diagonals_(3 * block + 2, 0);
    const Scalar* none = nullptr;
    const Index m = input_padded_;
    detail::transpose_scaled(x, x_stride, count, dim_, d1, work, ld);
    w.middleRows(dim_, m - dim_).setZero();
    detail::fwht_columns_unchecked(work, m, count, ld, none);
    for (Index b = 1; b < padded_ / m; ++b) w.middleRows(b * m, m) = w.topRows(m);
    detail::fwht_columns_unchecked(work, padded_, count, ld, d2);
    if (rows == padded_) {
      detail::fwht_columns_unchecked(work, padded_, count, ld, d3);
      return;
    }
    fold_signed(work, ld, count, rows, d3);
    detail::fwht_columns_unchecked(work, rows, count, ld, none);
  }

 private:
  // Rows [0, rows) of the p-row work buffer become the sums over b, in order, of d[b·rows + i]
  // times row b·rows + i (columns [0, count)), on packets: the ±1 products are exact, so these
  // are the bits of scaling every row and then adding the blocks, which Eigen block expressions
  // did as calls that GCC 12 inlines at -O3 only.
  void fold_signed(Scalar* work, Index ld, Index count, Index rows, const Scalar* d) const {
    namespace ei = Eigen::internal;
    using Packet = typename ei::packet_traits<Scalar>::type;
    constexpr Index kP = ei::packet_traits<Scalar>::size;
    const Index full = count - count % kP;
    for (Index i = 0; i < rows; ++i) {
      Scalar* out = work + i * ld;
      for (Index t = 0; t < full; t += kP) {
        Packet a = ei::pmul(ei::ploadu<Packet>(out + t), ei::pset1<Packet>(d[i]));
        for (Index r = i + rows; r < padded_; r += rows)
          a = ei::padd(a, ei::pmul(ei::ploadu<Packet>(work + r * ld + t), ei::pset1<Packet>(d[r])));
        ei::pstoreu(out + t, a);
      }
      for (Index t = full; t < count; ++t) {
        Scalar a = out[t] * d[i];
        for (Index r = i + rows; r < padded_; r += rows) a += work[r * ld + t] * d[r];
        out[t] = a;
      }
    }
  }

  template <typename Out>
  void check_apply(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& x, const Out& out,
                   Index max_cols) const {
    detail::require(
        x.cols() == dim_ && out.rows() == x.rows() && out.cols() >= 0 && out.cols() <= max_cols,
        where, "x is ", detail::shape_of(x), " and out ", detail::shape_of(out), ", expected n x ",
        dim_, " and n x k with k <= ", max_cols);
  }

  // out (n x k) = the k coordinates from block `first` on, each times column_scale (null:
  // scale_). Tiles of vectors are independent, so they run in parallel. A partial last block is
  // transformed in full rather than folded, so a coordinate's rounding does not depend on k.
  template <typename Out>
  void apply_blocks(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index first,
                    const Scalar* column_scale, Out& out) const {
    const Index n = x.rows(), k = out.cols();
    if (n == 0 || k == 0) return;
    // At most 2^16 scalars of scratch per tile, between 32 and 256 vectors.
    const Index tile = std::clamp<Index>((Index(1) << 16) / padded_, 32, 256);
    detail::parallel_for((n + tile - 1) / tile, [&](Index t) {
      const Index i0 = t * tile, count = std::min(tile, n - i0);
      RowMatrix<Scalar> work(padded_, count);
      for (Index c0 = 0; c0 < k; c0 += padded_) {
        const Index cols = std::min(padded_, k - c0);
        transform_tile(x.data() + i0 * x.outerStride(), x.outerStride(), count,
                       first + c0 / padded_, padded_, work.data(), count);
        for (Index j = 0; j < cols; ++j)
          work.row(j) *= column_scale ? column_scale[c0 + j] : scale_;
        auto target = out.block(i0, c0, count, cols);
        using Target = decltype(target);
        if constexpr (bool(Target::IsRowMajor) && bool(Target::Flags & Eigen::DirectAccessBit) &&
                      Target::InnerStrideAtCompileTime == 1) {
          detail::transpose_scaled(work.data(), count, cols, count,
                                   static_cast<const Scalar*>(nullptr), target.data(),
                                   target.outerStride());
        } else {
          target = work.topRows(cols).transpose();
        }
      }
    });
  }

  Index dim_ = 0;
  Index blocks_ = 0;
  Index padded_ = 0;        // p
  Index input_padded_ = 0;  // next_power_of_two(dim) <= p
  Scalar scale_ = 1;
  RowMatrix<Scalar> diagonals_;  // (3 blocks) x p, entries +-1
};

}  // namespace randattn
