// Sparse + low-rank attention: supports (LSH and LSF target sets, window, blocks, clusters,
// unions), the exact limit, the support method alone without remainder (bit for bit), Monte-Carlo
// unbiasedness of every remainder and of the cluster proposal, causality, thread-count
// independence, the block and cluster bounds, key centring and argument checks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <vector>

#include "gradient_check.hpp"
#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::BlockSupport;
using randattn::ClusterSupport;
using randattn::CrossPolytopeHash;
using randattn::FeatureRemainder;
using randattn::Index;
using randattn::LocalitySensitiveFilters;
using randattn::RotationKind;
using randattn::RowMatrix;
using randattn::SampledRemainder;
using randattn::SparseLowRankOptions;
using randattn::SparseLowRankStats;
using randattn::SupportSpec;
using randattn::TargetSets;
using randattn::WindowSupport;

namespace {

template <typename Scalar>
struct Problem {
  RowMatrix<Scalar> q, k, v;
  Problem(std::uint64_t seed, Index n, Index d, Index dv, double sd)
      : q(testing::gaussian<Scalar>(seed, n, d, sd)),
        k(testing::gaussian<Scalar>(seed + 1, n, d, sd)),
        v(testing::gaussian<Scalar>(seed + 2, n, dv)) {}
};

template <typename Scalar>
using Oprf = randattn::OptimalPositiveFeatures<Scalar, randattn::OrthogonalProjection<Scalar>>;

// Keys around `topics` centres (each key a random centre plus noise), queries along a random
// centre scaled by `beta`: peaked attention over clustered keys, as trained keys are.
template <typename Scalar>
Problem<Scalar> clustered_problem(std::uint64_t seed, Index n, Index d, Index dv, Index topics,
                                  double beta) {
  Problem<Scalar> p(seed, n, d, dv, 0.05);  // q and k: the noise
  const RowMatrix<Scalar> centres = testing::gaussian<Scalar>(seed + 7, topics, d, 1.0);
  const randattn::Philox rng(seed + 8);
  for (Index j = 0; j < n; ++j) {
    p.k.row(j) += centres.row(Index(rng.uniform(std::uint64_t(j), 0) * double(topics)));
    p.q.row(j) += Scalar(beta) * centres.row(Index(rng.uniform(std::uint64_t(j), 1) * double(topics)));
  }
  return p;
}

// The total Σ_{valid j} exp(scale q_i·k_j) [v_j | 1] in double, row i.
Eigen::RowVectorXd exact_numden(const RowMatrix<double>& q, const RowMatrix<double>& k,
                                const RowMatrix<double>& v, Index i, double scale, bool causal) {
  Eigen::RowVectorXd out = Eigen::RowVectorXd::Zero(v.cols() + 1);
  for (Index j = 0; j < (causal ? i + 1 : k.rows()); ++j) {
    const double w = std::exp(scale * q.row(i).dot(k.row(j)));
    out.head(v.cols()) += w * v.row(j);
    out(v.cols()) += w;
  }
  return out;
}

// The accumulator's rows as true [num | den] (times exp(log-scale)).
Eigen::MatrixXd true_numden(const randattn::SoftmaxAccumulator<double>& acc) {
  Eigen::MatrixXd out = acc.numden();
  for (Index i = 0; i < out.rows(); ++i)
    out.row(i) *= acc.log_scale()(i) == -INFINITY ? 0.0 : std::exp(acc.log_scale()(i));
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("sparse-lowrank: a support holding every key is exact attention",
                   "[sparse_lowrank]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Problem<Scalar> p(11, 40, 8, 3, 1.0);
  const bool causal = GENERATE(false, true);
  randattn::ExactOptions eopt;
  eopt.causal = causal;
  const RowMatrix<Scalar> exact = randattn::exact_attention(p.q, p.k, p.v, eopt);
  SparseLowRankOptions opt;
  opt.causal = causal;
  SECTION("window covering the sequence, every remainder") {
    SupportSpec<Scalar> s;
    s.window = WindowSupport{40, 0};
    const Oprf<Scalar> map(randattn::OrthogonalProjection<Scalar>(16, 8, 3), 2.0);
    SparseLowRankStats st;
    CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(p.q, p.k, p.v, s, {}, opt),
                             exact) < testing::tolerance<Scalar>());
    CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(
                                 p.q, p.k, p.v, s, FeatureRemainder<Oprf<Scalar>>{map, {}}, opt, &st),
                             exact) < testing::tolerance<Scalar>());
    CHECK(st.clamped_rows == 0);
    CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(
                                 p.q, p.k, p.v, s, SampledRemainder{8, false, 8}, opt, &st),
                             exact) < testing::tolerance<Scalar>());
    CHECK(st.samples == 0);
  }
  SECTION("lsh with one chunk, blocks with every block") {
    const CrossPolytopeHash<Scalar> hash(8, 4, 2, 5);
    SupportSpec<Scalar> s;
    s.lsh = &hash;
    s.lsh_options.chunk = 64;
    s.blocks = BlockSupport{8, 5};
    CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(p.q, p.k, p.v, s, {}, opt),
                             exact) < testing::tolerance<Scalar>());
  }
}

