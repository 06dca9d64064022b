#pragma once
// The short, wide products of linear attention (chunk rows against a feature state, feature rows
// against a chunk's values, a chunk's queries against its keys), without packing the operands.
// Eigen's GEMM copies both operands into panels on every call; for a 32 × 256 × 64 product that
// copy costs a third of the multiply. Here b and out are row-major with unit column stride, so a
// row of b is loaded as packets in place, and each entry of a is broadcast from where it lies
// (any strides: a may be the transpose of a row-major block). A tile of R rows × P packets of
// columns stays in registers over the whole depth, which runs in order k = 0, 1, …: the result
// is a function of the shapes alone, never of the thread count. row_dots gives a bᵀ (or its lower
// triangle) as dot products of rows read in place.
//
// The operand read as rows (b of the products, a of row_dots) may hold a storage type other than
// the compute type (bfloat16, half, int8, float under double; packet_load.hpp): each packet is
// converted as it is loaded. Decoding reads compressed key/value caches this way.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <Eigen/Core>

#include "../core/types.hpp"
#include "gemm.hpp"
#include "packet_load.hpp"
#include "unroll.hpp"
#include "validation.hpp"

namespace randattn::detail {

// Columns to allocate for a b operand of `cols` columns: a whole number of cache lines per row,
// so that no packet of a row straddles two lines (rows of 65 floats made a 256 x 256 x 65
// product run at 45–60 GFLOP/s against 74 with rows of 80; Zen 3). Use the leftmost `cols`.
template <typename Scalar>
constexpr Index line_padded(Index cols) {
  constexpr Index line = 64 / Index(sizeof(Scalar));
  return (cols + line - 1) / line * line;
}

// Where a product's left operand may be non-zero (row_panel_product).
enum class Triangle { full, lower, upper };

namespace row_panel {

template <typename Scalar>
using Packet = typename Eigen::internal::packet_traits<Scalar>::type;

template <typename Scalar>
constexpr Index packet_size = Eigen::internal::unpacket_traits<Packet<Scalar>>::size;

// A tile of R rows by P packets keeps R·P accumulators, P packets of b and one broadcast of a in
// vector registers: with 32 registers six rows by four packets, with 16 six rows by two. With 16
// registers, two rows by four packets (8 accumulators) ran at 45 GFLOP/s where six by two runs at
// 69–87 (a 48 x 256 x 64 product on a Zen 3; Eigen's GEMM: 59–61).
constexpr int kRegisters = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS;
constexpr int kTilePackets = kRegisters >= 32 ? 4 : 2;
template <int P>
constexpr int kTileRowsFor = std::min(24, (kRegisters - 1 - P) / P);
constexpr int kTileRows = 6;  // rows per tile where a panel's own height leaves a remainder
static_assert(kTileRowsFor<kTilePackets> >= kTileRows, "the default panels hold six rows");

// Keeps a loaded packet in a register. GCC otherwise folds the load into every multiply-add that
// uses the packet (R loads of one b packet per depth step of a tile of R rows), and the tiles
// become bound by loads instead of multiply-adds: decoding's value product and logits (4 query
// heads per kv head, rows in the caches) went from 28-31 to 37-42 GB/s with the packets held
// (Zen 5). An empty asm statement that claims to change the register; no instruction is emitted.
template <typename P_t>
inline void in_register(P_t& packet) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+v"(packet));
#else
  (void)packet;
#endif
}

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
template <int R, int P, typename Scalar, typename BT>
inline void tile(Scalar* out, Index out_stride, Start<Scalar> start, Strided<Scalar> a,
                 const BT* b, Index b_stride, Index depth) {
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pset1;
  using P_t = Packet<Scalar>;
  constexpr Index ps = packet_size<Scalar>;
  P_t c[R][P];
  const P_t alpha = pset1<P_t>(start.alpha);
  RANDATTN_UNROLL
  for (int r = 0; r < R; ++r)
    RANDATTN_UNROLL
    for (int p = 0; p < P; ++p)
      c[r][p] = start.data ? Eigen::internal::pmul(
                                 alpha, ploadu<P_t>(start.data + r * start.stride + p * ps))
                           : pset1<P_t>(Scalar(0));
  for (Index k = 0; k < depth; ++k) {
    P_t bk[P];
    RANDATTN_UNROLL
    for (int p = 0; p < P; ++p) bk[p] = load_packet<P_t>(b + k * b_stride + p * ps);
    RANDATTN_UNROLL
    for (int p = 0; p < P; ++p) in_register(bk[p]);
    const Scalar* ak = a.data + k * a.col;
    RANDATTN_UNROLL
    for (int r = 0; r < R; ++r) {
      const P_t ar = pset1<P_t>(ak[r * a.row]);
      RANDATTN_UNROLL
      for (int p = 0; p < P; ++p) c[r][p] = pmadd(ar, bk[p], c[r][p]);
    }
  }
  RANDATTN_UNROLL
  for (int r = 0; r < R; ++r)
    RANDATTN_UNROLL
    for (int p = 0; p < P; ++p) Eigen::internal::pstoreu(out + r * out_stride + p * ps, c[r][p]);
}

// One column panel of P packets for all rows. A triangular a lets a tile of rows [i, i + R)
// read only depth [0, min(depth, i + R)) (lower: a is zero past it) or [i, depth) (upper: zero
// before it); the skipped terms are exact zeros, so the sums are those of the whole depth.
template <int P, typename Scalar, typename BT>
void panel(Scalar* out, Index out_stride, Start<Scalar> start, Strided<Scalar> a, const BT* b,
           Index b_stride, Index rows, Index depth, Triangle shape) {
  const auto first_of = [&](Index i) {
    return shape == Triangle::upper ? std::min(i, depth) : Index(0);
  };
  const auto end_of = [&](Index i, Index r) {
    return shape == Triangle::lower ? std::min(depth, i + r) : depth;
  };
  const auto start_of = [&](Index i) {
    return Start<Scalar>{start.data ? start.data + i * start.stride : nullptr, start.stride,
                         start.alpha};
  };
  const auto run = [&](auto rows_c, Index i) {
    constexpr int R = decltype(rows_c)::value;
    const Index k0 = first_of(i);
    tile<R, P>(out + i * out_stride, out_stride, start_of(i),
               {a.data + i * a.row + k0 * a.col, a.row, a.col}, b + k0 * b_stride, b_stride,
               end_of(i, R) - k0);
  };
  // Narrow panels take taller tiles, as many rows as the registers hold.
  constexpr int tall = kTileRowsFor<P>;
  Index i = 0;
  for (; i + tall <= rows; i += tall) run(std::integral_constant<int, tall>(), i);
  if constexpr (tall > kTileRows) {
    for (; i + kTileRows <= rows; i += kTileRows) run(std::integral_constant<int, kTileRows>(), i);
  }
  // The last rows (at most five) in one tile of their count.
  switch (rows - i) {
    case 0: return;
    case 1: return run(std::integral_constant<int, 1>(), i);
    case 2: return run(std::integral_constant<int, 2>(), i);
    case 3: return run(std::integral_constant<int, 3>(), i);
    case 4: return run(std::integral_constant<int, 4>(), i);
    default: return run(std::integral_constant<int, 5>(), i);
  }
}

// out = start + a b in column panels Wide packets wide, then narrower ones; see
// row_panel_product.
template <int Wide, typename Out, typename A, typename B>
void product(Out& out, Start<typename Out::Scalar> start, const A& a, const B& b,
             Triangle shape) {
  using Scalar = typename Out::Scalar;
  constexpr Index ps = packet_size<Scalar>;
  const Index rows = a.rows(), depth = a.cols(), cols = b.cols();
  require(out.rows() == rows && out.cols() == cols && b.rows() == depth &&
              (out.colStride() == 1 || cols <= 1) && (b.colStride() == 1 || cols <= 1),
          "row_panel_product", "operands do not fit: out ", out.rows(), "x", out.cols(), ", a ",
          rows, "x", depth, ", b ", b.rows(), "x", cols);
  if (rows == 0 || cols == 0) return;
  if (depth == 0) {
    // out = start. b has no rows and may have no storage, so no pointer into it is formed.
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c)
        out(r, c) = start.data ? start.alpha * start.data[r * start.stride + c] : Scalar(0);
    return;
  }
  const Strided<Scalar> sa{a.data(), a.rowStride(), a.colStride()};
  Scalar* o = out.data();
  const auto* bb = b.data();
  const Index os = out.rowStride(), bs = b.rowStride();
  const auto from = [&](Index j) {
    return Start<Scalar>{start.data ? start.data + j : nullptr, start.stride, start.alpha};
  };
  Index j = 0;
  for (; j + Wide * ps <= cols; j += Wide * ps) {
    panel<Wide>(o + j, os, from(j), sa, bb + j, bs, rows, depth, shape);
  }
  if (Wide > 2 && j + 2 * ps <= cols) {
    panel<2>(o + j, os, from(j), sa, bb + j, bs, rows, depth, shape);
    j += 2 * ps;
  }
  if (j + ps <= cols) {
    panel<1>(o + j, os, from(j), sa, bb + j, bs, rows, depth, shape);
    j += ps;
  }
  if (j == cols) return;
  if constexpr (!std::is_same<typename B::Scalar, Scalar>::value) {
    // Columns past the last whole packet of a stored type: entry by entry, depth in order.
    for (Index r = 0; r < rows; ++r) {
      for (Index c = j; c < cols; ++c) {
        Scalar sum = start.data ? start.alpha * start.data[r * start.stride + c] : Scalar(0);
        for (Index k = 0; k < depth; ++k) sum += a(r, k) * widen<Scalar>(b(k, c));
        out(r, c) = sum;
      }
    }
  } else {
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

// out (+)= a b. out and b must have unit column stride (row-major rows); a any strides. A
// triangular `shape` says that a is square and zero above its diagonal (lower) or below it
// (upper): each tile of rows then reads only the depth where its rows can be non-zero.
template <typename Out, typename A, typename B>
void row_panel_product(Out&& out, const A& a, const B& b, bool accumulate,
                       Triangle shape = Triangle::full) {
  using Scalar = typename std::decay_t<Out>::Scalar;
  require(shape == Triangle::full || a.rows() == a.cols(), "row_panel_product",
          "a triangular operand must be square, got ", a.rows(), "x", a.cols());
  row_panel::product<row_panel::kTilePackets>(
      out, {accumulate ? out.data() : nullptr, out.rowStride(), Scalar(1)}, a, b, shape);
}

// out (+)= a b as row_panel_product, the same bits, for a b read once from memory and few rows
// of a (decoding's query heads): panels four packets wide take two cache lines of each row of b
// per pass. With 16 registers that allows tiles of only two rows, so b is read once per two
// rows, but the second read comes from the caches; panels of one cache line per row, read
// once, ran a kernel streaming b from memory at 0.6–0.8 of that speed (Zen 3).
template <typename Out, typename A, typename B>
void row_panel_product_streamed(Out&& out, const A& a, const B& b, bool accumulate) {
  using Scalar = typename std::decay_t<Out>::Scalar;
  row_panel::product<4>(out, {accumulate ? out.data() : nullptr, out.rowStride(), Scalar(1)}, a,
                        b, Triangle::full);
}

// out = alpha · start + a b, start having out's shape and unit column stride (it may be out).
template <typename Out, typename Start, typename A, typename B>
void row_panel_product_onto(Out&& out, const Start& start, typename std::decay_t<Out>::Scalar alpha,
                            const A& a, const B& b) {
  require(start.rows() == out.rows() && start.cols() == out.cols() &&
              (start.colStride() == 1 || start.cols() <= 1),
          "row_panel_product_onto", "start is ", start.rows(), "x", start.cols(), ", out ",
          out.rows(), "x", out.cols());
  row_panel::product<row_panel::kTilePackets>(out, {start.data(), start.rowStride(), alpha}, a, b,
                                              Triangle::full);
}

namespace row_panel {

// sums[r][s] = predux(c[r][s]), each packet reduced on its own.
template <int RI, int RJ, typename P_t, typename Scalar>
inline void horizontal_sums(const P_t (&c)[RI][RJ], Scalar (&sums)[RI][RJ]) {
  RANDATTN_UNROLL
  for (int r = 0; r < RI; ++r)
    RANDATTN_UNROLL
    for (int s = 0; s < RJ; ++s) sums[r][s] = Eigen::internal::predux(c[r][s]);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The same sixteen sums with the same additions in the same order as Eigen's predux of a packet
// of 16 floats (lanes l + l+8, then l + l+4, then (0 + 2) + (1 + 3)), done for all sixteen
// packets together: 30 shuffles instead of 64 and the results land in one register.
template <>
inline void horizontal_sums<4, 4, __m512, float>(const __m512 (&c)[4][4], float (&sums)[4][4]) {
  // Halves: lanes l + l+8 of two packets, in quarters [a lo, a hi, b lo, b hi].
  __m512 half[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = c[i / 2][2 * (i % 2)], b = c[i / 2][2 * (i % 2) + 1];
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  // Quarters: lanes l + l+4; quad[i] holds packets 4i .. 4i+3 (c[i][0..3]), one per quarter.
  __m512 quad[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 a = half[2 * i], b = half[2 * i + 1];
    quad[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // Within quarters: (0 + 2) + (1 + 3); quarter s of the result holds c[0..3][s].
  const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(quad[0], quad[1]),
                                  _mm512_unpackhi_ps(quad[0], quad[1]));
  const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(quad[2], quad[3]),
                                  _mm512_unpackhi_ps(quad[2], quad[3]));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x44), _mm512_shuffle_ps(y0, y1, 0xEE));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, z);
  for (int r = 0; r < 4; ++r)
    for (int s = 0; s < 4; ++s) sums[r][s] = lanes[4 * s + r];
}
#endif

#if defined(__AVX__)
// Eigen's predux of a packet of 8 floats adds lanes l + l+4, then (0 + 2) + (1 + 3). The same
// additions in the same order for several packets at once, two packets per register and step,
// so an entry's value does not depend on the tile it falls in.
inline __m256 halves_added(__m256 a, __m256 b) {  // [a_l + a_l+4 | b_l + b_l+4]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline __m256 pairs_added(__m256 x, __m256 y) {  // per half: [x0 + x2, x1 + x3, y0 + y2, y1 + y3]
  return _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x44), _mm256_shuffle_ps(x, y, 0xEE));
}
inline __m256 odd_even_added(__m256 x, __m256 y) {  // per half: [x0 + x1, x2 + x3, y0 + y1, y2 + y3]
  return _mm256_add_ps(_mm256_shuffle_ps(x, y, 0x88), _mm256_shuffle_ps(x, y, 0xDD));
}

