// Random-feature attention against tiled exact attention, in one binary so that ratios come
// from one run. d = dv = 64, m = 256 projections, float.
//
//  - ProjectionGemm: the plain Eigen product X ωᵀ (n × d × m), the floor of every feature map.
//  - FavorGemms: the four products of FAVOR+ attention as plain Eigen GEMMs, its floor.
//  - FeatureMap/<map>/<projection>: n rows to features (projection + exp/sin/cos + log-scales);
//    GFLOP/s counts the projection product only, so it compares directly with ProjectionGemm.
//  - Exact, Favor (positive features), FavorHyp (hyperbolic): attention end to end at
//    n = 128 ... 65536, bidirectional and causal (features of q and k included). GFLOP/s of
//    Exact counts its two products; of Favor/FavorHyp the feature products and the core.
//  - Oprf, Sderf: the same end to end at n = 4096 and 16384, the fit included: bidirectional
//    calls fit to their q and k (O(n·d) for OPRF, O(n·d²) for SDERF, plus O(d³ + m·d²) set-up),
//    causal calls use parameters fitted once to calibration rows outside the loop. Compare with
//    Favor of the same n and causal flag (run with --benchmark_filter='^(Favor|Oprf|Sderf)/').
//  - ExactThreads, FavorThreads, OprfThreads (arguments n, threads): bidirectional attention at
//    n = 65536 on 1 and 2 threads, written into one output reused across calls (the _into forms),
//    so that the rows time the computation and not the first touch of a fresh result. Their
//    ratio threads:1 / threads:2 is the two-thread speedup (OPRF's fit included).
//  - Backward/Favor (arguments n, threads, causal): the forward alone, then the forward keeping
//    its features + the backward from them, their times and ratio from one run, and the
//    backward's own time (bench_common.hpp); at n = 8192 on one thread and, causal, at n = 65536
//    on 1 and 2 threads (their backward_ms give the backward's two-thread speedup).
// Arguments: n, causal (0/1); these rows run on one thread.

#include <cmath>
#include <string>
#include <utility>

#include "bench_common.hpp"