TEMPLATE_TEST_CASE("sparse-lowrank: exclude_self leaves the own key out of support and remainder",
                   "[sparse_lowrank][exclude_self]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Problem<Scalar> p(17, 40, 8, 3, 1.0);
  const RowMatrix<Scalar>& kq = p.q;  // K = Q
  const bool causal = GENERATE(false, true);
  randattn::ExactOptions eopt;
  eopt.causal = causal;
  eopt.exclude_self = true;
  const RowMatrix<Scalar> exact = randattn::exact_attention(p.q, kq, p.v, eopt);
  SparseLowRankOptions opt;
  opt.causal = causal;
  opt.exclude_self = true;
  const Oprf<Scalar> map(randattn::OrthogonalProjection<Scalar>(16, 8, 3), 2.0);
  const CrossPolytopeHash<Scalar> hash(8, 4, 1, 5);
  SupportSpec<Scalar> all, narrow, lsh;
  all.window = WindowSupport{40, 0};
  narrow.window = WindowSupport{2, 0};
  lsh.lsh = &hash;
  lsh.lsh_options.chunk = 4;
  SparseLowRankStats st;
  // Every key in the support: the exact part alone is the answer; the remainders add nothing.
  CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(p.q, kq, p.v, all, {}, opt, &st),
                           exact) < testing::tolerance<Scalar>());
  CHECK(st.pairs_scored == (causal ? 40 * 39 / 2 + 1 : 40 * 39));  // row 0 alone under causal
  CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(
                               p.q, kq, p.v, all, FeatureRemainder<Oprf<Scalar>>{map, {}}, opt),
                           exact) < testing::tolerance<Scalar>());
  st = {};
  CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(
                               p.q, kq, p.v, all, SampledRemainder{8, false, 8}, opt, &st),
                           exact) < testing::tolerance<Scalar>());
  CHECK(st.samples == 0);
  // A narrow window or an LSH support, and every other key drawn (s >= n gives p = 1): the own
  // key is neither scored nor drawn.
  for (const SupportSpec<Scalar>* s : {&narrow, &lsh}) {
    st = {};
    CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(
                                 p.q, kq, p.v, *s, SampledRemainder{1e9, false, 8}, opt, &st),
                             exact) < testing::tolerance<Scalar>());
    const Index valid_others = causal ? 40 * 39 / 2 + 1 : 40 * 39;
    CHECK(st.pairs_scored + st.samples == valid_others);
  }
  // One position: it attends to its own key.
  const RowMatrix<Scalar> one = randattn::sparse_lowrank_attention<Scalar>(
      p.q.topRows(1), kq.topRows(1), p.v.topRows(1), narrow, SampledRemainder{4, false, 4}, opt);
  CHECK(one == p.v.topRows(1));
  CHECK_THROWS_AS(randattn::sparse_lowrank_attention<Scalar>(p.q, kq.topRows(39), p.v.topRows(39),
                                                             narrow, {}, opt),
                  std::invalid_argument);
}

TEST_CASE("sparse-lowrank: without remainder a hashing support is its method, bit for bit",
          "[sparse_lowrank]") {
  const Problem<float> p(21, 200, 16, 4, 1.5);
  const bool causal = GENERATE(false, true);
  const bool centre = GENERATE(false, true);
  SparseLowRankOptions opt;
  opt.causal = causal;
  opt.centre_keys = centre;
  const RowMatrix<float> keys = centre ? randattn::centred<float>(p.k, randattn::key_mean<float>(
                                                                         p.k, causal ? 64 : 0))
                                       : p.k;
  {
    const CrossPolytopeHash<float> hash(16, 8, 3, 7);
    randattn::LshOptions lopt;
    lopt.chunk = 32;
    lopt.causal = causal;
    SupportSpec<float> s;
    s.lsh = &hash;
    s.lsh_options = lopt;
    const RowMatrix<float> alone = randattn::lsh_attention(hash, p.q, keys, p.v, lopt);
    const RowMatrix<float> out = randattn::sparse_lowrank_attention<float>(p.q, p.k, p.v, s, {}, opt);
    if (centre)
      CHECK(testing::rel_error(out, alone) < 1e-5);  // logits shifted back: rounding only
    else
      CHECK(testing::rows_bit_identical(out, alone, out.rows()));
    // The target sets are the keys lsh_attention scores: exact softmax over them agrees.
    const TargetSets sets = randattn::lsh_target_sets<float>(hash, p.q, keys, lopt);
    CHECK(testing::rel_error(randattn::target_attention_accumulate<float>(
                                 p.q, keys, p.v, sets, 0.25f).finalize(),
                             alone) < 1e-5);
    for (Index i = 0; i < sets.rows(); ++i)
      for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j)
        if (causal) REQUIRE(*j <= i);
  }
  {
    const LocalitySensitiveFilters<float> filters(RotationKind::dense, 16, 16, 3, 9);
    randattn::LsfOptions fopt;
    fopt.eta = 0.5;
    fopt.causal = causal;
    SupportSpec<float> s;
    s.lsf = &filters;
    s.lsf_options = fopt;
    const RowMatrix<float> alone = randattn::lsf_attention(filters, p.q, keys, p.v, fopt);
    const RowMatrix<float> out = randattn::sparse_lowrank_attention<float>(p.q, p.k, p.v, s, {}, opt);
    if (centre)
      CHECK(testing::rel_error(out, alone) < 1e-5);
    else
      CHECK(testing::rows_bit_identical(out, alone, out.rows()));
    const TargetSets sets = randattn::lsf_target_sets<float>(filters, p.q, keys, fopt);
    CHECK(testing::rel_error(randattn::target_attention_accumulate<float>(
                                 p.q, keys, p.v, sets, 0.25f).finalize(),
                             alone) < 1e-5);
  }
}

