// Thread-count independence and concurrent use of shared objects: results that must not depend
// on how many threads compute them, and objects read from several threads at once. The
// ThreadSanitizer run compiles this file alone (scripts/sanitize.sh), so these cases are kept out
// of the families' larger files; the other files' [threads] cases check thread-count independence
// of parallel loops over disjoint rows, which the plain build runs.
#include <catch2/catch.hpp>

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kv_cache_support.hpp"
#include "layout_support.hpp"
#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace reg = randattn::registry;
using randattn::BatchShape;
using randattn::CrossPolytopeHash;
using randattn::DecodeMode;
using randattn::Index;
using randattn::KvCacheOptions;
using randattn::LinearOptions;
using randattn::LshOptions;
using randattn::OrthogonalProjection;
using randattn::PositiveFeatures;
using randattn::RandomFeatureOptions;
using randattn::RotationKind;
using randattn::RowMatrix;
using randattn::SparsifyOptions;
using randattn::Vector;
using testing::clustered;
using testing::rel_error;

namespace {

// Runs f once on this thread and three times concurrently on others; every run must give the
// reference result bit for bit. Under ThreadSanitizer this also proves the shared objects are
// only read.
template <typename F>
void check_concurrent_calls(F f) {
  const auto reference = f();
  std::vector<decltype(f())> results(3);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < results.size(); ++t)
    threads.emplace_back([&, t] { results[t] = f(); });
  for (std::thread& t : threads) t.join();
  for (const auto& r : results) CHECK(r == reference);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Linear core
// ---------------------------------------------------------------------------------------------

#if defined(_OPENMP)
// One thread runs the causal chunks in order with the state updated in place; on several
// threads each takes a run of consecutive chunks after replaying the state updates before it:
// the same products in the same order, so the same bits. Several groups of chunks, a ragged last
// chunk, signs and log-scales on both sides, runs that start inside a group.
TEMPLATE_TEST_CASE("Causal linear attention gives the same bits on one, two and three threads",
                   "[core][linear][causal][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const int saved = omp_get_max_threads();
  for (Index chunk : {1, 7, 16}) {
    INFO("chunk " << chunk);
    const Index n = 2 * 16 * chunk + 5;
    const auto p = testing::linear_problem<Scalar>(41, n, 24, 3, 4.0, true);
    LinearOptions opt;
    opt.causal = true;
    opt.block_size = chunk;
    const auto run = [&](int threads) {
      omp_set_num_threads(threads);
      return randattn::linear_attention_accumulate<Scalar>(p.qf, p.q_log, p.kf, p.k_log, p.v,
                                                           p.signs, opt)
          .finalize(Scalar(1e-6));
    };
    const RowMatrix<Scalar> one = run(1), two = run(2), three = run(3);
    omp_set_num_threads(saved);
    CHECK(testing::rows_bit_identical(one, two, n));
    CHECK(testing::rows_bit_identical(one, three, n));
  }
}
#endif

TEMPLATE_TEST_CASE("Batched linear attention equals per-slice calls for any thread count",
                   "[core][linear][batched][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  randattn::BatchShape shape;
  shape.batch = 2;
  shape.heads = 3;
  shape.n_q = shape.n_k = 70;
  shape.d = 10;
  shape.dv = 4;
  const Index s = shape.slices();
  const RowMatrix<Scalar> qf = testing::uniform<Scalar>(1, s * shape.n_q, shape.d, 0.1, 1.0);
  const RowMatrix<Scalar> kf = testing::uniform<Scalar>(2, s * shape.n_k, shape.d, 0.1, 1.0);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(3, s * shape.n_k, shape.dv);
  const RowMatrix<Scalar> kl = testing::uniform<Scalar>(4, s * shape.n_k, 1, -3, 3);
  for (bool causal : {false, true}) {
    LinearOptions opt;
    opt.causal = causal;
    opt.block_size = 16;
    RowMatrix<Scalar> out(s * shape.n_q, shape.dv);
    randattn::linear_attention_batched<Scalar>(qf.data(), nullptr, kf.data(), kl.data(), v.data(),
                                               nullptr, out.data(), shape, opt);
    for (Index i = 0; i < s; ++i) {
      const RowMatrix<Scalar> slice =
          randattn::linear_attention_accumulate<Scalar>(
              qf.middleRows(i * shape.n_q, shape.n_q), Vector<Scalar>(),
              kf.middleRows(i * shape.n_k, shape.n_k), kl.col(0).segment(i * shape.n_k, shape.n_k),
              v.middleRows(i * shape.n_k, shape.n_k), Vector<Scalar>(), opt)
              .finalize(Scalar(1e-6));
      CHECK((out.middleRows(i * shape.n_q, shape.n_q).array() == slice.array()).all());
    }
#if defined(_OPENMP)
    RowMatrix<Scalar> one(out.rows(), out.cols()), two(out.rows(), out.cols());
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    randattn::linear_attention_batched<Scalar>(qf.data(), nullptr, kf.data(), kl.data(), v.data(),
                                               nullptr, one.data(), shape, opt);
    omp_set_num_threads(2);
    randattn::linear_attention_batched<Scalar>(qf.data(), nullptr, kf.data(), kl.data(), v.data(),
                                               nullptr, two.data(), shape, opt);
    omp_set_num_threads(saved);
    CHECK((one.array() == two.array()).all());
#endif
  }
}

// ---------------------------------------------------------------------------------------------
// Random features
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("attention: batched, decoder and thread count agree with the single call",
                   "[features][threads]", RANDATTN_TEST_SCALARS) {
  const Index batch = 2, heads = 3, n = 150, d = 8, dv = 5, m = 32;
  const Index slices = batch * heads;
  const RowMatrix<TestType> q = testing::gaussian<TestType>(51, slices * n, d),
                            k = testing::gaussian<TestType>(52, slices * n, d),
                            v = testing::gaussian<TestType>(53, slices * n, dv);
  const PositiveFeatures<TestType> map(OrthogonalProjection<TestType>(m, d, 54));
  for (bool causal : {false, true}) {
    RandomFeatureOptions opt;
    opt.causal = causal;
    RowMatrix<TestType> out(slices * n, dv);
    randattn::random_feature_attention_batched(map, q.data(), k.data(), v.data(), out.data(),
                                               randattn::BatchShape{batch, heads, n, n, d, dv},
                                               opt);
    for (Index s = 0; s < slices; ++s) {
      const RowMatrix<TestType> single = randattn::random_feature_attention(
          map, q.middleRows(s * n, n), k.middleRows(s * n, n), v.middleRows(s * n, n), opt);
      CHECK(RowMatrix<TestType>(out.middleRows(s * n, n)) == single);
    }
#if defined(_OPENMP)
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    const RowMatrix<TestType> one = randattn::random_feature_attention(
        map, q.topRows(4 * n), k.topRows(4 * n), v.topRows(4 * n), opt);
    omp_set_num_threads(2);
    const RowMatrix<TestType> two = randattn::random_feature_attention(
        map, q.topRows(4 * n), k.topRows(4 * n), v.topRows(4 * n), opt);
    omp_set_num_threads(threads);
    CHECK(one == two);
#endif
  }
  // Streaming decoding reproduces causal attention up to rounding.
  RandomFeatureOptions opt;
  opt.causal = true;
  const RowMatrix<TestType> causal =
      randattn::random_feature_attention(map, q.topRows(n), k.topRows(n), v.topRows(n), opt);
  randattn::RandomFeatureDecoder<PositiveFeatures<TestType>> decoder(map, dv);
  RowMatrix<TestType> streamed(n, dv);
  for (Index t = 0; t < n; ++t) {
    decoder.append(k.row(t), v.row(t));
    streamed.row(t) = decoder.query(q.row(t));
  }
  CHECK(decoder.length() == n);
  CHECK(rel_error(streamed, causal) < 10 * testing::tolerance<TestType>());
}

#if defined(_OPENMP)
// A forward that keeps its features for the backward maps each piece of rows straight into the
// kept rows, and a thread replaying the keys before its chunks maps its own copy instead: the
// output and the kept features are those of one thread, and the output that of the forward
// that keeps nothing. Several groups of 16 chunks, a ragged last one.
TEST_CASE("attention: a forward keeping its features gives the same bits on 1, 2 and 3 threads",
          "[features][gradients][threads]") {
  const Index n = 3 * 16 * 8 + 5, d = 8, dv = 5, m = 32;
  const RowMatrix<float> q = testing::gaussian<float>(61, n, d),
                         k = testing::gaussian<float>(62, n, d),
                         v = testing::gaussian<float>(63, n, dv);
  const PositiveFeatures<float> map(OrthogonalProjection<float>(m, d, 64));
  const int threads = omp_get_max_threads();
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    RandomFeatureOptions opt;
    opt.causal = causal;
    opt.block_size = 8;
    const auto run = [&](int count, randattn::SavedFeatures<float>* saved) {
      omp_set_num_threads(count);
      RowMatrix<float> out(n, dv);
      if (saved) {
        randattn::random_feature_attention_into(map, q, k, v, out, *saved, opt);
      } else {
        randattn::random_feature_attention_into(map, q, k, v, out, opt);
      }
      return out;
    };
    randattn::SavedFeatures<float> one_saved;
    const RowMatrix<float> one = run(1, &one_saved);
    CHECK(one == run(1, nullptr));
    for (int count : {2, 3}) {
      INFO(count << " threads");
      randattn::SavedFeatures<float> saved;
      CHECK(run(count, &saved) == one);
      CHECK(saved.q.values == one_saved.q.values);
      CHECK(saved.q.log_scale == one_saved.q.log_scale);
      CHECK(saved.k.values == one_saved.k.values);
      CHECK(saved.k.log_scale == one_saved.k.log_scale);
    }
  }
  omp_set_num_threads(threads);
}
#endif

