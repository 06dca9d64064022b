#pragma once
// Always-on argument checks for public entry points. Each failure throws
// randattn::invalid_argument (a std::invalid_argument) with a message naming the function, the
// argument and the shapes.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "../core/invalid_argument.hpp"
#include "parallel.hpp"
#include "unroll.hpp"

namespace randattn::detail {

// A matrix's shape as it appears in messages ("3x4"). Only streamed when a check fails: the
// arguments of require() are evaluated on every call, and formatting a string there would cost
// a stream construction per call on paths taken once per decoded token.
struct Shape {
  Eigen::Index rows, cols;
  friend std::ostream& operator<<(std::ostream& os, const Shape& s) {
    return os << s.rows << "x" << s.cols;
  }
};

template <typename Derived>
Shape shape_of(const Eigen::DenseBase<Derived>& m) {
  return {m.rows(), m.cols()};
}

template <typename... Parts>
[[noreturn]] void fail(const char* where, const Parts&... parts) {
  std::ostringstream s;
  s << "randattn::" << where << ": ";
  (s << ... << parts);
  throw randattn::invalid_argument(s.str());
}

template <typename... Parts>
void require(bool ok, const char* where, const Parts&... parts) {
  if (!ok) fail(where, parts...);
}

// Whether the `count` entries from p are all finite, branch-free in explicit packets (so at any
// optimisation level): x · 0 is zero for finite x and NaN for Inf or NaN, so multiply-adds of
// every entry times zero sum to zero exactly when all of them are finite.
template <typename Scalar>
bool finite_run(const Scalar* p, Eigen::Index count) {
  using Eigen::internal::padd;
  using Eigen::internal::pmadd;
  using Eigen::internal::ploadu;
  using P = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr Eigen::Index ps = Eigen::internal::packet_traits<Scalar>::size;
  const P zero = Eigen::internal::pset1<P>(Scalar(0));
  P acc[4] = {zero, zero, zero, zero};  // four chains hide the multiply-add latency
  Eigen::Index i = 0;
  for (; i + 4 * ps <= count; i += 4 * ps) {
    RANDATTN_UNROLL  // else at -O2 the four chains stay in memory
    for (int u = 0; u < 4; ++u) acc[u] = pmadd(ploadu<P>(p + i + u * ps), zero, acc[u]);
  }
  for (; i + ps <= count; i += ps) acc[0] = pmadd(ploadu<P>(p + i), zero, acc[0]);
  // The lanes are summed from memory: GCC 12 warns about the undefined halves inside the
  // extraction intrinsics of Eigen's predux for AVX-512 doubles (its bug 105593).
  Scalar lanes[ps];
  Eigen::internal::pstoreu(lanes, padd(padd(acc[0], acc[1]), padd(acc[2], acc[3])));
  Scalar sum(0);
  for (Eigen::Index l = 0; l < ps; ++l) sum += lanes[l];
  for (; i < count; ++i) sum += p[i] * Scalar(0);
  return sum == Scalar(0);
}

// A branch-free scan over contiguous storage (finite_run) for the common case of direct-access
// inputs; Eigen's own allFinite for anything else.
template <typename Derived>
bool all_finite(const Eigen::DenseBase<Derived>& m) {
  const Derived& x = m.derived();
  if constexpr (bool(Derived::Flags & Eigen::DirectAccessBit) &&
                Derived::InnerStrideAtCompileTime == 1) {
    const Eigen::Index outer = x.outerSize(), inner = x.innerSize();
    const auto finite = [&](Eigen::Index o0, Eigen::Index o1) {  // outer slices [o0, o1)
      if (x.outerStride() == inner) return finite_run(x.data() + o0 * inner, (o1 - o0) * inner);
      for (Eigen::Index o = o0; o < o1; ++o)
        if (!finite_run(x.data() + o * x.outerStride(), inner)) return false;
      return true;
    };
    // The inputs of a long sequence are scanned in pieces in parallel: one thread's pass over
    // them is a visible part of a two-thread call.
    constexpr Eigen::Index kPiece = Eigen::Index(1) << 18;  // entries
    const Eigen::Index pieces = std::min(outer, outer * inner / kPiece);
    if (pieces < 2) return finite(0, outer);
    std::vector<char> ok(static_cast<std::size_t>(pieces));
    parallel_for(pieces, [&](Index t) {
      ok[std::size_t(t)] = finite(t * outer / pieces, (t + 1) * outer / pieces);
    });
    return std::all_of(ok.begin(), ok.end(), [](char f) { return f != 0; });
  } else {
    return x.allFinite();
  }
}

// Rejects NaN and Inf unless the caller opted out; the message names the argument
// and the first offending position so the user can find it.
template <typename Derived>
void require_finite(const Eigen::DenseBase<Derived>& m, const char* where, const char* name,
                    bool check = true) {
  if (!check || all_finite(m)) return;
  for (Eigen::Index i = 0; i < m.rows(); ++i) {
    for (Eigen::Index j = 0; j < m.cols(); ++j) {
      const auto x = m(i, j);
      if (!(x == x) || x - x != x - x) {
        fail(where, name, " (", shape_of(m), ") has a non-finite entry ", x, " at (", i, ", ", j,
             "); clean the input or set check_finite = false");
      }
    }
  }
}

template <typename Scalar>
void require_finite(const Scalar* data, Eigen::Index count, const char* where, const char* name,
                    bool check = true) {
  if (!check) return;
  if (all_finite(Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(data, count))) return;
  for (Eigen::Index i = 0; i < count; ++i) {
    const Scalar x = data[i];
    if (!(x == x) || x - x != x - x) {
      fail(where, name, " has a non-finite entry ", x, " at flat index ", i,
           "; clean the input or set check_finite = false");
    }
  }
}

// Post-condition of every computation on finite inputs. A NaN or Inf input entry always reaches
// the result (IEEE: NaN and Inf * 0 give NaN; masked entries are overwritten, not multiplied),
// so one scan of the small result replaces scans of the large inputs before the work. When the
// result is not finite, scan_inputs() throws naming the first non-finite input entry; if every
// input is finite the result overflowed, which is reported too: never silent NaN or Inf.
template <typename Result, typename ScanInputs>
void check_result_finite(const char* where, const Eigen::DenseBase<Result>& result, bool check,
                         ScanInputs&& scan_inputs) {
  if (!check || all_finite(result)) return;
  scan_inputs();
  fail(where, "the result overflowed the floating-point range although every input is finite; ",
       "rescale the inputs or the logit scale");
}

// The same post-condition for one number computed from checked, finite inputs.
inline void check_result_finite(const char* where, double result) {
  check_result_finite(where, Eigen::Matrix<double, 1, 1>::Constant(result), true, [] {});
}

}  // namespace randattn::detail