TEST_CASE("sparse-lowrank: every remainder is unbiased in numerator and denominator",
          "[sparse_lowrank][statistical]") {
  // Support: a window of 3 plus one sink, or LSH chunks of 4, over n = 24 keys; the rest estimated. Each entry of
  // E + R (in true scale) is averaged over T independent draws and compared with the exact total
  // within 5 standard errors of its own sample.
  const Index n = 24, d = 4, dv = 2;
  const Problem<double> p(31, n, d, dv, 0.8);
  const double scale = 0.5;
  const bool causal = GENERATE(false, true);
  const std::string kind = GENERATE(as<std::string>{}, "favor", "oprf", "sderf", "sample",
                                    "uniform");
  // lsh alone takes the chunk-by-chunk correction of the feature remainders.
  const bool lsh = GENERATE(false, true);
  CAPTURE(causal, kind, lsh);
  const CrossPolytopeHash<double> hash(d, 4, 2, 13);
  SupportSpec<double> s;
  if (lsh) {
    s.lsh = &hash;
    s.lsh_options.chunk = 4;
  } else {
    s.window = WindowSupport{3, 1};
  }
  SparseLowRankOptions opt;
  opt.causal = causal;
  opt.scale = scale;
  const int T = 2000;
  std::vector<testing::Moments> m(std::size_t(n * (dv + 1)));
  SparseLowRankStats st;
  for (int t = 0; t < T; ++t) {
    randattn::SoftmaxAccumulator<double> acc;
    const randattn::OrthogonalProjection<double> proj(16, d, 1000 + t);
    if (kind == "favor") {
      const randattn::PositiveFeatures<double> map(proj);
      acc = randattn::sparse_lowrank_accumulate<double>(
          p.q, p.k, p.v, s, FeatureRemainder<decltype(map)>{map, {}}, opt, &st);
    } else if (kind == "oprf") {
      const Oprf<double> map(proj, 1.0);
      acc = randattn::sparse_lowrank_accumulate<double>(
          p.q, p.k, p.v, s, FeatureRemainder<decltype(map)>{map, {}}, opt, &st);
    } else if (kind == "sderf") {
      const randattn::DenseExponentialFeatures<double> map(proj);
      acc = randattn::sparse_lowrank_accumulate<double>(
          p.q, p.k, p.v, s, FeatureRemainder<decltype(map)>{map, {}}, opt, &st);
    } else {
      opt.seed = std::uint64_t(t);
      acc = randattn::sparse_lowrank_accumulate<double>(
          p.q, p.k, p.v, s, SampledRemainder{4, kind == "uniform", 4}, opt, &st);
    }
    const Eigen::MatrixXd nd = true_numden(acc);
    for (Index i = 0; i < n; ++i)
      for (Index c = 0; c <= dv; ++c) m[std::size_t(i * (dv + 1) + c)].add(nd(i, c));
  }
  CHECK(st.clamped_rows == 0);
  for (Index i = 0; i < n; ++i) {
    const Eigen::RowVectorXd truth = exact_numden(p.q, p.k, p.v, i, scale, causal);
    for (Index c = 0; c <= dv; ++c) {
      const testing::Moments& e = m[std::size_t(i * (dv + 1) + c)];
      CAPTURE(i, c, e.mean, truth(c), e.standard_error());
      CHECK(std::abs(e.mean - truth(c)) <= 5 * e.standard_error() + 1e-12 * std::abs(truth(c)));
    }
  }
}

TEST_CASE("sparse-lowrank: the chunk-by-chunk LSH correction is the per-key one",
          "[sparse_lowrank]") {
  // Beyond kCountTableRounds rounds the pair counts come from the chunks' table.
  const Problem<double> p(81, 150, 8, 3, 1.0);
  const bool causal = GENERATE(false, true);
  const Index rounds = GENERATE(Index(3), randattn::detail::kCountTableRounds + 3);
  CAPTURE(causal, rounds);
  const CrossPolytopeHash<double> hash(8, 8, rounds, 7);
  randattn::LshOptions lopt;
  lopt.chunk = 16;
  lopt.causal = causal;
  const randattn::LshChunks chunks = randattn::lsh_chunks<double>(hash, p.q, p.k, lopt);
  const TargetSets sets = randattn::lsh_target_sets(chunks, causal);
  CHECK(sets.keys == randattn::lsh_target_sets<double>(hash, p.q, p.k, lopt).keys);
  const Oprf<double> map(randattn::OrthogonalProjection<double>(32, 8, 3), 2.0);
  randattn::RandomFeatureOptions fopt;
  fopt.causal = causal;
  Index clamped_keys = 0, clamped_chunks = 0;
  const auto by_key = randattn::feature_remainder_accumulate(map, p.q, p.k, p.v, sets, fopt,
                                                             &clamped_keys);
  const auto by_chunk = randattn::feature_remainder_accumulate(map, p.q, p.k, p.v, sets, fopt,
                                                               &clamped_chunks, &chunks);
  CHECK(clamped_keys == clamped_chunks);
  const Eigen::MatrixXd a = true_numden(by_key), b = true_numden(by_chunk);
  CHECK((a - b).norm() <= 1e-10 * a.norm());
  // The sizes alone, without the sets: the same rows, the same correction bit for bit, and the
  // sizes the correction counts as it runs are those of the sets.
  const std::vector<Index> sizes = randattn::lsh_target_sizes(chunks, causal);
  REQUIRE(Index(sizes.size()) == sets.rows());
  for (Index i = 0; i < sets.rows(); ++i) REQUIRE(sizes[std::size_t(i)] == sets.size(i));
  Index clamped_sizes = 0;
  std::vector<Index> counted;
  const auto by_sizes = randattn::feature_remainder_accumulate(map, p.q, p.k, p.v, chunks, fopt,
                                                               &clamped_sizes, &counted);
  CHECK(counted == sizes);
  CHECK(clamped_sizes == clamped_chunks);
  CHECK(by_sizes.numden() == by_chunk.numden());
  CHECK(by_sizes.log_scale() == by_chunk.log_scale());
}

