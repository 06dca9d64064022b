// Decoding one token over a long key/value cache (decode/kv_cache.hpp): time per generated token
// (all query heads) for exact decoding and the retrieval modes, with keys and values stored as
// float32, bfloat16, float16 or int8, in one process so that the ratios are measured in the same
// run. Rows are named BM_Decode/<mode>/storage:<type>/n:<tokens>.
//   vs_exact     exact decode time per token from float32 ÷ this row's (measured first, same n);
//   bytes_per_token  bytes of one token's keys and values in all kv heads as stored;
//   recall32     fraction of each query head's true top-32 keys (by exact logit) among the keys
//                the mode scored (sinks, window and retrieved), averaged over heads and tokens;
//   rel_error    ‖out − exact‖_F / ‖exact‖_F over all heads, averaged over tokens, exact being
//                attention over the keys and values before storage (in double);
//   append_us    CPU time to append one token to one kv head, measured while building the
//                cache token by token (every kv head per call, divided by kv_heads), with
//                the storage reserved beforehand;
//   keys_frac    keys scored ÷ (n · q_heads);
//   GBps (exact): bytes of K and V (as stored) read per second;
//   of_stream / stream_GBps (exact from float32): exact decoding's rate ÷ a plain one-thread
//                streaming read (sum) of the same number of bytes, the two alternated pass by
//                pass (16 pairs); that read's rate.
// Shape: d = dv = 128, 8 query heads over 2 kv heads, one thread, n = 32768 and 131072.
//
// Data, with the structure of trained models rather than i.i.d. Gaussians (all Philox-seeded):
//   keys of kv head h:  k_j = μ_h + A_h (t_{s(j)} + 0.5 w_j) + 0.4 e_j
//     μ_h ~ 2·N(0, I_d): a large offset shared by every key (trained keys share a big mean);
//     A_h (d x 16) with N(0, 1/16) entries: low-rank structure; t_s ~ N(0, I_16) is the "topic"
//     of segment s = j / 128 (consecutive tokens share it), w_j, e_j ~ N(0, I): noise.
//   values: N(0, I_dv).
//   queries are NOT distributed like keys: for each generated token and query head a random
//     unit direction u; the query is β·u + 0.1·N(0, I_d) with β = 14 (no μ, no topic
//     structure), and 64 planted "needle" keys per query head at random positions outside
//     the sinks and window have centred part ‖typical centred key‖·(c·u + √(1 − c²)·u⊥) with
//     cosines c evenly spread over [0.5, 0.95] (the query copies a few key directions).
//   So attention is peaked on the needles (counters attn_entropy, top32_mass of exact
//   decoding report how peaked) and a long tail of ordinary keys carries the rest.
//
// Times (us_per_token, append_us, vs_exact, GBps) are CPU time of the benchmark thread: the
// machine is shared with other jobs, wall time varies with their load and CPU time much less;
// the ratios (vs_exact, of_stream) are measured in one process and are the figures to compare.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using bench::Index;
using bench::RowMatrix;
using randattn::DecodeMode;
using randattn::DecodeReport;
using randattn::KvCache;
using randattn::KvCacheOptions;
using randattn::KvStorage;
using randattn::Philox;

constexpr Index kD = 128, kDv = 128, kKvHeads = 2, kQHeads = 8, kTokens = 4, kTop = 32;
constexpr Index kNeedles = 64, kSinks = 4, kWindow = 256;

// CPU time of the calling thread: on a machine shared with other jobs it is much less noisy
// than wall time (the scheduler's share of the core does not enter it).
struct Config {
  std::string name;  // the mode and its options
  KvCacheOptions options;
};

// A retrieval mode with the bench's sinks and window (and seed, for the modes that draw).
KvCacheOptions retrieval(DecodeMode mode) {
  KvCacheOptions o;
  o.mode = mode;
  o.sinks = kSinks;
  o.window = kWindow;
  o.seed = 7;
  return o;
}

