// Locality-sensitive-filter attention against LSH attention on the same unit-sphere data, single
// thread, float, d = dv = 64; every ratio comes from one run of this binary.
//
// Data: unit-norm queries and keys around n / 16 shared random directions (angular noise about
// 0.4 rad), so each query has about 16 near keys (cosine about 0.86), scale 16 (nGPT-style
// temperature on unit vectors: the softmax mass sits on the near keys).
//  - TiledExact/n: tiled exact attention; its output and time are kept for the ratios below.
//  - Lsf/n/L/eta_x100/rotation: LSF attention, m = n / 32 filters per table (32 keys per filter
//    on average), L tables, threshold eta; rotation 0 = dense Gaussian filters, 1 = Hadamard.
//  - Lsh/n/r/c: LSH attention with the same separate keys (exact buckets), r rounds,
//    b = 2 ceil(n / c) buckets (c = 64: 32 keys per bucket on average).
//  - LsfThreads/n/threads: Lsf at n = 65536, L = 2, eta = 2.5, Hadamard filters, on 1 and 2
//    threads, written into one output reused across calls (lsf_attention_into); threads:1 /
//    threads:2 is the two-thread speedup.
//  - Backward/Lsf/n/L/eta_x100/causal: the backward at n = 4096, Hadamard filters, one thread.
//    Each iteration times lsf_attention_into, then lsf_attention_forward + lsf_attention_backward
//    on the same inputs; counters forward_ms, forward_backward_ms and ratio = their quotient (CPU
//    times, one run).
// Counters: speedup (TiledExact wall time / this wall time), speedup_cpu (the same with CPU
// times, steadier on a shared machine), rel_error (Frobenius, against TiledExact's output) and,
// for LSF, pairs_scored (fraction of the n^2 pairs in the union of opened filters).

#include <chrono>
#include <ctime>
#include <map>

#include "bench_common.hpp"

