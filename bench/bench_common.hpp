#pragma once
// Shared set-up for the benchmarks: reproducible inputs, thread control, GFLOP/s counters.

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

template <typename Scalar>
RowMatrix<Scalar> gaussian(std::uint64_t seed, Index rows, Index cols, double sd = 1.0) {
  RowMatrix<Scalar> m = randattn::gaussian_matrix<Scalar>(randattn::Philox(seed), rows, cols);
  return (m.array() * static_cast<Scalar>(sd)).matrix();
}

template <typename Scalar>
RowMatrix<Scalar> uniform(std::uint64_t seed, Index rows, Index cols, double lo, double hi) {
  RowMatrix<Scalar> m(rows, cols);
  randattn::fill_uniform(randattn::Philox(seed), m);
  return (m.array().template cast<double>() * (hi - lo) + lo).matrix().template cast<Scalar>();
}

// Reports flops_per_iteration as a GFLOP/s rate.
inline void report_gflops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOPs"] = benchmark::Counter(flops_per_iteration * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace bench