// Every storage type for exact decoding; float32 and the two compressed kinds for a retrieval
// mode of each family.
std::vector<Config> configs() {
  std::vector<Config> c;
  const auto stored = [&c](const char* name, KvCacheOptions o, std::vector<KvStorage> types) {
    for (const KvStorage t : types) {
      o.storage = t;
      c.push_back({name, o});
    }
  };
  const std::vector<KvStorage> compressed = {KvStorage::float32, KvStorage::bfloat16,
                                             KvStorage::int8};
  KvCacheOptions exact;
  exact.mode = DecodeMode::exact;
  stored("exact", exact,
         {KvStorage::float32, KvStorage::bfloat16, KvStorage::float16, KvStorage::int8});

  KvCacheOptions blocks = retrieval(DecodeMode::blocks);
  blocks.page_size = 32;
  blocks.top_pages = 64;
  c.push_back({"blocks_P32_top64", blocks});
  blocks.page_size = 16;
  blocks.top_pages = 128;
  stored("blocks_P16_top128", blocks, compressed);
  blocks.page_axes = 1024;  // the boxes in the principal axes of the first 1024 keys
  c.push_back({"blocks_P16_top128_axes", blocks});
  blocks.page_axes = 0;
  blocks.page_size = 8;
  blocks.top_pages = 256;
  c.push_back({"blocks_P8_top256", blocks});

  KvCacheOptions lsh = retrieval(DecodeMode::lsh_sample);
  lsh.centre_tokens = 1024;
  lsh.lsh_bits = 10;
  lsh.lsh_tables = 100;
  c.push_back({"lsh_K10_L100", lsh});
  lsh.lsh_bits = 11;
  lsh.lsh_tables = 80;
  stored("lsh_K11_L80", lsh, compressed);
  lsh.lsh_bits = 12;
  lsh.lsh_tables = 128;
  c.push_back({"lsh_K12_L128", lsh});

  KvCacheOptions lsf = retrieval(DecodeMode::lsf);
  lsf.centre_tokens = 1024;
  lsf.lsf_filters = 256;
  lsf.lsf_tables = 4;
  lsf.lsf_alpha = 0.9;
  stored("lsf_m256_L4_a0.9", lsf, compressed);

  KvCacheOptions clusters = retrieval(DecodeMode::clusters);
  clusters.clusters = 256;
  clusters.probe = 4;
  c.push_back({"clusters_C256_p4", clusters});
  clusters.clusters = 1024;
  clusters.probe = 16;
  c.push_back({"clusters_C1024_p16", clusters});
  // A fixed budget: the probed clusters alone, then with keys drawn from the others.
  clusters.cluster_margin = -std::numeric_limits<double>::infinity();
  clusters.clusters = 512;
  clusters.probe = 8;
  c.push_back({"clusters_C512_p8_fixed", clusters});
  clusters.clusters = 1024;
  clusters.probe = 16;
  c.push_back({"clusters_C1024_p16_fixed", clusters});
  clusters.probe = 8;
  c.push_back({"clusters_C1024_p8_fixed", clusters});
  clusters.probe = 12;
  c.push_back({"clusters_C1024_p12_fixed", clusters});
  clusters.probe = 16;
  clusters.cluster_samples = 64;
  c.push_back({"clusters_C1024_p16_fixed_s64", clusters});
  return c;
}

struct World {
  Index n = 0;
  RowMatrix<float> k, v;                  // head-major: rows [h·n, (h + 1)·n) are kv head h
  std::vector<RowMatrix<float>> queries;  // kTokens generated tokens, each kQHeads x kD
  std::vector<RowMatrix<float>> exact;    // exact outputs
  std::vector<std::vector<std::vector<std::int32_t>>> top;  // [token][q head] true top-32
  double entropy = 0, top_mass = 0;
  std::map<std::string, std::unique_ptr<KvCache<float>>> caches;  // by row name
  std::map<std::string, double> append_us;
  double exact_seconds = 0;