TEST_CASE("sparse-lowrank: target sets are each row's distinct keys, sorted", "[sparse_lowrank]") {
  // Rows of random keys with repeats, some empty, over a range that spans many bitset words or
  // few (both ways of draining a row), against std::sort + std::unique.
  const Index n_k = GENERATE(Index(7), Index(70), Index(5000));
  const Index rows = 300;
  CAPTURE(n_k);
  randattn::Philox rng(5);
  std::vector<std::vector<std::int32_t>> lists(static_cast<std::size_t>(rows));
  for (Index i = 0; i < rows; ++i) {
    const Index count = Index(rng.uniform(std::uint64_t(i), 0) * 40) * (i % 5 != 0);
    for (Index t = 0; t < count; ++t)
      lists[std::size_t(i)].push_back(
          std::int32_t(rng.uniform(std::uint64_t(i), std::uint32_t(t + 1)) * double(n_k)));
  }
  const auto gather = [&](Index i, auto&& add) {
    for (std::int32_t j : lists[std::size_t(i)]) add(j);
  };
  const bool fill = GENERATE(false, true);
  const TargetSets sets = randattn::gather_target_sets(rows, n_k, gather, fill, true);
  const std::vector<Index> sizes = randattn::gather_target_sizes(rows, n_k, gather, fill, true);
  REQUIRE(sets.rows() == rows);
  for (Index i = 0; i < rows; ++i) {
    std::vector<std::int32_t> want = lists[std::size_t(i)];
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    if (want.empty() && fill)
      for (Index j = 0; j < std::min(i + 1, n_k); ++j) want.push_back(std::int32_t(j));
    REQUIRE(std::vector<std::int32_t>(sets.begin(i), sets.end(i)) == want);
    REQUIRE(sizes[std::size_t(i)] == Index(want.size()));
  }
  // The union of two sets is the sets of the concatenated lists.
  const TargetSets half = randattn::gather_target_sets(rows, n_k, [&](Index i, auto&& add) {
    for (std::size_t t = 0; t < lists[std::size_t(i)].size(); t += 2) add(lists[std::size_t(i)][t]);
  });
  const TargetSets rest = randattn::gather_target_sets(rows, n_k, [&](Index i, auto&& add) {
    for (std::size_t t = 1; t < lists[std::size_t(i)].size(); t += 2) add(lists[std::size_t(i)][t]);
  });
  const TargetSets all = randattn::gather_target_sets(rows, n_k, gather);
  const TargetSets joined = randattn::union_of({&half, &rest});
  CHECK(joined.keys == all.keys);
  CHECK(joined.start == all.start);
  // Copies hold their own storage; sets with no rows hold none.
  const TargetSets copy = joined;
  CHECK(copy.keys == joined.keys);
  CHECK(copy.start == joined.start);
  CHECK(TargetSets().rows() == 0);
  CHECK(TargetSets().pairs() == 0);
}

TEST_CASE("sparse-lowrank: causal outputs before key j do not depend on key j",
          "[sparse_lowrank]") {
  const Index n = 96, d = 8, j = 50;
  Problem<float> p(41, n, d, 3, 1.0);
  const std::string support =
      GENERATE(as<std::string>{}, "window", "blocks", "window,blocks", "clusters");
  const std::string remainder = GENERATE(as<std::string>{}, "none", "sample", "oprf");
  CAPTURE(support, remainder);
  SupportSpec<float> s;
  if (support.find("window") != std::string::npos) s.window = WindowSupport{8, 2};
  if (support.find("blocks") != std::string::npos) s.blocks = BlockSupport{16, 1};
  if (support == "clusters") s.clusters = ClusterSupport{4, 1, 16};
  SparseLowRankOptions opt;
  opt.causal = true;
  opt.centre_keys = true;
  opt.centre_prefix = 16;  // j is past the prefix
  const Oprf<float> map(randattn::OrthogonalProjection<float>(32, d, 3), 2.0);
  const auto run = [&](const Problem<float>& in) {
    if (remainder == "sample")
      return randattn::sparse_lowrank_attention<float>(in.q, in.k, in.v, s,
                                                       SampledRemainder{8, false, 16}, opt);
    if (remainder == "oprf")
      return randattn::sparse_lowrank_attention<float>(
          in.q, in.k, in.v, s, FeatureRemainder<Oprf<float>>{map, {}}, opt);
    return randattn::sparse_lowrank_attention<float>(in.q, in.k, in.v, s, {}, opt);
  };
  const RowMatrix<float> before = run(p);
  p.k.row(j) *= -7.0f;
  p.v.row(j).setConstant(100.0f);
  const RowMatrix<float> after = run(p);
  CHECK(testing::rows_bit_identical(before, after, j));
  CHECK_FALSE(testing::rows_bit_identical(before, after, n));
}

TEST_CASE("sparse-lowrank: hashing supports never score or estimate a later key",
          "[sparse_lowrank]") {
  const Index n = 64;
  const Problem<double> p(51, n, 8, 2, 1.0);
  const CrossPolytopeHash<double> hash(8, 4, 2, 5);
  randattn::LshOptions lopt;
  lopt.chunk = 8;
  lopt.causal = true;
  const LocalitySensitiveFilters<double> filters(RotationKind::dense, 8, 8, 2, 9);
  randattn::LsfOptions fopt;
  fopt.eta = 0.3;
  fopt.causal = true;
  for (const TargetSets& sets : {randattn::lsh_target_sets<double>(hash, p.q, p.k, lopt),
                                 randattn::lsf_target_sets<double>(filters, p.q, p.k, fopt)})
    for (Index i = 0; i < n; ++i) {
      REQUIRE(sets.size(i) >= 1);
      for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j) REQUIRE(*j <= i);
    }
  // The sampled remainder with every key drawn (s >= n) is causal exact attention.
  SupportSpec<double> s;
  s.lsh = &hash;
  s.lsh_options = lopt;
  SparseLowRankOptions opt;
  opt.causal = true;
  randattn::ExactOptions eopt;
  eopt.causal = true;
  CHECK(testing::rel_error(randattn::sparse_lowrank_attention<double>(
                               p.q, p.k, p.v, s, SampledRemainder{1e9, false, 8}, opt),
                           randattn::exact_attention(p.q, p.k, p.v, eopt)) < 1e-12);
}