// Eight packets p0..p7 (row-major c[r][s]): the result holds their sums in lanes
// [p0, p2, p4, p6, p1, p3, p5, p7].
template <>
inline void horizontal_sums<2, 4, __m256, float>(const __m256 (&c)[2][4], float (&sums)[2][4]) {
  const __m256 q0 = pairs_added(halves_added(c[0][0], c[0][1]), halves_added(c[0][2], c[0][3]));
  const __m256 q1 = pairs_added(halves_added(c[1][0], c[1][1]), halves_added(c[1][2], c[1][3]));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, odd_even_added(q0, q1));
  for (int p = 0; p < 8; ++p) sums[p / 4][p % 4] = lanes[p % 2 == 0 ? p / 2 : 4 + p / 2];
}

// Four packets p0..p3: their sums in lanes [p0, p2, ·, ·, p1, p3, ·, ·].
inline void sums_of_four(__m256 p0, __m256 p1, __m256 p2, __m256 p3, float (&out)[4]) {
  const __m256 q = pairs_added(halves_added(p0, p1), halves_added(p2, p3));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, odd_even_added(q, q));
  out[0] = lanes[0];
  out[1] = lanes[4];
  out[2] = lanes[1];
  out[3] = lanes[5];
}

template <>
inline void horizontal_sums<1, 4, __m256, float>(const __m256 (&c)[1][4], float (&sums)[1][4]) {
  sums_of_four(c[0][0], c[0][1], c[0][2], c[0][3], sums[0]);
}

