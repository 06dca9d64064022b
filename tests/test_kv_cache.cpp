// Decoding over a key/value cache (decode/kv_cache.hpp): exact mode against exact attention,
// retrieval modes that retrieve everything against exact decoding, SimHash inclusion
// probabilities against Monte Carlo collision rates, append/save/load bit identity,
// grouped-query heads, argument checks, and keys and values stored as float32, float64,
// bfloat16, float16 and int8. Concurrent attends and thread-count independence of the clusters
// are in test_threads.cpp.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>


#include <catch2/catch.hpp>

#include <randattn/decode/kv_cache.hpp>

#include <Eigen/QR>

#include "kv_cache_support.hpp"
#include "support.hpp"

using randattn::DecodeMode;
using randattn::Index;
using randattn::RowMatrix;
using randattn::DecodeReport;
using randattn::KvCache;
using randattn::KvCacheOptions;
using randattn::KvStorage;
using testing::bit_identical;
using testing::clusters_options;
using testing::drifting_tokens;
using testing::filled;
using testing::needle_queries;
using testing::Tokens;

namespace {

template <typename Scalar>
double rel_diff(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  return (a.template cast<double>() - b.template cast<double>()).norm() /
         std::max(1e-300, b.template cast<double>().norm());
}

// The keys of the `top` pages of P consecutive keys with the highest box bound on q·k, the boxes
// taken in the basis of axes' columns (ties by page index); checks that every key's score is
// below its page's bound.
std::set<std::int32_t> top_page_keys(const RowMatrix<double>& q, const RowMatrix<double>& k, Index P,
                                     int top, const RowMatrix<double>& axes) {
  const RowMatrix<double> qa = q * axes;
  std::vector<std::pair<double, Index>> bounds;
  for (Index p = 0; p < k.rows() / P; ++p) {
    const RowMatrix<double> keys = k.middleRows(p * P, P), ka = keys * axes;
    double b = 0;
    for (Index c = 0; c < k.cols(); ++c)
      b += std::max(qa(0, c) * ka.col(c).minCoeff(), qa(0, c) * ka.col(c).maxCoeff());
    CHECK((keys * q.row(0).transpose()).maxCoeff() <= b + 1e-12);
    bounds.push_back({-b, p});
  }
  std::sort(bounds.begin(), bounds.end());
  std::set<std::int32_t> keys;
  for (int t = 0; t < top; ++t)
    for (Index j = 0; j < P; ++j) keys.insert(std::int32_t(bounds[std::size_t(t)].second * P + j));
  return keys;
}

std::string temp_path(const std::string& name) {
  return "/tmp/randattn_test_kv_cache_" + std::to_string(::getpid()) + "_" + name;
}

}  // namespace

TEMPLATE_TEST_CASE("KvCache exact mode equals exact_attention of the same rows", "[kv_cache]",
                   RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const Index d = 24, dv = 10, kvh = 2, qh = 6, n = 700;
  const Tokens<S> tok(11, n, kvh, d, dv);
  KvCacheOptions opt;
  opt.block_size = 128;
  const auto cache = filled(tok, opt);
  REQUIRE(cache.size() == n);
  const RowMatrix<S> q = needle_queries(tok, qh, 5, 4.0);
  DecodeReport rep;
  const RowMatrix<S> out = cache.attend(q, &rep);
  CHECK(rep.exact_keys == qh * n);
  CHECK(rep.retrieved_keys == 0);
  const Index group = qh / kvh;
  randattn::ExactOptions eo;
  eo.block_size = 128;
  for (Index h = 0; h < kvh; ++h) {
    const RowMatrix<S> ref = randattn::exact_attention(q.middleRows(h * group, group),
                                                       tok.head_keys(h), tok.head_values(h), eo);
    const RowMatrix<S> got = out.middleRows(h * group, group);
    CHECK(rel_diff(got, ref) <= (std::is_same<S, float>::value ? 1e-6 : 1e-14));
  }
}

TEMPLATE_TEST_CASE("KvCache retrieval of every key equals exact decoding", "[kv_cache]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const double tol = std::is_same<S, float>::value ? 1e-5 : 1e-12;
  const Index d = 32, dv = 16, kvh = 2, qh = 8, n = 1000;
  const Tokens<S> tok(21, n, kvh, d, dv);
  const RowMatrix<S> q = needle_queries(tok, qh, 7, 6.0);
  const RowMatrix<S> exact = filled(tok, KvCacheOptions{}).attend(q);

  for (const auto& [sinks, window] : {std::pair<Index, Index>{0, 0}, {4, 64}, {3, 997}}) {
    KvCacheOptions blocks;
    blocks.mode = DecodeMode::blocks;
    blocks.sinks = sinks;
    blocks.window = window;
    blocks.page_size = 16;
    blocks.top_pages = n / 16 + 1;  // every page
    DecodeReport rep;
    rep.record_keys = true;
    CHECK(rel_diff(filled(tok, blocks).attend(q, &rep), exact) <= tol);
    CHECK(rep.keys_scored() == qh * n);  // sinks and window never counted twice
    for (const auto& keys : rep.scored_keys) {
      CHECK(Index(std::set<std::int32_t>(keys.begin(), keys.end()).size()) == n);
    }

    KvCacheOptions lsh;
    lsh.mode = DecodeMode::lsh_sample;
    lsh.sinks = sinks;
    lsh.window = window;
    lsh.lsh_bits = 0;  // every key collides in every table: p = 1
    lsh.lsh_tables = 2;
    CHECK(rel_diff(filled(tok, lsh).attend(q, &rep), exact) <= tol);
    CHECK(rep.keys_scored() == qh * n);
    for (const auto& keys : rep.scored_keys) {
      CHECK(Index(std::set<std::int32_t>(keys.begin(), keys.end()).size()) == n);
      CHECK(Index(keys.size()) == n);
    }
  }
}

TEST_CASE("KvCache blocks attends to the pages with the highest bound", "[kv_cache]") {
  const Index d = 16, dv = 8, n = 640, P = 32;
  const Tokens<double> tok(31, n, 1, d, dv);
  KvCacheOptions opt;
  opt.mode = DecodeMode::blocks;
  opt.sinks = 0;
  opt.window = 0;
  opt.page_size = P;
  opt.top_pages = 3;
  const auto cache = filled(tok, opt);
  const RowMatrix<double> q = needle_queries(tok, 1, 3, 5.0);
  DecodeReport rep;
  rep.record_keys = true;
  const RowMatrix<double> out = cache.attend(q, &rep);
  CHECK(rep.pages_opened == 3);
  CHECK(rep.pages_scored == n / P);
  // The bounds by hand (the identity basis multiplies exactly); every key's score is below its
  // page's bound.
  const std::set<std::int32_t> expected = top_page_keys(q, tok.k, P, 3, RowMatrix<double>::Identity(d, d));
  CHECK(std::set<std::int32_t>(rep.scored_keys[0].begin(), rep.scored_keys[0].end()) == expected);
  // Output: softmax over exactly those keys.
  std::map<Index, int> targets;
  for (auto j : expected) targets[j] = 1;
  const Eigen::RowVectorXd ref = testing::softmax_over_targets(
      q, 0, tok.k, tok.v, targets, 1.0 / std::sqrt(double(d)));
  CHECK((out.row(0) - ref).norm() <= 1e-12 * ref.norm());

  // Centring lowers every bound of a query by the same amount: same pages.
  KvCacheOptions centred = opt;
  centred.centre_tokens = 50;
  DecodeReport rep2;
  rep2.record_keys = true;
  const RowMatrix<double> out2 = filled(tok, centred).attend(q, &rep2);
  CHECK(rep2.scored_keys == rep.scored_keys);
  CHECK((out2 - out).norm() <= 1e-12 * out.norm());
}

TEST_CASE("Principal axes: orthonormal eigenvectors of the covariance, by decreasing variance",
          "[kv_cache]") {
  const Index d = 6, n = 400;
  // Rows stretched along the axes of a random rotation, with decreasing spreads.
  const RowMatrix<double> z = testing::gaussian<double>(5, n, d, 1.0);
  const Eigen::HouseholderQR<Eigen::MatrixXd> qr(testing::gaussian<double>(6, d, d, 1.0));
  const Eigen::MatrixXd rotation = qr.householderQ();
  Eigen::VectorXd spread(d);
  spread << 9, 5, 3, 2, 1, 0.5;
  RowMatrix<double> rows = (z * spread.asDiagonal()) * rotation.transpose();
  rows.rowwise() += testing::gaussian<double>(7, 1, d, 4.0).row(0);
  const auto at = [&](Index j) { return rows.row(j).data(); };
  const RowMatrix<double> axes = randattn::detail::principal_axes<double>(n, d, at);
  CHECK((axes.transpose() * axes - Eigen::MatrixXd::Identity(d, d)).norm() <= 1e-12);
  const RowMatrix<double> centred = rows.rowwise() - rows.colwise().mean();
  const Eigen::MatrixXd cov = centred.transpose() * centred;
  for (Index a = 0; a < d; ++a) {
    const Eigen::VectorXd v = axes.col(a);
    const double lambda = v.dot(cov * v);
    CHECK((cov * v - lambda * v).norm() <= 1e-9 * cov.norm());
    if (a > 0) CHECK(lambda < axes.col(a - 1).dot(cov * axes.col(a - 1)));
    Index top;
    v.cwiseAbs().maxCoeff(&top);
    CHECK(v(top) > 0);
    // Well separated spreads: the axis is the rotation's column, up to sign.
    CHECK(std::abs(std::abs(v.dot(rotation.col(a))) - 1) <= 0.05);
  }
  // Too few rows, or a non-finite row: the identity.
  CHECK(randattn::detail::principal_axes<double>(1, d, at) == RowMatrix<double>::Identity(d, d));
  rows(3, 2) = std::numeric_limits<double>::quiet_NaN();
  CHECK(randattn::detail::principal_axes<double>(n, d, at) == RowMatrix<double>::Identity(d, d));
}

