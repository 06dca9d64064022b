// The shared core against plain Eigen GEMMs of the same shapes, in one binary so the ratios
// come from one run. Arguments: n, threads. d = dv = 64, m = 256 (feature dimension).
//
//  - PeakSgemm: a square 2048 sgemm with Eigen on one thread, the physical-limit anchor; every
//    later benchmark reports "of_peak", its GFLOP/s as a fraction of the anchor's in this run.
//  - EigenGemmExactShapes: S = Q K^T (n x n x d) then S V (n x n x dv), the two products of
//    attention with the score matrix materialised.
//  - NaiveExact / TiledExact: softmax attention; flops counted as the same two products.
//  - EigenGemmLinearShapes: K'^T V (m x n x dv) then Q' (K'^T V) (n x m x dv).
//  - Linear: the linear core on given features, flops counted as the same two products.
//  - Backward/Exact: exact attention's forward (with its row log-sum-exps) and its backward at
//    n = 4096, one thread. Each iteration times the forward alone, then forward + backward, on
//    the thread's CPU clock (the machine may be shared), so "ratio" = (forward + backward) /
//    forward comes from one run. A recomputing backward has five products to the forward's two.

#include "bench_common.hpp"

namespace {

using bench::Index;
using bench::RowMatrix;
using randattn::gaussian_matrix;
using randattn::Philox;
using randattn::uniform_matrix;
constexpr Index kD = 64, kDv = 64, kM = 256;

double exact_flops(Index n, bool causal) {
  return (causal ? 0.5 : 1.0) * 2.0 * double(n) * double(n) * double(kD + kDv);
}
double linear_flops(Index n) { return 4.0 * double(n) * double(kM) * double(kDv); }

void EigenGemmExactShapes(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(int(state.range(1)));
  const RowMatrix<float> q = gaussian_matrix<float>(Philox(1), n, kD),
                         k = gaussian_matrix<float>(Philox(2), n, kD),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  RowMatrix<float> s(n, n), out(n, kDv);
  for (auto _ : state) {
    s.noalias() = q * k.transpose();
    out.noalias() = s * v;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  bench::report_gflops(state, exact_flops(n, false));
}

void NaiveExact(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(int(state.range(1)));
  const RowMatrix<float> q = gaussian_matrix<float>(Philox(1), n, kD),
                         k = gaussian_matrix<float>(Philox(2), n, kD),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  for (auto _ : state) {
    RowMatrix<float> out = randattn::naive_attention(q, k, v);
    benchmark::DoNotOptimize(out.data());
  }
  bench::report_gflops(state, exact_flops(n, false));
}

void TiledExact(benchmark::State& state) {
  const Index n = state.range(0);
  const bool causal = state.range(2) != 0;
  bench::set_threads(int(state.range(1)));
  const RowMatrix<float> q = gaussian_matrix<float>(Philox(1), n, kD),
                         k = gaussian_matrix<float>(Philox(2), n, kD),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  randattn::ExactOptions opt;
  opt.causal = causal;
  for (auto _ : state) {
    RowMatrix<float> out = randattn::exact_attention(q, k, v, opt);
    benchmark::DoNotOptimize(out.data());
  }
  bench::report_gflops(state, exact_flops(n, causal));
}

void EigenGemmLinearShapes(benchmark::State& state) {
  const Index n = state.range(0);
  bench::set_threads(int(state.range(1)));
  const RowMatrix<float> qf = uniform_matrix<float>(Philox(1), n, kM, 0.1, 1.0),
                         kf = uniform_matrix<float>(Philox(2), n, kM, 0.1, 1.0),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  RowMatrix<float> kv(kM, kDv), out(n, kDv);
  for (auto _ : state) {
    kv.noalias() = kf.transpose() * v;
    out.noalias() = qf * kv;
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  bench::report_gflops(state, linear_flops(n));
}

void Linear(benchmark::State& state) {
  const Index n = state.range(0);
  const bool causal = state.range(2) != 0;
  bench::set_threads(int(state.range(1)));
  const RowMatrix<float> qf = uniform_matrix<float>(Philox(1), n, kM, 0.1, 1.0),
                         kf = uniform_matrix<float>(Philox(2), n, kM, 0.1, 1.0),
                         v = gaussian_matrix<float>(Philox(3), n, kDv);
  const randattn::Vector<float> kl = uniform_matrix<float>(Philox(4), n, 1, -2.0, 2.0).col(0);
  const randattn::Vector<float> none;
  randattn::LinearOptions opt;
  opt.causal = causal;
  for (auto _ : state) {
    RowMatrix<float> out =
        randattn::linear_attention_accumulate<float>(qf, none, kf, kl, v, none, opt)
            .finalize(1e-6f);
    benchmark::DoNotOptimize(out.data());
  }
  bench::report_gflops(state, linear_flops(n));
}

void BackwardExact(benchmark::State& state) {
  const Index n = state.range(0);
  const bench::AttentionInputs in(n, kD, kDv);
  randattn::ExactOptions opt;
  opt.causal = state.range(2) != 0;
  bench::BackwardBuffers b(n, kD, kDv);
  bench::time_backward(
      state, int(state.range(1)),
      [&] { randattn::exact_attention_forward_into(in.q, in.k, in.v, b.out, opt); },
      [&] {
        const randattn::Vector<float> lse =
            randattn::exact_attention_forward_into(in.q, in.k, in.v, b.out, opt);
        randattn::exact_attention_backward<float>(in.q, in.k, in.v, b.out, lse, b.grad_out, b.dq,
                                                  b.dk, b.dv, opt);
      });
  // Products of forward + backward: 2 + 5 of n x n x 64 (half of them under causal masking).
  state.counters["GFLOPs"] = 7.0 * 0.5 * exact_flops(n, opt.causal) * 1e-6 /
                             state.counters["forward_backward_ms"];
}

}  // namespace

BENCHMARK(bench::PeakSgemm)
    ->Name("PeakSgemm")
    ->ArgNames({"n"})
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(EigenGemmExactShapes)
    ->ArgNames({"n", "threads"})
    ->Args({8192, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(NaiveExact)
    ->ArgNames({"n", "threads"})
    ->Args({8192, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(TiledExact)
    ->ArgNames({"n", "threads", "causal"})
    ->Args({8192, 1, 0})
    ->Args({8192, 1, 1})
    ->Args({8192, 2, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(EigenGemmLinearShapes)
    ->ArgNames({"n", "threads"})
    ->Args({8192, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(Linear)
    ->ArgNames({"n", "threads", "causal"})
    ->Args({8192, 1, 0})
    ->Args({8192, 1, 1})
    ->Args({8192, 2, 0})
    ->Args({8192, 2, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BackwardExact)
    ->Name("Backward/Exact")
    ->ArgNames({"n", "threads", "causal"})
    ->Args({4096, 1, 0})
    ->Args({4096, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);