TEST_CASE("sparse-lowrank: results do not depend on the thread count", "[sparse_lowrank][threads]") {
#if defined(_OPENMP)
  const Problem<float> p(61, 300, 16, 4, 1.2);
  const CrossPolytopeHash<float> hash(16, 8, 2, 5);
  SupportSpec<float> s;
  s.lsh = &hash;
  s.lsh_options.chunk = 32;
  s.window = WindowSupport{16, 4};
  const Oprf<float> map(randattn::OrthogonalProjection<float>(32, 16, 3), 3.0);
  // The LSH support alone corrects chunk by chunk (factored without causal masking) in tasks of
  // consecutive chunks: 263 chunks of 8 make several tasks.
  const Problem<float> big(62, 2100, 16, 4, 1.2);
  SupportSpec<float> alone;
  alone.lsh = &hash;
  alone.lsh_options.chunk = 8;
  // Clustered keys, so that clusters stay closed and the cluster proposal draws.
  const Problem<float> grouped = clustered_problem<float>(63, 2100, 16, 4, 24, 6.0);
  SupportSpec<float> clusters;
  clusters.clusters = ClusterSupport{32, 2, 16};
  const auto run = [&] {
    std::vector<RowMatrix<float>> out;
    out.push_back(randattn::sparse_lowrank_attention<float>(
        p.q, p.k, p.v, s, SampledRemainder{32, false, 16}, {}));
    for (bool causal : {false, true}) {  // k-means, assignments and the cluster proposal
      SparseLowRankOptions opt;
      opt.causal = causal;
      opt.seed = 4;
      SparseLowRankStats st;
      out.push_back(randattn::sparse_lowrank_attention<float>(
          grouped.q, grouped.k, grouped.v, clusters, SampledRemainder{32, false, 16}, opt, &st));
      CHECK(st.samples > 0);
      CHECK(st.pairs_scored < 2100 * 2100 / 2);
    }
    out.push_back(randattn::sparse_lowrank_attention<float>(
        p.q, p.k, p.v, s, FeatureRemainder<Oprf<float>>{map, {}}, {}));
    for (bool causal : {false, true}) {
      SparseLowRankOptions opt;
      opt.causal = causal;
      out.push_back(randattn::sparse_lowrank_attention<float>(
          big.q, big.k, big.v, alone, FeatureRemainder<Oprf<float>>{map, {}}, opt));
    }
    return out;
  };
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = run();
  omp_set_num_threads(3);
  const auto three = run();
  omp_set_num_threads(saved);
  for (std::size_t r = 0; r < one.size(); ++r) {
    CAPTURE(r);
    CHECK(testing::rows_bit_identical(one[r], three[r], one[r].rows()));
  }
#else
  SUCCEED("built without OpenMP");
#endif
}

TEMPLATE_TEST_CASE("sparse-lowrank: the block bound is an upper bound on every logit",
                   "[sparse_lowrank]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const std::uint64_t seed = GENERATE(range(0, 8));
  const Index n = 53, d = 7, B = GENERATE(1, 5, 16);
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(seed, 20, d, 3.0);
  RowMatrix<Scalar> k = testing::gaussian<Scalar>(seed + 100, n, d, 2.0);
  k.col(0).array() += Scalar(5);  // off-centre keys
  const randattn::KeyBlockBounds<Scalar> bounds(k, B);
  const RowMatrix<Scalar> ub = bounds.bounds(q);
  REQUIRE(ub.cols() == (n + B - 1) / B);
  bool tight_somewhere = false;
  for (Index i = 0; i < q.rows(); ++i)
    for (Index j = 0; j < n; ++j) {
      const double logit = double(q.row(i).template cast<double>().dot(k.row(j).template cast<double>()));
      // Rounding of the two products only: a few ulps of Σ|q_c||k_c|.
      const double slack = 8 * std::numeric_limits<Scalar>::epsilon() *
                           double((q.row(i).cwiseAbs() * k.row(j).cwiseAbs().transpose()).value());
      REQUIRE(double(ub(i, j / B)) >= logit - slack);
      tight_somewhere = tight_somewhere || (B == 1 && double(ub(i, j)) <= logit + slack);
    }
  if (B == 1) CHECK(tight_somewhere);  // one key per block: the bound is the logit
}

TEST_CASE("sparse-lowrank: supports, edges and argument checks", "[sparse_lowrank]") {
  SECTION("window and sinks") {
    const TargetSets w = randattn::window_target_sets(6, 6, WindowSupport{2, 1}, true);
    CHECK(std::vector<std::int32_t>(w.begin(5), w.end(5)) == std::vector<std::int32_t>{0, 4, 5});
    CHECK(std::vector<std::int32_t>(w.begin(0), w.end(0)) == std::vector<std::int32_t>{0});
    const TargetSets b = randattn::window_target_sets(6, 6, WindowSupport{2, 0}, false);
    CHECK(std::vector<std::int32_t>(b.begin(3), b.end(3)) == std::vector<std::int32_t>{2, 3, 4});
    CHECK_THROWS_AS(randattn::window_target_sets(6, 6, WindowSupport{-1, 0}, false),
                    std::invalid_argument);
  }
  const Problem<double> p(71, 10, 4, 2, 1.0);
  SupportSpec<double> s;
  s.window = WindowSupport{2, 0};
  SECTION("bad arguments") {
    CHECK_THROWS_AS(randattn::sparse_lowrank_attention<double>(p.q, p.k, p.v, SupportSpec<double>{}),
                    std::invalid_argument);
    CHECK_THROWS_AS(randattn::sparse_lowrank_attention<double>(p.q, p.k, p.v, s,
                                                               SampledRemainder{0, false, 4}),
                    std::invalid_argument);
    SupportSpec<double> blocks;
    blocks.blocks = BlockSupport{0, 1};
    CHECK_THROWS_AS(randattn::sparse_lowrank_attention<double>(p.q, p.k, p.v, blocks),
                    std::invalid_argument);
    RowMatrix<double> bad = p.k;
    bad(3, 1) = NAN;
    CHECK_THROWS_AS(randattn::sparse_lowrank_attention<double>(p.q, bad, p.v, s),
                    std::invalid_argument);
  }
  SECTION("n = 0 and n = 1") {
    CHECK(randattn::sparse_lowrank_attention<double>(p.q.topRows(0), p.k, p.v, s).rows() == 0);
    const RowMatrix<double> one = randattn::sparse_lowrank_attention<double>(
        p.q.topRows(1), p.k.topRows(1), p.v.topRows(1), s, SampledRemainder{4, false, 4});
    CHECK(testing::rel_error(one, p.v.topRows(1)) < 1e-15);
  }
}