  explicit World(Index n_) : n(n_) {
    const Index group = kQHeads / kKvHeads, r = 16, seg = 128;
    k.resize(kKvHeads * n, kD);
    std::vector<RowMatrix<float>> means;
    v = randattn::gaussian_matrix<float>(Philox(30), kKvHeads * n, kDv);
    for (Index h = 0; h < kKvHeads; ++h) {
      const RowMatrix<float> mu = randattn::gaussian_matrix<float>(Philox(10, h), 1, kD, 2.0);
      const RowMatrix<float> a = randattn::gaussian_matrix<float>(Philox(11, h), kD, r, 0.25);
      const RowMatrix<float> topics =
          randattn::gaussian_matrix<float>(Philox(12, h), (n + seg - 1) / seg, r);
      RowMatrix<float> z = randattn::gaussian_matrix<float>(Philox(13, h), n, r, 0.5);
      for (Index j = 0; j < n; ++j) z.row(j) += topics.row(j / seg);
      auto kh = k.middleRows(h * n, n);
      kh = randattn::gaussian_matrix<float>(Philox(14, h), n, kD, 0.4);
      kh.noalias() += z * a.transpose();
      kh.rowwise() += mu.row(0);
      means.push_back(mu);
    }
    // Typical norm of a centred key.
    const double typical = std::sqrt(kD * (r * 0.0625 * 1.25 + 0.16));
    for (Index t = 0; t < kTokens; ++t) {
      RowMatrix<float> q = randattn::gaussian_matrix<float>(Philox(20, t), kQHeads, kD, 0.1);
      const RowMatrix<double> dirs = randattn::gaussian_matrix<double>(Philox(21, t), kQHeads, kD);
      for (Index i = 0; i < kQHeads; ++i) {
        const Index h = i / group;
        const Eigen::RowVectorXd u = dirs.row(i).normalized();
        q.row(i) += (14.0 * u).cast<float>();
        const RowMatrix<double> perp =
            randattn::gaussian_matrix<double>(Philox(22, t * kQHeads + i), kNeedles, kD);
        for (Index m = 0; m < kNeedles; ++m) {
          const double c = 0.5 + 0.45 * double(m) / double(kNeedles - 1);
          Eigen::RowVectorXd w = perp.row(m) - perp.row(m).dot(u) * u;
          w.normalize();
          const Index j = kSinks + Index(Philox(23, t * kQHeads + i).uniform(m) *
                                         double(n - kSinks - kWindow));
          k.row(h * n + j) =
              means[h].row(0) + (typical * (c * u + std::sqrt(1 - c * c) * w)).cast<float>();
        }
      }
      queries.push_back(q);
    }
    // Exact outputs, true top-32 keys, and how peaked exact attention is.
    const float scale = 1.0f / std::sqrt(float(kD));
    top.resize(kTokens);
    for (Index t = 0; t < kTokens; ++t) {
      RowMatrix<float> out(kQHeads, kDv);
      for (Index i = 0; i < kQHeads; ++i) {
        const Index h = i / group;
        const Eigen::VectorXd s =
            (k.middleRows(h * n, n) * queries[t].row(i).transpose()).cast<double>() * scale;
        const double smax = s.maxCoeff();
        const Eigen::VectorXd p = (s.array() - smax).exp().matrix() / (s.array() - smax).exp().sum();
        out.row(i) = (p.transpose() * v.middleRows(h * n, n).cast<double>()).cast<float>();
        std::vector<std::int32_t> idx(static_cast<std::size_t>(n));
        for (Index j = 0; j < n; ++j) idx[j] = std::int32_t(j);
        std::partial_sort(idx.begin(), idx.begin() + kTop, idx.end(),
                          [&](std::int32_t a, std::int32_t b) { return s(a) > s(b); });
        idx.resize(kTop);
        double mass = 0;
        for (auto j : idx) mass += p(j);
        top[t].push_back(idx);
        top_mass += mass / double(kTokens * kQHeads);
        entropy += -(p.array() * (p.array().max(1e-300)).log()).sum() / double(kTokens * kQHeads);
      }
      exact.push_back(out);
    }
  }

  KvCache<float>& cache(const std::string& row, const Config& c) {
    auto it = caches.find(row);
    if (it != caches.end()) return *it->second;
    // One mode's cache resident at a time, as in a server: the caches of the rows before (up to
    // 0.5 GB each at n = 131072) would otherwise stay mapped and slow the scattered reads of
    // the rows after them (page walks that miss the caches).
    caches.clear();
    auto cache = std::make_unique<KvCache<float>>(kD, kDv, kKvHeads, c.options);
    // Storage reserved up front (as a server would for its context length), so the figure is
    // the append itself, not the operating system's first touch of fresh pages.
    cache->reserve(n);
    // Token j of every kv head: rows j, n + j, … of k and v, passed in place (the kv heads' rows
    // one head's length apart). The loop is timed as a whole: the thread's CPU clock costs about
    // as much as an append to read (a system call, ~0.6 µs here).
    using Rows = Eigen::Map<const RowMatrix<float>, 0, Eigen::OuterStride<>>;
    const double start = bench::thread_cpu_seconds();
    for (Index j = 0; j < n; ++j) {
      cache->append(Rows(k.row(j).data(), kKvHeads, kD, Eigen::OuterStride<>(n * kD)),
                    Rows(v.row(j).data(), kKvHeads, kDv, Eigen::OuterStride<>(n * kDv)));
    }
    append_us[row] = (bench::thread_cpu_seconds() - start) * 1e6 / double(n * kKvHeads);
    return *caches.emplace(row, std::move(cache)).first->second;
  }
};

std::unique_ptr<World>& world_for(Index n) {
  static std::unique_ptr<World> world;
  if (!world || world->n != n) {
    world.reset();  // free the previous size first
    world = std::make_unique<World>(n);
  }
  return world;
}

// The bandwidth anchor: a plain one-thread streaming read (a sum) of the keys and values that
// the cache holds a copy of, as many bytes as exact decoding reads, alternated pass by pass with
// exact decoding. The machine's one-thread read rate drifts by half between minutes, so an
// anchor timed in a row of its own measured the drift more than the kernel; alternated, both
// see the machine in the same state.
struct StreamAnchor {
  double stream_gbps, of_stream;
};

