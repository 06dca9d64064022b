// Tensor sketching: sparsify a low-rank-plus-noise tensor with Algorithm 1 and recover its HOSVD
// subspaces from two sketches (Algorithm 2), against exact HOSVD.
//
//   tensor_sketch                  the HOSVD table (order 3, d = 100, Tucker rank 3, noise 0.3)
//   tensor_sketch --curve out.csv  also writes relative spectral error against budget for
//                                  Algorithm 1 and the three baselines (data of
//                                  docs/sketch_spectral_error.png, see scripts/plot_sketch.py)

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <randattn/randattn.hpp>

using randattn::Index;

namespace {

template <typename F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void hosvd_table() {
  const Index d = 100, r = 3;
  randattn::SyntheticOptions so;
  so.noise = 0.3;
  const auto t = randattn::low_rank_plus_noise<float>({d, d, d}, {r, r, r}, so, 5);
  const std::vector<Index> ranks{r, r, r};
  std::printf(
      "tensor sketch: order 3, d = %ld, Tucker rank %ld, noise %.1f, D = %ld entries (float)\n\n",
      long(d), long(r), so.noise, long(t.data.size()));

  randattn::Hosvd<float> exact;
  const double t_exact = seconds([&] { exact = randattn::exact_hosvd(t.view(), ranks); });
  double planted = 0;
  for (Index j = 0; j < 3; ++j)
    planted = std::max(planted, randattn::sin_theta_distance(t.factors[std::size_t(j)],
                                                             exact.factors[std::size_t(j)]));
  std::printf("exact HOSVD: %.3f s (sin-theta to the planted subspaces: %.3f)\n\n", t_exact,
              planted);

  const randattn::SpectralNormEstimate norm = randattn::spectral_norm(t.view());
  std::printf("%10s %9s %9s %9s %9s %10s %9s %8s\n", "budget n", "nnz(A1)", "E[nnz]", "rel.fro",
              "rel.spec", "sin-theta", "time (s)", "/exact");
  double first_below = 0;
  for (double n : {3e3, 1e4, 2e4, 3e4, 5e4, 1e5, 3e5}) {
    randattn::SparsifyOptions opt;
    opt.budget = n;
    opt.seed = 1;
    randattn::SketchedHosvd<float> h;
    const double t_sketch = seconds([&] { h = randattn::sketched_hosvd(t.view(), ranks, opt); });
    double worst = 0;
    for (std::size_t j = 0; j < 3; ++j)
      worst = std::max(worst, randattn::sin_theta_distance(exact.factors[j], h.factors[j]));
    const auto sketch = randattn::sparsify(t.view(), opt);
    const randattn::SketchError err = randattn::sketch_error(t.view(), sketch, {}, norm);
    std::printf("%10.0f %9ld %9.0f %9.3f %9.3f %10.4f %9.3f %8.2f\n", n, long(h.nnz[0]),
                h.stats.expected_nnz, err.relative_frobenius, err.relative_spectral, worst,
                t_sketch, t_sketch / t_exact);
    if (first_below == 0 && worst < 0.1) first_below = n;
  }
  std::printf("\nsin-theta (worst mode) below 0.1 from budget n = %.0f on (seed 1)\n", first_below);
}

// Mean over draws of the relative spectral error of each scheme at matched expected nnz.
void spectral_curve(const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << "factors,spikes,scheme,budget_fraction,expected_nnz,rel_spectral,rel_frobenius\n";
  const Index d = 64;
  const double D = double(d * d * d);
  const int draws = 3;
  for (bool flat : {true, false}) {
    for (Index spikes : {Index(0), Index(30)}) {
      randattn::SyntheticOptions so;
      so.noise = 0.3;
      so.flat_factors = flat;
      so.spikes = spikes;
      so.spike_size = 0.3;
      const auto t = randattn::low_rank_plus_noise<double>({d, d, d}, {3, 3, 3}, so, 11);
      const randattn::SpectralNormEstimate norm = randattn::spectral_norm(t.view());
      for (double fraction : {0.003, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3, 0.5}) {
        for (auto scheme : {randattn::SparsifyScheme::spa, randattn::SparsifyScheme::ndt,
                            randattn::SparsifyScheme::l2, randattn::SparsifyScheme::uniform}) {
          double spec = 0, fro = 0, expected = 0;
          for (int s = 0; s < draws; ++s) {
            randattn::SparsifyOptions opt;
            opt.budget = fraction * D;
            opt.seed = 100 + std::uint64_t(s);
            opt.scheme = scheme;
            const auto sketch = randattn::sparsify(t.view(), opt);
            const randattn::SketchError err = randattn::sketch_error(t.view(), sketch, {}, norm);
            spec += err.relative_spectral / draws;
            fro += err.relative_frobenius / draws;
            expected = sketch.stats.expected_nnz;
          }
          out << (flat ? "sign" : "gaussian") << ',' << spikes << ','
              << randattn::scheme_name(scheme) << ',' << fraction << ',' << expected << ',' << spec
              << ',' << fro << '\n';
        }
      }
      std::printf("curve: %s factors, %ld spikes done\n", flat ? "sign" : "gaussian", long(spikes));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    hosvd_table();
    if (argc == 3 && std::string(argv[1]) == "--curve") {
      spectral_curve(argv[2]);
    } else if (argc != 1) {
      std::fprintf(stderr, "usage: %s [--curve out.csv]\n", argv[0]);
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tensor_sketch: %s\n", e.what());
    return 1;
  }
  return 0;
}
