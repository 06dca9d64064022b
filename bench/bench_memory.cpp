// Peak resident memory of attention at long sequences: the memory a call needs beyond its inputs
// must grow like n·d (never n², nor n·M for random features), so "per_nd", the call's peak RSS
// above what was resident before it in units of n·d floats, stays flat from n = 16384 to 65536.
// d = dv = 64, one thread unless a row says, one call per row.
//
//  - Exact: tiled exact attention (its O(n²) time makes the n = 65536 row take seconds).
//  - Favor: positive random features (m = 256) end to end; features are mapped block by block.
//  - Linear: the linear core on given n × M features (those inputs are not counted).
//  - Lsh: 4 rounds of cross-polytope hashing, chunks of 64.
//  - Backward/Favor (n, threads): a causal FAVOR+ training step's attention, the forward keeping
//    its features and then the backward, with the output, its cotangent and the gradients
//    allocated inside the call (an n·M·dv tensor would be 4.3 GB at n = 65536).
//  - Backward/Exact: causal exact attention's forward and backward, the same way (n² floats
//    would be 4.3 GB at n = 32768).
//
// "process_MiB" is the whole process's peak during the call, inputs included (run one row per
// process for it: what earlier rows left resident, such as their threads' arenas, counts too).
//
// Linux and glibc only: every allocation above 128 KiB is mapped and unmapped on its own
// (M_MMAP_THRESHOLD fixed), so freed memory leaves the resident set at once, and the high-water
// mark VmHWM is reset before each call by writing 5 to /proc/self/clear_refs.

#include <fstream>
#include <string>

#include <malloc.h>

#include "bench_common.hpp"

namespace {

using bench::Index;
using bench::RowMatrix;
using randattn::gaussian_matrix;
using randattn::Philox;
constexpr Index kD = 64, kDv = 64, kM = 256;

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"); -1 if absent.
long status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string key;
  long value = -1;
  while (status >> key) {
    if (key == field + ":") {
      status >> value;
      return value;
    }
    status.ignore(1 << 16, '\n');
  }
  return -1;
}

// Runs call() once per iteration and reports its peak resident memory above the resident set
// before it, in MiB and per n·d floats.
template <typename Call>
void peak_memory(benchmark::State& state, Index n, Call&& call, int threads = 1) {
  static const bool fixed_threshold = mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1;
  bench::set_threads(threads);
  long extra_kib = 0, process_kib = 0;
  for (auto _ : state) {
    malloc_trim(0);
    std::ofstream("/proc/self/clear_refs") << "5";
    const long before = status_kib("VmRSS");
    benchmark::DoNotOptimize(call());
    const long peak = status_kib("VmHWM");
    if (!fixed_threshold || before < 0 || peak < 0) {
      state.SkipWithError("needs glibc and /proc/self/status with VmHWM");
      return;
    }
    extra_kib = std::max(extra_kib, peak - before);
    process_kib = std::max(process_kib, peak);
  }
  state.counters["peak_MiB"] = double(extra_kib) / 1024.0;
  state.counters["process_MiB"] = double(process_kib) / 1024.0;
  state.counters["per_nd"] = double(extra_kib) * 1024.0 / (double(n) * kD * sizeof(float));
}

struct Inputs : bench::AttentionInputs {
  explicit Inputs(Index n) : AttentionInputs(n, kD, kDv) {}
};

void Exact(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  peak_memory(state, n, [&] { return randattn::exact_attention(in.q, in.k, in.v); });
}

void Favor(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  const randattn::PositiveFeatures<float> map(randattn::OrthogonalProjection<float>(kM, kD, 1));
  randattn::RandomFeatureOptions opt;
  opt.causal = state.range(1) != 0;
  peak_memory(state, n,
              [&] { return randattn::random_feature_attention(map, in.q, in.k, in.v, opt); });
}

void Linear(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  const randattn::PositiveFeatures<float> map(randattn::OrthogonalProjection<float>(kM, kD, 1));
  const randattn::ScaledFeatures<float> qf = map.features(in.q), kf = map.features(in.k);
  randattn::LinearOptions opt;
  opt.causal = state.range(1) != 0;
  peak_memory(state, n, [&] { return randattn::linear_attention(qf, kf, in.v, opt); });
}

void Lsh(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  const randattn::CrossPolytopeHash<float> hash(randattn::RotationKind::hadamard, kD,
                                                randattn::reformer_buckets(n, 64), 4, 7);
  randattn::LshOptions opt;
  opt.chunk = 64;
  peak_memory(state, n, [&] { return randattn::lsh_attention(hash, in.q, in.v, opt); });
}

void BackwardFavor(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  const randattn::PositiveFeatures<float> map(randattn::OrthogonalProjection<float>(kM, kD, 1));
  randattn::RandomFeatureOptions opt;
  opt.causal = true;
  peak_memory(
      state, n,
      [&] {
        bench::BackwardBuffers b(n, kD, kDv);
        randattn::SavedFeatures<float> saved;
        randattn::random_feature_attention_into(map, in.q, in.k, in.v, b.out, saved, opt);
        randattn::random_feature_attention_backward(map, in.q, in.k, in.v, b.out, b.grad_out, b.dq,
                                                    b.dk, b.dv, saved, opt);
        return b.dq(0, 0);
      },
      int(state.range(1)));
}

void BackwardExact(benchmark::State& state) {
  const Index n = state.range(0);
  const Inputs in(n);
  randattn::ExactOptions opt;
  opt.causal = true;
  peak_memory(state, n, [&] {
    bench::BackwardBuffers b(n, kD, kDv);
    const randattn::Vector<float> lse =
        randattn::exact_attention_forward_into(in.q, in.k, in.v, b.out, opt);
    randattn::exact_attention_backward<float>(in.q, in.k, in.v, b.out, lse, b.grad_out, b.dq, b.dk,
                                              b.dv, opt);
    return b.dq(0, 0);
  });
}

void lengths(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n"})->Arg(16384)->Arg(65536)->Iterations(1)->Unit(benchmark::kMillisecond);
}
void lengths_causal(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "causal"});
  for (int causal : {0, 1})
    for (Index n : {16384, 65536}) b->Args({n, causal});
  b->Iterations(1)->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(Exact)->Apply(lengths);
BENCHMARK(Favor)->Apply(lengths_causal);
BENCHMARK(Linear)->Apply(lengths_causal);
BENCHMARK(Lsh)->Apply(lengths);
BENCHMARK(BackwardFavor)
    ->Name("Backward/Favor")
    ->ArgNames({"n", "threads"})
    ->Args({65536, 1})
    ->Args({65536, 2})
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BackwardExact)
    ->Name("Backward/Exact")
    ->ArgNames({"n"})
    ->Arg(32768)
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
