#pragma once
// Counter-based random source. A Philox value holds only (seed, stream); every draw is a pure
// function of (seed, stream, i, j), so results do not depend on traversal order, block size,
// storage order or thread count, and two copies of the same value always agree.

#include <randattn/detail/intrinsics.hpp>

#include <array>
#include <cmath>
#include <cstdint>

#include <Random123/philox.h>

namespace randattn {

class Philox {
 public:
  using Bits = std::array<std::uint32_t, 4>;

  explicit Philox(std::uint64_t seed = 0, std::uint32_t stream = 0)
      : seed_(seed), stream_(stream) {}

  std::uint64_t seed() const { return seed_; }
  std::uint32_t stream() const { return stream_; }

  // Independent sub-stream for another purpose (e.g. projection vs. sign vectors).
  Philox with_stream(std::uint32_t stream) const { return Philox(seed_, stream); }

  // Raw Philox4x32-10 block: key = seed (low word first), counter = (j, i_lo, i_hi, stream).
  Bits bits(std::uint64_t i, std::uint32_t j = 0) const {
    using Engine = r123::Philox4x32;
    const Engine::key_type key = {
        {static_cast<std::uint32_t>(seed_), static_cast<std::uint32_t>(seed_ >> 32)}};
    const Engine::ctr_type ctr = {
        {j, static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(i >> 32), stream_}};
    const Engine::ctr_type out = Engine()(ctr, key);
    return {out[0], out[1], out[2], out[3]};
  }

  // Uniform on [0, 1) with 53 random bits.
  double uniform(std::uint64_t i, std::uint32_t j = 0) const {
    const Bits b = bits(i, j);
    return to_unit_closed_open(b[0], b[1]);
  }

  // Standard normal by Box–Muller on two 53-bit uniforms (the cosine branch). The expression
  // has no a*b+c pattern, so FMA contraction cannot change its rounding between builds.
  double gaussian(std::uint64_t i, std::uint32_t j = 0) const {
    const Bits b = bits(i, j);
    const double u1 = 1.0 - to_unit_closed_open(b[0], b[1]);  // (0, 1]: log is finite
    const double u2 = to_unit_closed_open(b[2], b[3]);
    constexpr double two_pi = 6.283185307179586476925286766559;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2);
  }

  // +1 or -1 with probability 1/2 each.
  int rademacher(std::uint64_t i, std::uint32_t j = 0) const {
    return (bits(i, j)[0] & 1u) ? 1 : -1;
  }

 private:
  static double to_unit_closed_open(std::uint32_t lo, std::uint32_t hi) {
    const std::uint64_t w = (static_cast<std::uint64_t>(hi) << 32) | lo;
    return static_cast<double>(w >> 11) * 0x1.0p-53;
  }

  std::uint64_t seed_;
  std::uint32_t stream_;
};

}  // namespace randattn
