// Attention error against exact attention versus the query/key norm, at an equal feature
// budget of about 256 features per token, for the positive (FAVOR+), hyperbolic, OPRF, SDERF,
// trig and angular-hybrid maps, and for sparse + low-rank attention with that OPRF map as the
// remainder of an LSH support (sort-and-chunk, chunk 64, 4 rounds). Prints CSV
// (map,s,scaled_sq_norm,feature_dim,mean_rel_error,stderr,predicted_rel_mse) on stdout;
// scripts/plot_error_vs_norm.py turns it into docs/error_vs_norm.png and the README table.
// Runs with no arguments.
//
// Data: Q, K ~ s·N(0, I), V ~ N(0, I), n = 4096, d = 64, scale = 1/sqrt(d), so that
// scale·‖q‖² ≈ 8s². Each point is the mean over 3 seeds (data and projections) of the relative
// Frobenius error of bidirectional attention. OPRF and SDERF are fitted on the queries and keys
// of the call. predicted_rel_mse is the closed-form i.i.d. kernel MSE relative to the kernel
// squared, averaged over 1024 sampled query-key pairs (features/kernel_variance.hpp).

#include <cmath>
#include <iostream>
#include <string>

#include <randattn/randattn.hpp>

using randattn::Index;
using randattn::RowMatrix;

namespace {

constexpr Index kN = 4096, kD = 64, kBudget = 256;
constexpr int kSeeds = 3;

struct Data {
  RowMatrix<double> q, k, v, exact;
};

Data make_data(double s, int seed) {
  const randattn::Philox rng(1000 + std::uint64_t(seed));
  Data data{randattn::gaussian_matrix<double>(rng.with_stream(0), kN, kD, s),
            randattn::gaussian_matrix<double>(rng.with_stream(1), kN, kD, s),
            randattn::gaussian_matrix<double>(rng.with_stream(2), kN, kD),
            {}};
  data.exact = randattn::exact_attention(data.q, data.k, data.v);
  return data;
}

// Map of one method drawn with `seed` and fitted to (q, k) where it has parameters.
template <typename Map>
Map fitted(Map map, const Data& data, double normaliser) {
  if constexpr (std::is_same<Map, randattn::OptimalPositiveFeatures<double>>::value ||
                std::is_same<Map, randattn::DenseExponentialFeatures<double>>::value)
    map.fit(data.q, data.k, normaliser);
  return map;
}

const double kNormaliser = std::pow(double(kD), -0.25);  // scale^{1/2}, scale = 1/sqrt(d)

// What one method gives on one draw of the data.
struct Run {
  RowMatrix<double> out;
  Index feature_dim = 0;
  double predicted_rel_mse = 0;  // 0: not available
};

// Random-feature attention with the map make(seed), fitted to (q, k) where it has parameters.
template <typename MakeMap>
auto features(MakeMap make) {
  return [make](const Data& data, std::uint64_t seed) {
    const auto map = fitted(make(seed), data, kNormaliser);
    Run run{randattn::random_feature_attention(map, data.q, data.k, data.v), map.feature_dim(), 0};
    if constexpr (!std::is_same<decltype(map), const randattn::HybridFeatures<double>>::value)
      run.predicted_rel_mse = randattn::mean_kernel_relative_mse(map, data.q, data.k, kNormaliser);
    return run;
  };
}

// Sparse + low-rank: exact on the keys LSH puts in each query's chunks, OPRF (fitted as above)
// for the rest.
Run sparse_lowrank(const Data& data, std::uint64_t seed) {
  using namespace randattn;
  const LshOptions lsh_options;  // chunk 64, exact union of the rounds
  const CrossPolytopeHash<double> hash(kD, reformer_buckets(kN, lsh_options.chunk), 4, seed);
  SupportSpec<double> support;
  support.lsh = &hash;
  support.lsh_options = lsh_options;
  const auto map = fitted(OptimalPositiveFeatures(OrthogonalProjection<double>(kBudget, kD, seed)),
                          data, kNormaliser);
  SparseLowRankOptions options;
  options.seed = seed;
  return {sparse_lowrank_attention<double>(
              data.q, data.k, data.v, support,
              FeatureRemainder<OptimalPositiveFeatures<double>>{map, {}}, options),
          map.feature_dim(), 0};
}

template <typename Method>
void sweep(const std::string& name, Method method) {
  for (double s : {0.18, 0.25, 0.35, 0.5, 0.6, 0.7, 0.85, 1.0}) {
    double sum = 0, sum_sq = 0, norm = 0, predicted = 0;
    Index dim = 0;
    for (int seed = 0; seed < kSeeds; ++seed) {
      const Data data = make_data(s, seed);
      const Run run = method(data, std::uint64_t(seed + 1));
      dim = run.feature_dim;
      const double e = (run.out - data.exact).norm() / data.exact.norm();
      sum += e;
      sum_sq += e * e;
      norm += kNormaliser * kNormaliser * data.q.rowwise().squaredNorm().mean();
      predicted += run.predicted_rel_mse;
    }
    const double mean = sum / kSeeds;
    const double se = std::sqrt(std::max(0.0, sum_sq / kSeeds - mean * mean) / (kSeeds - 1));
    std::cout << name << "," << s << "," << norm / kSeeds << "," << dim << "," << mean << "," << se
              << ",";
    if (predicted > 0) std::cout << predicted / kSeeds;
    std::cout << "\n" << std::flush;
  }
}

}  // namespace

int main() {
  using namespace randattn;
  using Orth = OrthogonalProjection<double>;
  std::cout << "map,s,scaled_sq_norm,feature_dim,mean_rel_error,stderr,predicted_rel_mse\n";
  sweep("positive",
        features([](std::uint64_t seed) { return PositiveFeatures(Orth(kBudget, kD, seed)); }));
  sweep("oprf", features([](std::uint64_t seed) {
          return OptimalPositiveFeatures(Orth(kBudget, kD, seed));
        }));
  sweep("sderf", features([](std::uint64_t seed) {
          return DenseExponentialFeatures(Orth(kBudget, kD, seed));
        }));
  sweep("hyperbolic", features([](std::uint64_t seed) {
          return HyperbolicFeatures(Orth(kBudget / 2, kD, seed));
        }));
  sweep("trig",
        features([](std::uint64_t seed) { return TrigFeatures(Orth(kBudget / 2, kD, seed)); }));
  // 2·(n_lambda + 1)·2m + 2m = 250 features with m = 25, n_lambda = 1.
  sweep("hybrid",
        features([](std::uint64_t seed) { return angular_hybrid<double>(25, 1, kD, seed); }));
  sweep("sparse-lowrank", sparse_lowrank);
  return 0;
}
