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
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <Eigen/Core>

#include <randattn/core/types.hpp>
#include <randattn/random/fill.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

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

// The entries check_gradient compares: every one in the plain build. Under a sanitizer
// (RANDATTN_TEST_SANITIZED, 10-20x slower) every 7th in row-major order and the last: the
// sanitizers look for memory and undefined-behaviour errors, which each forward and backward
// call exercises whatever entry it perturbs; a stride prime to the usual widths (4, 8, 16, 64)
// still reaches every column. The plain build compares them all.
#ifdef RANDATTN_TEST_SANITIZED
constexpr randattn::Index kCheckedEntryStride = 7;
#else
constexpr randattn::Index kCheckedEntryStride = 1;
#endif

// Compares `grad` (the backward's gradient of f with respect to x) with central differences of
// f, perturbing x in place (restored after each entry). The entries of kCheckedEntryStride are
// checked; the first failures are named in the message. `f` is called twice per checked entry.
inline void check_gradient(const std::string& what, randattn::RowMatrix<double>& x,
                           const randattn::RowMatrix<double>& grad,
                           const std::function<double()>& f, GradientTolerance tol = {},
                           double h = 1e-5) {
  REQUIRE(grad.rows() == x.rows());
  REQUIRE(grad.cols() == x.cols());
  int failures = 0;
  std::ostringstream message;
  double worst = 0;
  const randattn::Index entries = x.size();
  for (randattn::Index e = 0; e < entries; ++e) {
    if (e % kCheckedEntryStride != 0 && e != entries - 1) continue;
    const randattn::Index i = e / x.cols(), c = e % x.cols();
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

// The directional form of check_gradient, for long sequences: for `directions` random directions
// u (one per input, drawn from `seed`), (f(x + h u) − f(x − h u)) / 2h against Σ <grad_x, u_x>,
// at check_gradient's default tolerance. Two calls of f per direction.
inline void check_directions(const std::string& what,
                             const std::vector<randattn::RowMatrix<double>*>& xs,
                             const std::vector<randattn::RowMatrix<double>>& grads,
                             const std::function<double()>& f, int directions,
                             std::uint64_t seed, double h = 1e-5) {
  const GradientTolerance tol;
  for (int t = 0; t < directions; ++t) {
    std::vector<randattn::RowMatrix<double>> u;
    double analytic = 0;
    for (std::size_t a = 0; a < xs.size(); ++a) {
      u.push_back(randattn::gaussian_matrix<double>(randattn::Philox(seed + 10 * t + a),
                                                    xs[a]->rows(), xs[a]->cols()));
      analytic += (grads[a].array() * u[a].array()).sum();
    }
    const auto shift = [&](double by) {
      for (std::size_t a = 0; a < xs.size(); ++a) *xs[a] += by * u[a];
    };
    shift(h);
    const double plus = f();
    shift(-2 * h);
    const double minus = f();
    shift(h);
    const double numeric = (plus - minus) / (2 * h);
    INFO(what << " direction " << t << ": backward " << analytic << ", finite difference "
              << numeric);
    CHECK(std::abs(numeric - analytic) <= tol.absolute + tol.relative * std::abs(numeric));
  }
}

// One thread while it lives: finite differences run thousands of small forwards, where starting
// a parallel region costs more than the work.
class OneThread {
 public:
#if defined(_OPENMP)
  OneThread() : threads_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(threads_); }

 private:
  int threads_;
#endif
};

}  // namespace testing