TEST_CASE("KvCache blocks with page_axes bounds the pages in the principal axes", "[kv_cache]") {
  const Index d = 16, dv = 8, n = 640, P = 32, axes_tokens = 100;
  const Tokens<double> tok(31, n, 1, d, dv);
  KvCacheOptions opt;
  opt.mode = DecodeMode::blocks;
  opt.sinks = 0;
  opt.window = 0;
  opt.page_size = P;
  opt.top_pages = 3;
  opt.page_axes = axes_tokens;
  const auto cache = filled(tok, opt);
  const RowMatrix<double> q = needle_queries(tok, 1, 3, 5.0);
  DecodeReport rep;
  rep.record_keys = true;
  const RowMatrix<double> out = cache.attend(q, &rep);
  CHECK(rep.pages_opened == 3);
  // The bounds by hand in the axes of the first keys; every key's score is below its page's.
  const RowMatrix<double> axes = randattn::detail::principal_axes<double>(
      axes_tokens, d, [&](Index j) { return tok.k.row(j).data(); });
  CHECK(std::set<std::int32_t>(rep.scored_keys[0].begin(), rep.scored_keys[0].end()) ==
        top_page_keys(q, tok.k, P, 3, axes));

  // Before the axes are fixed the pages are bounded in the keys' own coordinates.
  KvCacheOptions raw = opt;
  raw.page_axes = 0;
  KvCache<double> early(d, dv, 1, opt), plain(d, dv, 1, raw);
  early.append(tok.keys(0, axes_tokens - 1), tok.values(0, axes_tokens - 1));
  plain.append(tok.keys(0, axes_tokens - 1), tok.values(0, axes_tokens - 1));
  CHECK(bit_identical<double>(early.attend(q), plain.attend(q)));
  CHECK_THROWS_AS((KvCache<double>(d, dv, 1, [&] {
                    KvCacheOptions bad = opt;
                    bad.page_axes = -1;
                    return bad;
                  }())),
                  std::invalid_argument);
}

TEST_CASE("SimHash sample probability is P[Binomial(L, c) >= 2]", "[kv_cache]") {
  for (const double cos : {-0.9, -0.2, 0.0, 0.3, 0.7, 0.95, 1.0}) {
    for (const int K : {0, 1, 4, 10}) {
      for (const int L : {2, 3, 8, 64, 200}) {
        const double c = randattn::simhash_collision_probability(cos, K);
        CHECK(c == Approx(std::pow(1.0 - std::acos(cos) / M_PI, K)).epsilon(1e-14));
        // Direct binomial sum in long double.
        long double p = 0, term = std::pow(1.0L - c, L);
        for (int i = 0; i <= L; ++i) {
          if (i >= 2) p += term;
          term *= (long double)(L - i) / (i + 1) * c / (1.0L - c);
        }
        if (c >= 1) p = 1;
        const double got = randattn::simhash_sample_probability(cos, K, L);
        CHECK(got == Approx(double(p)).epsilon(1e-9).margin(1e-300));
      }
    }
  }
  // Tiny probabilities keep their relative accuracy: C(L,2) c^2 leading term.
  const double c = randattn::simhash_collision_probability(-0.99, 16);
  CHECK(randattn::simhash_sample_probability(-0.99, 16, 10) ==
        Approx(45 * c * c * std::pow(1 - c, 8)).epsilon(1e-6));
  CHECK(randattn::simhash_sample_probability(0.5, 4, 1) == 0.0);
}

TEST_CASE("KvCache lsh_sample inclusion probability matches the collision rate over seeds",
          "[kv_cache]") {
  // Keys at known cosines to one query; for each hash seed, record which keys were sampled.
  // Each key's inclusion over seeds is Bernoulli(p); the check is |rate − p| ≤ 4σ with
  // σ = sqrt(p(1 − p)/M) (a two-sided 4σ band: ~6e-5 chance per key for a correct p).
  const Index d = 16, dv = 2;
  const int K = 3, L = 5, M = 3000;
  const std::vector<double> cosines = {0.95, 0.8, 0.5, 0.2, 0.0, -0.4};
  const RowMatrix<double> g = testing::gaussian<double>(41, Index(cosines.size()) + 1, d);
  Eigen::RowVectorXd qhat = g.row(0).normalized();
  RowMatrix<double> keys(Index(cosines.size()), d);
  for (Index i = 0; i < keys.rows(); ++i) {
    Eigen::RowVectorXd u = g.row(i + 1) - g.row(i + 1).dot(qhat) * qhat;
    u.normalize();
    keys.row(i) = (2.0 + i) * (cosines[i] * qhat + std::sqrt(1 - cosines[i] * cosines[i]) * u);
  }
  const RowMatrix<double> values = RowMatrix<double>::Zero(keys.rows(), dv);
  RowMatrix<double> q(1, d);
  q.row(0) = 1.7 * qhat;
  std::vector<int> hits(cosines.size(), 0);
  for (int seed = 0; seed < M; ++seed) {
    KvCacheOptions opt;
    opt.mode = DecodeMode::lsh_sample;
    opt.sinks = 0;
    opt.window = 0;
    opt.lsh_bits = K;
    opt.lsh_tables = L;
    opt.seed = 1000 + seed;
    opt.lsh_hash_block = 1;  // every key hashed as it comes (no open block)
    KvCache<double> cache(d, dv, 1, opt);
    cache.append(keys, values);
    DecodeReport rep;
    rep.record_keys = true;
    cache.attend(q, &rep);
    for (const auto j : rep.scored_keys[0]) ++hits[j];
  }
  for (std::size_t i = 0; i < cosines.size(); ++i) {
    const double p = randattn::simhash_sample_probability(cosines[i], K, L);
    const double rate = double(hits[i]) / M;
    const double sigma = std::sqrt(p * (1 - p) / M);
    INFO("cos " << cosines[i] << ": p " << p << ", rate " << rate << ", sigma " << sigma);
    CHECK(std::abs(rate - p) <= 4 * sigma + 1e-12);
  }
}

TEST_CASE("KvCache lsh_sample weights sampled keys by 1/p and merges the exact part",
          "[kv_cache]") {
  const Index d = 24, dv = 6, n = 900;
  const Tokens<double> tok(51, n, 1, d, dv);
  KvCacheOptions opt;
  opt.mode = DecodeMode::lsh_sample;
  opt.sinks = 3;
  opt.window = 40;
  opt.lsh_bits = 4;
  opt.lsh_tables = 6;
  opt.centre_tokens = 100;
  const auto cache = filled(tok, opt);
  const RowMatrix<double> q = needle_queries(tok, 2, 9, 5.0);
  DecodeReport rep;
  rep.record_keys = true;
  const RowMatrix<double> out = cache.attend(q, &rep);
  const double scale = 1.0 / std::sqrt(double(d));
  const Eigen::RowVectorXd centre = tok.k.topRows(100).colwise().mean();
  REQUIRE((cache.key_centre(0).transpose() - centre).norm() <= 1e-12);
  for (Index i = 0; i < 2; ++i) {
    double top = -INFINITY;
    std::vector<std::pair<Index, double>> logits;
    for (const auto j : rep.scored_keys[i]) {
      double s = scale * q.row(i).dot(tok.k.row(j));
      if (j >= opt.sinks && j < n - opt.window) {
        const Eigen::RowVectorXd kc = tok.k.row(j) - centre;
        const double cos = q.row(i).dot(kc) / (q.row(i).norm() * kc.norm());
        s -= std::log(randattn::simhash_sample_probability(cos, opt.lsh_bits, opt.lsh_tables));
      }
      logits.push_back({j, s});
      top = std::max(top, s);
    }
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(dv);
    double den = 0;
    for (const auto& [j, s] : logits) {
      num += std::exp(s - top) * tok.v.row(j);
      den += std::exp(s - top);
    }
    CHECK((out.row(i) - num / den).norm() <= 1e-12 * (num / den).norm());
  }
  CHECK(rep.exact_keys == 2 * (3 + 40));
  CHECK(rep.tables_probed == 2 * 6);
}

