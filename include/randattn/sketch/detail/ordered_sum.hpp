#pragma once
// Sums over the entries of a tensor, rounded in a way fixed by the flat indices alone.
//
// The term of flat index omega goes to lane omega % 256 (each lane summed in increasing omega);
// at the end of every aligned chunk of kSketchChunk entries the 256 lanes are folded by a fixed
// pairwise tree into the chunk's sum, and the chunk sums are added in order (sums of
// consecutive ranges of whole chunks, computed in parallel, are joined by append()). The same terms
// split into any consecutive pieces (streamed blocks of any size, a chunk per thread, runs of a
// strided view) give the same bits, and independent lanes make the sum vector code instead of
// one serial chain of additions. With 256 lanes, a lane gets one term per 256 entries, so the
// latency of its additions hides behind the work on the other entries.

#include <cmath>
#include <vector>

#include "../../core/types.hpp"
#include "../../detail/unroll.hpp"

namespace randattn::detail {

constexpr Index kSketchChunk = Index(1) << 15;

class OrderedSum {
 public:
  static constexpr Index kLanes = 256;  // divides kSketchChunk; the sampler's tile

  // The term x of flat index omega; terms come in increasing omega from a chunk start.
  void add(Index omega, double x) {
    lanes_[omega % kLanes] += x;
    if ((omega + 1) % kSketchChunk == 0) close_chunk();
  }
  // The term a^2, with one rounding where the target has FMA. Spelling the fused operation out
  // keeps the compiler from fusing some call sites and not others, which would make the
  // in-memory and streamed sums differ in the last bit.
  void add_square(Index omega, double a) {
    lanes_[omega % kLanes] = square_plus(a, lanes_[omega % kLanes]);
    if ((omega + 1) % kSketchChunk == 0) close_chunk();
  }
  // The terms x[0..kLanes) (or their squares) of flat indices omega0 .. omega0 + kLanes - 1,
  // omega0 a multiple of kLanes: the vectorised form of kLanes calls of add (add_square).
  void add_lanes(Index omega0, const double* x) {
    RANDATTN_UNROLL
    for (Index l = 0; l < kLanes; ++l) lanes_[l] += x[l];
    lanes_done(omega0);
  }
  template <typename Scalar>
  void add_square_lanes(Index omega0, const Scalar* a) {
    RANDATTN_UNROLL
    for (Index l = 0; l < kLanes; ++l) lanes_[l] = square_plus(double(a[l]), lanes_[l]);
    lanes_done(omega0);
  }
  // The same written by hand (vector code that updates lane l with the term of omega0 + l, as
  // add_lanes does), followed by lanes_done(omega0).
  double* lanes() { return lanes_; }
  void lanes_done(Index omega0) {
    if ((omega0 + kLanes) % kSketchChunk == 0) close_chunk();
  }

  // Joins the sum of the terms that follow this sum's, which must end at a chunk end.
  void append(const OrderedSum& next) {
    chunk_sums_.insert(chunk_sums_.end(), next.chunk_sums_.begin(), next.chunk_sums_.end());
    RANDATTN_UNROLL
    for (Index l = 0; l < kLanes; ++l) lanes_[l] = next.lanes_[l];
  }
  double value() const {
    double total = 0;
    for (double c : chunk_sums_) total += c;
    return total + fold();
  }

 private:
  static double square_plus(double a, double s) {
#if defined(__FMA__) || defined(__FP_FAST_FMA)
    return std::fma(a, a, s);
#else
    return s + a * a;
#endif
  }
  double fold() const {
    double t[kLanes];
    RANDATTN_UNROLL
    for (Index l = 0; l < kLanes; ++l) t[l] = lanes_[l];
    for (Index w = kLanes / 2; w >= 1; w /= 2)
      for (Index l = 0; l < w; ++l) t[l] += t[l + w];
    return t[0];
  }
  void close_chunk() {
    chunk_sums_.push_back(fold());
    for (double& x : lanes_) x = 0;
  }

  double lanes_[kLanes] = {};
  std::vector<double> chunk_sums_;  // of the closed chunks, in order
};

}  // namespace randattn::detail