// ---------------------------------------------------------------------------------------------
// LSH
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Separate-key sort-and-chunk does not depend on the thread count",
                   "[lsh][threads]", RANDATTN_TEST_SCALARS) {
#if defined(_OPENMP)
  using Scalar = TestType;
  const Index d = 16, dv = 6;
  const CrossPolytopeHash<Scalar> hash(RotationKind::hadamard, d, 32, 3, 17);
  struct Case {
    Index n_q, n_k;
    bool causal;
  };
  for (const Case c : {Case{3000, 2000, false}, Case{1500, 4100, false}, Case{3000, 3000, true}}) {
    const RowMatrix<Scalar> q = clustered<Scalar>(171, c.n_q, d, 9, 0.6),
                            k = clustered<Scalar>(172, c.n_k, d, 9, 0.6),
                            v = testing::gaussian<Scalar>(173, c.n_k, dv);
    for (Index chunk : {Index(16), Index(200)}) {
      INFO("n_q " << c.n_q << " n_k " << c.n_k << " causal " << c.causal << " chunk " << chunk);
      LshOptions opt;
      opt.chunk = chunk;
      opt.causal = c.causal;
      const int threads = omp_get_max_threads();
      omp_set_num_threads(1);
      const RowMatrix<Scalar> one = randattn::lsh_attention(hash, q, k, v, opt);
      omp_set_num_threads(2);
      const RowMatrix<Scalar> two = randattn::lsh_attention(hash, q, k, v, opt);
      omp_set_num_threads(threads);
      CHECK(testing::rows_bit_identical(one, two, one.rows()));
    }
  }
#else
  SUCCEED("built without OpenMP");
#endif
}