TEST_CASE("KvCache lsh_sample hashes whole blocks and attends the open block exactly",
          "[kv_cache]") {
  // Blocks of B = 64 tokens aligned to positions: after 300 tokens [0, 256) are hashed and the
  // open block [256, 300) joins the exact tail, so it is scored once per query head (not
  // sampled) and the result is the one of a cache hashing every key whose window starts at 256.
  const Index d = 24, dv = 6, kvh = 2, qh = 4, n = 300;
  const Tokens<double> tok(53, n + 40, kvh, d, dv);
  const RowMatrix<double> q = needle_queries(tok, qh, 5, 4.0);
  KvCacheOptions opt;
  opt.mode = DecodeMode::lsh_sample;
  opt.sinks = 2;
  opt.window = 10;
  opt.lsh_bits = 3;
  opt.lsh_tables = 8;
  REQUIRE(opt.lsh_hash_block == 64);
  KvCache<double> cache(d, dv, kvh, opt);
  cache.append(tok.keys(0, n), tok.values(0, n));
  CHECK(cache.hashed_tokens() == 256);
  KvCacheOptions every = opt;
  every.lsh_hash_block = 1;
  every.window = n - 256;
  KvCache<double> reference(d, dv, kvh, every);
  reference.append(tok.keys(0, n), tok.values(0, n));
  CHECK(reference.hashed_tokens() == n);
  DecodeReport rep, ref_rep;
  rep.record_keys = true;
  const RowMatrix<double> out = cache.attend(q, &rep);
  CHECK(rel_diff(out, reference.attend(q, &ref_rep)) <= 1e-12);
  CHECK(rep.exact_keys == qh * (2 + n - 256));
  CHECK(rep.retrieved_keys == ref_rep.retrieved_keys);
  CHECK(rep.keys_scored() == ref_rep.keys_scored());
  for (const auto& keys : rep.scored_keys) {
    CHECK(std::set<std::int32_t>(keys.begin(), keys.end()).size() == keys.size());  // no key twice
    for (Index j = 256; j < n; ++j) CHECK(std::count(keys.begin(), keys.end(), j) == 1);
  }
  // Filling the block hashes it: then only sinks and window are exact.
  cache.append(tok.keys(n, 20), tok.values(n, 20));
  CHECK(cache.hashed_tokens() == 320);
  cache.attend(q, &rep);
  CHECK(rep.exact_keys == qh * (2 + 10));

  // With centring by the first 100 keys nothing is hashed before the centre is fixed (every
  // key exact), then the whole blocks before it are.
  opt.centre_tokens = 100;
  KvCache<double> centred(d, dv, kvh, opt);
  centred.append(tok.keys(0, 90), tok.values(0, 90));
  CHECK(centred.hashed_tokens() == 0);
  centred.attend(q, &rep);
  CHECK(rep.retrieved_keys == 0);
  CHECK(rep.exact_keys == qh * 90);
  centred.append(tok.keys(90, 10), tok.values(90, 10));
  CHECK(centred.key_centre_fixed());
  CHECK(centred.hashed_tokens() == 64);
  centred.append(tok.keys(100, 40), tok.values(100, 40));
  CHECK(centred.hashed_tokens() == 128);
}

TEST_CASE("KvCache lsh_sample error falls as the number of tables grows", "[kv_cache]") {
  // Mean relative error over 6 hash seeds and 8 query heads; with more tables more keys reach
  // two collisions, so the importance-weighted estimate approaches exact decoding.
  const Index d = 32, dv = 16, kvh = 2, qh = 8, n = 3000;
  const Tokens<float> tok(61, n, kvh, d, dv);
  const RowMatrix<float> q = needle_queries(tok, qh, 4, 3.0);
  const RowMatrix<float> exact = filled(tok, KvCacheOptions{}).attend(q);
  std::vector<double> errors;
  for (const int L : {4, 16, 64}) {
    double err = 0;
    for (int seed = 0; seed < 6; ++seed) {
      KvCacheOptions opt;
      opt.mode = DecodeMode::lsh_sample;
      opt.sinks = 0;
      opt.window = 16;
      opt.lsh_bits = 6;
      opt.lsh_tables = L;
      opt.seed = 77 + seed;
      opt.centre_tokens = 64;
      err += rel_diff(filled(tok, opt).attend(q), exact) / 6;
    }
    errors.push_back(err);
  }
  INFO("mean relative error for L = 4, 16, 64: " << errors[0] << ", " << errors[1] << ", "
                                                 << errors[2]);
  CHECK(errors[1] < errors[0]);
  CHECK(errors[2] < errors[1]);
}

TEMPLATE_TEST_CASE("KvCache appending token by token equals one block, bit for bit",
                   "[kv_cache]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const Index d = 20, dv = 12, kvh = 2, qh = 4, n = 300;
  const Tokens<S> tok(71, n, kvh, d, dv);
  const RowMatrix<S> q = needle_queries(tok, qh, 8, 4.0);
  for (const DecodeMode mode : {DecodeMode::exact, DecodeMode::blocks, DecodeMode::lsh_sample,
                                DecodeMode::lsf, DecodeMode::clusters}) {
    for (const Index centre_tokens : {Index(0), Index(37)}) {
      KvCacheOptions opt;
      opt.mode = mode;
      opt.sinks = 2;
      opt.window = 20;
      opt.page_size = 8;
      opt.top_pages = 5;
      opt.lsh_bits = 5;
      opt.lsh_tables = 12;
      opt.lsf_filters = 16;
      opt.lsf_tables = 3;
      opt.clusters = 16;  // 278 candidates: splits and merges happen
      opt.probe = 2;
      opt.centre_tokens = centre_tokens;
      opt.page_axes = centre_tokens > 0 ? 45 : 0;  // fixed mid-page, mid-block
      const auto block = filled(tok, opt);
      KvCache<S> single(d, dv, kvh, opt), mixed(d, dv, kvh, opt);
      for (Index i = 0; i < n; ++i) single.append(tok.keys(i, 1), tok.values(i, 1));
      for (Index i0 = 0; i0 < n;) {
        const Index t = std::min<Index>(n - i0, 1 + (i0 % 23));
        mixed.append(tok.keys(i0, t), tok.values(i0, t));
        i0 += t;
      }
      INFO("mode " << randattn::to_string(mode) << ", centre_tokens " << centre_tokens);
      const RowMatrix<S> ref = block.attend(q);
      CHECK(bit_identical<S>(single.attend(q), ref));
      CHECK(bit_identical<S>(mixed.attend(q), ref));
    }
  }
}

TEST_CASE("Bucket lists keep every entry, in order, across chunks and pages", "[kv_cache]") {
  using randattn::detail::BucketLists;
  // 300 buckets filled unevenly (bucket b receives about b / 10 of every 30 pushes), plus one
  // bucket that outgrows several 2^21-int pages on its own and a reserve in between.
  const std::size_t lists = 301, big = 300;
  BucketLists buckets(lists);
  std::vector<std::vector<std::int32_t>> expected(lists);
  std::uint64_t state = 12345;
  const auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return std::uint32_t(state >> 33);
  };
  const auto push = [&](std::size_t list, std::int32_t value) {
    buckets.push_back(list, value);
    expected[list].push_back(value);
  };
  for (std::int32_t i = 0; i < 200000; ++i) {
    const std::size_t b = next() % 300;
    if (next() % 300 < b) push(b, i);
    if (i == 100000) buckets.reserve(50000);
  }
  for (std::int32_t i = 0; i < 5000000; ++i) push(big, i);
  const auto contents = [&](const BucketLists& from, std::size_t list) {
    std::vector<BucketLists::Run> runs;
    std::vector<BucketLists::Cursor> walking;
    from.collect_runs(1, [&](Index) { return list; }, runs, walking);
    std::vector<std::int32_t> all;
    for (const auto& r : runs) all.insert(all.end(), r.entries, r.entries + r.count);
    return all;
  };
  const BucketLists copy = buckets;
  for (std::size_t b = 0; b < lists; ++b) {
    INFO("bucket " << b);
    REQUIRE(buckets.size(b) == Index(expected[b].size()));
    CHECK(contents(buckets, b) == expected[b]);
    CHECK(contents(copy, b) == expected[b]);
  }
  CHECK(expected[0].empty());
  // Several buckets walked side by side: the runs of each stay in order, none is lost.
  std::vector<BucketLists::Run> runs;
  std::vector<BucketLists::Cursor> walking;
  const std::vector<std::size_t> some = {0, 7, 150, 299, big, 299};
  buckets.collect_runs(Index(some.size()), [&](Index i) { return some[std::size_t(i)]; }, runs,
                       walking);
  std::multiset<std::int32_t> got, want;
  for (const auto& r : runs) {
    CHECK(std::is_sorted(r.entries, r.entries + r.count));
    got.insert(r.entries, r.entries + r.count);
  }
  for (const std::size_t b : some) want.insert(expected[b].begin(), expected[b].end());
  CHECK(got == want);
}

