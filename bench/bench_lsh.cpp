// LSH attention benchmarks, single thread, float; all ratios come from one run of this binary.
//
//  - Hash/rotation/n/d/b/r: cross-polytope hashing of n vectors with b buckets and r rounds;
//    counters vectors_per_s and vectors_per_cpu_s = hashed vectors per wall and per CPU second
//    on one core (the CPU rate is the steadier one on a shared machine). rotation 0 = dense
//    Gaussian (one GEMM per block), 1 = fast Hadamard (three transforms). The d = 64, b = 128, r =
//    1 rows are the shape of FALCONN's published hashing rates; b = 16 shows the dense rotation's
//    regime.
//  - TiledExact/n: tiled exact softmax attention over the same (q, normalised keys, v), d = dv =
//  64;
//    its time per call is kept for the ratios below.
//  - Lsh/n/r/rotation: shared-QK sort-and-chunk attention (hashing included), c = 64,
//    b = 2 ceil(n / c); counters speedup = TiledExact(n) wall time / this wall time and
//    speedup_cpu, the same ratio of CPU times (steadier when the machine is shared).
//  - LshExactBuckets/n/r: the exact-bucket mode on the same inputs, same counters.
//  - LshThreads/n/threads: Lsh at n = 65536, r = 4, dense rotation, on 1 and 2 threads, written
//    into one output reused across calls (lsh_attention_into); threads:1 / threads:2 is the
//    two-thread speedup.
//  - Backward/Lsh/n/mode/causal: the backward at n = 4096, r = 4, c = 64, dense rotation, one
//    thread; mode 0 = shared QK, 1 = separate keys, 2 = separate keys with exact buckets. Each
//    iteration times lsh_attention_into, then lsh_attention_forward + lsh_attention_backward on
//    the same inputs; counters forward_ms, forward_backward_ms and ratio = their quotient (CPU
//    times, one run).

#include <chrono>
#include <map>

#include "bench_common.hpp"

