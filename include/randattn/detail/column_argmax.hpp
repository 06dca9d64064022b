#pragma once
// The row of the first maximum down each column of a row-major block, on packets of adjacent
// columns: the buckets of cross-polytope LSH (argmax of [s y; -s y], lsh/cross_polytope.hpp) and
// the best filter of locality-sensitive filters (argmax of y, lsf/filters.hpp).

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>
#include <limits>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "unroll.hpp"

namespace randattn::detail {

#if defined(__GNUC__)
#pragma GCC diagnostic push
// Eigen's packet types carry alignment attributes that do not survive as template arguments.
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

// For N packets of adjacent columns from t0 of the block y (`rows` rows of stride ld), the row
// of the first maximum of s·y (Signed: of [s y; -s y], rows + k standing for -y_k), into
// codes[t * stride]. Each packet keeps its running maximum (and minimum) and their rows in
// registers while the loop walks down the rows (N independent packets hide the latency of the
// compares); -v > -min is v < min, so the negative half needs no negation. The comparisons are
// strict, so the first maximal entry wins, positive part before negative. Rows are counted in
// Scalar (exact, rows <= 2^23), so each update is a compare and two selects per packet.
template <bool Signed, int N, typename Packet, typename Scalar>
void column_argmax_packets(const Scalar* y, Index ld, Index rows, Scalar scale, Index t0,
                           std::int32_t* codes, Index stride) {
  namespace ei = Eigen::internal;
  constexpr int kP = ei::unpacket_traits<Packet>::size;
  const Packet s = ei::pset1<Packet>(scale), one = ei::pset1<Packet>(Scalar(1));
  Packet hi[N], lo[N], hi_arg[N], lo_arg[N];
  RANDATTN_UNROLL
  for (int j = 0; j < N; ++j) {
    hi[j] = ei::pset1<Packet>(-std::numeric_limits<Scalar>::infinity());
    lo[j] = ei::pset1<Packet>(std::numeric_limits<Scalar>::infinity());
    hi_arg[j] = lo_arg[j] = ei::pset1<Packet>(Scalar(0));
  }
  Packet kk = ei::pset1<Packet>(Scalar(0));
  for (Index k = 0; k < rows; ++k) {
    const Scalar* row = y + k * ld + t0;
    RANDATTN_UNROLL
    for (int j = 0; j < N; ++j) {
      const Packet v = ei::pmul(ei::ploadu<Packet>(row + j * kP), s);
      const Packet up = ei::pcmp_lt(hi[j], v);
      hi[j] = ei::pselect(up, v, hi[j]);
      hi_arg[j] = ei::pselect(up, kk, hi_arg[j]);
      if constexpr (Signed) {
        const Packet down = ei::pcmp_lt(v, lo[j]);
        lo[j] = ei::pselect(down, v, lo[j]);
        lo_arg[j] = ei::pselect(down, kk, lo_arg[j]);
      }
    }
    kk = ei::padd(kk, one);
  }
  RANDATTN_UNROLL
  for (int j = 0; j < N; ++j) {
    Scalar h[kP], l[kP], ha[kP], la[kP];
    ei::pstoreu(h, hi[j]);
    ei::pstoreu(l, lo[j]);
    ei::pstoreu(ha, hi_arg[j]);
    ei::pstoreu(la, lo_arg[j]);
    RANDATTN_UNROLL
    for (int i = 0; i < kP; ++i)
      codes[(t0 + j * kP + i) * stride] = static_cast<std::int32_t>(
          !Signed || h[i] >= -l[i] ? ha[i] : la[i] + Scalar(rows));
  }
}

// column_argmax_packets over the `count` columns of y: strips of four packets, then single
// packets, then single columns.
template <bool Signed, typename Scalar>
void column_argmax(const Scalar* y, Index ld, Index rows, Index count, Scalar scale,
                   std::int32_t* codes, Index stride) {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr int kP = Eigen::internal::unpacket_traits<Packet>::size, kStrip = 4;
  Index t0 = 0;
  for (; t0 + kStrip * kP <= count; t0 += kStrip * kP)
    column_argmax_packets<Signed, kStrip, Packet>(y, ld, rows, scale, t0, codes, stride);
  for (; t0 + kP <= count; t0 += kP)
    column_argmax_packets<Signed, 1, Packet>(y, ld, rows, scale, t0, codes, stride);
  for (; t0 < count; ++t0)
    column_argmax_packets<Signed, 1, Scalar>(y, ld, rows, scale, t0, codes, stride);
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

}  // namespace randattn::detail