TEMPLATE_TEST_CASE("sparse_lowrank_attention_into equals the allocating form bit for bit",
                   "[sparse_lowrank][into]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using Refs = std::vector<Eigen::Ref<const RowMatrix<Scalar>>>;
  const Problem<Scalar> p(101, 40, 8, 3, 1.0);
  const Oprf<Scalar> map(randattn::OrthogonalProjection<Scalar>(16, 8, 102), 2.0);
  SupportSpec<Scalar> s;
  s.window = WindowSupport{5, 0};
  s.blocks = BlockSupport{8, 1};
  for (const bool causal : {false, true}) {
    INFO("causal " << causal);
    SparseLowRankOptions opt;
    opt.causal = causal;
    const FeatureRemainder<Oprf<Scalar>> remainder{map, {}};
    testing::check_into_form<Scalar>(
        randattn::sparse_lowrank_attention<Scalar>(p.q, p.k, p.v, s, remainder, opt),
        {p.q, p.k, p.v}, {"q", "k", "v"}, [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
          randattn::sparse_lowrank_attention_into<Scalar>(in[0], in[1], in[2], s, out, remainder,
                                                          opt);
        });
  }
}


TEMPLATE_TEST_CASE("sparse-lowrank: clusters with every cluster probed is exact attention",
                   "[sparse_lowrank][clusters]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Problem<Scalar> p(111, 70, 8, 3, 1.0);
  const bool causal = GENERATE(false, true);
  CAPTURE(causal);
  randattn::ExactOptions eopt;
  eopt.causal = causal;
  const RowMatrix<Scalar> exact = randattn::exact_attention(p.q, p.k, p.v, eopt);
  SparseLowRankOptions opt;
  opt.causal = causal;
  SupportSpec<Scalar> s;
  s.clusters = ClusterSupport{5, 5, 16};
  const Oprf<Scalar> map(randattn::OrthogonalProjection<Scalar>(16, 8, 3), 2.0);
  SparseLowRankStats st;
  // Exact attention's own tiles: bit for bit, whatever the remainder (nothing is left to it).
  CHECK(testing::rows_bit_identical(
      randattn::sparse_lowrank_attention<Scalar>(p.q, p.k, p.v, s, {}, opt, &st), exact, 70));
  CHECK(st.pairs_scored == (causal ? 70 * 71 / 2 : 70 * 70));
  CHECK(testing::rows_bit_identical(
      randattn::sparse_lowrank_attention<Scalar>(p.q, p.k, p.v, s, SampledRemainder{8, false, 8},
                                                 opt),
      exact, 70));
  CHECK(testing::rows_bit_identical(
      randattn::sparse_lowrank_attention<Scalar>(p.q, p.k, p.v, s,
                                                 FeatureRemainder<Oprf<Scalar>>{map, {}}, opt),
      exact, 70));
  // Every cluster probed through the target sets (in a union): the same up to rounding.
  SupportSpec<Scalar> united = s;
  united.window = WindowSupport{1, 0};
  CHECK(testing::rel_error(randattn::sparse_lowrank_attention<Scalar>(p.q, p.k, p.v, united, {}, opt),
                           exact) < testing::tolerance<Scalar>());
  // Fewer keys than clusters are scored exactly: all of them (bidirectional), or the rows whose
  // prefix of completed chunks holds fewer than K keys (causal: chunks of 4, K = 12, rows < 12).
  s.clusters = ClusterSupport{12, 1, 4};
  const TargetSets few = randattn::cluster_target_sets<Scalar>(p.q.topRows(10), p.k.topRows(10),
                                                               *s.clusters, Scalar(0.3), causal, 0);
  const TargetSets rows = randattn::cluster_target_sets<Scalar>(p.q, p.k, *s.clusters, Scalar(0.3),
                                                                causal, 0);
  for (Index i = 0; i < 10; ++i) CHECK(few.size(i) == randattn::valid_keys(i, 10, causal));
  if (causal)
    for (Index i = 0; i < 12; ++i) CHECK(rows.size(i) == i + 1);
}