TEMPLATE_TEST_CASE("Batched multi-head LSH attention equals per-slice calls, for any thread count",
                   "[lsh][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const randattn::BatchShape shape{2, 3, 130, 130, 16, 7};  // batch, heads, n_q, n_k, d, dv
  const Index s = shape.slices();
  const RowMatrix<Scalar> q = clustered<Scalar>(81, s * shape.n_q, shape.d, 7, 0.6);
  const RowMatrix<Scalar> k = clustered<Scalar>(82, s * shape.n_k, shape.d, 7, 0.6);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(83, s * shape.n_k, shape.dv);
  const CrossPolytopeHash<Scalar> hash(RotationKind::hadamard, shape.d, 16, 3, 4);
  for (bool exact_buckets : {false, true}) {
    for (bool causal : {false, true}) {
      INFO("exact_buckets " << exact_buckets << " causal " << causal);
      LshOptions opt;
      opt.chunk = 16;
      opt.exact_buckets = exact_buckets;
      opt.causal = causal;
      opt.scale = 1;
      RowMatrix<Scalar> out(s * shape.n_q, shape.dv), out_k(s * shape.n_q, shape.dv);
      randattn::lsh_attention_batched<Scalar>(hash, q.data(), v.data(), out.data(), shape, opt);
      randattn::lsh_attention_batched<Scalar>(hash, q.data(), k.data(), v.data(), out_k.data(),
                                              shape, opt);
      for (Index i = 0; i < s; ++i) {
        const auto rows = [&](const RowMatrix<Scalar>& m) {
          return RowMatrix<Scalar>(m.middleRows(i * shape.n_q, shape.n_q));
        };
        CHECK(testing::rows_bit_identical(
            rows(out), randattn::lsh_attention(hash, rows(q), rows(v), opt), shape.n_q));
        CHECK(testing::rows_bit_identical(
            rows(out_k), randattn::lsh_attention(hash, rows(q), rows(k), rows(v), opt), shape.n_q));
      }
#if defined(_OPENMP)
      // Chunks and buckets of one long slice run in parallel; the result must not change.
      const RowMatrix<Scalar> long_q = clustered<Scalar>(84, 3000, shape.d, 9, 0.6);
      const RowMatrix<Scalar> long_v = testing::gaussian<Scalar>(85, 3000, shape.dv);
      const int threads = omp_get_max_threads();
      omp_set_num_threads(1);
      const RowMatrix<Scalar> one = randattn::lsh_attention(hash, long_q, long_v, opt);
      omp_set_num_threads(2);
      const RowMatrix<Scalar> two = randattn::lsh_attention(hash, long_q, long_v, opt);
      omp_set_num_threads(threads);
      CHECK(testing::rows_bit_identical(one, two, one.rows()));
#endif
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Objects shared between threads
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("robustness: objects shared between threads give identical results",
                   "[robustness][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 300, d = 16, dv = 4;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(11, n, d, 0.4),
                          k = testing::gaussian<Scalar>(12, n, d, 0.4),
                          v = testing::gaussian<Scalar>(13, n, dv);
  RandomFeatureOptions causal;
  causal.causal = true;
  const PositiveFeatures<Scalar> favor(OrthogonalProjection<Scalar>(64, d, 14));
  const auto hybrid = randattn::angular_hybrid<Scalar>(8, 2, d, 15);
  check_concurrent_calls(
      [&] { return randattn::random_feature_attention(favor, q, k, v, causal); });
  check_concurrent_calls([&] { return randattn::random_feature_attention(hybrid, q, k, v); });
  check_concurrent_calls([&] { return randattn::exact_attention(q, k, v); });

  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    const CrossPolytopeHash<Scalar> hash(kind, d, 16, 3, 16);
    LshOptions opt;
    opt.chunk = 32;
    check_concurrent_calls([&] { return hash.hash(q); });
    check_concurrent_calls([&] { return randattn::lsh_attention(hash, q, v, opt); });
  }

  // Sparsification: the same options object and tensor from several threads.
  const RowMatrix<Scalar> a = testing::gaussian<Scalar>(17, 40, 60);
  const auto tensor = randattn::tensor_view(a.data(), {40, 60});
  SparsifyOptions sopt;
  sopt.budget = 300;
  sopt.seed = 18;
  const auto sketch = [&] {
    const auto s = randattn::sparsify(tensor, sopt);
    return std::make_tuple(s.dims(), s.indices(), s.values());
  };
  check_concurrent_calls(sketch);
  check_concurrent_calls([&] { return randattn::sketched_hosvd(tensor, {3, 3}, sopt).factors; });
}

// ---------------------------------------------------------------------------------------------
// Key/value cache
// ---------------------------------------------------------------------------------------------

TEST_CASE("KvCache concurrent attend equals serial", "[kv_cache][threads]") {
  const Index d = 32, dv = 16, kvh = 2, qh = 8, n = 2000;
  const testing::Tokens<float> tok(101, n, kvh, d, dv);
  for (const DecodeMode mode : {DecodeMode::exact, DecodeMode::blocks, DecodeMode::lsh_sample,
                                DecodeMode::lsf}) {
    KvCacheOptions opt;
    opt.mode = mode;
    opt.page_size = 16;
    opt.top_pages = 8;
    opt.lsh_bits = 5;
    opt.lsh_tables = 16;
    opt.lsf_filters = 32;
    const auto cache = testing::filled(tok, opt);
    std::vector<RowMatrix<float>> queries, serial;
    for (int i = 0; i < 16; ++i) {
      queries.push_back(testing::needle_queries(tok, qh, 200 + i, 4.0));
      serial.push_back(cache.attend(queries.back()));
    }
    std::atomic<int> mismatches{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (int rep = 0; rep < 3; ++rep)
          for (int i = 0; i < 16; ++i) {
            const int k = (i + 5 * t) % 16;
            if (!testing::bit_identical<float>(cache.attend(queries[k]), serial[k])) ++mismatches;
          }
      });
    }
    for (auto& th : threads) th.join();
    INFO("mode " << randattn::to_string(mode));
    CHECK(mismatches == 0);
  }
}

