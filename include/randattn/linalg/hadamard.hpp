#pragma once
// Fast Walsh–Hadamard transform in the Sylvester ordering, H(a, b) = (-1)^popcount(a & b),
// unnormalised: applying it twice multiplies by n. The building block of structured projections
// and of pseudo-random rotations (linalg/structured_rotation.hpp).
//
// One kernel, batched across vectors: fwht_columns transforms every column of a p x B row-major
// block, so each butterfly combines two contiguous rows and runs as SIMD over B vectors at once.
// fwht_inplace (one vector) and fwht_rows (the rows of a token-major matrix) are thin layouts
// around it. Every output is produced by the same sequence of additions as the textbook
// radix-2 transform (levels h = 1, 2, 4, ... in order, lo + hi and lo - hi), so the result does
// not depend on the batch size or the vector width.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/transpose.hpp"
#include "../detail/unroll.hpp"
#include "../detail/validation.hpp"

namespace randattn {

constexpr bool is_power_of_two(Index n) { return n > 0 && (n & (n - 1)) == 0; }

constexpr Index next_power_of_two(Index n) {
  Index p = 1;
  while (p < n) p <<= 1;
  return p;
}

namespace detail {

#if defined(__GNUC__)
#define RANDATTN_FWHT_INLINE inline __attribute__((always_inline))
#else
#define RANDATTN_FWHT_INLINE inline
#endif

// Radix-2^M step on P packets of adjacent vectors (Packet a SIMD type, or Scalar itself for one
// vector): levels h, 2h, ..., 2^{M-1} h at once on the 2^M rows spaced `stride` apart, kept in
// registers across the levels. With Scaled, row m is first multiplied by sign[m] = +-1 (exact).
// Only exact products and the adds of the radix-2 levels occur, in the same order, so neither the
// grouping of levels nor the strip's width changes a bit. Written with Eigen's packet operations:
// as scalar arrays left to the vectoriser, GCC kept the strip in registers in some programs and
// spilled it lane by lane in others.
template <int M, int P, bool Scaled, typename Packet, typename Scalar>
RANDATTN_FWHT_INLINE void fwht_strip(Scalar* __restrict base, Index stride, const Scalar* sign) {
  using namespace Eigen::internal;
  constexpr int kRows = 1 << M, kSize = unpacket_traits<Packet>::size;
  Packet a[kRows][P];
  RANDATTN_UNROLL
  for (int m = 0; m < kRows; ++m)
    RANDATTN_UNROLL
    for (int l = 0; l < P; ++l) {
      a[m][l] = ploadu<Packet>(base + m * stride + l * kSize);
      if (Scaled) a[m][l] = pmul(a[m][l], pset1<Packet>(sign[m]));
    }
  RANDATTN_UNROLL
  for (int level = 1; level < kRows; level <<= 1) {
    RANDATTN_UNROLL
    for (int m = 0; m < kRows; ++m) {
      if (m & level) continue;
      RANDATTN_UNROLL
      for (int l = 0; l < P; ++l) {
        const Packet x = a[m][l], y = a[m | level][l];
        a[m][l] = padd(x, y);
        a[m | level][l] = psub(x, y);
      }
    }
  }
  RANDATTN_UNROLL
  for (int m = 0; m < kRows; ++m)
    RANDATTN_UNROLL
    for (int l = 0; l < P; ++l) pstoreu(base + m * stride + l * kSize, a[m][l]);
}

// Levels h .. 2^{M-1} h over the whole p x cols block (row stride ld).
template <int M, bool Scaled, typename Scalar>
void fwht_columns_step(Scalar* w, Index p, Index cols, Index ld, Index h, const Scalar* diag) {
  // A strip of 8 rows fills half of the vector registers: two packets a row with AVX-512's 32,
  // one with AVX2's 16, where two left too few registers for the butterflies.
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr int kSize = Eigen::internal::packet_traits<Scalar>::size;
  constexpr int kRows = 1 << M, kPackets = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 2 : 1;
  constexpr int kWidth = kPackets * kSize;
  const Index stride = h * ld;
  Scalar sign[kRows];
  for (Index i0 = 0; i0 < p; i0 += kRows * h) {
    for (Index j = i0; j < i0 + h; ++j) {
      RANDATTN_UNROLL
      for (int m = 0; m < kRows; ++m) sign[m] = Scaled ? diag[j + m * h] : Scalar(1);
      Scalar* row = w + j * ld;
      Index t = 0;
      for (; t + kWidth <= cols; t += kWidth)
        fwht_strip<M, kPackets, Scaled, Packet>(row + t, stride, sign);
      for (; t < cols; ++t) fwht_strip<M, 1, Scaled, Scalar>(row + t, stride, sign);
    }
  }
}

// fwht_columns without the argument checks, for callers that have made them.
template <typename Scalar>
void fwht_columns_unchecked(Scalar* w, Index p, Index cols, Index ld, const Scalar* sign) {
  if (p == 1) {
    if (sign)
      for (Index t = 0; t < cols; ++t) w[t] *= sign[0];
    return;
  }
  for (Index h = 1; h < p;) {
    const int levels = p / h >= 8 ? 3 : (p / h == 4 ? 2 : 1);
    if (levels == 3)
      sign ? fwht_columns_step<3, true>(w, p, cols, ld, h, sign)
           : fwht_columns_step<3, false>(w, p, cols, ld, h, sign);
    else if (levels == 2)
      sign ? fwht_columns_step<2, true>(w, p, cols, ld, h, sign)
           : fwht_columns_step<2, false>(w, p, cols, ld, h, sign);
    else
      sign ? fwht_columns_step<1, true>(w, p, cols, ld, h, sign)
           : fwht_columns_step<1, false>(w, p, cols, ld, h, sign);
    h <<= levels;
    sign = nullptr;
  }
}

#undef RANDATTN_FWHT_INLINE

}  // namespace detail

// Transforms every column of the p x cols row-major block at w (row stride ld >= cols): column t
// becomes H_p diag(sign) w(:, t), sign a +-1 vector of length p or null for none. p must be a
// power of two. Each butterfly is a contiguous operation over the cols vectors.
template <typename Scalar>
void fwht_columns(Scalar* w, Index p, Index cols, Index ld, const Scalar* sign = nullptr) {
  detail::require(is_power_of_two(p) && cols >= 0 && ld >= cols, "fwht_columns",
                  "need a power-of-two length p and a row stride ld >= cols, got p = ", p,
                  ", cols = ", cols, ", ld = ", ld);
  detail::fwht_columns_unchecked(w, p, cols, ld, sign);
}

// In-place transform of x[0..n), n a power of two; O(n log n).
template <typename Scalar>
void fwht_inplace(Scalar* x, Index n) {
  detail::require(is_power_of_two(n), "fwht_inplace", "length must be a power of two, got ", n);
  detail::fwht_columns_unchecked(x, n, 1, 1, static_cast<const Scalar*>(nullptr));
}

// Transforms every row of a row-major matrix whose column count is a power of two: tiles of rows
// are transposed into a coordinate-major buffer, transformed together and transposed back.
template <typename Scalar>
void fwht_rows(Eigen::Ref<RowMatrix<Scalar>> m) {
  const Index n = m.rows(), p = m.cols();
  detail::require(is_power_of_two(p), "fwht_rows", "column count must be a power of two, got ", n,
                  "x", p);
  // Up to 2^16 scalars of buffer, at least 32 rows (a few SIMD vectors) per tile.
  const Index tile = std::min(n, std::max<Index>(32, (Index(1) << 16) / p));
  RowMatrix<Scalar> work(p, tile);
  for (Index i0 = 0; i0 < n; i0 += tile) {
    const Index rows = std::min(tile, n - i0);
    Scalar* row0 = m.data() + i0 * m.outerStride();
    detail::transpose_scaled(row0, m.outerStride(), rows, p, static_cast<const Scalar*>(nullptr),
                             work.data(), tile);
    detail::fwht_columns_unchecked(work.data(), p, rows, tile, static_cast<const Scalar*>(nullptr));
    detail::transpose_scaled(work.data(), tile, p, rows, static_cast<const Scalar*>(nullptr), row0,
                             m.outerStride());
  }
}

}  // namespace randattn
