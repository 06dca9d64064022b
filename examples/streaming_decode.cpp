// Causal streaming decoding with FAVOR+: tokens arrive one at a time; each step appends the new
// key/value to a fixed-size state (m × (dv + 1)) and reads the output of the new query, at a
// cost that does not grow with the sequence length. The outputs equal the chunked causal
// computation over the whole sequence up to rounding, and are compared with exact causal
// attention. Runs with no arguments.

#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>

#include <randattn/randattn.hpp>

using randattn::Index;
using randattn::RowMatrix;

int main() {
  const Index n = 2048, d = 64, dv = 64, m = 256;
  // A built-in sequence with scale · ‖q‖² ≈ 2 (scale = 1/sqrt(d)).
  const randattn::Philox rng(2024);
  const RowMatrix<float> q = 0.5f * randattn::gaussian_matrix<float>(rng.with_stream(1), n, d);
  const RowMatrix<float> k = 0.5f * randattn::gaussian_matrix<float>(rng.with_stream(2), n, d);
  const RowMatrix<float> v = randattn::gaussian_matrix<float>(rng.with_stream(3), n, dv);

  const randattn::PositiveFeatures favor(randattn::OrthogonalProjection<float>(m, d, /*seed=*/1));
  randattn::RandomFeatureOptions opt;
  opt.causal = true;
  randattn::RandomFeatureDecoder decoder(favor, dv, opt);

  RowMatrix<float> streamed(n, dv);
  std::cout << "streaming FAVOR+ decoding: m = " << m << ", d = " << d << ", dv = " << dv
            << ", state " << m << " x " << dv + 1 << " floats\n\n"
            << "  tokens    us / token\n";
  const auto start = std::chrono::steady_clock::now();
  auto last = start;
  for (Index t = 0; t < n; ++t) {
    decoder.append(k.row(t), v.row(t));
    decoder.query_into(q.row(t), streamed.row(t));  // no allocation per token
    if ((t + 1) % 512 == 0) {
      const auto now = std::chrono::steady_clock::now();
      std::cout << std::setw(8) << t + 1 << "    " << std::fixed << std::setprecision(2)
                << std::chrono::duration<double, std::micro>(now - last).count() / 512 << "\n";
      last = now;
    }
  }

  const RowMatrix<float> chunked = randattn::random_feature_attention(favor, q, k, v, opt);
  randattn::ExactOptions exact_opt;
  exact_opt.causal = true;
  const RowMatrix<float> exact = randattn::exact_attention(q, k, v, exact_opt);
  std::cout << "\nstreamed vs chunked causal FAVOR+: rel. error " << std::scientific
            << std::setprecision(2) << (streamed - chunked).norm() / chunked.norm() << "\n"
            << "streamed vs exact causal attention: rel. error "
            << (streamed - exact).norm() / exact.norm() << "\n";
  return 0;
}