template <>
inline void horizontal_sums<2, 2, __m256, float>(const __m256 (&c)[2][2], float (&sums)[2][2]) {
  float s[4];
  sums_of_four(c[0][0], c[0][1], c[1][0], c[1][1], s);
  sums[0][0] = s[0];
  sums[0][1] = s[1];
  sums[1][0] = s[2];
  sums[1][1] = s[3];
}
#endif

// out(i0 + r, j0 + c) = a_{i0 + r} · b_{j0 + c} for r < RI, c < RJ: packets along the depth,
// then one horizontal sum per entry, then the depth past the last whole packet.
template <int RI, int RJ, typename Out, typename A, typename B>
void dot_tile(Out& out, const A& a, const B& b, Index i0, Index j0) {
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using Eigen::internal::predux;
  using Scalar = typename B::Scalar;
  using P_t = Packet<Scalar>;
  constexpr Index ps = packet_size<Scalar>;
  const Index depth = a.cols(), whole = depth / ps * ps;
  P_t c[RI][RJ];
  RANDATTN_UNROLL
  for (int r = 0; r < RI; ++r)
    RANDATTN_UNROLL
    for (int s = 0; s < RJ; ++s) c[r][s] = Eigen::internal::pset1<P_t>(Scalar(0));
  for (Index k = 0; k < whole; k += ps) {
    P_t ak[RI], bk[RJ];
    RANDATTN_UNROLL
    for (int r = 0; r < RI; ++r) ak[r] = load_packet<P_t>(&a.coeffRef(i0 + r, k));
    RANDATTN_UNROLL
    for (int s = 0; s < RJ; ++s) bk[s] = ploadu<P_t>(&b.coeffRef(j0 + s, k));
    RANDATTN_UNROLL
    for (int r = 0; r < RI; ++r) in_register(ak[r]);
    RANDATTN_UNROLL
    for (int s = 0; s < RJ; ++s) in_register(bk[s]);
    RANDATTN_UNROLL
    for (int r = 0; r < RI; ++r)
      RANDATTN_UNROLL
      for (int s = 0; s < RJ; ++s) c[r][s] = pmadd(ak[r], bk[s], c[r][s]);
  }
  Scalar sums[RI][RJ];
  horizontal_sums(c, sums);
  if (whole == depth) {
    RANDATTN_UNROLL
    for (int r = 0; r < RI; ++r)
      RANDATTN_UNROLL
      for (int s = 0; s < RJ; ++s) out.coeffRef(i0 + r, j0 + s) = sums[r][s];
    return;
  }
  RANDATTN_UNROLL
  for (int r = 0; r < RI; ++r) {
    RANDATTN_UNROLL
    for (int s = 0; s < RJ; ++s) {
      Scalar sum = sums[r][s];
      for (Index k = whole; k < depth; ++k) sum += widen<Scalar>(a(i0 + r, k)) * b(j0 + s, k);
      out.coeffRef(i0 + r, j0 + s) = sum;
    }
  }
}

}  // namespace row_panel

