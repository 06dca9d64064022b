// Hybrid random features against FAVOR+ at equal total feature dimension M, on the same inputs
// in one run: time (cost ratio) and the relative error against exact attention (counter
// rel_error, computed once outside the timed loop; error ratio = hybrid / FAVOR+).
// n = 4096, d = dv = 64, float, single thread, bidirectional; q, k ~ N(0, 0.25 I).
//  - Hybrid/m/n_lambda: angular hybrid, M = 2 (n_lambda + 1) 2m + 2m.
//  - HybridGaussian/m/n_lambda: Gaussian hybrid (bandwidth 1), M = 2 n_lambda (2m + m) + m.
//  - Favor/M: positive features with M projections.
//  - Exact: tiled exact attention (the reference of the errors).

#include "bench_common.hpp"

namespace {

using bench::Index;
using bench::RowMatrix;
using randattn::gaussian_matrix;
using randattn::OrthogonalProjection;
using randattn::Philox;
constexpr Index kN = 4096, kD = 64, kDv = 64;

struct Inputs {
  RowMatrix<float> q = gaussian_matrix<float>(Philox(1), kN, kD, 0.5),
                   k = gaussian_matrix<float>(Philox(2), kN, kD, 0.5),
                   v = gaussian_matrix<float>(Philox(3), kN, kDv);
  RowMatrix<float> exact = randattn::exact_attention(q, k, v);
};

const Inputs& inputs() {
  static const Inputs in;
  return in;
}

template <typename Map>
void run(benchmark::State& state, const Map& map) {
  bench::set_threads(1);
  const Inputs& in = inputs();
  const RowMatrix<float> once = randattn::random_feature_attention(map, in.q, in.k, in.v);
  for (auto _ : state) {
    RowMatrix<float> out = randattn::random_feature_attention(map, in.q, in.k, in.v);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["M"] = double(map.feature_dim());
  state.counters["rel_error"] = (once - in.exact).norm() / in.exact.norm();
}

void Hybrid(benchmark::State& state) {
  run(state, randattn::angular_hybrid<float>(state.range(0), state.range(1), kD, 1));
}
void HybridGaussian(benchmark::State& state) {
  run(state, randattn::gaussian_hybrid<float>(state.range(0), state.range(1), kD, 1.0, 1));
}
void Favor(benchmark::State& state) {
  run(state, randattn::PositiveFeatures(OrthogonalProjection<float>(state.range(0), kD, 1)));
}
void Exact(benchmark::State& state) {
  bench::set_threads(1);
  const Inputs& in = inputs();
  for (auto _ : state) {
    RowMatrix<float> out = randattn::exact_attention(in.q, in.k, in.v);
    benchmark::DoNotOptimize(out.data());
  }
}

}  // namespace

// Total dimensions: 2·4·32 + 32 = 288 and 2·8·64 + 64 = 1088 (angular; nearest FAVOR+ 1216);
// 2·3·48 + 16 = 304 and 2·6·96 + 32 = 1184 (Gaussian).
BENCHMARK(Hybrid)
    ->ArgNames({"m", "nl"})
    ->Args({16, 3})
    ->Args({32, 7})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(HybridGaussian)
    ->ArgNames({"m", "nl"})
    ->Args({16, 3})
    ->Args({32, 6})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(Favor)
    ->ArgNames({"M"})
    ->Arg(288)
    ->Arg(304)
    ->Arg(1184)
    ->Arg(1216)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(Exact)->Unit(benchmark::kMillisecond)->UseRealTime();
