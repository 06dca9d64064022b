#pragma once
// The short, wide products of linear attention (chunk rows against a feature state, feature rows
// against a chunk's values, a chunk's queries against its keys), without packing the operands.
// Eigen's GEMM copies both operands into panels on every call; for a 32 × 256 × 64 product that
// copy costs a third of the multiply. Here b and out are row-major with unit column stride, so a
// row of b is loaded as packets in place, and each entry of a is broadcast from where it lies
// (any strides: a may be the transpose of a row-major block). A tile of R rows × P packets of
// columns stays in registers over the whole depth, which runs in order k = 0, 1, …: the result
// is a function of the shapes alone, never of the thread count. lower_row_dots gives the lower
// triangle of a bᵀ as dot products of rows read in place.

#include <algorithm>
#include <type_traits>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "gemm.hpp"
#include "validation.hpp"

namespace randattn::detail {

namespace row_panel {

template <typename Scalar>
using Packet = typename Eigen::internal::packet_traits<Scalar>::type;

template <typename Scalar>
constexpr Index packet_size = Eigen::internal::unpacket_traits<Packet<Scalar>>::size;

// Accumulator rows of a tile: six with 32 vector registers (24 accumulators, 4 loads of b, one
// broadcast), two with 16.
constexpr int kTileRows = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 6 : 2;
static_assert(kTileRows <= 6, "panel() finishes with tiles of at most 5 rows");
constexpr int kTilePackets = 4;

// Operand a by strides: a(i, k) = data[i * row + k * col].
template <typename Scalar>
struct Strided {
  const Scalar* data;
  Index row, col;
};

// What a product adds to: nothing (data == nullptr), or alpha times a matrix of out's shape with
// unit column stride (it may be out itself).
template <typename Scalar>
struct Start {
  const Scalar* data;
  Index stride;
  Scalar alpha;
};

// out[R × P packets] = start + a[R × depth] b[depth × P packets].
template <int R, int P, typename Scalar>
inline void tile(Scalar* out, Index out_stride, Start<Scalar> start, Strided<Scalar> a,
                 const Scalar* b, Index b_stride, Index depth) {
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pset1;
  using P_t = Packet<Scalar>;
  constexpr Index ps = packet_size<Scalar>;
  P_t c[R][P];
  const P_t alpha = pset1<P_t>(start.alpha);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      c[r][p] = start.data ? Eigen::internal::pmul(
                                 alpha, ploadu<P_t>(start.data + r * start.stride + p * ps))
                           : pset1<P_t>(Scalar(0));
  for (Index k = 0; k < depth; ++k) {
    P_t bk[P];
    for (int p = 0; p < P; ++p) bk[p] = ploadu<P_t>(b + k * b_stride + p * ps);
    const Scalar* ak = a.data + k * a.col;
    for (int r = 0; r < R; ++r) {
      const P_t ar = pset1<P_t>(ak[r * a.row]);
      for (int p = 0; p < P; ++p) c[r][p] = pmadd(ar, bk[p], c[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) Eigen::internal::pstoreu(out + r * out_stride + p * ps, c[r][p]);
}

// One column panel of P packets for all rows; `lower`: the tile of rows [i, i + R) reads depth
// [0, min(depth, i + R)), a being zero past it.
template <int P, typename Scalar>
void panel(Scalar* out, Index out_stride, Start<Scalar> start, Strided<Scalar> a, const Scalar* b,
           Index b_stride, Index rows, Index depth, bool lower) {
  const auto depth_of = [&](Index i, Index r) { return lower ? std::min(depth, i + r) : depth; };
  const auto start_of = [&](Index i) {
    return Start<Scalar>{start.data ? start.data + i * start.stride : nullptr, start.stride,
                         start.alpha};
  };
  const auto run = [&](auto rows_c, Index i) {
    constexpr int R = decltype(rows_c)::value;
    tile<R, P>(out + i * out_stride, out_stride, start_of(i), {a.data + i * a.row, a.row, a.col},
               b, b_stride, depth_of(i, R));
  };
  // Narrow panels take taller tiles, so that each tile keeps kTileRows * kTilePackets
  // accumulators.
  constexpr int tall = kTileRows * (kTilePackets / P);
  Index i = 0;
  for (; i + tall <= rows; i += tall) run(std::integral_constant<int, tall>(), i);
  for (; i + kTileRows <= rows; i += kTileRows) run(std::integral_constant<int, kTileRows>(), i);
  // The last rows in one tile of their count (kTileRows is at most 6).
  switch (rows - i) {
    case 0: return;
    case 1: return run(std::integral_constant<int, 1>(), i);
    case 2: return run(std::integral_constant<int, 2>(), i);
    case 3: return run(std::integral_constant<int, 3>(), i);
    case 4: return run(std::integral_constant<int, 4>(), i);
    default: return run(std::integral_constant<int, 5>(), i);
  }
}

// out = start + a b; see row_panel_product.
template <typename Out, typename A, typename B>
void product(Out& out, Start<typename Out::Scalar> start, const A& a, const B& b, bool lower) {
  using Scalar = typename Out::Scalar;
  constexpr Index ps = packet_size<Scalar>;
  const Index rows = a.rows(), depth = a.cols(), cols = b.cols();
  require(out.rows() == rows && out.cols() == cols && b.rows() == depth &&
              (out.colStride() == 1 || cols <= 1) && (b.colStride() == 1 || cols <= 1),
          "row_panel_product", "operands do not fit: out ", out.rows(), "x", out.cols(), ", a ",
          rows, "x", depth, ", b ", b.rows(), "x", cols);
  if (rows == 0 || cols == 0) return;
  const Strided<Scalar> sa{a.data(), a.rowStride(), a.colStride()};
  Scalar* o = out.data();
  const Scalar* bb = b.data();
  const Index os = out.rowStride(), bs = b.rowStride();
  const auto from = [&](Index j) {
    return Start<Scalar>{start.data ? start.data + j : nullptr, start.stride, start.alpha};
  };
  Index j = 0;
  for (; j + kTilePackets * ps <= cols; j += kTilePackets * ps) {
    panel<kTilePackets>(o + j, os, from(j), sa, bb + j, bs, rows, depth, lower);
  }
  if (j + 2 * ps <= cols) {
    panel<2>(o + j, os, from(j), sa, bb + j, bs, rows, depth, lower);
    j += 2 * ps;
  }
  if (j + ps <= cols) {
    panel<1>(o + j, os, from(j), sa, bb + j, bs, rows, depth, lower);
    j += ps;
  }
  if (j < cols) {
    // The columns past the last whole packet (the weight column of [V | 1]), through Eigen's
    // product in fixed-depth steps: Eigen's own blocking of the depth depends on the thread
    // count, which would make the result depend on it.
    auto tail = out.rightCols(cols - j);
    if (start.data) {
      const Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> start_tail(
          start.data + j, rows, cols - j, Eigen::OuterStride<>(start.stride));
      tail = start.alpha * start_tail;
      gemm_fixed_depth(tail, a, b.rightCols(cols - j), true);
    } else {
      gemm_fixed_depth(tail, a, b.rightCols(cols - j), false);
    }
  }
}

}  // namespace row_panel

// out (+)= a b. out and b must have unit column stride (row-major rows); a any strides. With
// `lower`, a is square and lower triangular (its entries above the diagonal must be zero): each
// tile of rows stops at the depth of its last diagonal entry.
template <typename Out, typename A, typename B>
void row_panel_product(Out&& out, const A& a, const B& b, bool accumulate, bool lower = false) {
  using Scalar = typename std::decay_t<Out>::Scalar;
  row_panel::product(out, {accumulate ? out.data() : nullptr, out.rowStride(), Scalar(1)}, a, b,
                     lower);
}

// out = alpha · start + a b, start having out's shape and unit column stride (it may be out).
template <typename Out, typename Start, typename A, typename B>
void row_panel_product_onto(Out&& out, const Start& start, typename std::decay_t<Out>::Scalar alpha,
                            const A& a, const B& b) {
  require(start.rows() == out.rows() && start.cols() == out.cols() &&
              (start.colStride() == 1 || start.cols() <= 1),
          "row_panel_product_onto", "start is ", start.rows(), "x", start.cols(), ", out ",
          out.rows(), "x", out.cols());
  row_panel::product(out, {start.data(), start.rowStride(), alpha}, a, b, false);
}

namespace row_panel {

// out(i0 + r, j0 + c) = a_{i0 + r} · b_{j0 + c} for r < RI, c < RJ: packets along the depth,
// then one horizontal sum per entry, then the depth past the last whole packet.
template <int RI, int RJ, typename Out, typename A, typename B>
void dot_tile(Out& out, const A& a, const B& b, Index i0, Index j0) {
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using Eigen::internal::predux;
  using Scalar = typename A::Scalar;
  using P_t = Packet<Scalar>;
  constexpr Index ps = packet_size<Scalar>;
  const Index depth = a.cols(), whole = depth / ps * ps;
  P_t c[RI][RJ];
  for (int r = 0; r < RI; ++r)
    for (int s = 0; s < RJ; ++s) c[r][s] = Eigen::internal::pset1<P_t>(Scalar(0));
  for (Index k = 0; k < whole; k += ps) {
    P_t ak[RI], bk[RJ];
    for (int r = 0; r < RI; ++r) ak[r] = ploadu<P_t>(&a.coeffRef(i0 + r, k));
    for (int s = 0; s < RJ; ++s) bk[s] = ploadu<P_t>(&b.coeffRef(j0 + s, k));
    for (int r = 0; r < RI; ++r)
      for (int s = 0; s < RJ; ++s) c[r][s] = pmadd(ak[r], bk[s], c[r][s]);
  }
  for (int r = 0; r < RI; ++r) {
    for (int s = 0; s < RJ; ++s) {
      Scalar sum = predux(c[r][s]);
      for (Index k = whole; k < depth; ++k) sum += a(i0 + r, k) * b(j0 + s, k);
      out(i0 + r, j0 + s) = sum;
    }
  }
}

}  // namespace row_panel

// out(i, j) = a_i · b_j (rows of a and b, both with unit column stride) for every j <= i, computed
// in square tiles on and below the diagonal; entries above the diagonal are left unspecified.
template <typename Out, typename A, typename B>
void lower_row_dots(Out&& out, const A& a, const B& b) {
  constexpr int t = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 4 : 2;
  const Index n = a.rows();
  require(b.rows() == n && a.cols() == b.cols() && out.rows() == n && out.cols() == n &&
              (a.colStride() == 1 || a.cols() <= 1) && (b.colStride() == 1 || b.cols() <= 1),
          "lower_row_dots", "operands do not fit: out ", out.rows(), "x", out.cols(), ", a ",
          a.rows(), "x", a.cols(), ", b ", b.rows(), "x", b.cols());
  const Index tiled = n / t * t;
  for (Index i = 0; i < tiled; i += t) {
    for (Index j = 0; j <= i; j += t) row_panel::dot_tile<t, t>(out, a, b, i, j);
  }
  for (Index i = tiled; i < n; ++i) {
    for (Index j = 0; j <= i; ++j) row_panel::dot_tile<1, 1>(out, a, b, i, j);
  }
}

}  // namespace randattn::detail