TEST_CASE("sparse-lowrank: a query's clusters hold every key that can matter",
          "[sparse_lowrank][clusters]") {
  // Peaked attention over clustered keys: the clusters left closed are a real part of the keys,
  // and every key outside S_i has a logit at least kClusterMargin below the best one in S_i (the
  // bound scale·q·c + |scale|·‖q‖·r held for every member), S_i holds the own chunk up to i and
  // only valid keys.
  const Index n = 300, d = 8, C = 16;
  const Problem<double> p = clustered_problem<double>(121, n, d, 2, 12, 6.0);
  const bool causal = GENERATE(false, true);
  const bool centre = GENERATE(false, true);
  CAPTURE(causal, centre);
  const double scale = 0.5;
  const ClusterSupport cs{24, 1, C};
  const RowMatrix<double> keys =
      centre ? randattn::centred<double>(p.k, randattn::key_mean<double>(p.k, 0)) : p.k;
  const TargetSets sets = randattn::cluster_target_sets<double>(p.q, keys, cs, scale, causal, 9);
  double left_out = 0, valid_pairs = 0;
  for (Index i = 0; i < n; ++i) {
    const Index valid = randattn::valid_keys(i, n, causal);
    valid_pairs += double(valid);
    std::vector<char> in(std::size_t(n), 0);
    double best = -INFINITY;
    for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j) {
      REQUIRE(*j < valid);
      in[std::size_t(*j)] = 1;
      best = std::max(best, scale * p.q.row(i).dot(p.k.row(*j)));
    }
    if (causal)
      for (Index j = i / C * C; j <= i; ++j) REQUIRE(in[std::size_t(j)]);
    for (Index j = 0; j < valid; ++j)
      if (!in[std::size_t(j)]) {
        left_out += 1;
        REQUIRE(scale * p.q.row(i).dot(p.k.row(j)) < best - randattn::detail::kClusterMargin + 1e-9);
      }
  }
  CHECK(left_out > 0.2 * valid_pairs);
  // margin −inf: the probed cluster alone (and the own chunk), a subset of every row's support.
  ClusterSupport fixed = cs;
  fixed.margin = -INFINITY;
  const TargetSets few = randattn::cluster_target_sets<double>(p.q, keys, fixed, scale, causal, 9);
  for (Index i = 0; i < n; ++i)
    REQUIRE(std::includes(sets.begin(i), sets.end(i), few.begin(i), few.end(i)));
  CHECK(few.keys.size() < sets.keys.size());
  // The seed seeds the k-means: another gives other clusters, the same the same.
  CHECK(randattn::cluster_target_sets<double>(p.q, keys, cs, scale, causal, 9).keys == sets.keys);
  CHECK_FALSE(randattn::cluster_target_sets<double>(p.q, keys, ClusterSupport{24, 1, C}, scale,
                                                    causal, 10).keys == sets.keys);
}

TEST_CASE("sparse-lowrank: the sampled remainder drawing from clusters is unbiased",
          "[sparse_lowrank][clusters][statistical]") {
  // The cluster proposal on its own: a window support of 3 and one sink leaves most keys to it
  // (the clusters support itself leaves only negligible ones). Each entry of E + R (true scale)
  // averaged over T draws against the exact total within 5 standard errors of its own sample.
  const Index n = 24, d = 4, dv = 2;
  const Problem<double> p(131, n, d, dv, 0.8);
  const double scale = 0.5;
  const bool causal = GENERATE(false, true);
  CAPTURE(causal);
  const TargetSets sets = randattn::window_target_sets(n, n, WindowSupport{3, 1}, causal);
  const randattn::detail::KeyClusterIndex<double> index(p.q, p.k, ClusterSupport{3, 1, 4}, scale,
                                                        causal, 2);
  const randattn::SoftmaxAccumulator<double> exact =
      randattn::target_attention_accumulate<double>(p.q, p.k, p.v, sets, scale);
  const int T = 2000;
  std::vector<testing::Moments> m(std::size_t(n * (dv + 1)));
  Index drawn = 0;
  for (int t = 0; t < T; ++t) {
    randattn::SoftmaxAccumulator<double> acc = exact;
    drawn += randattn::sampled_remainder_merge<double>(
        p.q, p.k, p.k, p.v, sets, SampledRemainder{3, false, 4}, scale, causal,
        randattn::Philox(std::uint64_t(t), 1), 0, acc, nullptr, &index);
    const Eigen::MatrixXd nd = true_numden(acc);
    for (Index i = 0; i < n; ++i)
      for (Index c = 0; c <= dv; ++c) m[std::size_t(i * (dv + 1) + c)].add(nd(i, c));
  }
  CHECK(drawn > 0);
  for (Index i = 0; i < n; ++i) {
    const Eigen::RowVectorXd truth = exact_numden(p.q, p.k, p.v, i, scale, causal);
    for (Index c = 0; c <= dv; ++c) {
      const testing::Moments& e = m[std::size_t(i * (dv + 1) + c)];
      CAPTURE(i, c, e.mean, truth(c), e.standard_error());
      CHECK(std::abs(e.mean - truth(c)) <= 5 * e.standard_error() + 1e-12 * std::abs(truth(c)));
    }
  }
}

TEST_CASE("sparse-lowrank: clusters support options are checked", "[sparse_lowrank][clusters]") {
  const Problem<double> p(141, 20, 4, 2, 1.0);
  for (const ClusterSupport& bad : {ClusterSupport{0, 1, 8}, ClusterSupport{4, 0, 8},
                                    ClusterSupport{4, 5, 8}, ClusterSupport{4, 2, 0},
                                    ClusterSupport{4, 2, 8, std::nan("")}}) {
    SupportSpec<double> s;
    s.clusters = bad;
    CAPTURE(bad.clusters, bad.probe, bad.chunk);
    CHECK_THROWS_AS(randattn::sparse_lowrank_attention<double>(p.q, p.k, p.v, s),
                    std::invalid_argument);
    CHECK_THROWS_AS(randattn::sparse_lowrank_attention<double>(p.q.topRows(0), p.k, p.v, s),
                    std::invalid_argument);
  }
}

