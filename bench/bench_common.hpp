#pragma once
// Shared set-up for the benchmarks: thread control and GFLOP/s counters.

#include <time.h>

#include <chrono>
#include <type_traits>

#include <benchmark/benchmark.h>

#include <randattn/randattn.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace bench {

using randattn::Index;
using randattn::RowMatrix;

inline void set_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
  Eigen::setNbThreads(threads);
}

// The rows of a two-thread scaling figure: n = 65536 on 1 and 2 threads (arguments n, threads),
// wall time, and at least 2 s per row. A row of one iteration (a call takes 0.2-0.5 s) would
// time the first call, which pays the first touch of the allocator's fresh pages and the thread
// pool's start; a user calling attention in a loop sees the steady state.
inline void thread_rows(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "threads"})->Args({65536, 1})->Args({65536, 2});
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
}

// GFLOP/s of the PeakSgemm anchor (a square 2048 sgemm with Eigen on one thread) measured
// earlier in the same run; 0 until it has run.
inline double& peak_gflops() {
  static double peak = 0;
  return peak;
}

// Reports flops_per_iteration as a GFLOP/s rate and, once the anchor has run, as a fraction of
// it ("of_peak"): both from the same timing, so the fraction is a ratio measured in one run.
inline void report_gflops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOPs"] =
      benchmark::Counter(flops_per_iteration * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  if (peak_gflops() > 0)
    state.counters["of_peak"] = benchmark::Counter(flops_per_iteration * 1e-9 / peak_gflops(),
                                                   benchmark::Counter::kIsIterationInvariantRate);
}

// Attention inputs of n rows: q and k with entries N(0, 0.25), so scale·‖q‖² ≈ 2 at d = 64 and
// scale 1/8, and v with entries N(0, 1).
struct AttentionInputs {
  RowMatrix<float> q, k, v;
  AttentionInputs(Index n, Index d, Index dv)
      : q(randattn::gaussian_matrix<float>(randattn::Philox(1), n, d, 0.5)),
        k(randattn::gaussian_matrix<float>(randattn::Philox(2), n, d, 0.5)),
        v(randattn::gaussian_matrix<float>(randattn::Philox(3), n, dv)) {}
};

// The physical-limit anchor: C = A B for square n x n float matrices with Eigen, one thread.
// Register it first in a binary so later benchmarks can report their fraction of it.
inline void PeakSgemm(benchmark::State& state) {
  const Index n = state.range(0);
  set_threads(1);
  const RowMatrix<float> a = randattn::gaussian_matrix<float>(randattn::Philox(1), n, n),
                         b = randattn::gaussian_matrix<float>(randattn::Philox(2), n, n);
  RowMatrix<float> c(n, n);
  const double flops = 2.0 * double(n) * double(n) * double(n);
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  peak_gflops() = flops * double(state.iterations()) * 1e-9 / seconds;
  report_gflops(state, flops);
}

// The calling thread's CPU time in seconds: on a shared machine, a one-thread row timed on its
// own clock does not count the time other programs held the core.
inline double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

// The buffers of a Backward/... row: a fixed incoming gradient (entries N(0, 1)), the output and
// the three gradients.
struct BackwardBuffers {
  RowMatrix<float> grad_out, out, dq, dk, dv;
  BackwardBuffers(Index n, Index d, Index dv_cols)
      : grad_out(randattn::gaussian_matrix<float>(randattn::Philox(4), n, dv_cols)),
        out(n, dv_cols),
        dq(n, d),
        dk(n, d),
        dv(n, dv_cols) {}
};

// A Backward/... row: each iteration times the forward alone, then forward + backward (the
// forward that keeps what the backward needs, then the backward), and the row reports both and
// their ratio, so the ratio comes from one run. A forward_backward that takes an argument gets a
// callable to call between its forward and its backward, and the row also reports the backward
// alone (backward_ms). One untimed call of each comes first: the first call of a shape takes its
// working buffers fresh (page faults, the kernel zeroing the pages), which a training step's later
// calls reuse, and the long rows run a single iteration. One thread: the thread's CPU clock;
// more: wall time (a thread's clock would miss the other threads' work).
template <typename Forward, typename ForwardBackward>
void time_backward(benchmark::State& state, int threads, Forward&& forward,
                   ForwardBackward&& forward_backward) {
  set_threads(threads);
  const auto now = [threads] {
    return threads == 1 ? thread_cpu_seconds()
                        : std::chrono::duration<double>(
                              std::chrono::steady_clock::now().time_since_epoch())
                              .count();
  };
  double marked = 0;
  const auto mark = [&] { marked = now(); };
  constexpr bool split = std::is_invocable_v<ForwardBackward&, decltype(mark)&>;
  const auto run_both = [&] {
    if constexpr (split) {
      forward_backward(mark);
    } else {
      forward_backward();
    }
  };
  forward();
  run_both();
  double alone = 0, both = 0, backward = 0;
  for (auto _ : state) {
    const double t0 = now();
    forward();
    benchmark::ClobberMemory();
    const double t1 = now();
    run_both();
    benchmark::ClobberMemory();
    const double t2 = now();
    alone += t1 - t0;
    both += t2 - t1;
    backward += t2 - marked;
  }
  const double iterations = double(state.iterations());
  state.counters["forward_ms"] = 1e3 * alone / iterations;
  state.counters["forward_backward_ms"] = 1e3 * both / iterations;
  if (split) state.counters["backward_ms"] = 1e3 * backward / iterations;
  state.counters["ratio"] = both / alone;
}

}  // namespace bench
