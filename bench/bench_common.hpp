#pragma once
// Shared set-up for the benchmarks: thread control and GFLOP/s counters.

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

// Reports flops_per_iteration as a GFLOP/s rate.
inline void report_gflops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOPs"] = benchmark::Counter(flops_per_iteration * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace bench
