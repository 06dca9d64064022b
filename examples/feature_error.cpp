// Attention error against exact attention versus the number of random projections m, for
// the three projections (i.i.d., orthogonal, Hadamard) with positive features, and for the
// three maps (positive, hyperbolic, trig) with orthogonal projections. Prints CSV
// (map,projection,m,feature_dim,mean_rel_error,stderr) on stdout; scripts/plot_feature_error.py
// turns it into docs/feature_error.png. Runs with no arguments.
//
// Data: n = 1024 tokens, d = 64, scale = 1/sqrt(d). Token t belongs to topic t mod 8; q, k
// and v rows are their topic's centre (N(0, 0.4²) entries) plus N(0, 0.25²) noise, so that
// attention concentrates on same-topic keys and outputs differ by topic (scale · ‖q‖² ≈ 1.7).
// Each point is the mean over 8 seeds of the relative Frobenius error of bidirectional
// attention.

#include <cmath>
#include <iostream>
#include <string>

#include <randattn/randattn.hpp>

using randattn::Index;
using randattn::RowMatrix;

namespace {

constexpr Index kN = 1024, kD = 64, kDv = 64;
constexpr int kSeeds = 8;

template <typename MakeMap>
void sweep(const std::string& map_name, const std::string& projection_name, MakeMap make,
           const RowMatrix<double>& q, const RowMatrix<double>& k, const RowMatrix<double>& v,
           const RowMatrix<double>& exact) {
  for (Index m : {16, 32, 64, 128, 256, 512}) {
    double sum = 0, sum_sq = 0;
    Index dim = 0;
    for (int s = 0; s < kSeeds; ++s) {
      const auto map = make(m, std::uint64_t(s + 1));
      dim = map.feature_dim();
      const double e =
          (randattn::random_feature_attention(map, q, k, v) - exact).norm() / exact.norm();
      sum += e;
      sum_sq += e * e;
    }
    const double mean = sum / kSeeds;
    const double se = std::sqrt(std::max(0.0, sum_sq / kSeeds - mean * mean) / (kSeeds - 1));
    std::cout << map_name << "," << projection_name << "," << m << "," << dim << "," << mean << ","
              << se << "\n";
  }
}

}  // namespace

int main() {
  const randattn::Philox rng(99);
  const RowMatrix<double> centres =
      0.4 * randattn::gaussian_matrix<double>(rng.with_stream(0), 8, kD);
  RowMatrix<double> q = 0.25 * randattn::gaussian_matrix<double>(rng.with_stream(1), kN, kD);
  RowMatrix<double> k = 0.25 * randattn::gaussian_matrix<double>(rng.with_stream(2), kN, kD);
  RowMatrix<double> v = 0.25 * randattn::gaussian_matrix<double>(rng.with_stream(3), kN, kDv);
  for (Index t = 0; t < kN; ++t) {
    q.row(t) += centres.row(t % 8);
    k.row(t) += centres.row(t % 8);
    v.row(t) += centres.row((t + 3) % 8);
  }
  const RowMatrix<double> exact = randattn::exact_attention(q, k, v);

  using namespace randattn;
  std::cout << "map,projection,m,feature_dim,mean_rel_error,stderr\n";
  sweep(
      "positive", "iid",
      [](Index m, std::uint64_t s) {
        return PositiveFeatures(GaussianProjection<double>(m, kD, s));
      },
      q, k, v, exact);
  sweep(
      "positive", "orthogonal",
      [](Index m, std::uint64_t s) {
        return PositiveFeatures(OrthogonalProjection<double>(m, kD, s));
      },
      q, k, v, exact);
  sweep(
      "positive", "hadamard",
      [](Index m, std::uint64_t s) {
        return PositiveFeatures(HadamardProjection<double>(m, kD, s));
      },
      q, k, v, exact);
  sweep(
      "hyperbolic", "orthogonal",
      [](Index m, std::uint64_t s) {
        return HyperbolicFeatures(OrthogonalProjection<double>(m, kD, s));
      },
      q, k, v, exact);
  sweep(
      "trig", "orthogonal",
      [](Index m, std::uint64_t s) { return TrigFeatures(OrthogonalProjection<double>(m, kD, s)); },
      q, k, v, exact);
  return 0;
}
