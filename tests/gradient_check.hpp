#pragma once
// Finite-difference checks of backward passes ([gradients] cases). Every backward computes the
// vector–Jacobian product of f(x) = <G, F(x)> for a fixed cotangent G, so its gradient can be
// compared, entry by entry, with the central difference (f(x + h e) − f(x − h e)) / 2h of the
// same seeded forward in double: the random numbers (projections, hashes, samples) are held
// fixed by the seed, so the forward is a smooth function of x away from the discrete choices.
//
// The truncation error of a central difference is h²/6 · f''' and the rounding error about
// ε·|f|/h; h = 1e-5 makes both far below the tolerance 1e-5 + 1e-3·|g| asked of every method.

#include <cmath>
#include <functional>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include <Eigen/Core>

#include <randattn/core/types.hpp>

namespace testing {

// <G, F> in double.
template <typename A, typename B>
double contract(const Eigen::MatrixBase<A>& g, const Eigen::MatrixBase<B>& f) {
  return (g.template cast<double>().array() * f.template cast<double>().array()).sum();
}

struct GradientTolerance {
  double absolute = 1e-5;
  double relative = 1e-3;
};

// Compares `grad` (the backward's gradient of f with respect to x) with central differences of
// f, perturbing x in place (restored after each entry). Every entry is checked; the first
// failures are named in the message. `f` is called twice per entry of x.
inline void check_gradient(const std::string& what, randattn::RowMatrix<double>& x,
                           const randattn::RowMatrix<double>& grad,
                           const std::function<double()>& f, GradientTolerance tol = {},
                           double h = 1e-5) {
  REQUIRE(grad.rows() == x.rows());
  REQUIRE(grad.cols() == x.cols());
  int failures = 0;
  std::ostringstream message;
  double worst = 0;
  for (randattn::Index i = 0; i < x.rows(); ++i)
    for (randattn::Index c = 0; c < x.cols(); ++c) {
      const double saved = x(i, c);
      x(i, c) = saved + h;
      const double plus = f();
      x(i, c) = saved - h;
      const double minus = f();
      x(i, c) = saved;
      const double numeric = (plus - minus) / (2 * h);
      const double err = std::abs(numeric - grad(i, c));
      const double allowed = tol.absolute + tol.relative * std::abs(numeric);
      worst = std::max(worst, err / allowed);
      if (!(err <= allowed) && failures++ < 5)
        message << what << "(" << i << ", " << c << "): backward " << grad(i, c)
                << ", finite difference " << numeric << "\n";
    }
  INFO(message.str() << what << ": " << failures << " entries off, worst error / tolerance "
                     << worst);
  CHECK(failures == 0);
}

}  // namespace testing
