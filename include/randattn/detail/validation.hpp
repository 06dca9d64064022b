#pragma once
// Always-on argument checks for public entry points. Each failure throws
// std::invalid_argument with a message naming the function, the argument and the shapes.

#include <sstream>
#include <stdexcept>
#include <string>

#include <Eigen/Core>

namespace randattn::detail {

template <typename Derived>
std::string shape_of(const Eigen::DenseBase<Derived>& m) {
  std::ostringstream s;
  s << m.rows() << "x" << m.cols();
  return s.str();
}

template <typename... Parts>
[[noreturn]] void fail(const char* where, const Parts&... parts) {
  std::ostringstream s;
  s << "randattn::" << where << ": ";
  (s << ... << parts);
  throw std::invalid_argument(s.str());
}

template <typename... Parts>
void require(bool ok, const char* where, const Parts&... parts) {
  if (!ok) fail(where, parts...);
}

// x * 0 is 0 for finite x and NaN for NaN or Inf, so one vectorised sum decides.
template <typename Derived>
bool all_finite(const Eigen::DenseBase<Derived>& m) {
  using Scalar = typename Derived::Scalar;
  return m.size() == 0 || (m.derived().array() * Scalar(0)).sum() == Scalar(0);
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

}  // namespace randattn::detail