namespace {

using bench::Index;
using bench::RowMatrix;
constexpr Index kDim = 64, kValueDim = 64;
constexpr double kScale = 16;

struct Inputs {
  RowMatrix<float> q, k, v;
};

// n unit rows: direction (i * 7919) mod (n / 16) of a shared set of centres plus Gaussian noise of
// norm about 0.4, normalised; queries and keys differ only in their noise stream.
RowMatrix<float> unit_sphere_tokens(Index n, std::uint32_t noise_stream) {
  const Index groups = std::max<Index>(1, n / 16);
  RowMatrix<float> dirs = randattn::gaussian_matrix<float>(randattn::Philox(77, 1), groups, kDim);
  dirs.rowwise().normalize();
  RowMatrix<float> out = randattn::gaussian_matrix<float>(randattn::Philox(77, noise_stream), n,
                                                          kDim, 0.4 / std::sqrt(double(kDim)));
  for (Index i = 0; i < n; ++i) {
    out.row(i) += dirs.row((i * 7919) % groups);
    out.row(i).normalize();
  }
  return out;
}

const Inputs& inputs(Index n) {
  static std::map<Index, Inputs> cache;
  auto found = cache.find(n);
  if (found == cache.end())
    found = cache
                .emplace(
                    n, Inputs{unit_sphere_tokens(n, 2), unit_sphere_tokens(n, 3),
                              randattn::gaussian_matrix<float>(randattn::Philox(78), n, kValueDim)})
                .first;
  return found->second;
}

// Mean wall and CPU (std::clock: this process, one thread) seconds of a call, and its output.
struct Measured {
  double wall = 0, cpu = 0;
  RowMatrix<float> out;
};

template <typename Call>
Measured measure(benchmark::State& state, Call&& call) {
  Measured m;
  for (auto _ : state) {
    const std::clock_t c0 = std::clock();
    const auto w0 = std::chrono::steady_clock::now();
    m.out = call();
    m.wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    m.cpu += double(std::clock() - c0) / CLOCKS_PER_SEC;
  }
  m.wall /= double(state.iterations());
  m.cpu /= double(state.iterations());
  return m;
}

std::map<Index, Measured>& exact_runs() {
  static std::map<Index, Measured> runs;
  return runs;
}

void report_against_exact(benchmark::State& state, Index n, const Measured& m) {
  const auto exact = exact_runs().find(n);
  if (exact == exact_runs().end()) return;
  state.counters["speedup"] = exact->second.wall / m.wall;
  state.counters["speedup_cpu"] = exact->second.cpu / m.cpu;
  const Eigen::MatrixXd e = exact->second.out.cast<double>();
  state.counters["rel_error"] = (m.out.cast<double>() - e).norm() / e.norm();
}

void TiledExact(benchmark::State& state) {
  bench::set_threads(1);
  const Index n = state.range(0);
  const Inputs& in = inputs(n);
  randattn::ExactOptions opt;
  opt.scale = kScale;
  exact_runs()[n] =
      measure(state, [&] { return randattn::exact_attention(in.q, in.k, in.v, opt); });
  bench::report_gflops(state, 2.0 * double(n) * double(n) * double(kDim + kValueDim));
}

void Lsf(benchmark::State& state) {
  bench::set_threads(1);
  const Index n = state.range(0), tables = state.range(1);
  const auto kind =
      state.range(3) == 0 ? randattn::RotationKind::dense : randattn::RotationKind::hadamard;
  const Inputs& in = inputs(n);
  const randattn::LocalitySensitiveFilters<float> filters(kind, kDim, n / 32, tables, 1234);
  randattn::LsfOptions opt;
  opt.eta = double(state.range(2)) / 100;
  opt.scale = kScale;
  const Measured m =
      measure(state, [&] { return randattn::lsf_attention(filters, in.q, in.k, in.v, opt); });
  report_against_exact(state, n, m);
  const randattn::LsfProbeStats st = randattn::lsf_probe_stats<float>(filters, in.q, in.k, opt);
  state.counters["pairs_scored"] = double(st.target_pairs) / (double(n) * double(n));
}

void Lsh(benchmark::State& state) {
  bench::set_threads(1);
  const Index n = state.range(0), rounds = state.range(1), chunk = state.range(2);
  const Inputs& in = inputs(n);
  const randattn::CrossPolytopeHash<float> hash(randattn::RotationKind::dense, kDim,
                                                randattn::reformer_buckets(n, chunk), rounds, 1234);
  randattn::LshOptions opt;
  opt.exact_buckets = true;
  opt.scale = kScale;
  const Measured m =
      measure(state, [&] { return randattn::lsh_attention(hash, in.q, in.k, in.v, opt); });
  report_against_exact(state, n, m);
}

void LsfThreads(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(int(state.range(1)));
  const Inputs& in = inputs(n);
  const randattn::LocalitySensitiveFilters<float> filters(randattn::RotationKind::hadamard, kDim,
                                                          n / 32, 2, 1234);
  randattn::LsfOptions opt;
  opt.eta = 2.5;
  opt.scale = kScale;
  RowMatrix<float> out(n, kValueDim);
  for (auto _ : state) {
    randattn::lsf_attention_into(filters, in.q, in.k, in.v, out, opt);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}

void Backward(benchmark::State& state) {
  const Index n = state.range(0), tables = state.range(1);
  const Inputs& in = inputs(n);
  const randattn::LocalitySensitiveFilters<float> filters(randattn::RotationKind::hadamard, kDim,
                                                          n / 32, tables, 1234);
  randattn::LsfOptions opt;
  opt.eta = double(state.range(2)) / 100;
  opt.scale = kScale;
  opt.causal = state.range(3) != 0;
  bench::BackwardBuffers b(n, kDim, kValueDim);
  bench::time_backward(
      state, 1, [&] { randattn::lsf_attention_into(filters, in.q, in.k, in.v, b.out, opt); },
      [&] {
        const auto saved =
            randattn::lsf_attention_forward<float>(filters, in.q, in.k, in.v, b.out, opt);
        randattn::lsf_attention_backward<float>(saved, in.q, in.k, in.v, b.out, b.grad_out, b.dq,
                                                b.dk, b.dv);
      });
}

void register_all() {
  for (Index causal : {0, 1})
    for (Index eta : {250, 200})
      benchmark::RegisterBenchmark("Backward/Lsf", Backward)
          ->ArgNames({"n", "L", "eta_x100", "causal"})
          ->Args({4096, 2, eta, causal})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  benchmark::RegisterBenchmark("LsfThreads", LsfThreads)->Apply(bench::thread_rows);
  for (Index n : {16384, 65536}) {
    benchmark::RegisterBenchmark("TiledExact", TiledExact)
        ->ArgNames({"n"})
        ->Arg(n)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (Index r : {1, 2, 4, 8})
      benchmark::RegisterBenchmark("Lsh", Lsh)
          ->ArgNames({"n", "r", "c"})
          ->Args({n, r, 64})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    benchmark::RegisterBenchmark("Lsh", Lsh)
        ->ArgNames({"n", "r", "c"})
        ->Args({n, 8, 256})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (Index tables : {1, 2, 4})
      for (Index eta : {300, 250, 215, 200})
        benchmark::RegisterBenchmark("Lsf", Lsf)
            ->ArgNames({"n", "L", "eta_x100", "rotation"})
            ->Args({n, tables, eta, 1})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
    for (Index eta : {300, 250, 200})
      benchmark::RegisterBenchmark("Lsf", Lsf)
          ->ArgNames({"n", "L", "eta_x100", "rotation"})
          ->Args({n, 2, eta, 0})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
}

const bool registered = (register_all(), true);

}  // namespace