TEMPLATE_TEST_CASE("KvCache save/load round trip is bit-identical", "[kv_cache]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const Index d = 16, dv = 8, kvh = 2, qh = 6, n = 250;
  const Tokens<S> tok(81, n, kvh, d, dv);
  const RowMatrix<S> q = needle_queries(tok, qh, 2, 4.0);
  const std::string path = temp_path("roundtrip.bin");
  for (const DecodeMode mode : {DecodeMode::exact, DecodeMode::blocks, DecodeMode::lsh_sample,
                                DecodeMode::lsf, DecodeMode::clusters}) {
    KvCacheOptions opt;
    opt.mode = mode;
    opt.clusters = 8;
    opt.probe = 2;
    opt.sinks = 1;
    opt.window = 10;
    opt.page_size = 4;
    opt.top_pages = 7;
    opt.lsh_bits = 4;
    opt.lsh_tables = 9;
    opt.lsf_filters = 12;
    opt.lsf_tables = 2;
    opt.lsf_threshold = 0.4;
    opt.lsf_min_probes = 2;
    opt.seed = 5;
    opt.scale = 0.3;
    opt.key_centre = testing::gaussian<double>(3, kvh, d, 0.5);
    opt.page_axes = 30;
    const auto cache = filled(tok, opt);
    cache.save(path);
    const auto loaded = KvCache<S>::load(path);
    INFO("mode " << randattn::to_string(mode));
    CHECK(loaded.size() == n);
    CHECK(loaded.options().mode == mode);
    CHECK(loaded.scale() == cache.scale());
    for (Index h = 0; h < kvh; ++h) {
      CHECK(bit_identical<S>(RowMatrix<S>(loaded.keys(h)), RowMatrix<S>(cache.keys(h))));
      CHECK(bit_identical<S>(RowMatrix<S>(loaded.values(h)), RowMatrix<S>(cache.values(h))));
    }
    DecodeReport a, b;
    CHECK(bit_identical<S>(loaded.attend(q, &a), cache.attend(q, &b)));
    CHECK(a.keys_scored() == b.keys_scored());
    // The loaded cache keeps growing like the original.
    auto grown = KvCache<S>::load(path);
    auto twin = filled(tok, opt);
    const Tokens<S> more(82, 5, kvh, d, dv);
    grown.append(more.k, more.v);
    twin.append(more.k, more.v);
    CHECK(bit_identical<S>(grown.attend(q), twin.attend(q)));
  }
  std::remove(path.c_str());
}

