// Sparse + low-rank attention against its two parts alone (support lsh: chunk 64, 4 rounds;
// remainder oprf: 256 features fitted to the call's queries and keys), one thread, float.
//   GaussianError/s_x1000   Q, K ~ s·N(0, I), V ~ N(0, I), n = 4096, d = 64, scale 1/8, so
//                           scale·‖q‖² ≈ 8 s² (0.98, 2.0, 3.9, 8.0 for s = 0.35, 0.5, 0.7, 1).
//                           Counters (computed once, outside the timed loop): rel_error of
//                           sparse-lowrank, lsh_error and oprf_error of the parts alone,
//                           sample_error of the sampled remainder (s = 256 keys), pairs_scored.
//   CentringError/offset    the same at s = 0.5 with every key shifted by a common vector of
//                           norm `offset` (logits unchanged up to a per-query constant): lsh
//                           alone and lsh + oprf, without and with centre_keys, at equal pairs.
//   Time/n/part             n = 16384: part 0 lsh alone, 1 oprf alone, 2 sparse-lowrank (its
//                           counters: seconds per call in the support, exact and remainder parts).
//   ClusterTime/n/causal/part  the clusters support (64 clusters, probe 4, chunk 64; remainder
//                           none) on clustered keys: k = t_s(j) + 0.2 e_j around 32 topics
//                           t ~ N(0, I), q = 6 t_s'(i) + 0.2 e'_i (peaked attention, as trained
//                           models give). Part 0 is exact attention on its support alone (the
//                           call's target sets, built outside the timed loop), part 1 the whole
//                           call (counters: support_s, exact_s, pairs_scored); the goal is part 1
//                           within 1.6x of part 0.
#include <cmath>
#include <map>

#include "bench_common.hpp"

namespace {

using randattn::Index;
using randattn::RowMatrix;

constexpr Index kD = 64, kChunk = 64, kRounds = 4, kFeatures = 256;
constexpr float kScale = 0.125f;

using Oprf = randattn::OptimalPositiveFeatures<float, randattn::OrthogonalProjection<float>>;

struct Data {
  RowMatrix<float> q, k, v, exact;
};

Data make_data(Index n, double s, double offset, bool with_exact) {
  const randattn::Philox rng(77);
  Data d{randattn::gaussian_matrix<float>(rng.with_stream(0), n, kD, s),
         randattn::gaussian_matrix<float>(rng.with_stream(1), n, kD, s),
         randattn::gaussian_matrix<float>(rng.with_stream(2), n, kD), {}};
  if (offset > 0) {
    Eigen::RowVectorXf shift = randattn::gaussian_matrix<float>(rng.with_stream(3), 1, kD);
    d.k.rowwise() += shift * float(offset / shift.norm());
  }
  if (with_exact) {
    randattn::ExactOptions eopt;
    eopt.scale = kScale;
    d.exact = randattn::exact_attention(d.q, d.k, d.v, eopt);
  }
  return d;
}

struct Parts {
  randattn::CrossPolytopeHash<float> hash;
  Oprf map;
  randattn::SupportSpec<float> support;
  randattn::SparseLowRankOptions opt;
  Parts(const Data& d)
      : hash(randattn::RotationKind::dense, kD, randattn::reformer_buckets(d.q.rows(), kChunk),
             kRounds, 1234),
        map(randattn::OrthogonalProjection<float>(kFeatures, kD, 99)) {
    map.fit(d.q, d.k, std::sqrt(double(kScale)));
    support.lsh = &hash;
    support.lsh_options.chunk = kChunk;
    opt.scale = kScale;
  }
  RowMatrix<float> lsh_alone() const {
    randattn::LshOptions o = support.lsh_options;
    o.scale = kScale;
    return randattn::lsh_attention(hash, q(), k(), v(), o);
  }
  const Data* data = nullptr;
  const RowMatrix<float>& q() const { return data->q; }
  const RowMatrix<float>& k() const { return data->k; }
  const RowMatrix<float>& v() const { return data->v; }
};

double rel(const RowMatrix<float>& a, const RowMatrix<float>& e) {
  return (a.cast<double>() - e.cast<double>()).norm() / e.cast<double>().norm();
}

void GaussianError(benchmark::State& state) {
  bench::set_threads(1);
  const double s = double(state.range(0)) / 1000;
  const Data d = make_data(4096, s, 0, true);
  Parts p(d);
  p.data = &d;
  const randattn::FeatureRemainder<Oprf> remainder{p.map, {}};
  randattn::SparseLowRankStats st;
  RowMatrix<float> out;
  for (auto _ : state)
    out = randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, p.support, remainder, p.opt);
  out = randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, p.support, remainder, p.opt, &st);
  randattn::RandomFeatureOptions fopt;
  fopt.scale = kScale;
  state.counters["scaled_sq_norm"] = double(kScale) * 64 * s * s;
  state.counters["rel_error"] = rel(out, d.exact);
  state.counters["lsh_error"] = rel(p.lsh_alone(), d.exact);
  state.counters["oprf_error"] =
      rel(randattn::random_feature_attention(p.map, d.q, d.k, d.v, fopt), d.exact);
  state.counters["sample_error"] = rel(
      randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, p.support,
                                                randattn::SampledRemainder{256, false, 64}, p.opt),
      d.exact);
  state.counters["pairs_scored"] = double(st.pairs_scored) / (4096.0 * 4096.0);
  state.counters["clamped_rows"] = double(st.clamped_rows);
}