namespace {

using bench::Index;
using bench::RowMatrix;
using randattn::gaussian_matrix;
using randattn::Philox;
constexpr Index kD = 64, kDv = 64, kChunk = 64;

// Mean wall and CPU seconds of one call. The runs are single-threaded, so on a shared machine
// the CPU time is the steadier measure; both ratios are reported.
struct Seconds {
  double wall = 0, cpu = 0;
};

template <typename Call>
Seconds timed_loop(benchmark::State& state, Call&& call) {
  Seconds total;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = bench::thread_cpu_seconds();
    auto out = call();
    benchmark::DoNotOptimize(out.data());
    total.cpu += bench::thread_cpu_seconds() - c0;
    total.wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const double iterations = double(state.iterations());
  return {total.wall / iterations, total.cpu / iterations};
}

std::map<Index, Seconds>& exact_seconds() {
  static std::map<Index, Seconds> seconds;
  return seconds;
}

randattn::RotationKind rotation(std::int64_t arg) {
  return arg == 0 ? randattn::RotationKind::dense : randattn::RotationKind::hadamard;
}

void Hash(benchmark::State& state) {
  bench::set_threads(1);
  const Index n = state.range(1), d = state.range(2), b = state.range(3), rounds = state.range(4);
  const RowMatrix<float> x = gaussian_matrix<float>(Philox(1), n, d);
  const randattn::CrossPolytopeHash<float> hash(rotation(state.range(0)), d, b, rounds, 7);
  const Seconds seconds = timed_loop(state, [&] { return hash.hash(x); });
  state.counters["vectors_per_s"] = double(n) / seconds.wall;
  state.counters["vectors_per_cpu_s"] = double(n) / seconds.cpu;
}

void TiledExact(benchmark::State& state) {
  bench::set_threads(1);
  const Index n = state.range(0);
  const RowMatrix<float> q = gaussian_matrix<float>(Philox(1), n, kD),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  const RowMatrix<float> keys = q.rowwise().normalized();
  randattn::ExactOptions opt;
  opt.scale = 1.0;
  exact_seconds()[n] =
      timed_loop(state, [&] { return randattn::exact_attention(q, keys, v, opt); });
  bench::report_gflops(state, 2.0 * double(n) * double(n) * double(kD + kDv));
}

void run_lsh(benchmark::State& state, Index n, Index rounds, randattn::RotationKind kind,
             bool exact_buckets) {
  bench::set_threads(1);
  const RowMatrix<float> q = gaussian_matrix<float>(Philox(1), n, kD),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  const randattn::CrossPolytopeHash<float> hash(kind, kD, randattn::reformer_buckets(n, kChunk),
                                                rounds, 7);
  randattn::LshOptions opt;
  opt.chunk = kChunk;
  opt.exact_buckets = exact_buckets;
  const Seconds seconds =
      timed_loop(state, [&] { return randattn::lsh_attention(hash, q, v, opt); });
  const auto exact = exact_seconds().find(n);
  if (exact != exact_seconds().end()) {
    state.counters["speedup"] = exact->second.wall / seconds.wall;
    state.counters["speedup_cpu"] = exact->second.cpu / seconds.cpu;
  }
}

void Lsh(benchmark::State& state) {
  run_lsh(state, state.range(0), state.range(1), rotation(state.range(2)), false);
}

void LshExactBuckets(benchmark::State& state) {
  run_lsh(state, state.range(0), state.range(1), randattn::RotationKind::dense, true);
}

void LshThreads(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(int(state.range(1)));
  const RowMatrix<float> q = gaussian_matrix<float>(Philox(1), n, kD),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  const randattn::CrossPolytopeHash<float> hash(randattn::RotationKind::dense, kD,
                                                randattn::reformer_buckets(n, kChunk), 4, 7);
  randattn::LshOptions opt;
  opt.chunk = kChunk;
  RowMatrix<float> out(n, kDv);
  for (auto _ : state) {
    randattn::lsh_attention_into(hash, q, v, out, opt);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
}

void Backward(benchmark::State& state) {
  const Index n = state.range(0), mode = state.range(1);
  const bool shared = mode == 0;
  const RowMatrix<float> q = gaussian_matrix<float>(Philox(1), n, kD),
                         k = gaussian_matrix<float>(Philox(2), n, kD),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  const randattn::CrossPolytopeHash<float> hash(randattn::RotationKind::dense, kD,
                                                randattn::reformer_buckets(n, kChunk), 4, 7);
  randattn::LshOptions opt;
  opt.chunk = kChunk;
  opt.exact_buckets = mode == 2;
  opt.causal = state.range(2) != 0;
  bench::BackwardBuffers b(n, kD, kDv);
  bench::time_backward(
      state, 1,
      [&] {
        if (shared)
          randattn::lsh_attention_into(hash, q, v, b.out, opt);
        else
          randattn::lsh_attention_into(hash, q, k, v, b.out, opt);
      },
      [&] {
        if (shared) {
          const auto saved = randattn::lsh_attention_forward<float>(hash, q, v, b.out, opt);
          randattn::lsh_attention_backward<float>(saved, q, v, b.out, b.grad_out, b.dq, b.dv);
        } else {
          const auto saved = randattn::lsh_attention_forward<float>(hash, q, k, v, b.out, opt);
          randattn::lsh_attention_backward<float>(saved, q, k, v, b.out, b.grad_out, b.dq, b.dk,
                                                  b.dv);
        }
      });
}

void register_all() {
  for (Index mode : {0, 1, 2})
    for (Index causal : {0, 1})
      benchmark::RegisterBenchmark("Backward/Lsh", Backward)
          ->ArgNames({"n", "mode", "causal"})
          ->Args({4096, mode, causal})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  benchmark::RegisterBenchmark("LshThreads", LshThreads)->Apply(bench::thread_rows);
  for (int kind : {0, 1}) {
    for (Index b : {16, 128})
      benchmark::RegisterBenchmark("Hash", Hash)
          ->ArgNames({"rotation", "n", "d", "b", "r"})
          ->Args({kind, 65536, 64, b, 1})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    for (Index d : {64, 256, 1024})
      benchmark::RegisterBenchmark("Hash", Hash)
          ->ArgNames({"rotation", "n", "d", "b", "r"})
          ->Args({kind, 16384, d, 512, 4})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
  for (Index n : {4096, 16384, 65536}) {
    benchmark::RegisterBenchmark("TiledExact", TiledExact)
        ->ArgNames({"n"})
        ->Arg(n)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    for (Index r : {1, 2, 4, 8})
      benchmark::RegisterBenchmark("Lsh", Lsh)
          ->ArgNames({"n", "r", "rotation"})
          ->Args({n, r, 0})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    benchmark::RegisterBenchmark("Lsh", Lsh)
        ->ArgNames({"n", "r", "rotation"})
        ->Args({n, 4, 1})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("LshExactBuckets", LshExactBuckets)
        ->ArgNames({"n", "r"})
        ->Args({n, 4})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}

const bool registered = (register_all(), true);

}  // namespace
