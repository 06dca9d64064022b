// Tensor sketching, in one binary so ratios come from one run. Data: order 3, d = 200, Tucker rank
// 5 plus noise 0.3 (8e6 float entries, 32 MB).
//
//  - PlainPass: sum of squares over the tensor with Eigen (vectorised, one thread), the
//    memory-speed reference.
//  - Sparsify: Algorithm 1 in memory (pass 1 for ||A||_F, pass 2 samples); StreamedSparsify: the
//    same through StreamingSparsifier in blocks of 65536 entries. Every iteration also times one
//    plain pass, so vs_plain = (plain pass time) / (sparsify time) comes from interleaved runs.
//    SparsifyInto: the same into one sketch reused across calls (sparsify_into).
//    Counter bytes_per_second: tensor bytes per second (each call reads the data twice).
//  - ExactHosvd / SketchedHosvd (Algorithm 2, budget n): factors of Tucker rank 5. Every
//    SketchedHosvd iteration also runs the exact HOSVD (untimed): speedup = exact time / sketched
//    time, sin_theta = the worst mode's sin-Theta distance of the sketched factors to the exact.
// Arguments: threads (and the budget n for the sketches).

#include <algorithm>
#include <chrono>
#include <memory>

#include "bench_common.hpp"

namespace {

using bench::Index;
constexpr Index kD = 200, kRank = 5;

const randattn::SyntheticTensor<float>& tensor() {
  static const auto t = [] {
    randattn::SyntheticOptions so;
    so.noise = 0.3;
    return randattn::low_rank_plus_noise<float>({kD, kD, kD}, {kRank, kRank, kRank}, so, 5);
  }();
  return t;
}

const std::vector<Index> kRanks{kRank, kRank, kRank};

void report_bytes(benchmark::State& state) {
  state.counters["bytes_per_second"] = benchmark::Counter(
      double(tensor().data.size() * sizeof(float)), benchmark::Counter::kIsIterationInvariantRate);
}

randattn::SparsifyOptions options(double budget) {
  randattn::SparsifyOptions opt;
  opt.budget = budget;
  opt.seed = 1;
  return opt;
}

double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Seconds of one plain pass (the reference of the vs_plain counters).
double plain_pass_seconds() {
  const auto t0 = std::chrono::steady_clock::now();
  float s = tensor().data.squaredNorm();
  benchmark::DoNotOptimize(s);
  return seconds(t0, std::chrono::steady_clock::now());
}

void PlainPass(benchmark::State& state) {
  tensor();
  for (auto _ : state) state.SetIterationTime(plain_pass_seconds());
  report_bytes(state);
}

// Runs `sketch` (returning its nnz) once per iteration, timed, next to an untimed plain pass.
template <typename Sketch>
void run_sparsify(benchmark::State& state, Sketch&& sketch) {
  double plain = 0, sparse = 0;
  Index nnz = 0;
  for (auto _ : state) {
    plain += plain_pass_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    nnz = sketch();
    benchmark::DoNotOptimize(nnz);
    const double t = seconds(t0, std::chrono::steady_clock::now());
    sparse += t;
    state.SetIterationTime(t);
  }
  report_bytes(state);
  state.counters["vs_plain"] = plain / sparse;
  state.counters["nnz"] = double(nnz);
}

void Sparsify(benchmark::State& state) {
  tensor();
  bench::set_threads(int(state.range(0)));
  run_sparsify(state, [&] {
    return randattn::sparsify(tensor().view(), options(double(state.range(1)))).nnz();
  });
}

// Sparsify into one sketch reused from call to call (sparsify_into): the kept entries land in
// memory that is already mapped.
void SparsifyInto(benchmark::State& state) {
  tensor();
  bench::set_threads(int(state.range(0)));
  randattn::SparseSketch<float> out;
  run_sparsify(state, [&] {
    randattn::sparsify_into(tensor().view(), options(double(state.range(1))), out);
    return out.nnz();
  });
}

void StreamedSparsify(benchmark::State& state) {
  tensor();
  bench::set_threads(1);
  const auto& t = tensor();
  const Index size = t.data.size(), block = 65536;
  run_sparsify(state, [&] {
    randattn::StreamingSparsifier<float> s(t.dims, options(double(state.range(0))));
    for (Index i = 0; i < size; i += block)
      s.add_norm_block(t.data.data() + i, std::min(block, size - i));
    for (Index i = 0; i < size; i += block)
      s.add_sample_block(t.data.data() + i, std::min(block, size - i));
    return s.finish().nnz();
  });
}

void ExactHosvd(benchmark::State& state) {
  tensor();  // generated before timing
  bench::set_threads(int(state.range(0)));
  for (auto _ : state) {
    const auto h = randattn::exact_hosvd(tensor().view(), kRanks);
    benchmark::DoNotOptimize(h.factors.front().data());
  }
  report_bytes(state);
}

void SketchedHosvd(benchmark::State& state) {
  tensor();
  bench::set_threads(int(state.range(0)));
  double worst = 0, exact_time = 0, sketched_time = 0;
  Index nnz = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto exact = randattn::exact_hosvd(tensor().view(), kRanks);
    const auto t1 = std::chrono::steady_clock::now();
    const auto h =
        randattn::sketched_hosvd(tensor().view(), kRanks, options(double(state.range(1))));
    benchmark::DoNotOptimize(h.factors.front().data());
    const auto t2 = std::chrono::steady_clock::now();
    exact_time += seconds(t0, t1);
    sketched_time += seconds(t1, t2);
    state.SetIterationTime(seconds(t1, t2));
    worst = 0;
    for (std::size_t j = 0; j < 3; ++j)
      worst = std::max(worst, randattn::sin_theta_distance(exact.factors[j], h.factors[j]));
    nnz = h.nnz[0];
  }
  report_bytes(state);
  state.counters["speedup"] = exact_time / sketched_time;
  state.counters["sin_theta"] = worst;
  state.counters["nnz"] = double(nnz);
}

}  // namespace

BENCHMARK(PlainPass)->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(Sparsify)
    ->ArgNames({"threads", "n"})
    ->Args({1, 100000})
    ->Args({2, 100000})
    ->Args({1, 1000000})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(SparsifyInto)
    ->ArgNames({"threads", "n"})
    ->Args({1, 100000})
    ->Args({1, 1000000})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(StreamedSparsify)
    ->ArgNames({"n"})
    ->Arg(100000)
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
BENCHMARK(ExactHosvd)
    ->ArgNames({"threads"})
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(SketchedHosvd)
    ->ArgNames({"threads", "n"})
    ->Args({1, 100000})
    ->Args({1, 200000})
    ->Args({1, 250000})
    ->Args({1, 300000})
    ->Args({2, 250000})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();