TEST_CASE("KvCache load rejects corrupt, truncated and mismatched files", "[kv_cache]") {
  const Index d = 8, dv = 4, kvh = 1, n = 40;
  const Tokens<float> tok(91, n, kvh, d, dv);
  KvCacheOptions opt;
  opt.mode = DecodeMode::blocks;
  const auto cache = filled(tok, opt);
  const std::string path = temp_path("corrupt.bin"), bad = temp_path("bad.bin");
  cache.save(path);
  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto write = [&](const std::vector<char>& b) {
    std::ofstream out(bad, std::ios::binary | std::ios::trunc);
    out.write(b.data(), std::streamsize(b.size()));
  };
  const auto load_error = [&]() -> std::string {
    try {
      KvCache<float>::load(bad);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  // Truncations at every interesting length.
  for (const std::size_t keep : {std::size_t(0), std::size_t(5), std::size_t(8), std::size_t(40),
                                 bytes.size() / 2, bytes.size() - 9, bytes.size() - 1}) {
    write(std::vector<char>(bytes.begin(), bytes.begin() + std::ptrdiff_t(keep)));
    const std::string msg = load_error();
    INFO("kept " << keep << " bytes: " << msg);
    CHECK(!msg.empty());
  }
  // A flipped bit in the header, the payload and the checksum.
  for (const std::size_t at : {std::size_t(2), std::size_t(30), bytes.size() / 2, bytes.size() - 3}) {
    std::vector<char> b = bytes;
    b[at] ^= 0x10;
    write(b);
    const std::string msg = load_error();
    INFO("flipped byte " << at << ": " << msg);
    CHECK(!msg.empty());
  }
  {  // bad magic
    std::vector<char> b = bytes;
    b[0] = 'X';
    write(b);
    CHECK_THAT(load_error(), Catch::Contains("magic"));
  }
  {  // wrong scalar type
    CHECK_THROWS_WITH(KvCache<double>::load(path), Catch::Contains("32-bit"));
  }
  {  // trailing garbage
    std::vector<char> b = bytes;
    b.push_back(0);
    write(b);
    CHECK(!load_error().empty());
  }
  CHECK_THROWS_AS(KvCache<float>::load(temp_path("missing.bin")), std::invalid_argument);
  // The intact file still loads.
  CHECK(KvCache<float>::load(path).size() == n);
  std::remove(path.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("KvCache grouped-query heads equal repeated kv heads", "[kv_cache]") {
  const Index d = 16, dv = 8, kvh = 2, group = 3, n = 400;
  const Tokens<double> tok(111, n, kvh, d, dv);
  // The same keys with every kv head repeated `group` times.
  const Index rep_heads = kvh * group;
  RowMatrix<double> k(rep_heads * n, d), v(rep_heads * n, dv);
  for (Index h = 0; h < rep_heads; ++h) {
    k.middleRows(h * n, n) = tok.head_keys(h / group);
    v.middleRows(h * n, n) = tok.head_values(h / group);
  }
  const RowMatrix<double> q = needle_queries(tok, kvh * group, 12, 4.0);
  for (const DecodeMode mode : {DecodeMode::exact, DecodeMode::blocks}) {
    KvCacheOptions opt;
    opt.mode = mode;
    opt.page_size = 8;
    opt.top_pages = 6;
    opt.window = 16;
    const auto gqa = filled(tok, opt);
    KvCache<double> mha(d, dv, rep_heads, opt);
    mha.append(k, v);
    INFO("mode " << randattn::to_string(mode));
    CHECK(rel_diff(gqa.attend(q), mha.attend(q)) <= 1e-13);
  }
}

TEST_CASE("KvCache partial states of split caches merge into the whole", "[kv_cache]") {
  // Tokens [0, m) in one cache and [m, n) in another; the first holds the sinks, the second the
  // window, the split lies inside the retrieval range. Hyperplanes depend on (seed, kv head)
  // only, and the split is at a multiple of lsh_hash_block (64), so both halves hash the blocks
  // the whole cache hashes and sample what it samples: merged states equal attend up to the
  // rounding of one merge per row.
  const Index n = 300, m = 128, d = 16, dv = 8, kvh = 2, qh = 4;
  const Tokens<double> tok(41, n, kvh, d, dv);
  const RowMatrix<double> q = needle_queries(tok, qh, 42, 4.0);
  KvCacheOptions lsh;
  lsh.mode = DecodeMode::lsh_sample;
  lsh.sinks = 5;
  lsh.window = 40;
  lsh.lsh_bits = 4;
  lsh.lsh_tables = 16;
  lsh.seed = 3;
  for (const KvCacheOptions& opt : {KvCacheOptions{}, lsh}) {
    const auto whole = filled(tok, opt);
    KvCache<double> first(d, dv, kvh, opt), second(d, dv, kvh, opt);
    first.append(tok.keys(0, m), tok.values(0, m));
    second.append(tok.keys(m, n - m), tok.values(m, n - m));
    DecodeReport all, a, b;
    const RowMatrix<double> expected = whole.attend(q, &all);
    auto acc = first.attend_partial(q, opt.sinks, 0, &a);
    acc.merge(second.attend_partial(q, 0, opt.window, &b));
    INFO("mode " << randattn::to_string(opt.mode));
    CHECK(rel_diff(acc.finalize(), expected) <= 1e-13);
    CHECK(a.exact_keys + b.exact_keys == all.exact_keys);
    CHECK(a.retrieved_keys + b.retrieved_keys == all.retrieved_keys);
  }
  // An empty cache gives an empty state (attend refuses it).
  const KvCache<double> empty(d, dv, kvh, lsh);
  DecodeReport rep;
  const auto none = empty.attend_partial(q, 5, 40, &rep);
  CHECK(rep.empty_heads == qh);
  CHECK(none.log_scale().array().isInf().all());
  CHECK(none.numden().isZero(0));
}

TEST_CASE("KvCache rejects bad input and stays unchanged", "[kv_cache]") {
  const Index d = 8, dv = 4, kvh = 2, n = 30;
  const Tokens<float> tok(121, n, kvh, d, dv);
  KvCacheOptions opt;
  opt.mode = DecodeMode::blocks;
  opt.page_size = 4;
  opt.top_pages = 2;
  opt.window = 4;

  KvCache<float> empty(d, dv, kvh, opt);
  const RowMatrix<float> q = needle_queries(tok, 4, 1, 2.0);
  CHECK_THROWS_WITH(empty.attend(q), Catch::Contains("empty"));

  auto cache = filled(tok, opt);
  const RowMatrix<float> before = cache.attend(q);
  const auto unchanged = [&] {
    CHECK(cache.size() == n);
    CHECK(bit_identical<float>(cache.attend(q), before));
  };
  using Catch::Contains;
  CHECK_THROWS_WITH(cache.append(RowMatrix<float>::Zero(2, d + 1), RowMatrix<float>::Zero(2, dv)),
                    Contains("head_dim"));
  unchanged();
  CHECK_THROWS_WITH(cache.append(RowMatrix<float>::Zero(2, d), RowMatrix<float>::Zero(2, dv + 1)),
                    Contains("value_dim"));
  unchanged();
  CHECK_THROWS_WITH(cache.append(RowMatrix<float>::Zero(3, d), RowMatrix<float>::Zero(3, dv)),
                    Contains("kv_heads"));
  unchanged();
  CHECK_THROWS_WITH(cache.append(RowMatrix<float>::Zero(2, d), RowMatrix<float>::Zero(4, dv)),
                    Contains("same number of rows"));
  unchanged();
  RowMatrix<float> nan_k = RowMatrix<float>::Ones(4, d);
  nan_k(3, 2) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(cache.append(nan_k, RowMatrix<float>::Ones(4, dv)), Contains("k ("));
  unchanged();
  RowMatrix<float> inf_v = RowMatrix<float>::Ones(4, dv);
  inf_v(0, 0) = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(cache.append(RowMatrix<float>::Ones(4, d), inf_v), Contains("v ("));
  unchanged();

  CHECK_THROWS_WITH(cache.attend(RowMatrix<float>::Zero(3, d)), Contains("multiple of kv_heads"));
  CHECK_THROWS_WITH(cache.attend(RowMatrix<float>::Zero(0, d)), Contains("multiple of kv_heads"));
  CHECK_THROWS_WITH(cache.attend(RowMatrix<float>::Zero(4, d + 2)), Contains("head_dim"));
  RowMatrix<float> nan_q = q;
  nan_q(1, 1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(cache.attend(nan_q), Contains("q ("));
  unchanged();

  // Constructor arguments and options.
  CHECK_THROWS_WITH(KvCache<float>(0, dv, kvh), Contains("head_dim"));
  CHECK_THROWS_WITH(KvCache<float>(d, 0, kvh), Contains("value_dim"));
  CHECK_THROWS_WITH(KvCache<float>(d, dv, 0), Contains("kv_heads"));
  auto bad = [&](auto edit, const char* name) {
    KvCacheOptions o;
    edit(o);
    CHECK_THROWS_WITH(KvCache<float>(d, dv, kvh, o), Contains(name));
  };
  bad([](KvCacheOptions& o) { o.page_size = 0; }, "page_size");
  bad([](KvCacheOptions& o) { o.top_pages = -1; }, "top_pages");
  bad([](KvCacheOptions& o) { o.lsh_bits = 17; }, "lsh_bits");
  bad([](KvCacheOptions& o) { o.lsh_tables = 1; }, "lsh_tables");
  bad([](KvCacheOptions& o) { o.sinks = -1; }, "sinks");
  bad([](KvCacheOptions& o) { o.window = -2; }, "window");
  bad([](KvCacheOptions& o) { o.block_size = 1000; }, "block_size");
  bad([](KvCacheOptions& o) { o.scale = std::nan(""); }, "scale");
  bad([](KvCacheOptions& o) { o.key_centre = RowMatrix<double>::Zero(3, 8); }, "key_centre");
  bad([](KvCacheOptions& o) { o.mode = DecodeMode(9); }, "mode");
  bad([](KvCacheOptions& o) { o.lsf_filters = 1; }, "lsf_filters");
  bad([](KvCacheOptions& o) { o.lsf_tables = 0; }, "lsf_tables");
  bad([](KvCacheOptions& o) { o.lsf_alpha = 1.5; }, "lsf_alpha");
  bad([](KvCacheOptions& o) { o.lsf_threshold = std::nan(""); }, "lsf_threshold");
  bad([](KvCacheOptions& o) { o.lsf_min_probes = -1; }, "lsf_min_probes");

  // Opting out of the finiteness check is allowed.
  KvCacheOptions lax = opt;
  lax.check_finite = false;
  KvCache<float> loose(d, dv, kvh, lax);
  CHECK_NOTHROW(loose.append(nan_k, RowMatrix<float>::Ones(4, dv)));
}

TEST_CASE("KvCache edge cases: one token, short caches, huge norms, empty retrieval",
          "[kv_cache]") {
  const Index d = 8, dv = 3;
  const Tokens<double> tok(131, 50, 1, d, dv);
  for (const DecodeMode mode : {DecodeMode::exact, DecodeMode::blocks, DecodeMode::lsh_sample,
                                DecodeMode::lsf}) {
    KvCacheOptions opt;
    opt.mode = mode;
    KvCache<double> cache(d, dv, 1, opt);
    cache.append(tok.keys(0, 1), tok.values(0, 1));
    const RowMatrix<double> q = testing::gaussian<double>(3, 2, d);
    const RowMatrix<double> out = cache.attend(q);  // one key: its value, whatever q
    CHECK((out.row(0) - tok.v.row(0)).norm() <= 1e-15);
    CHECK((out.row(1) - tok.v.row(0)).norm() <= 1e-15);
  }
  // Huge but finite logits are fine; an overflowing logit is an error, not Inf/NaN.
  KvCache<float> big(d, dv, 1, KvCacheOptions{});
  RowMatrix<float> k = tok.keys(0, 10).cast<float>() * 1e18f;
  big.append(k, tok.values(0, 10).cast<float>());
  RowMatrix<float> q = testing::gaussian<float>(4, 1, d) * 1e-16f;
  CHECK(big.attend(q).allFinite());
  q *= 1e37f;  // |q·k| ~ 1e39 > FLT_MAX
  CHECK_THROWS_WITH(big.attend(q), Catch::Contains("overflowed"));
  // Nothing exact and nothing retrieved: a zero row, reported.
  KvCacheOptions none;
  none.mode = DecodeMode::blocks;
  none.sinks = 0;
  none.window = 0;
  none.top_pages = 0;
  KvCache<double> c(d, dv, 1, none);
  c.append(tok.k, tok.v);
  DecodeReport rep;
  const RowMatrix<double> zero = c.attend(testing::gaussian<double>(5, 1, d), &rep);
  CHECK(zero.isZero(0));
  CHECK(rep.empty_heads == 1);
}

TEMPLATE_TEST_CASE("KvCache lsf: every filter open equals exact; probes follow the threshold",
                   "[kv_cache]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const double tol = std::is_same<S, float>::value ? 1e-5 : 1e-12;
  const Index d = 32, dv = 16, kvh = 2, qh = 8, n = 1200;
  const Tokens<S> tok(141, n, kvh, d, dv);
  const RowMatrix<S> q = needle_queries(tok, qh, 3, 6.0);
  const RowMatrix<S> exact = filled(tok, KvCacheOptions{}).attend(q);
  KvCacheOptions opt;
  opt.mode = DecodeMode::lsf;
  opt.sinks = 2;
  opt.window = 30;
  opt.lsf_filters = 24;
  opt.lsf_tables = 3;
  opt.lsf_threshold = -std::numeric_limits<double>::infinity();
  DecodeReport rep;
  rep.record_keys = true;
  CHECK(rel_diff(filled(tok, opt).attend(q, &rep), exact) <= tol);
  CHECK(rep.filters_opened == qh * 3 * 24);
  for (const auto& keys : rep.scored_keys) CHECK(Index(keys.size()) == n);  // each key once

  // A high threshold opens only the min_probes best filters of each table; the keys scored are
  // exactly those stored there (checked against the filter each key went to).
  opt.lsf_threshold = 50.0;
  opt.lsf_min_probes = 1;
  opt.centre_tokens = 0;
  const auto cache = filled(tok, opt);
  const RowMatrix<S> out = cache.attend(q, &rep);
  CHECK(rep.filters_opened == qh * 3);
  CHECK(out.allFinite());
  // The support found is a subset of the candidates, and it is attended exactly.
  for (Index i = 0; i < qh; ++i) {
    std::map<Index, int> targets;
    for (const auto j : rep.scored_keys[i]) targets[j] = 1;
    const Index h = i / (qh / kvh);
    const Eigen::MatrixXd keys = tok.head_keys(h).template cast<double>();
    const Eigen::MatrixXd values = tok.head_values(h).template cast<double>();
    const Eigen::MatrixXd qd = q.template cast<double>();
    const Eigen::RowVectorXd ref = testing::softmax_over_targets(
        qd, i, keys, values, targets, 1.0 / std::sqrt(double(d)));
    CHECK((out.row(i).template cast<double>() - ref).norm() <= 10 * tol * ref.norm());
  }
}

namespace {

// Every invariant of the clusters of kv head h: `clusters` of them, every candidate key
// [sinks, n − window) in exactly one but the newest ones of the open block (fewer than a
// block), members ascending, radius ≥ every member's distance.
template <typename S>
void check_clusters(const KvCache<S>& cache, Index h) {
  const auto& cl = cache.key_clusters(h);
  const KvCacheOptions& o = cache.options();
  const Index n = cache.size(), first = o.sinks, all = std::max(first, n - o.window);
  REQUIRE(cl.count() == o.clusters);
  REQUIRE(cl.keys() == all - first);
  REQUIRE(cl.file_block() == std::clamp<Index>(o.clusters / 16, 1, 64));
  REQUIRE(cl.unfiled() < cl.file_block());
  const Index last = all - cl.unfiled();
  std::vector<int> seen(std::size_t(n), 0);
  const auto keys = cache.keys(h);
  for (Index c = 0; c < cl.count(); ++c) {
    const auto& m = cl.members(c);
    CHECK(!m.empty());
    CHECK(std::is_sorted(m.begin(), m.end()));
    double far = 0;
    for (const std::int32_t j : m) {
      REQUIRE((j >= first && j < last));
      ++seen[std::size_t(j)];
      far = std::max(far, (keys.row(j).template cast<double>() -
                           cl.centroids().row(c).template cast<double>()).norm());
    }
    // The radius bounds the largest member distance (up to the rounding of the distances).
    CHECK(double(cl.radii()(c)) >= far * (1 - 1e-5));
  }
  for (Index j = 0; j < n; ++j) CHECK(seen[std::size_t(j)] == (j >= first && j < last ? 1 : 0));
}

}  // namespace

TEMPLATE_TEST_CASE("KvCache clusters: probe == clusters is exact decoding, bit for bit",
                   "[kv_cache]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const Index d = 16, dv = 8, kvh = 2, qh = 6, n = 700;
  const Tokens<S> tok(101, n, kvh, d, dv);
  const RowMatrix<S> q = needle_queries(tok, qh, 3, 5.0);
  const auto exact = filled(tok, KvCacheOptions{});
  const auto cache = filled(tok, clusters_options(12, 12));
  for (Index h = 0; h < kvh; ++h) check_clusters(cache, h);
  DecodeReport a, b;
  CHECK(bit_identical<S>(cache.attend(q, &a), exact.attend(q, &b)));
  CHECK(a.exact_keys == qh * n);
  CHECK(a.retrieved_keys == 0);
}

TEMPLATE_TEST_CASE("KvCache clusters: fewer candidates than clusters are scored exactly",
                   "[kv_cache]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const Index d = 16, dv = 8, kvh = 2, qh = 4, clusters = 40, sinks = 4, window = 32;
  const Tokens<S> tok(103, sinks + window + clusters, kvh, d, dv);
  KvCache<S> cache(d, dv, kvh, clusters_options(clusters, 3, sinks, window));
  KvCache<S> exact(d, dv, kvh, KvCacheOptions{});
  const RowMatrix<S> q = needle_queries(tok, qh, 4, 5.0);
  for (Index i = 0; i < tok.n; ++i) {
    cache.append(tok.keys(i, 1), tok.values(i, 1));
    exact.append(tok.keys(i, 1), tok.values(i, 1));
    const Index candidates = std::max<Index>(0, cache.size() - sinks - window);
    DecodeReport rep;
    const RowMatrix<S> out = cache.attend(q, &rep);
    if (candidates < clusters) {
      CHECK(cache.key_clusters(0).count() == 0);
      CHECK(bit_identical<S>(out, exact.attend(q)));
      CHECK(rep.retrieved_keys == 0);
      CHECK(rep.clusters_opened == 0);
    } else {
      CHECK(cache.key_clusters(0).count() == clusters);
      CHECK(rep.clusters_opened >= qh * 3);
    }
  }
}

TEST_CASE("KvCache clusters: bad options throw std::invalid_argument", "[kv_cache]") {
  for (const auto& [clusters, probe] :
       {std::pair<Index, Index>{0, 1}, {4, 0}, {4, 5}, {-1, -1}, {3, -2}}) {
    INFO("clusters " << clusters << ", probe " << probe);
    CHECK_THROWS_AS(KvCache<float>(8, 8, 1, clusters_options(clusters, probe)),
                    std::invalid_argument);
  }
  CHECK_NOTHROW(KvCache<float>(8, 8, 1, clusters_options(1, 1)));
  CHECK_NOTHROW(KvCache<float>(8, 8, 1, clusters_options(5, 5)));
  KvCacheOptions o = clusters_options(4, 2);
  o.cluster_margin = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH(KvCache<float>(8, 8, 1, o), Catch::Contains("cluster_margin must not be NaN"));
  o.cluster_margin = -std::numeric_limits<double>::infinity();
  CHECK_NOTHROW(KvCache<float>(8, 8, 1, o));
  for (const Index samples : {Index(-1), (Index(1) << 24) + 1}) {
    o.cluster_samples = samples;
    CHECK_THROWS_WITH(KvCache<float>(8, 8, 1, o), Catch::Contains("cluster_samples must be in"));
  }
}

TEST_CASE("KvCache clusters: the draws from closed clusters are unbiased in numerator and "
          "denominator",
          "[kv_cache][clusters][statistical]") {
  // margin −inf and probe 1: one cluster is opened per query head and `samples` keys drawn from
  // the others estimate their share. Given the clusters, the unnormalised sums Σ_j e^{l_j}·[v_j, 1]
  // over every key are estimated without bias, with the variance of importance sampling,
  // (1/S)·(Σ_j f_j²/p_j − F²) over the closed keys j, p_j = π_c/n_c. The seed moves the draws
  // (and the splits' seeds): the mean over R seeds has the mean of those variances over R.
  const Index d = 16, dv = 4, kvh = 1, qh = 2, n = 600, sinks = 4, window = 16, K = 16, S = 8;
  const int R = 300;
  const Tokens<float> tok(131, n, kvh, d, dv);
  const RowMatrix<float> q = testing::gaussian<float>(133, qh, d, 1.0);
  const Eigen::MatrixXd keys = tok.head_keys(0).cast<double>(), values = tok.head_values(0).cast<double>();
  const double scale = 1 / std::sqrt(double(d));
  Eigen::MatrixXd sum = Eigen::MatrixXd::Zero(qh, dv + 1), variance = sum, truth = sum;
  Eigen::VectorXd top(qh);
  for (Index i = 0; i < qh; ++i) {
    const Eigen::VectorXd l = scale * (keys * q.row(i).transpose().cast<double>());
    top(i) = l.maxCoeff();
    const Eigen::VectorXd w = (l.array() - top(i)).exp();
    truth.row(i) << (values.transpose() * w).transpose(), w.sum();
  }
  for (int seed = 0; seed < R; ++seed) {
    KvCacheOptions o = clusters_options(K, 1, sinks, window);
    o.seed = std::uint64_t(seed);
    o.cluster_margin = -std::numeric_limits<double>::infinity();
    o.cluster_samples = S;
    const auto cache = filled(tok, o);
    DecodeReport rep;
    const auto acc = cache.attend_partial(q, sinks, window, &rep);
    const auto& cl = cache.key_clusters(0);
    REQUIRE(cl.count() == K);
    CHECK(rep.clusters_opened == qh);
    Index retrieved = 0;  // the opened clusters' members and S draws per query head
    for (Index i = 0; i < qh; ++i) {
      // The estimate, on the scale of truth (shifted by the largest logit).
      const double shift = std::exp(double(acc.log_scale()(i)) - top(i));
      sum.row(i) += acc.numden().row(i).cast<double>() * shift;
      // The cluster opened (the highest bound) and the proposal over the others.
      const Eigen::VectorXd qd = q.row(i).transpose().cast<double>();
      const Eigen::VectorXd b = scale * (cl.centroids().cast<double>() * qd);
      Index opened = 0;
      for (Index c = 1; c < K; ++c)
        if (b(c) + scale * qd.norm() * cl.radii()(c) > b(opened) + scale * qd.norm() * cl.radii()(opened))
          opened = c;
      retrieved += Index(cl.members(opened).size()) + S;
      double total = 0;
      for (Index c = 0; c < K; ++c)
        if (c != opened) total += double(cl.members(c).size()) * std::exp(b(c) - top(i));
      Eigen::VectorXd f2_over_p = Eigen::VectorXd::Zero(dv + 1), f = f2_over_p;
      for (Index c = 0; c < K; ++c) {
        if (c == opened) continue;
        const double p = std::exp(b(c) - top(i)) / total;  // π_c / n_c
        for (const std::int32_t j : cl.members(c)) {
          const double w = std::exp(scale * keys.row(j).dot(qd) - top(i));
          Eigen::VectorXd fj(dv + 1);
          fj << w * values.row(j).transpose(), w;
          f += fj;
          f2_over_p += fj.cwiseAbs2() / p;
        }
      }
      variance.row(i) += ((f2_over_p - f.cwiseAbs2()) / double(S)).transpose();
    }
    CHECK(rep.retrieved_keys == retrieved);
  }
  for (Index i = 0; i < qh; ++i) {
    for (Index c = 0; c <= dv; ++c) {
      const double mean = sum(i, c) / R, sd = std::sqrt(variance(i, c)) / R;
      INFO("query head " << i << ", column " << c << ": mean " << mean << ", truth " << truth(i, c)
                         << ", sd of the mean " << sd);
      CHECK(sd > 0);
      CHECK(std::abs(mean - truth(i, c)) <= 4.5 * sd + 1e-5 * std::abs(truth(i, c)));
    }
  }
}

TEST_CASE("KvCache clusters: splits and merges keep the count and every key in one cluster",
          "[kv_cache]") {
  const Index d = 16, dv = 4, kvh = 2, n = 3000;
  const Tokens<float> tok = drifting_tokens(107, n, kvh, d, dv);
  // Token by token, checking the invariants as the clusters split and merge.
  KvCache<float> cache(d, dv, kvh, clusters_options(8, 2, 3, 20));
  for (Index i = 0; i < n; i += 50) {
    cache.append(tok.keys(i, 50), tok.values(i, 50));
    if (cache.size() - 23 >= 8) {
      for (Index h = 0; h < kvh; ++h) check_clusters(cache, h);
    }
  }
  CHECK(cache.key_clusters(0).splits() + cache.key_clusters(1).splits() > 0);
  // One cluster: never split, holds every candidate.
  const auto one = filled(tok, clusters_options(1, 1, 3, 20));
  for (Index h = 0; h < kvh; ++h) check_clusters(one, h);
}

TEST_CASE("KvCache clusters: keys filed in blocks; the open block is scored exactly",
          "[kv_cache]") {
  // 128 clusters file keys 8 at a time: at every size the invariants hold with fewer than 8
  // keys pending, those are among the keys scored, and appending token by token gives the
  // same clusters and bits as in blocks of 37.
  const Index d = 16, dv = 8, kvh = 2, qh = 4, n = 2500, sinks = 3, window = 20;
  const Tokens<float> tok = drifting_tokens(113, n, kvh, d, dv);
  const RowMatrix<float> q = needle_queries(tok, qh, 9, 5.0);
  KvCacheOptions o = clusters_options(128, 1, sinks, window);
  o.cluster_margin = -std::numeric_limits<double>::infinity();
  KvCache<float> one_by_one(d, dv, kvh, o), blocks(d, dv, kvh, o);
  REQUIRE(one_by_one.key_clusters(0).file_block() == 8);
  Index pending_seen = 0;
  for (Index i = 0; i < n; ++i) {
    one_by_one.append(tok.keys(i, 1), tok.values(i, 1));
    const auto& cl = one_by_one.key_clusters(0);
    if (cl.count() == 0 || i % 13 != 0) continue;
    for (Index h = 0; h < kvh; ++h) check_clusters(one_by_one, h);
    pending_seen += cl.unfiled() > 0;
    DecodeReport rep;
    rep.record_keys = true;
    one_by_one.attend(q, &rep);
    const Index size = one_by_one.size(), from = size - window - cl.unfiled();
    Index missing = 0;
    for (const auto& keys : rep.scored_keys)
      for (Index j = from; j < size; ++j) missing += !std::binary_search(keys.begin(), keys.end(), std::int32_t(j));
    CHECK(missing == 0);
  }
  CHECK(pending_seen > 0);
  CHECK(one_by_one.key_clusters(0).splits() > 0);
  for (Index i = 0; i < n; i += 37) {
    const Index t = std::min<Index>(37, n - i);
    blocks.append(tok.keys(i, t), tok.values(i, t));
  }
  CHECK(bit_identical<float>(blocks.attend(q), one_by_one.attend(q)));
  for (Index h = 0; h < kvh; ++h) {
    const auto &a = blocks.key_clusters(h), &b = one_by_one.key_clusters(h);
    CHECK(a.splits() == b.splits());
    CHECK(bit_identical<float>(RowMatrix<float>(a.centroids()), RowMatrix<float>(b.centroids())));
    for (Index c = 0; c < a.count(); ++c) CHECK(a.members(c) == b.members(c));
  }
}

TEST_CASE("KvCache clusters: every key left out is below the negligible margin", "[kv_cache]") {
  // Clustered keys and queries aimed at one key: the clusters far from the query stay closed;
  // every key not scored has a logit below (best logit scored − margin), the guarantee of the
  // bound, so the top-32 keys are all scored whenever they are within the margin of the best.
  const Index d = 32, dv = 8, kvh = 2, qh = 8, n = 4000, sinks = 4, window = 64;
  const Tokens<float> tok(109, n, kvh, d, dv);
  const RowMatrix<float> q = needle_queries(tok, qh, 5, 30.0);
  const auto cache = filled(tok, clusters_options(32, 2, sinks, window));
  DecodeReport rep;
  rep.record_keys = true;
  cache.attend(q, &rep);
  const double margin = 24 * std::log(2.0);
  const Index group = qh / kvh;
  Index left_out = 0;
  for (Index i = 0; i < qh; ++i) {
    const Index h = i / group;
    const Eigen::VectorXd logits =
        (cache.keys(h).template cast<double>() * q.row(i).transpose().template cast<double>()) *
        double(cache.scale());
    const auto& keys = rep.scored_keys[std::size_t(i)];
    double best = -1e300;
    for (const std::int32_t j : keys) best = std::max(best, logits(j));
    CHECK(best == Approx(logits.maxCoeff()).epsilon(1e-5));
    for (Index j = 0; j < n; ++j) {
      if (std::binary_search(keys.begin(), keys.end(), std::int32_t(j))) continue;
      ++left_out;
      // float logits of the cache against double ones here: 1e-4 of slack.
      CHECK(logits(j) < best - margin + 1e-4 * (1 + std::abs(best)));
    }
  }
  CHECK(rep.clusters_opened >= 2 * qh);
  CHECK(rep.clusters_opened < 32 * qh);  // the bound closes some clusters on this data
  CHECK(left_out > 0);
  CHECK(rep.keys_scored() + left_out == qh * n);
}

TEST_CASE("KvCache clusters: save/load keeps the clusters; truncated files are refused",
          "[kv_cache]") {
  const Index d = 16, dv = 8, kvh = 2, qh = 4, n = 3000;
  const Tokens<float> tok = drifting_tokens(107, n, kvh, d, dv);
  const RowMatrix<float> q = needle_queries(tok, qh, 8, 5.0);
  // A finite margin closes some clusters, and keys are drawn from them.
  KvCacheOptions o = clusters_options(8, 2, 3, 20);
  o.cluster_margin = 4;
  o.cluster_samples = 12;
  const auto cache = filled(tok, o);
  CHECK(cache.key_clusters(0).splits() > 0);
  const std::string path = temp_path("clusters.bin"), cut = temp_path("clusters_cut.bin");
  cache.save(path);
  const auto loaded = KvCache<float>::load(path);
  CHECK(loaded.options().clusters == 8);
  CHECK(loaded.options().probe == 2);
  CHECK(loaded.options().cluster_margin == 4);
  CHECK(loaded.options().cluster_samples == 12);
  DecodeReport a, b;
  CHECK(bit_identical<float>(loaded.attend(q, &a), cache.attend(q, &b)));
  CHECK(a.clusters_opened < 8 * qh);  // some clusters closed: keys were drawn
  CHECK(a.clusters_opened == b.clusters_opened);
  CHECK(a.retrieved_keys == b.retrieved_keys);
  for (Index h = 0; h < kvh; ++h) {
    CHECK(bit_identical<float>(RowMatrix<float>(loaded.key_clusters(h).centroids()),
                               RowMatrix<float>(cache.key_clusters(h).centroids())));
    for (Index c = 0; c < 8; ++c)
      CHECK(loaded.key_clusters(h).members(c) == cache.key_clusters(h).members(c));
  }
  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  for (const std::size_t keep : {std::size_t(20), std::size_t(130), bytes.size() - 9}) {
    {
      std::ofstream out(cut, std::ios::binary | std::ios::trunc);
      out.write(bytes.data(), std::streamsize(keep));
    }
    CHECK_THROWS_AS(KvCache<float>::load(cut), std::invalid_argument);
  }
  std::remove(path.c_str());
  std::remove(cut.c_str());
}

namespace {

// Entry (i, c) of `x` as storage type `s` holds it, computed here from the definitions: round to
// nearest even (bfloat16 and float16 through Eigen's conversions of the float nearest a float
// input; float32 of a double by the cast), or s·round(x / s) with s = max|row| / 127.
template <typename S>
RowMatrix<S> stored_reference(const RowMatrix<S>& x, KvStorage s) {
  RowMatrix<S> out(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    const S top = x.row(i).cwiseAbs().maxCoeff();
    for (Index c = 0; c < x.cols(); ++c) {
      const S v = x(i, c);
      switch (s) {
        case KvStorage::float32: out(i, c) = S(float(v)); break;
        case KvStorage::float64: out(i, c) = S(double(v)); break;
        case KvStorage::bfloat16: out(i, c) = S(float(Eigen::bfloat16(float(v)))); break;
        case KvStorage::float16: out(i, c) = S(float(Eigen::half(float(v)))); break;
        case KvStorage::int8: out(i, c) = top / 127 * std::nearbyint(v / (top / 127)); break;
      }
    }
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("KvCache storage types: rows as rounded, every mode reads them in place",
                   "[kv_cache]", RANDATTN_TEST_SCALARS) {
  using S = TestType;
  const double tol = std::is_same<S, float>::value ? 2e-6 : 1e-13;
  // Head and value widths that leave a remainder after whole packets (both kernels' tails).
  const Index d = 24, dv = 10, kvh = 2, qh = 4, n = 300;
  const Tokens<S> tok(141, n, kvh, d, dv);
  const RowMatrix<S> q = needle_queries(tok, qh, 3, 5.0);
  const std::string path = temp_path("storage.bin");
  for (const KvStorage storage : {KvStorage::float32, KvStorage::float64, KvStorage::bfloat16,
                                  KvStorage::float16, KvStorage::int8}) {
    INFO("storage " << randattn::to_string(storage));
    KvCacheOptions opt;
    opt.storage = storage;
    opt.block_size = 64;
    const auto cache = filled(tok, opt);
    CHECK(cache.storage() == storage);
    const std::size_t entry = storage == KvStorage::float64 ? 8
                              : storage == KvStorage::float32 ? 4
                              : storage == KvStorage::int8    ? 1
                                                              : 2;
    const std::size_t scales = storage == KvStorage::int8 ? 2 * sizeof(S) : 0;
    CHECK(cache.bytes_per_token() == std::size_t(kvh) * ((d + dv) * entry + scales));
    CHECK(cache.memory_bytes() == cache.storage_bytes() + cache.index_bytes());
    CHECK(cache.storage_bytes() >= std::size_t(n) * cache.bytes_per_token());

    // The stored rows are the rounded inputs (float16's range holds these entries; a double
    // rounded to bfloat16 or float16 in one step can differ from the float-first reference only
    // at a float-rounded tie, which these data do not hit: compared bit for bit).
    for (Index h = 0; h < kvh; ++h) {
      const RowMatrix<S> keys = cache.keys(h), values = cache.values(h);
      if (storage == KvStorage::int8) {
        // s·q can differ from the reference in the last bit (s = max/127 rounded once more).
        CHECK(rel_diff(keys, stored_reference<S>(tok.head_keys(h), storage)) <= tol);
        CHECK(rel_diff(values, stored_reference<S>(tok.head_values(h), storage)) <= tol);
      } else {
        CHECK(bit_identical<S>(keys, stored_reference<S>(tok.head_keys(h), storage)));
        CHECK(bit_identical<S>(values, stored_reference<S>(tok.head_values(h), storage)));
      }
    }

    // Exact decoding from the stored rows equals exact attention over them (rounding of the
    // accumulation only).
    DecodeReport rep;
    const RowMatrix<S> out = cache.attend(q, &rep);
    CHECK(rep.bytes_per_token == Index(cache.bytes_per_token()));
    randattn::ExactOptions eo;
    eo.block_size = 64;
    const Index group = qh / kvh;
    for (Index h = 0; h < kvh; ++h) {
      const RowMatrix<S> ref = randattn::exact_attention(q.middleRows(h * group, group),
                                                         cache.keys(h), cache.values(h), eo);
      CHECK(rel_diff<S>(out.middleRows(h * group, group), ref) <= 4 * tol);
    }

    // Every retrieval mode that retrieves every key reads the same rows (gathered and in runs).
    for (const DecodeMode mode : {DecodeMode::blocks, DecodeMode::lsh_sample, DecodeMode::lsf,
                                  DecodeMode::clusters}) {
      INFO("mode " << randattn::to_string(mode));
      KvCacheOptions all = opt;
      all.mode = mode;
      all.sinks = 2;
      all.window = 5;
      all.page_size = 8;
      all.top_pages = n;
      all.lsh_bits = 0;
      all.lsh_hash_block = 16;
      all.lsf_threshold = -std::numeric_limits<double>::infinity();
      all.clusters = 16;
      all.probe = 16;
      const auto retrieving = filled(tok, all);
      DecodeReport r;
      CHECK(rel_diff(retrieving.attend(q, &r), out) <= 4 * tol);
      CHECK(r.keys_scored() == qh * n);

      // Save/load keeps the stored rows and the index: bit-identical, and growing alike.
      all.probe = 3;
      all.lsf_threshold = 0.3;
      all.lsh_bits = 3;
      all.top_pages = 4;
      auto original = filled(tok, all);
      original.save(path);
      auto loaded = KvCache<S>::load(path);
      CHECK(loaded.storage() == storage);
      CHECK(bit_identical<S>(loaded.attend(q), original.attend(q)));
      const Tokens<S> more(142, 40, kvh, d, dv);
      loaded.append(more.k, more.v);
      original.append(more.k, more.v);
      CHECK(bit_identical<S>(loaded.attend(q), original.attend(q)));
    }
  }
  std::remove(path.c_str());
}

TEST_CASE("KvCache storage types: rounding of doubles, ranges, refused input", "[kv_cache]") {
  using Catch::Contains;
  // A double just above a bfloat16 midpoint rounds up; through float it would become the
  // midpoint and round to even (down).
  const double above = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  CHECK(float(randattn::detail::narrow<Eigen::bfloat16>(above)) == float(1.0 + std::ldexp(1.0, -7)));
  CHECK(float(randattn::detail::narrow<Eigen::half>(1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40))) ==
        float(1.0 + std::ldexp(1.0, -10)));
  CHECK(float(randattn::detail::narrow<Eigen::bfloat16>(1.0 + std::ldexp(1.0, -8))) == 1.0f);

  const Index d = 8, dv = 4, kvh = 1;
  const Tokens<float> tok(151, 20, kvh, d, dv);
  const RowMatrix<float> q = needle_queries(tok, 2, 1, 2.0);
  for (const bool check : {true, false}) {
    KvCacheOptions opt;
    opt.check_finite = check;
    opt.storage = KvStorage::int8;
    auto cache = filled(tok, opt);
    const RowMatrix<float> before = cache.attend(q);
    RowMatrix<float> nan_k = RowMatrix<float>::Ones(1, d);
    nan_k(0, 3) = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_WITH(cache.append(nan_k, RowMatrix<float>::Ones(1, dv)), Contains("int8"));
    RowMatrix<float> inf_v = RowMatrix<float>::Ones(1, dv);
    inf_v(0, 1) = -std::numeric_limits<float>::infinity();
    CHECK_THROWS_WITH(cache.append(RowMatrix<float>::Ones(1, d), inf_v), Contains("int8"));
    CHECK(cache.size() == 20);
    CHECK(bit_identical<float>(cache.attend(q), before));
  }
  // float16 holds at most 65504; a finite entry beyond it is refused, not stored as Inf.
  KvCacheOptions half;
  half.storage = KvStorage::float16;
  auto cache = filled(tok, half);
  RowMatrix<float> big = RowMatrix<float>::Ones(1, d);
  big(0, 0) = 65519.0f;  // rounds to 65504
  CHECK_NOTHROW(cache.append(big, RowMatrix<float>::Ones(1, dv)));
  big(0, 0) = 65520.0f;  // rounds to Inf
  CHECK_THROWS_WITH(cache.append(big, RowMatrix<float>::Ones(1, dv)), Contains("range"));
  CHECK(cache.size() == 21);
  // An all-zero int8 row has scale 0 and decodes to zeros.
  KvCacheOptions i8;
  i8.storage = KvStorage::int8;
  KvCache<float> zeros(d, dv, kvh, i8);
  zeros.append(RowMatrix<float>::Zero(1, d), RowMatrix<float>::Zero(1, dv));
  CHECK(zeros.keys(0).isZero(0));
  CHECK(zeros.attend(q).isZero(0));

  KvCacheOptions unknown;
  unknown.storage = KvStorage(7);
  CHECK_THROWS_WITH(KvCache<float>(d, dv, kvh, unknown), Contains("storage"));

  // A file with an unknown storage type or truncated rows is refused.
  const std::string path = temp_path("storage_bad.bin");
  KvCacheOptions bf;
  bf.storage = KvStorage::bfloat16;
  filled(tok, bf).save(path);
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  const auto rewrite = [&](std::vector<char> b) {
    // A fresh checksum, so that the reader gets past it to the field under test.
    b.resize(b.size() - 8);
    std::uint64_t h = randattn::detail::fnv1a(reinterpret_cast<const unsigned char*>(b.data()), b.size());
    for (int i = 0; i < 8; ++i) b.push_back(char((h >> (8 * i)) & 0xff));
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(b.data(), std::streamsize(b.size()));
  };
  // The storage field sits before the clusters' margin and samples and page_axes (8 bytes each)
  // and the rows: 20 tokens × (8 + 4) entries × 2 bytes.
  const std::size_t rows_at = bytes.size() - 8 - 20 * (d + dv) * 2;
  const std::size_t storage_at = rows_at - 24 - 4;
  std::vector<char> wrong = bytes;
  wrong[storage_at] = 9;
  rewrite(wrong);
  CHECK_THROWS_WITH(KvCache<float>::load(path), Contains("storage type 9"));
  std::vector<char> shorter(bytes.begin(), bytes.end() - 8 - 6);
  shorter.insert(shorter.end(), bytes.end() - 8, bytes.end());
  rewrite(shorter);
  CHECK_THROWS_WITH(KvCache<float>::load(path), Contains("truncated"));
  // A file of format version 5 (no page_axes) is still read.
  std::vector<char> v5(bytes.begin(), bytes.begin() + std::ptrdiff_t(rows_at - 8));
  v5.insert(v5.end(), bytes.begin() + std::ptrdiff_t(rows_at), bytes.end());
  CHECK(v5[8] == 6);
  v5[8] = 5;
  rewrite(v5);
  const auto old = KvCache<float>::load(path);
  CHECK(old.options().page_axes == 0);
  CHECK(old.size() == 20);
  CHECK(bit_identical<float>(RowMatrix<float>(old.keys(0)), RowMatrix<float>(filled(tok, bf).keys(0))));
  std::remove(path.c_str());
}