TEST_CASE("KvCache clusters: the same seed gives the same clusters for any thread count",
          "[kv_cache][threads]") {
  const Index d = 16, dv = 8, kvh = 2, qh = 4, n = 3000;
  const testing::Tokens<float> tok = testing::drifting_tokens(107, n, kvh, d, dv);
  const RowMatrix<float> q = testing::needle_queries(tok, qh, 6, 5.0);
  const auto build = [&](int threads) {
#if defined(_OPENMP)
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
    auto cache = testing::filled(tok, testing::clusters_options(8, 3, 3, 20));
#if defined(_OPENMP)
    omp_set_num_threads(before);
#endif
    return cache;
  };
  const auto one = build(1), four = build(4);
  CHECK(one.key_clusters(0).splits() > 0);
  CHECK(testing::bit_identical<float>(one.attend(q), four.attend(q)));
  for (Index h = 0; h < kvh; ++h) {
    const auto &a = one.key_clusters(h), &b = four.key_clusters(h);
    CHECK(a.splits() == b.splits());
    CHECK(testing::bit_identical<float>(RowMatrix<float>(a.centroids()), RowMatrix<float>(b.centroids())));
    for (Index c = 0; c < a.count(); ++c) CHECK(a.members(c) == b.members(c));
  }
}

// ---------------------------------------------------------------------------------------------
// Key layouts of registered methods
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Layout sub-calls run in parallel with the same bits for any thread count",
                   "[layout][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // Grouped heads (4 query heads on 2 key heads), a scattered padding mask, causal and
  // self-excluding: every kind of sub-call (gathered keys and queries, runs of padded queries).
  const BatchShape shape{3, 4, 40, 40, 8, 5};
  const Index kv_heads = 2;
  const std::vector<Scalar> q = testing::values<Scalar>(11, shape.slices() * shape.n_q, shape.d);
  const std::vector<Scalar> k = testing::values<Scalar>(12, shape.batch * kv_heads * shape.n_k, shape.d);
  const std::vector<Scalar> v = testing::values<Scalar>(13, shape.batch * kv_heads * shape.n_k, shape.dv);
  std::vector<std::int64_t> mask(std::size_t(shape.batch * shape.n_k), 0);
  for (Index j : {1, 5, 6, 7, 30}) mask[std::size_t(j)] = 1;
  for (Index j = 25; j < 40; ++j) mask[std::size_t(shape.n_k + j)] = 1;
  for (Index j = 0; j < 40; ++j) mask[std::size_t(2 * shape.n_k + j)] = 1;  // nothing valid
  const std::map<std::string, reg::IndexArray> layouts[] = {
      {{"key_padding_mask", {{shape.batch, shape.n_k}, mask, true}}},
      {{"cu_seqlens", testing::integers({4}, {0, 9, 10, 40})}},
      {{"key_lengths", testing::integers({3}, {40, 17, 0})}},
  };
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
#endif
  for (const char* method : {"exact", "favor", "lsh", "lsf"}) {
    for (const auto& layout : layouts) {
      for (bool causal : {false, true}) {
        INFO(method << " " << layout.begin()->first << " causal " << causal);
        const auto call = [&] {
          return testing::run<Scalar>(method, shape, kv_heads, layout, causal, true, q, k, v);
        };
#if defined(_OPENMP)
        omp_set_num_threads(1);
#endif
        const std::vector<Scalar> one = call();
#if defined(_OPENMP)
        omp_set_num_threads(2);
#endif
        const std::vector<Scalar> two = call();
#if defined(_OPENMP)
        omp_set_num_threads(threads);
#endif
        CHECK(one == two);
        for (Scalar x : one) CHECK(std::isfinite(double(x)));
      }
    }
  }
}
