#pragma once
// The stabilised exponentials of a row, exp((±x_i − shift) · factor), and the row's largest entry
// (or magnitude) that usually serves as the shift, on explicit packets: the finishing step of
// the exponential feature maps (features/feature_maps.hpp, projected_feature_map.hpp). Written
// as Eigen expressions these were left partly unvectorised and unrolled by GCC 12 at -O2 (a
// FAVOR+ feature map lost 10–15 % against -O3).
//
// Every entry, the last partial packet's too, goes through Eigen's packet exponential (pexp), so
// an entry's value depends on its own input alone, not on its position or the row's alignment.
// The subtraction comes first: with shift = max x the exponent is ≤ 0 exactly and every value is
// in (0, 1].

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
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

template <typename Scalar>
using RowPacket = typename Eigen::internal::packet_traits<Scalar>::type;

// max_i x_i (Magnitude: max_i |x_i|) of x[0, n), n ≥ 1; four packets of running maxima.
template <bool Magnitude = false, typename Scalar>
Scalar row_max(const Scalar* x, Index n) {
  namespace ei = Eigen::internal;
  using Packet = RowPacket<Scalar>;
  constexpr Index kP = ei::unpacket_traits<Packet>::size, kN = 4;
  const auto load = [](const Scalar* p) {
    const Packet v = ei::ploadu<Packet>(p);
    if constexpr (Magnitude) return ei::pabs(v);
    else return v;
  };
  Scalar best = -std::numeric_limits<Scalar>::infinity();
  Index i = 0;
  if (n >= kN * kP) {
    Packet m[kN];
    RANDATTN_UNROLL
    for (Index j = 0; j < kN; ++j) m[j] = load(x + j * kP);
    for (i = kN * kP; i + kN * kP <= n; i += kN * kP) {
      RANDATTN_UNROLL
      for (Index j = 0; j < kN; ++j) m[j] = ei::pmax(m[j], load(x + i + j * kP));
    }
    best = ei::predux_max(ei::pmax(ei::pmax(m[0], m[1]), ei::pmax(m[2], m[3])));
  }
  for (; i < n; ++i) best = std::max(best, Magnitude ? std::abs(x[i]) : x[i]);
  return best;
}

// out[i] = exp((±in[i] − shift) · factor) for i < n (Negate: −in[i]); out may be in.
template <bool Negate = false, typename Scalar>
void row_exp(const Scalar* in, Scalar* out, Index n, Scalar shift, Scalar factor) {
  namespace ei = Eigen::internal;
  using Packet = RowPacket<Scalar>;
  constexpr Index kP = ei::unpacket_traits<Packet>::size;
  const Packet s = ei::pset1<Packet>(shift), f = ei::pset1<Packet>(factor);
  const auto one = [&](const Packet& x) {
    return ei::pexp(ei::pmul(ei::psub(Negate ? ei::pnegate(x) : x, s), f));
  };
  Index i = 0;
  for (; i + 2 * kP <= n; i += 2 * kP) {
    const Packet a = one(ei::ploadu<Packet>(in + i)), b = one(ei::ploadu<Packet>(in + i + kP));
    ei::pstoreu(out + i, a);
    ei::pstoreu(out + i + kP, b);
  }
  for (; i + kP <= n; i += kP) ei::pstoreu(out + i, one(ei::ploadu<Packet>(in + i)));
  if (i < n) {  // the last partial packet, through a packet-sized buffer
    alignas(64) Scalar buf[kP] = {};
    std::copy(in + i, in + n, buf);
    ei::pstore(buf, one(ei::pload<Packet>(buf)));
    std::copy(buf, buf + (n - i), out + i);
  }
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

}  // namespace randattn::detail