StreamAnchor stream_anchor(const KvCache<float>& cache, const World& w) {
  constexpr int kPairs = 16;
  double stream = 0, decode = 0;
  for (int r = 0; r < kPairs; ++r) {
    const double t0 = bench::thread_cpu_seconds();
    float sum = w.k.sum() + w.v.sum();
    benchmark::DoNotOptimize(sum);
    const double t1 = bench::thread_cpu_seconds();
    RowMatrix<float> out = cache.attend(w.queries[r % kTokens]);
    benchmark::DoNotOptimize(out.data());
    decode += bench::thread_cpu_seconds() - t1;
    stream += t1 - t0;
  }
  const double bytes = double(w.k.size() + w.v.size()) * sizeof(float) * kPairs;
  return {bytes / stream * 1e-9, stream / decode};
}

std::string row_name(const Config& c, Index n) {
  // A row that names no storage type keeps the cache's own (float32).
  return "BM_Decode/" + c.name + "/storage:" + to_string(c.options.storage.value_or(KvStorage::float32)) +
         "/n:" + std::to_string(n);
}

void BM_Decode(benchmark::State& state, const Config& config, Index n) {
  bench::set_threads(1);
  World& w = *world_for(n);
  const std::string row = row_name(config, n);
  KvCache<float>& cache = w.cache(row, config);
  const bool exact = config.options.mode == DecodeMode::exact;
  const bool reference = exact && cache.storage() == KvStorage::float32;
  Index it = 0;
  const double start = bench::thread_cpu_seconds();
  for (auto _ : state) {
    RowMatrix<float> out = cache.attend(w.queries[it++ % kTokens]);
    benchmark::DoNotOptimize(out.data());
  }
  const double per_token = (bench::thread_cpu_seconds() - start) / double(state.iterations());
  if (reference) w.exact_seconds = per_token;

  // Accuracy, outside the timed loop.
  double recall = 0, err = 0, scored = 0, entries = 0;
  for (Index t = 0; t < kTokens; ++t) {
    DecodeReport rep;
    rep.record_keys = true;
    const RowMatrix<float> out = cache.attend(w.queries[t], &rep);
    err += (out - w.exact[t]).norm() / w.exact[t].norm() / double(kTokens);
    scored += double(rep.keys_scored()) / double(n * kQHeads * kTokens);
    entries += double(rep.bucket_entries) / double(kQHeads * kTokens);
    for (Index i = 0; i < kQHeads; ++i) {
      const auto& keys = rep.scored_keys[i];
      int found = 0;
      for (auto j : w.top[t][i]) found += std::binary_search(keys.begin(), keys.end(), j);
      recall += double(found) / double(kTop * kQHeads * kTokens);
    }
  }
  state.counters["us_per_token"] = per_token * 1e6;
  state.counters["vs_exact"] = w.exact_seconds > 0 ? w.exact_seconds / per_token : 0.0;
  state.counters["recall32"] = recall;
  state.counters["rel_error"] = err;
  state.counters["keys_frac"] = scored;
  state.counters["append_us"] = w.append_us[row];
  state.counters["bytes_per_token"] = double(cache.bytes_per_token());
  if (config.options.mode == DecodeMode::lsh_sample || config.options.mode == DecodeMode::lsf)
    state.counters["bucket_entries"] = entries;
  if (config.options.mode == DecodeMode::clusters) {
    DecodeReport rep;
    cache.attend(w.queries[0], &rep);
    state.counters["clusters_opened"] = double(rep.clusters_opened) / double(kQHeads);
    state.counters["splits"] = double(cache.key_clusters(0).splits());
  }
  state.counters["index_MB"] = double(cache.index_bytes()) / 1e6;
  if (exact) state.counters["GBps"] = double(cache.bytes_per_token()) * double(n) / per_token * 1e-9;
  if (reference) {
    const StreamAnchor anchor = stream_anchor(cache, w);
    state.counters["stream_GBps"] = anchor.stream_gbps;
    state.counters["of_stream"] = anchor.of_stream;
    state.counters["attn_entropy"] = w.entropy;
    state.counters["top32_mass"] = w.top_mass;
  }
}

const int registered = [] {
  for (const Index n : {Index(32768), Index(131072)}) {
    for (const Config& c : configs()) {
      benchmark::RegisterBenchmark(row_name(c, n).c_str(),
                                   [c, n](benchmark::State& state) { BM_Decode(state, c, n); })
          ->Unit(benchmark::kMillisecond);
    }
  }
  return 0;
}();

}  // namespace