// out(i, j) = a_i · b_j for the rows of a and b (both with unit column stride): every entry, or
// with `lower` (a and b with the same number of rows) those with j <= i, entries above the
// diagonal being left unspecified. Square tiles of rows read in place, then strips of one row or
// column; each entry is summed on its own (packets in depth order, then one horizontal sum), so
// its value does not depend on the tile it falls in.
template <typename Out, typename A, typename B>
void row_dots(Out&& out, const A& a, const B& b, bool lower = false) {
  // Tiles of ti rows of a by tj rows of b: tj = 4 gives eight independent accumulators with
  // 16 registers, enough to hide the latency of the multiply-adds.
  constexpr int ti = row_panel::kRegisters >= 32 ? 4 : 2, tj = 4;
  const Index m = a.rows(), n = b.rows();
  require(a.cols() == b.cols() && out.rows() == m && out.cols() == n && (!lower || m == n) &&
              (a.colStride() == 1 || a.cols() <= 1) && (b.colStride() == 1 || b.cols() <= 1),
          lower ? "row_dots (lower)" : "row_dots", "operands do not fit: out ", out.rows(), "x",
          out.cols(), ", a ", m, "x", a.cols(), ", b ", n, "x", b.cols());
  const auto strip = [&](auto rows_c, Index i, Index end) {
    constexpr int R = decltype(rows_c)::value;
    Index j = 0;
    for (; j + tj <= end; j += tj) row_panel::dot_tile<R, tj>(out, a, b, i, j);
    for (; j + 2 <= end; j += 2) row_panel::dot_tile<R, 2>(out, a, b, i, j);
    for (; j < end; ++j) row_panel::dot_tile<R, 1>(out, a, b, i, j);
  };
  const Index tiled = m / ti * ti;
  for (Index i = 0; i < tiled; i += ti)
    strip(std::integral_constant<int, ti>(), i, lower ? i + ti : n);
  for (Index i = tiled; i < m; ++i) strip(std::integral_constant<int, 1>(), i, lower ? i + 1 : n);
}

}  // namespace randattn::detail