void CentringError(benchmark::State& state) {
  bench::set_threads(1);
  const Data d = make_data(4096, 0.5, double(state.range(0)), true);
  Parts p(d);
  p.data = &d;
  const randattn::FeatureRemainder<Oprf> remainder{p.map, {}};
  RowMatrix<float> out;
  for (auto _ : state)
    out = randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, p.support, remainder, p.opt);
  randattn::SparseLowRankOptions centred = p.opt;
  centred.centre_keys = true;
  randattn::SparseLowRankStats plain_st, centred_st;
  state.counters["lsh_error"] = rel(
      randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, p.support, {}, p.opt, &plain_st),
      d.exact);
  state.counters["lsh_centred_error"] = rel(randattn::sparse_lowrank_attention<float>(
                                                d.q, d.k, d.v, p.support, {}, centred, &centred_st),
                                            d.exact);
  state.counters["rel_error"] = rel(out, d.exact);
  state.counters["centred_error"] = rel(
      randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, p.support, remainder, centred),
      d.exact);
  state.counters["pairs_scored"] = double(plain_st.pairs_scored) / (4096.0 * 4096.0);
  state.counters["centred_pairs_scored"] = double(centred_st.pairs_scored) / (4096.0 * 4096.0);
}

void Time(benchmark::State& state) {
  bench::set_threads(1);
  const Index n = state.range(0), part = state.range(1);
  static std::map<Index, Data> cache;
  if (!cache.count(n)) cache.emplace(n, make_data(n, 0.5, 0, false));
  const Data& d = cache.at(n);
  Parts p(d);
  p.data = &d;
  randattn::RandomFeatureOptions fopt;
  fopt.scale = kScale;
  const randattn::FeatureRemainder<Oprf> remainder{p.map, {}};
  RowMatrix<float> out;
  randattn::SparseLowRankStats st;
  for (auto _ : state) {
    if (part == 0) out = p.lsh_alone();
    if (part == 1) out = randattn::random_feature_attention(p.map, d.q, d.k, d.v, fopt);
    if (part == 2)
      out = randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, p.support, remainder, p.opt,
                                                      &st);
    benchmark::DoNotOptimize(out.data());
  }
  if (part == 2) {  // mean seconds of each part per call
    const double calls = double(state.iterations());
    state.counters["support_s"] = st.support_seconds / calls;
    state.counters["exact_s"] = st.exact_seconds / calls;
    state.counters["remainder_s"] = st.remainder_seconds / calls;
  }
}

Data clustered_data(Index n) {
  constexpr Index kTopics = 32;  // fewer than the clusters: tight clusters, as k-means splits topics
  const randattn::Philox rng(78);
  const RowMatrix<float> topics = randattn::gaussian_matrix<float>(rng.with_stream(4), kTopics, kD);
  Data d{randattn::gaussian_matrix<float>(rng.with_stream(0), n, kD, 0.2),
         randattn::gaussian_matrix<float>(rng.with_stream(1), n, kD, 0.2),
         randattn::gaussian_matrix<float>(rng.with_stream(2), n, kD), {}};
  for (Index j = 0; j < n; ++j) {
    d.k.row(j) += topics.row(Index(rng.uniform(std::uint64_t(j), 0) * kTopics));
    d.q.row(j) += 6.0f * topics.row(Index(rng.uniform(std::uint64_t(j), 1) * kTopics));
  }
  return d;
}

void ClusterTime(benchmark::State& state) {
  bench::set_threads(1);
  const Index n = state.range(0), part = state.range(2);
  static std::map<Index, Data> cache;
  if (!cache.count(n)) cache.emplace(n, clustered_data(n));
  const Data& d = cache.at(n);
  randattn::SupportSpec<float> support;
  support.clusters = randattn::ClusterSupport{64, 4, 64};
  randattn::SparseLowRankOptions opt;
  opt.scale = kScale;
  opt.causal = state.range(1) != 0;
  const randattn::TargetSets sets =
      randattn::cluster_target_sets<float>(d.q, d.k, *support.clusters, kScale, opt.causal, opt.seed);
  RowMatrix<float> out;
  randattn::SparseLowRankStats st;
  for (auto _ : state) {
    if (part == 0)
      out = randattn::target_attention_accumulate<float>(d.q, d.k, d.v, sets, kScale).finalize();
    if (part == 1)
      out = randattn::sparse_lowrank_attention<float>(d.q, d.k, d.v, support, {}, opt, &st);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["pairs_scored"] = double(sets.pairs()) / (double(n) * double(n));
  if (part == 1) {
    const double calls = double(state.iterations());
    state.counters["support_s"] = st.support_seconds / calls;
    state.counters["exact_s"] = st.exact_seconds / calls;
  }
}

void register_all() {
  for (Index s : {350, 500, 700, 1000})
    benchmark::RegisterBenchmark("GaussianError", GaussianError)
        ->ArgNames({"s_x1000"})
        ->Arg(s)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  for (Index offset : {0, 4, 8})
    benchmark::RegisterBenchmark("CentringError", CentringError)
        ->ArgNames({"offset"})
        ->Arg(offset)
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  for (Index part : {0, 1, 2})
    benchmark::RegisterBenchmark("Time", Time)
        ->ArgNames({"n", "part"})
        ->Args({16384, part})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  for (Index causal : {0, 1})
    for (Index part : {0, 1})
      benchmark::RegisterBenchmark("ClusterTime", ClusterTime)
          ->ArgNames({"n", "causal", "part"})
          ->Args({16384, causal, part})
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
}

const int registered = (register_all(), 0);

}  // namespace