TEST_CASE("sparse-lowrank: the cluster bounds' gradients against finite differences",
          "[sparse_lowrank][clusters][gradients]") {
  // F = Σ_ic W_ic B_ic with B the bounds the cluster proposal draws with (clusters rebuilt at each
  // evaluation with the same seed: assignments and radii stay put under a step of 1e-5), against
  // KeyClusterIndex::bound_gradients given gamma = W.
  const Index n = 37, d = 4, K = 3;
  const bool causal = GENERATE(false, true);
  CAPTURE(causal);
  Problem<double> p = clustered_problem<double>(151, n, d, 1, 4, 1.0);
  const double scale = 0.7;
  const ClusterSupport cs{K, 1, 8};
  const RowMatrix<double> w = testing::gaussian<double>(152, n, K, 1.0);
  const auto bounds = [&] {
    const randattn::detail::KeyClusterIndex<double> index(p.q, p.k, cs, scale, causal, 3);
    RowMatrix<double> b = RowMatrix<double>::Zero(n, K);
    index.bounds_into(p.q, 0, b);
    for (Index i = 0; i < n; ++i)
      if (index.sampled(i) == 0) b.row(i).setZero();  // rows scored exactly: no bounds
    return b;
  };
  const auto f = [&] { return testing::contract(w, bounds()); };
  const randattn::detail::KeyClusterIndex<double> index(p.q, p.k, cs, scale, causal, 3);
  RowMatrix<double> gamma = w;
  for (Index i = 0; i < n; ++i)
    if (index.sampled(i) == 0) gamma.row(i).setZero();
  RowMatrix<double> dq = RowMatrix<double>::Zero(n, d), dk = RowMatrix<double>::Zero(n, d);
  index.bound_gradients(p.q, p.k, gamma, scale, dq, dk);
  CHECK(dk.norm() > 0);
  testing::check_gradient("dq", p.q, dq, f);
  testing::check_gradient("dk", p.k, dk, f);
}

TEST_CASE("sparse-lowrank: the clusters support's backward against finite differences",
          "[sparse_lowrank][clusters][gradients]") {
  // The support is a fixed set of pairs given the keys: the shared pair backward, with the
  // sampled remainder's draws (and all-probed calls, whose exact part is exact attention's).
  const Index n = 37, d = 4, dv = 3;
  const bool causal = GENERATE(false, true);
  const std::string remainder = GENERATE(as<std::string>{}, "none", "sample", "all probed");
  CAPTURE(causal, remainder);
  RowMatrix<double> q = testing::gaussian<double>(161, n, d), k = testing::gaussian<double>(162, n, d),
                    v = testing::gaussian<double>(163, n, dv);
  const RowMatrix<double> g = testing::gaussian<double>(164, n, dv);
  SupportSpec<double> s;
  s.clusters = ClusterSupport{4, remainder == "all probed" ? 4 : 1, 8};
  SparseLowRankOptions opt;
  opt.causal = causal;
  opt.seed = 5;
  const auto check = [&](const auto& rem) {
    RowMatrix<double> out(n, dv), dq(n, d), dk(n, d), dvv(n, dv);
    const auto saved = randattn::sparse_lowrank_forward<double>(q, k, v, s, out, rem, opt);
    CHECK(out == randattn::sparse_lowrank_attention<double>(q, k, v, s, rem, opt));
    randattn::sparse_lowrank_backward<double>(saved, q, k, v, out, g, dq, dk, dvv);
    const auto f = [&] {
      return testing::contract(g, randattn::sparse_lowrank_attention<double>(q, k, v, s, rem, opt));
    };
    const testing::OneThread one_thread;
    testing::check_gradient("dq", q, dq, f);
    testing::check_gradient("dk", k, dk, f);
    testing::check_gradient("dv", v, dvv, f);
  };
  if (remainder == "sample")
    check(SampledRemainder{6, false, 8});
  else
    check(randattn::NoRemainder{});
}

TEST_CASE("sparse-lowrank: the cluster bound is an upper bound on every member's logit",
          "[sparse_lowrank][clusters]") {
  // Each query's clusters split the keys before its chunk (each once, group_of naming its
  // cluster), and scale·q·c + |scale|·‖q‖·r bounds the logit of every member; the scale's sign
  // does not matter.
  const Index n = 200, d = 6, K = 5, C = 16;
  const bool causal = GENERATE(false, true);
  const double scale = GENERATE(0.4, -0.4);
  CAPTURE(causal, scale);
  const RowMatrix<double> q = testing::gaussian<double>(171, n, d, 2.0);
  RowMatrix<double> k = testing::gaussian<double>(172, n, d, 1.5);
  k.col(0).array() += 3.0;  // off-centre keys
  const randattn::detail::KeyClusterIndex<double> index(q, k, ClusterSupport{K, 1, C}, scale,
                                                        causal, 6);
  RowMatrix<double> ub(n, K);
  index.bounds_into(q, 0, ub);
  Index clustered = 0;
  for (Index i = 0; i < n; ++i) {
    if (index.sampled(i) == 0) {
      CHECK((causal && i < 2 * C));  // K keys are first completed before chunk 1
      continue;
    }
    ++clustered;
    std::vector<int> seen(std::size_t(n), 0);
    for (Index c = 0; c < K; ++c) {
      const randattn::detail::KeySpan span = index.group(i, c);
      for (Index u = 0; u < span.size; ++u) {
        const Index j = span.at(u);
        ++seen[std::size_t(j)];
        REQUIRE(index.group_of(i, j) == c);
        REQUIRE(scale * q.row(i).dot(k.row(j)) <= ub(i, c) + 1e-12 * (1 + std::abs(ub(i, c))));
      }
    }
    for (Index j = 0; j < n; ++j)
      REQUIRE(seen[std::size_t(j)] == (j < index.whole_from(i) ? 1 : 0));
    CHECK(index.whole_from(i) == (causal ? i / C * C : n));
  }
  CHECK(clustered >= n - C);
}
