// The rules of docs/robustness.md that cut across the families: large norms in the hybrid maps
// and LSH, objects reused across calls, and unit-size inputs of the sketching entry points, and
// the one exception type of every bad argument (objects shared between threads: test_threads.cpp).
// Rules owned by one family are tested next to it.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <limits>
#include <fstream>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <typeinfo>
#include <vector>

#include <randattn/io/npy.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "support.hpp"

using randattn::CrossPolytopeHash;
using randattn::Index;
using randattn::LshOptions;
using randattn::OrthogonalProjection;
using randattn::PositiveFeatures;
using randattn::RandomFeatureOptions;
using randattn::RotationKind;
using randattn::RowMatrix;
using randattn::SparsifyOptions;
using randattn::Vector;

namespace {

// Norms spread over [0, 20], with 20 itself on row 0.
Eigen::VectorXd norms_up_to_20(std::uint64_t seed, Index n) {
  Eigen::VectorXd norms = testing::uniform<double>(seed, n, 1, 0.0, 20.0).col(0);
  norms(0) = 20.0;
  return norms;
}


// f() must throw randattn::invalid_argument itself (not a class derived from it), catchable as
// std::invalid_argument.
template <typename F>
void require_library_invalid_argument(F f) {
  REQUIRE_THROWS_AS(f(), randattn::invalid_argument);
  try {
    f();
    FAIL("no exception");
  } catch (const std::invalid_argument& e) {
    CHECK(typeid(e) == typeid(randattn::invalid_argument));
    CHECK(std::string(e.what()).rfind("randattn::", 0) == 0);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("robustness: hybrid maps and LSH stay finite for norms up to 20",
                   "[robustness][edge]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 160, d = 16, dv = 3;
  const RowMatrix<Scalar> q = testing::rows_with_norms<Scalar>(1, norms_up_to_20(2, n), d),
                          k = testing::rows_with_norms<Scalar>(3, norms_up_to_20(4, n), d),
                          v = testing::gaussian<Scalar>(5, n, dv);
  const auto angular = randattn::angular_hybrid<Scalar>(16, 3, d, 6);
  const auto gaussian = randattn::gaussian_hybrid<Scalar>(16, 3, d, 1.0, 7);
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    RandomFeatureOptions opt;
    opt.causal = causal;
    CHECK(randattn::random_feature_attention(angular, q, k, v, opt).allFinite());
    CHECK(randattn::random_feature_attention(gaussian, q, k, v, opt).allFinite());
    // Clipped estimates are nonnegative weights: convex combinations of v (or zero rows).
    for (const RowMatrix<Scalar>& o :
         {randattn::random_feature_attention_clipped(angular, q, k, v, opt),
          randattn::random_feature_attention_clipped(gaussian, q, k, v, opt)}) {
      REQUIRE(o.allFinite());
      CHECK(testing::within_value_ranges(o, v));
    }
    // LSH weights are a softmax over each row's targets: always convex combinations of v, here
    // with logits up to 20 * 20 (scale 1) for separate keys.
    for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
      const CrossPolytopeHash<Scalar> hash(kind, d, 8, 2, 8);
      LshOptions lsh;
      lsh.causal = causal;
      lsh.chunk = 16;
      lsh.scale = 1.0;
      const RowMatrix<Scalar> shared = randattn::lsh_attention(hash, q, v, lsh);
      REQUIRE(shared.allFinite());
      CHECK(testing::within_value_ranges(shared, v));
      lsh.exact_buckets = true;
      lsh.scale = 1.0;
      const RowMatrix<Scalar> separate = randattn::lsh_attention(hash, q, k, v, lsh);
      REQUIRE(separate.allFinite());
      CHECK(testing::within_value_ranges(separate, v));
    }
  }
}

TEMPLATE_TEST_CASE("robustness: reuse across calls, decoder reset and redraw", "[robustness][edge]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 64, d = 8, dv = 3;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(21, n, d, 0.5),
                          k = testing::gaussian<Scalar>(22, n, d, 0.5),
                          v = testing::gaussian<Scalar>(23, n, dv);
  PositiveFeatures<Scalar> map(OrthogonalProjection<Scalar>(32, d, 24));
  const RowMatrix<Scalar> first = randattn::random_feature_attention(map, q, k, v);
  CHECK(randattn::random_feature_attention(map, q, k, v) == first);
  // redraw(seed) is a pure function of the seed: back to the first seed, back to the first result.
  map.redraw(25);
  CHECK_FALSE(randattn::random_feature_attention(map, q, k, v) == first);
  map.redraw(24);
  CHECK(randattn::random_feature_attention(map, q, k, v) == first);

  randattn::RandomFeatureDecoder<PositiveFeatures<Scalar>> decoder(map, dv);
  RowMatrix<Scalar> run1(n, dv), run2(n, dv);
  for (RowMatrix<Scalar>* run : {&run1, &run2}) {
    decoder.reset();
    for (Index t = 0; t < n; ++t) {
      decoder.append(k.row(t), v.row(t));
      decoder.query_into(q.row(t), run->row(t));
    }
  }
  CHECK(run1 == run2);
  CHECK(decoder.length() == n);
}

TEMPLATE_TEST_CASE("robustness: unit-size inputs of the sketching entry points",
                   "[robustness][edge]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // A 1 x 1 tensor: its single entry is the whole norm, so it is kept exactly.
  const Vector<Scalar> one = Vector<Scalar>::Constant(1, Scalar(-2.5));
  SparsifyOptions opt;
  opt.budget = 1;
  const auto s = randattn::sparsify(randattn::tensor_view(one.data(), {1, 1}), opt);
  REQUIRE(s.nnz() == 1);
  CHECK(s.values()[0] == Scalar(-2.5));
  // Modes of size 1 in a larger tensor: rank-1 HOSVD factors are unit vectors.
  const RowMatrix<Scalar> a = testing::gaussian<Scalar>(31, 1, 24);
  const auto h = randattn::exact_hosvd(randattn::tensor_view(a.data(), {1, 4, 6}), {1, 1, 1});
  REQUIRE(h.factors.size() == 3);
  CHECK(std::abs(std::abs(double(h.factors[0](0, 0))) - 1.0) < testing::tolerance<Scalar>());
  // Sparse-score attention: no query gives an empty result; one token attends to itself.
  randattn::SparseScoreOptions so;
  so.budget = 4;
  const RowMatrix<Scalar> x = testing::gaussian<Scalar>(32, 1, 5),
                          vx = testing::gaussian<Scalar>(33, 1, 2);
  CHECK(randattn::sparse_score_attention(RowMatrix<Scalar>(0, 5), x, vx, so).rows() == 0);
  CHECK(testing::rel_error(randattn::sparse_score_attention(x, x, vx, so), vx) <
        testing::tolerance<Scalar>());
}

TEMPLATE_TEST_CASE("robustness: every bad argument throws randattn::invalid_argument",
                   "[robustness][errors]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 12, d = 4, dv = 3;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(1, n, d),
                          k = testing::gaussian<Scalar>(2, n, d),
                          v = testing::gaussian<Scalar>(3, n, dv);
  // Exact attention: keys of the wrong width.
  require_library_invalid_argument(
      [&] { return randattn::exact_attention(q, RowMatrix<Scalar>::Ones(n, d + 1), v); });
  // A feature map: zero features, and inputs of the wrong width.
  require_library_invalid_argument([&] { return OrthogonalProjection<Scalar>(0, d, 1); });
  const PositiveFeatures<Scalar> map(OrthogonalProjection<Scalar>(8, d, 4));
  require_library_invalid_argument(
      [&] { return map.features(testing::gaussian<Scalar>(5, n, d + 1)); });
  require_library_invalid_argument([&] {
    return randattn::random_feature_attention(map, q, k, RowMatrix<Scalar>(v.topRows(5)));
  });
  // LSF: zero filters per table, and values with too few rows.
  require_library_invalid_argument(
      [&] { return randattn::LocalitySensitiveFilters<Scalar>(RotationKind::dense, d, 0, 2, 1); });
  const randattn::LocalitySensitiveFilters<Scalar> filters(RotationKind::dense, d, 8, 2, 1);
  require_library_invalid_argument(
      [&] { return randattn::lsf_attention(filters, q, k, RowMatrix<Scalar>(v.topRows(5))); });
  // Sketching: a zero budget, and an unknown scheme name.
  const RowMatrix<Scalar> a = testing::gaussian<Scalar>(6, 5, 6);
  SparsifyOptions opt;
  opt.budget = 0;
  require_library_invalid_argument([&] {
    return randattn::sparsify(randattn::tensor_view(a.data(), {5, 6}), opt);
  });
  require_library_invalid_argument([] { return randattn::parse_scheme("bogus"); });
  // Non-finite input.
  RowMatrix<Scalar> bad_q = q;
  bad_q(1, 2) = std::numeric_limits<Scalar>::quiet_NaN();
  require_library_invalid_argument([&] { return randattn::exact_attention(bad_q, k, v); });
}

TEST_CASE("robustness: an unreadable .npy file throws a randattn::invalid_argument",
          "[robustness][errors]") {
  namespace fs = std::filesystem;
  std::random_device rd;
  const fs::path dir = fs::temp_directory_path() /
                       ("randattn_errors_" + std::to_string(rd()) + std::to_string(rd()));
  fs::create_directories(dir);
  const fs::path bad = dir / "bad.npy";
  {
    std::ofstream out(bad, std::ios::binary);
    out << "this is not a .npy file";
  }
  // io::NpyError, derived from randattn::invalid_argument, derived from std::invalid_argument.
  REQUIRE_THROWS_AS(randattn::io::read_npy(bad), randattn::invalid_argument);
  REQUIRE_THROWS_AS(randattn::io::read_npy(bad), std::invalid_argument);
  REQUIRE_THROWS_AS(randattn::io::read_npy(dir / "absent.npy"), randattn::invalid_argument);
  try {
    (void)randattn::io::read_npy(bad);
    FAIL("no exception");
  } catch (const randattn::invalid_argument& e) {
    CHECK(typeid(e) == typeid(randattn::io::NpyError));
    CHECK(std::string(e.what()) == bad.string() + ": not a .npy file (bad magic string)");
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEMPLATE_TEST_CASE("robustness: values near the type's maximum give the exact convex combination",
                   "[robustness][overflow]", RANDATTN_TEST_SCALARS) {
  // 2^(max_exponent - 1) v: the same weights, values scaled by a power of two, so the output is
  // the small-value output times that power, bit for bit, with no Inf from the numerators.
  using Scalar = TestType;
  const Scalar big = std::ldexp(Scalar(1), std::numeric_limits<Scalar>::max_exponent - 1);
  const Index n = 70, d = 8, dv = 3;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(11, n, d),
                          k = testing::gaussian<Scalar>(12, n, d),
                          v = testing::gaussian<Scalar>(13, n, dv).cwiseMin(Scalar(1)).cwiseMax(
                              Scalar(-1));
  const RowMatrix<Scalar> huge = v * big;
  REQUIRE(huge.allFinite());
  const auto check_scaled = [&](const RowMatrix<Scalar>& small, const RowMatrix<Scalar>& large) {
    REQUIRE(large.allFinite());
    CHECK(large == RowMatrix<Scalar>(small * big));
  };
  for (bool dedupe : {true, false}) {
    INFO("dedupe " << dedupe);
    const CrossPolytopeHash<Scalar> hash(RotationKind::dense, d, 4, 3, 9);
    LshOptions opt;
    opt.chunk = 16;
    opt.dedupe = dedupe;
    check_scaled(randattn::lsh_attention(hash, q, v, opt), randattn::lsh_attention(hash, q, huge, opt));
    opt.exact_buckets = true;
    check_scaled(randattn::lsh_attention(hash, q, k, v, opt),
                 randattn::lsh_attention(hash, q, k, huge, opt));
    const randattn::BatchShape shape{1, 1, n, n, d, dv};
    RowMatrix<Scalar> small(n, dv), large(n, dv);
    randattn::lsh_attention_batched(hash, q.data(), k.data(), v.data(), small.data(), shape, opt);
    randattn::lsh_attention_batched(hash, q.data(), k.data(), huge.data(), large.data(), shape,
                                    opt);
    check_scaled(small, large);
  }
  const randattn::LocalitySensitiveFilters<Scalar> filters(RotationKind::dense, d, 8, 3, 5);
  randattn::LsfOptions lsf;
  lsf.eta = 0.0;
  check_scaled(randattn::lsf_attention(filters, q, k, v, lsf),
               randattn::lsf_attention(filters, q, k, huge, lsf));
  const randattn::BatchShape shape{1, 1, n, n, d, dv};
  RowMatrix<Scalar> small(n, dv), large(n, dv);
  randattn::lsf_attention_batched(filters, q.data(), k.data(), v.data(), small.data(), shape, lsf);
  randattn::lsf_attention_batched(filters, q.data(), k.data(), huge.data(), large.data(), shape,
                                  lsf);
  check_scaled(small, large);
}

TEMPLATE_TEST_CASE("robustness: LSF logits beyond the range raise exact attention's overflow error",
                   "[robustness][overflow]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 12, d = 4, dv = 2;
  // Keys equal to the queries, of norm 4 sqrt(max): each query's logit with its own key is
  // 16 max, beyond the range, so exact attention reports overflow.
  const Scalar norm = std::sqrt(std::numeric_limits<Scalar>::max()) * Scalar(4);
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(21, n, d).rowwise().normalized() * norm,
                          k = q, v = testing::gaussian<Scalar>(23, n, dv);
  REQUIRE(q.allFinite());
  REQUIRE(k.allFinite());
  const std::string overflow = "the result overflowed the floating-point range";
  randattn::ExactOptions eopt;
  eopt.scale = 1;
  CHECK_THROWS_WITH(randattn::exact_attention(q, k, v, eopt), Catch::Contains(overflow));
  const randattn::LocalitySensitiveFilters<Scalar> filters(RotationKind::dense, d, 8, 2, 5);
  randattn::LsfOptions lsf;
  lsf.eta = -std::numeric_limits<double>::infinity();
  lsf.scale = 1;
  CHECK_THROWS_WITH(randattn::lsf_attention(filters, q, k, v, lsf), Catch::Contains(overflow));
  RowMatrix<Scalar> out(n, dv);
  CHECK_THROWS_WITH(randattn::lsf_attention_batched(filters, q.data(), k.data(), v.data(),
                                                    out.data(), {1, 1, n, n, d, dv}, lsf),
                    Catch::Contains(overflow));
}

TEMPLATE_TEST_CASE("robustness: HOSVD of finite entries whose squares overflow reports overflow",
                   "[robustness][overflow][sketch]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // Entries near sqrt(max) * 10: finite, but the mode Gram matrices overflow.
  const Scalar scale = std::sqrt(std::numeric_limits<Scalar>::max()) * Scalar(10);
  std::vector<Scalar> a(4 * 5 * 6);
  const RowMatrix<Scalar> g = testing::gaussian<Scalar>(31, Index(a.size()), 1);
  for (std::size_t t = 0; t < a.size(); ++t) a[t] = g(Index(t), 0) * scale;
  const randattn::TensorView<Scalar> view(a.data(), {4, 5, 6});
  CHECK_THROWS_WITH(randattn::exact_hosvd(view, {2, 2, 2}),
                    Catch::Contains("the result overflowed the floating-point range"));
}

TEST_CASE("robustness: a second _into call with the same shapes allocates nothing",
          "[robustness][into]") {
  if (!testing::allocations_counted()) {
    WARN("heap allocations are not counted in this build (sanitizer or not glibc)");
    return;
  }
  // One thread: with more, which thread runs which task can change between calls, and a thread's
  // first task of a shape takes new storage for it (see docs/core.md).
#if defined(_OPENMP)
  struct OneThread {
    int before = omp_get_max_threads();
    OneThread() { omp_set_num_threads(1); }
    ~OneThread() { omp_set_num_threads(before); }
  } one_thread;
#endif
  using S = float;
  const Index n = 200, d = 16, dv = 8;  // n not a multiple of any tile length
  const RowMatrix<S> q = testing::gaussian<S>(301, n, d, 0.5), k = testing::gaussian<S>(302, n, d, 0.5),
                     v = testing::gaussian<S>(303, n, dv);
  const RowMatrix<S> qf = (q * S(0.2)).array().exp().matrix(),
                     kf = (k * S(0.2)).array().exp().matrix();
  const PositiveFeatures<S> positive(OrthogonalProjection<S>(32, d, 304));
  const randattn::TrigFeatures<S> trig(OrthogonalProjection<S>(16, d, 305));
  const auto hybrid = randattn::angular_hybrid<S>(8, 2, d, 310);
  const CrossPolytopeHash<S> hash(RotationKind::dense, d, 8, 2, 306);
  const randattn::LocalitySensitiveFilters<S> filters(RotationKind::dense, d, 16, 2, 307);
  RowMatrix<S> out(n, dv);
  std::vector<std::pair<std::string, std::function<void()>>> calls;
  for (const bool causal : {false, true}) {
    const std::string mode = causal ? " (causal)" : "";
    randattn::ExactOptions exact;
    exact.causal = causal;
    randattn::ExactOptions self = exact;
    self.exclude_self = true;
    randattn::LinearOptions linear;
    linear.causal = causal;
    RandomFeatureOptions features;
    features.causal = causal;
    LshOptions lsh;
    lsh.causal = causal;
    lsh.chunk = 32;
    randattn::LsfOptions lsf;
    lsf.causal = causal;
    lsf.eta = 0.3;
    calls.emplace_back("exact_attention_into" + mode,
                       [&, exact] { randattn::exact_attention_into(q, k, v, out, exact); });
    calls.emplace_back("exact_attention_into, exclude_self" + mode,
                       [&, self] { randattn::exact_attention_into(q, q, v, out, self); });
    calls.emplace_back("linear_attention_into" + mode,
                       [&, linear] { randattn::linear_attention_into(qf, kf, v, out, linear); });
    calls.emplace_back("random_feature_attention_into, positive" + mode, [&, features] {
      randattn::random_feature_attention_into(positive, q, k, v, out, features);
    });
    calls.emplace_back("random_feature_attention_into, trig" + mode, [&, features] {
      randattn::random_feature_attention_into(trig, q, k, v, out, features);
    });
    calls.emplace_back("random_feature_attention_into, angular hybrid" + mode, [&, features] {
      randattn::random_feature_attention_into(hybrid, q, k, v, out, features);
    });
    calls.emplace_back("lsh_attention_into, shared QK" + mode,
                       [&, lsh] { randattn::lsh_attention_into(hash, q, v, out, lsh); });
    calls.emplace_back("lsh_attention_into, separate keys" + mode,
                       [&, lsh] { randattn::lsh_attention_into(hash, q, k, v, out, lsh); });
    calls.emplace_back("shared_qk_attention_into" + mode,
                       [&, lsh] { randattn::shared_qk_attention_into(q, v, out, lsh); });
    calls.emplace_back("lsf_attention_into" + mode,
                       [&, lsf] { randattn::lsf_attention_into(filters, q, k, v, out, lsf); });
    // Sparse + low-rank: each kind of support and remainder, the LSH support alone both with its
    // sets (sampled remainder) and without them (the feature correction runs chunk by chunk).
    using randattn::SupportSpec;
    using randattn::WindowSupport;
    const randattn::FeatureRemainder<PositiveFeatures<S>> positive_rest{positive, {}};
    const randattn::SampledRemainder sampled{16, false, 32};
    randattn::SparseLowRankOptions slr;
    slr.causal = causal;
    slr.seed = 309;
    randattn::SparseLowRankOptions slr_centred = slr;
    slr_centred.centre_keys = true;
    randattn::SparseLowRankOptions slr_self = slr;
    slr_self.exclude_self = true;
    SupportSpec<S> window, lsh_support, lsh_buckets, lsh_window, lsf_support, window_blocks;
    window.window = WindowSupport{16, 2};
    lsh_support.lsh = &hash;
    lsh_support.lsh_options = lsh;
    lsh_buckets = lsh_support;
    lsh_buckets.lsh_options.exact_buckets = true;
    lsh_window = lsh_support;
    lsh_window.window = window.window;
    lsf_support.lsf = &filters;
    lsf_support.lsf_options = lsf;
    window_blocks.window = WindowSupport{8, 0};
    window_blocks.blocks = randattn::BlockSupport{32, 1};
    const auto add_sparse_lowrank = [&](const std::string& what, const SupportSpec<S>& support,
                                        const auto& remainder,
                                        const randattn::SparseLowRankOptions& opt) {
      calls.emplace_back("sparse_lowrank_attention_into, " + what + mode,
                         [&, support, remainder, opt] {
                           randattn::SparseLowRankStats stats;
                           randattn::sparse_lowrank_attention_into<S>(q, k, v, support, out,
                                                                      remainder, opt, &stats);
                         });
    };
    add_sparse_lowrank("window + positive features", window, positive_rest, slr);
    add_sparse_lowrank("window + positive features, exclude_self", window, positive_rest, slr_self);
    add_sparse_lowrank("lsh + sampled", lsh_support, sampled, slr);
    add_sparse_lowrank("lsh + positive features", lsh_support, positive_rest, slr);
    add_sparse_lowrank("lsh + no remainder, centred keys", lsh_support, randattn::NoRemainder{},
                       slr_centred);
    add_sparse_lowrank("lsh buckets + positive features", lsh_buckets, positive_rest, slr);
    add_sparse_lowrank("lsf + sampled, centred keys", lsf_support, sampled, slr_centred);
    add_sparse_lowrank("window, blocks + sampled", window_blocks, sampled, slr);
    add_sparse_lowrank("lsh, window + positive features", lsh_window, positive_rest, slr);
  }
  for (const auto& [name, call] : calls) {
    INFO(name);
    call();
    testing::start_counting_allocations();
    call();
    CHECK(testing::stop_counting_allocations() == 0);
  }
  // Sparse-score attention's sketch keeps its shape, its stream list and the ordered partial sums
  // of its two passes (one double per 2^15 scores) in small vectors of its own; its scaled
  // queries, score tiles, kept entries and [num | den] come from the pools.
  for (const bool causal : {false, true}) {
    INFO("sparse_score_attention_into, causal " << causal);
    randattn::SparseScoreOptions sparse;
    sparse.causal = causal;
    sparse.budget = 4000;
    sparse.seed = 308;
    randattn::sparse_score_attention_into(q, k, v, out, sparse);
    testing::start_counting_allocations();
    randattn::sparse_score_attention_into(q, k, v, out, sparse);
    CHECK(testing::stop_counting_allocations() <= 8);
    CHECK(testing::counted_bytes() < 1024);
  }
}