namespace {

using bench::Index;
using bench::RowMatrix;
using randattn::gaussian_matrix;
using randattn::GaussianProjection;
using randattn::HadamardProjection;
using randattn::OrthogonalProjection;
using randattn::Philox;
constexpr Index kD = 64, kDv = 64, kM = 256;

// The shared inputs at d = dv = 64 (bench_common.hpp).
struct Inputs : bench::AttentionInputs {
  explicit Inputs(Index n) : AttentionInputs(n, kD, kDv) {}
};

void ProjectionGemm(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(1);
  const Inputs in(n);
  const RowMatrix<float> omega = gaussian_matrix<float>(Philox(4), kM, kD);
  RowMatrix<float> u(n, kM);
  for (auto _ : state) {
    u.noalias() = in.q * omega.transpose();
    benchmark::DoNotOptimize(u.data());
    benchmark::ClobberMemory();
  }
  bench::report_gflops(state, 2.0 * double(n) * kD * kM);
}

// The products FAVOR+ attention cannot avoid, as plain Eigen GEMMs: the projections Q ωᵀ and
// K ωᵀ (n × d × m each), K'ᵀ V (m × n × dv) and Q' (K'ᵀ V) (n × m × dv). Favor's time over this
// one's is its overhead over the GEMM floor (same n, same run).
void FavorGemms(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(1);
  const Inputs in(n);
  const RowMatrix<float> omega = gaussian_matrix<float>(Philox(4), kM, kD);
  RowMatrix<float> qf(n, kM), kf(n, kM), kv(kM, kDv), out(n, kDv);
  for (auto _ : state) {
    qf.noalias() = in.q * omega.transpose();
    kf.noalias() = in.k * omega.transpose();
    kv.noalias() = kf.transpose() * in.v;
    out.noalias() = qf * kv;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  bench::report_gflops(state, 4.0 * double(n) * kD * kM + 4.0 * double(n) * kM * kDv);
}

template <typename Map>
void FeatureMap(benchmark::State& state, Map map) {
  const Index n = state.range(0);
  bench::set_threads(1);
  const Inputs in(n);
  randattn::ScaledFeatures<float> f{RowMatrix<float>(n, map.feature_dim()),
                                    randattn::Vector<float>(n)};
  for (auto _ : state) {
    map.features_into(in.q, 0.35f, f.values, f.log_scale);
    benchmark::DoNotOptimize(f.values.data());
    benchmark::ClobberMemory();
  }
  bench::report_gflops(state, 2.0 * double(n) * kD * kM);
  state.counters["rows/s"] =
      benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate);
}

double exact_flops(Index n, bool causal) {
  return (causal ? 0.5 : 1.0) * 2.0 * double(n) * double(n) * (kD + kDv);
}
double feature_flops(Index n, Index dim) {
  return 4.0 * double(n) * kD * kM + 4.0 * double(n) * dim * (kDv + 1);
}

void Exact(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(1);
  const Inputs in(n);
  randattn::ExactOptions opt;
  opt.causal = state.range(1) != 0;
  for (auto _ : state) {
    RowMatrix<float> out = randattn::exact_attention(in.q, in.k, in.v, opt);
    benchmark::DoNotOptimize(out.data());
  }
  bench::report_gflops(state, exact_flops(n, opt.causal));
}

// Attention end to end with the map; refit(map, inputs) runs inside the timed loop before
// every call.
template <typename Map, typename Refit>
void EndToEnd(benchmark::State& state, Map map, Refit&& refit) {
  const Index n = state.range(0);
  bench::set_threads(1);
  const Inputs in(n);
  randattn::RandomFeatureOptions opt;
  opt.causal = state.range(1) != 0;
  for (auto _ : state) {
    refit(map, in);
    RowMatrix<float> out = randattn::random_feature_attention(map, in.q, in.k, in.v, opt);
    benchmark::DoNotOptimize(out.data());
  }
  bench::report_gflops(state, feature_flops(n, map.feature_dim()));
}

template <typename Map>
void Features(benchmark::State& state, Map map) {
  EndToEnd(state, std::move(map), [](Map&, const Inputs&) {});
}

void Favor(benchmark::State& state) {
  Features(state, randattn::PositiveFeatures(OrthogonalProjection<float>(kM, kD, 1)));
}
void FavorHyp(benchmark::State& state) {
  Features(state, randattn::HyperbolicFeatures(OrthogonalProjection<float>(kM, kD, 1)));
}

// Fit (bidirectional) and attention, as one call of a fitted map costs; causal calls use
// parameters fitted once to calibration rows.
template <typename Map>
void Fitted(benchmark::State& state, Map map) {
  const double c = std::pow(double(kD), -0.25);
  const bool causal = state.range(1) != 0;
  if (causal) {
    const RowMatrix<float> calibration = gaussian_matrix<float>(Philox(5), 256, kD, 0.5);
    map.fit(calibration, calibration, c);
  }
  EndToEnd(state, std::move(map), [&](Map& m, const Inputs& in) {
    if (!causal) m.fit(in.q, in.k, c);
  });
}

void Oprf(benchmark::State& state) {
  Fitted(state, randattn::OptimalPositiveFeatures(OrthogonalProjection<float>(kM, kD, 1)));
}
void Sderf(benchmark::State& state) {
  Fitted(state, randattn::DenseExponentialFeatures(OrthogonalProjection<float>(kM, kD, 1)));
}

// Two-thread scaling: see the header. refit(map, inputs) runs before every call.
template <typename Map, typename Refit>
void IntoThreads(benchmark::State& state, Map map, Refit&& refit) {
  const Index n = state.range(0);
  bench::set_threads(int(state.range(1)));
  const Inputs in(n);
  RowMatrix<float> out(n, kDv);
  for (auto _ : state) {
    refit(map, in);
    randattn::random_feature_attention_into(map, in.q, in.k, in.v, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  bench::report_gflops(state, feature_flops(n, map.feature_dim()));
}

void ExactThreads(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(int(state.range(1)));
  const Inputs in(n);
  RowMatrix<float> out(n, kDv);
  for (auto _ : state) {
    randattn::exact_attention_into(in.q, in.k, in.v, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  bench::report_gflops(state, exact_flops(n, false));
}
void FavorThreads(benchmark::State& state) {
  IntoThreads(state, randattn::PositiveFeatures(OrthogonalProjection<float>(kM, kD, 1)),
              [](auto&, const Inputs&) {});
}
void OprfThreads(benchmark::State& state) {
  const double c = std::pow(double(kD), -0.25);
  IntoThreads(state, randattn::OptimalPositiveFeatures(OrthogonalProjection<float>(kM, kD, 1)),
              [c](auto& map, const Inputs& in) { map.fit(in.q, in.k, c); });
}

// FAVOR+ (orthogonal projection) forward, then forward + backward (the gradients with respect
// to q, k and v, from the features the forward kept, as a training step runs them); arguments
// n, threads, causal. The forward alone is the _into form, the one the IntoThreads rows time.
void BackwardFavor(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  const randattn::PositiveFeatures map(OrthogonalProjection<float>(kM, kD, 1));
  randattn::RandomFeatureOptions opt;
  opt.causal = state.range(2) != 0;
  bench::BackwardBuffers b(n, kD, kDv);
  randattn::SavedFeatures<float> saved;
  bench::time_backward(
      state, int(state.range(1)),
      [&] { randattn::random_feature_attention_into(map, in.q, in.k, in.v, b.out, opt); },
      [&](const auto& mark) {
        randattn::random_feature_attention_into(map, in.q, in.k, in.v, b.out, saved, opt);
        mark();
        randattn::random_feature_attention_backward(map, in.q, in.k, in.v, b.out, b.grad_out,
                                                    b.dq, b.dk, b.dv, saved, opt);
      });
}

void fitted_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "causal"});
  for (int causal : {0, 1})
    for (Index n : {4096, 16384}) b->Args({n, causal});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

void end_to_end_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "causal"});
  for (int causal : {0, 1})
    for (Index n : {128, 256, 512, 1024, 4096, 16384, 65536}) b->Args({n, causal});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(ProjectionGemm)
    ->ArgNames({"n"})
    ->Arg(16384)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(FeatureMap, positive / iid,
                  randattn::PositiveFeatures(GaussianProjection<float>(kM, kD, 1)))
    ->ArgNames({"n"})
    ->Arg(16384)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(FeatureMap, positive / orthogonal,
                  randattn::PositiveFeatures(OrthogonalProjection<float>(kM, kD, 1)))
    ->ArgNames({"n"})
    ->Arg(16384)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(FeatureMap, positive / hadamard,
                  randattn::PositiveFeatures(HadamardProjection<float>(kM, kD, 1)))
    ->ArgNames({"n"})
    ->Arg(16384)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(FeatureMap, hyperbolic / orthogonal,
                  randattn::HyperbolicFeatures(OrthogonalProjection<float>(kM, kD, 1)))
    ->ArgNames({"n"})
    ->Arg(16384)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(FeatureMap, trig / orthogonal,
                  randattn::TrigFeatures(OrthogonalProjection<float>(kM, kD, 1)))
    ->ArgNames({"n"})
    ->Arg(16384)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(FavorGemms)->ArgNames({"n"})->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Exact)->Apply(end_to_end_args);
BENCHMARK(Favor)->Apply(end_to_end_args);
BENCHMARK(FavorHyp)->Apply(end_to_end_args);
BENCHMARK(Oprf)->Apply(fitted_args);
BENCHMARK(Sderf)->Apply(fitted_args);
BENCHMARK(ExactThreads)->Apply(bench::thread_rows);
BENCHMARK(FavorThreads)->Apply(bench::thread_rows);
BENCHMARK(OprfThreads)->Apply(bench::thread_rows);
BENCHMARK(BackwardFavor)
    ->Name("Backward/Favor")
    ->ArgNames({"n", "threads", "causal"})
    ->Args({8192, 1, 0})
    ->Args({8192, 1, 1})
    ->Args({65536, 1, 1})
    ->Args({65536, 2, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
