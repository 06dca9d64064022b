// Tensor sketching, in one binary so ratios come from one run. Data: order 3, d = 200, Tucker rank
// 5 plus noise 0.3 (8e6 float entries, 32 MB).
//
//  - PlainPass: sum of squares over the tensor with Eigen (vectorised), the memory-speed reference.
//  - Sparsify: Algorithm 1 in memory (pass 1 for ||A||_F, pass 2 draws a Philox uniform per
//    entry); StreamedSparsify: the same through StreamingSparsifier in blocks of 65536 entries.
//    Counter bytes_per_second: tensor bytes per second (each call reads the data twice).
//  - ExactHosvd / SketchedHosvd (Algorithm 2, budget n): factors of Tucker rank 5; counter
//    sin_theta: the worst mode's sin-Theta distance of the sketched factors to the exact ones.
// Arguments: threads (and the budget n for the sketches).

#include <algorithm>
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

const randattn::Hosvd<float>& exact_factors() {
  static const auto h = randattn::exact_hosvd(tensor().view(), kRanks);
  return h;
}

void report_bytes(benchmark::State& state) {
  state.counters["bytes_per_second"] = benchmark::Counter(double(tensor().data.size() * sizeof(float)),
                                                          benchmark::Counter::kIsIterationInvariantRate);
}

randattn::SparsifyOptions options(double budget) {
  randattn::SparsifyOptions opt;
  opt.budget = budget;
  opt.seed = 1;
  return opt;
}

void PlainPass(benchmark::State& state) {
  bench::set_threads(int(state.range(0)));
  const auto& t = tensor();
  for (auto _ : state) {
    float s = t.data.squaredNorm();
    benchmark::DoNotOptimize(s);
  }
  report_bytes(state);
}

void Sparsify(benchmark::State& state) {
  bench::set_threads(int(state.range(0)));
  const auto& t = tensor();
  Index nnz = 0;
  for (auto _ : state) {
    const auto sketch = randattn::sparsify(t.view(), options(double(state.range(1))));
    nnz = sketch.nnz();
    benchmark::DoNotOptimize(nnz);
  }
  report_bytes(state);
  state.counters["nnz"] = double(nnz);
}

void StreamedSparsify(benchmark::State& state) {
  bench::set_threads(1);
  const auto& t = tensor();
  const Index size = t.data.size(), block = 65536;
  Index nnz = 0;
  for (auto _ : state) {
    randattn::StreamingSparsifier<float> s(t.dims, options(double(state.range(0))));
    for (Index i = 0; i < size; i += block) s.add_norm_block(t.data.data() + i, std::min(block, size - i));
    for (Index i = 0; i < size; i += block) s.add_sample_block(t.data.data() + i, std::min(block, size - i));
    nnz = s.finish().nnz();
    benchmark::DoNotOptimize(nnz);
  }
  report_bytes(state);
  state.counters["nnz"] = double(nnz);
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
  exact_factors();  // computed before timing
  bench::set_threads(int(state.range(0)));
  double worst = 0;
  Index nnz = 0;
  for (auto _ : state) {
    const auto h = randattn::sketched_hosvd(tensor().view(), kRanks, options(double(state.range(1))));
    benchmark::DoNotOptimize(h.factors.front().data());
    worst = 0;
    for (std::size_t j = 0; j < 3; ++j)
      worst = std::max(worst, randattn::sin_theta_distance(exact_factors().factors[j], h.factors[j]));
    nnz = h.nnz[0];
  }
  report_bytes(state);
  state.counters["sin_theta"] = worst;
  state.counters["nnz"] = double(nnz);
}

}  // namespace

BENCHMARK(PlainPass)->ArgNames({"threads"})->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(Sparsify)->ArgNames({"threads", "n"})->Args({1, 100000})->Args({2, 100000})->Args({1, 1000000})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(StreamedSparsify)->ArgNames({"n"})->Arg(100000)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(ExactHosvd)->ArgNames({"threads"})->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(SketchedHosvd)->ArgNames({"threads", "n"})->Args({1, 100000})->Args({1, 300000})->Args({1, 1000000})
    ->Args({2, 300000})->Unit(benchmark::kMillisecond)->UseRealTime();
