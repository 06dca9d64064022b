#pragma once
// Transposed copies between token-major (one vector per row) and coordinate-major (one coordinate
// per row, its values over the vectors contiguous) layouts. The batched Walsh–Hadamard transform
// works on the second layout; inputs and outputs come in the first.

#include <randattn/detail/intrinsics.hpp>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "unroll.hpp"

namespace randattn::detail {

// out(j, t) = x(t, j) * scale[j] (scale null: 1) for the rows x cols block x with row stride
// x_stride, into out (cols x rows, row stride ld). Square tiles of one SIMD packet per side are
// transposed in registers (Eigen's ptranspose, portable over its SIMD back ends); the ragged
// edges are copied one entry at a time. Every entry is one rounding of x * scale, so the result
// does not depend on the tiling.
#if defined(__GNUC__)
#pragma GCC diagnostic push
// Eigen's packet types carry alignment attributes that do not survive as template arguments;
// harmless here, the packets are loaded and stored unaligned.
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif
template <typename Scalar>
void transpose_scaled(const Scalar* x, Index x_stride, Index rows, Index cols, const Scalar* scale,
                      Scalar* out, Index ld) {
  namespace ei = Eigen::internal;
  using Packet = typename ei::packet_traits<Scalar>::type;
  constexpr int kP = ei::unpacket_traits<Packet>::size;
  auto edge = [&](Index t, Index j) {
    out[j * ld + t] = scale ? x[t * x_stride + j] * scale[j] : x[t * x_stride + j];
  };
  Index t0 = 0;
  for (; t0 + kP <= rows; t0 += kP) {
    Index j0 = 0;
    for (; j0 + kP <= cols; j0 += kP) {
      ei::PacketBlock<Packet, kP> tile;
      RANDATTN_UNROLL
      for (int l = 0; l < kP; ++l)
        tile.packet[l] = ei::ploadu<Packet>(x + (t0 + l) * x_stride + j0);
      ei::ptranspose(tile);
      RANDATTN_UNROLL
      for (int l = 0; l < kP; ++l) {
        const Packet v =
            scale ? ei::pmul(tile.packet[l], ei::pset1<Packet>(scale[j0 + l])) : tile.packet[l];
        ei::pstoreu(out + (j0 + l) * ld + t0, v);
      }
    }
    for (; j0 < cols; ++j0)
      for (Index t = t0; t < t0 + kP; ++t) edge(t, j0);
  }
  for (; t0 < rows; ++t0)
    for (Index j = 0; j < cols; ++j) edge(t0, j);
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

}  // namespace randattn::detail
