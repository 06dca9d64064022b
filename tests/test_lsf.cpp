// Locality-sensitive-filter attention: the filters, the limit η = −inf (exact attention), a
// brute-force reference that rebuilds every query's opened filters and key set from the filter
// scores (std::set union, double precision softmax), recall against a Monte-Carlo estimate of the
// collision probability, causality, batching, threads and argument checks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <vector>

#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::Index;
using randattn::LocalitySensitiveFilters;
using randattn::LsfOptions;
using randattn::RotationKind;
using randattn::RowMatrix;
using testing::rel_error;

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

template <typename Scalar>
using Scores = std::vector<RowMatrix<Scalar>>;  // per table: n x m

template <typename Scalar>
Scores<Scalar> all_scores(const LocalitySensitiveFilters<Scalar>& f, const RowMatrix<Scalar>& x) {
  Scores<Scalar> s;
  for (Index t = 0; t < f.tables(); ++t) s.push_back(f.scores(x, t));
  return s;
}

// Filters query row i opens in one table: score >= eta, or the min_probes best if fewer pass
// (descending score, ties to the lower index). Written from the definition, not the library.
template <typename Scalar>
std::set<Index> opened_in_table(const RowMatrix<Scalar>& s, Index i, double eta, Index min_probes) {
  std::set<Index> open;
  for (Index f = 0; f < s.cols(); ++f)
    if (s(i, f) >= eta) open.insert(f);
  if (Index(open.size()) >= min_probes) return open;
  std::vector<Index> order(static_cast<std::size_t>(s.cols()));
  std::iota(order.begin(), order.end(), Index(0));
  std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) { return s(i, a) > s(i, b); });
  return std::set<Index>(order.begin(), order.begin() + min_probes);
}

// Brute force: explicit filter sets per table, fallback in global score order, explicit union of
// valid keys, softmax in double. exclude_self: key i is not valid for query i; a query with no
// valid key then attends to its own key alone.
template <typename Scalar>
Eigen::MatrixXd reference(const LocalitySensitiveFilters<Scalar>& f, const RowMatrix<Scalar>& q,
                          const RowMatrix<Scalar>& k, const RowMatrix<Scalar>& v, double eta,
                          Index min_probes, double scale, bool causal, Index* pairs = nullptr,
                          bool exclude_self = false) {
  const Index L = f.tables(), m = f.filters();
  const Scores<Scalar> qs = all_scores(f, q);
  const randattn::HashCodes codes = f.assign(k);
  const Eigen::MatrixXd qd = q.template cast<double>(), kd = k.template cast<double>(),
                        vd = v.template cast<double>();
  Eigen::MatrixXd out(q.rows(), v.cols());
  for (Index i = 0; i < q.rows(); ++i) {
    std::vector<std::set<Index>> open;
    for (Index t = 0; t < L; ++t)
      open.push_back(opened_in_table(qs[std::size_t(t)], i, eta, min_probes));
    const auto keys_of = [&](Index t, Index filter) {
      std::set<Index> keys;
      for (Index j = 0; j < k.rows(); ++j)
        if (codes(j, t) == filter && !(causal && j > i) && !(exclude_self && j == i))
          keys.insert(j);
      return keys;
    };
    std::set<Index> targets;
    for (Index t = 0; t < L; ++t)
      for (Index filter : open[std::size_t(t)]) {
        const std::set<Index> keys = keys_of(t, filter);
        targets.insert(keys.begin(), keys.end());
      }
    if (targets.empty()) {
      std::vector<std::pair<Index, Index>> order;
      for (Index t = 0; t < L; ++t)
        for (Index filter = 0; filter < m; ++filter) order.push_back({t, filter});
      std::stable_sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
        return qs[std::size_t(a.first)](i, a.second) > qs[std::size_t(b.first)](i, b.second);
      });
      for (const auto& [t, filter] : order) {
        targets = keys_of(t, filter);
        if (!targets.empty()) break;
      }
    }
    if (targets.empty() && exclude_self) targets.insert(i);
    REQUIRE(!targets.empty());
    if (pairs) *pairs += Index(targets.size());
    std::map<Index, int> once;
    for (Index j : targets) once[j] = 1;
    out.row(i) = testing::softmax_over_targets(qd, i, kd, vd, once, scale);
  }
  return out;
}

template <typename Scalar>
RowMatrix<Scalar> unit(RowMatrix<Scalar> x) {
  x.rowwise().normalize();
  return x;
}

using testing::clustered;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Filters
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Filter scores are <a_i, x/|x|> with unit variance, keys go to the argmax",
                   "[lsf]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index d = 12, n = 70;
  const RowMatrix<Scalar> x = testing::gaussian<Scalar>(1, n, d, 3.0);
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    for (Index m : {5, 16, 40}) {
      INFO("kind " << int(kind) << " m " << m);
      const LocalitySensitiveFilters<Scalar> f(kind, d, m, 3, 7);
      const RowMatrix<Scalar> a = f.matrix();
      REQUIRE(a.rows() == 3 * m);
      REQUIRE(a.cols() == d);
      const RowMatrix<Scalar> xu = unit(x);
      const randattn::HashCodes codes = f.assign(x);
      for (Index t = 0; t < 3; ++t) {
        const RowMatrix<Scalar> s = f.scores(x, t);
        const RowMatrix<Scalar> expected = xu * a.middleRows(t * m, m).transpose();
        CHECK(rel_error(s, expected) < 10 * testing::tolerance<Scalar>());
        for (Index i = 0; i < n; ++i) {
          Index best = 0;
          s.row(i).maxCoeff(&best);
          CHECK(codes(i, t) == best);
        }
      }
    }
  }
  // Dense filters are the Philox Gaussians of their stream; tables are prefixes of one draw.
  const LocalitySensitiveFilters<Scalar> dense(RotationKind::dense, d, 8, 2, 99),
      one(RotationKind::dense, d, 8, 1, 99);
  const randattn::Philox rng(99, randattn::streams::lsf_dense_filters);
  CHECK(dense.matrix()(13, 5) == static_cast<Scalar>(rng.gaussian(13, 5)));
  CHECK(dense.matrix().topRows(8) == one.matrix());
  // Hadamard with m = p: the p filters are √p times an orthogonal matrix, so the squared scores
  // of a unit vector sum to p exactly (mean 1: the scale of the threshold formula).
  const LocalitySensitiveFilters<Scalar> had(RotationKind::hadamard, 16, 16, 2, 5);
  const RowMatrix<Scalar> s = had.scores(testing::gaussian<Scalar>(2, 30, 16), 1);
  for (Index i = 0; i < s.rows(); ++i) CHECK(s.row(i).squaredNorm() == Approx(16.0).epsilon(1e-5));
  // A zero key lands in filter 0; scores do not depend on the norm.
  RowMatrix<Scalar> z = x;
  z.row(4).setZero();
  z.row(5) *= Scalar(1e20);
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    const LocalitySensitiveFilters<Scalar> f(kind, d, 16, 2, 3);
    const randattn::HashCodes c = f.assign(z), c0 = f.assign(x);
    CHECK(c(4, 0) == 0);
    CHECK(c(4, 1) == 0);
    CHECK(c.row(5) == c0.row(5));
    CHECK(f.scores(z, 0).row(4).isZero(0));
  }
}

TEST_CASE("Threshold for a target cosine: η = α √(2 ln m) − √(2 (1 − α²) ln ln m)", "[lsf]") {
  const double m = 1024, a = 0.8;
  CHECK(randattn::filter_threshold(a, 1024) ==
        Approx(a * std::sqrt(2 * std::log(m)) - std::sqrt(2 * (1 - a * a) * std::log(std::log(m))))
            .epsilon(1e-15));
  CHECK(randattn::filter_threshold(0.5, 2) ==
        Approx(0.5 * std::sqrt(2 * std::log(2.0))));  // ln ln 2 < 0 taken as 0
  CHECK(randattn::filter_threshold(0.5, 1) == 0.0);
  CHECK(randattn::filter_threshold(0.9, 256) > randattn::filter_threshold(0.5, 256));
  CHECK_THROWS_AS(randattn::filter_threshold(0.0, 16), std::invalid_argument);
  CHECK_THROWS_AS(randattn::filter_threshold(1.0, 16), std::invalid_argument);
  CHECK_THROWS_AS(randattn::filter_threshold(std::nan(""), 16), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Attention against exact attention and the brute-force reference
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("η = −inf opens every filter: exact attention", "[lsf]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 150, d = 16, dv = 5;
  const RowMatrix<Scalar> q = clustered<Scalar>(11, n, d, 6, 0.4),
                          k = clustered<Scalar>(12, n, d, 6, 0.4);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(13, n, dv);
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    for (Index L : {1, 3}) {
      for (bool causal : {false, true}) {
        INFO("kind " << int(kind) << " L " << L << " causal " << causal);
        const LocalitySensitiveFilters<Scalar> f(kind, d, 9, L, 21);
        LsfOptions opt;
        opt.eta = kNegInf;
        opt.causal = causal;
        randattn::ExactOptions eopt;
        eopt.causal = causal;
        CHECK(rel_error(randattn::lsf_attention(f, q, k, v, opt),
                        randattn::exact_attention(q, k, v, eopt)) < testing::tolerance<Scalar>());
        const randattn::LsfProbeStats st = randattn::lsf_probe_stats<Scalar>(f, q, k, opt);
        CHECK(st.opened == n * 9 * L);
        CHECK(st.target_pairs == (causal ? n * (n + 1) / 2 : n * n));
        CHECK(st.logits == L * st.target_pairs);
      }
    }
  }
}

TEMPLATE_TEST_CASE("LSF attention equals softmax over the explicit union of opened filters",
                   "[lsf]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index d = 10, dv = 4;
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    for (Index L : {1, 3}) {
      for (bool causal : {false, true}) {
        for (Index min_probes : {1, 2}) {
          // n_q != n_k without causal; thresholds that leave many queries on their best filters.
          const Index n_k = 90, n_q = causal ? n_k : 61, m = 12;
          const RowMatrix<Scalar> q = clustered<Scalar>(31 + L, n_q, d, 4, 0.7);
          const RowMatrix<Scalar> k = clustered<Scalar>(41 + L, n_k, d, 4, 0.7);
          const RowMatrix<Scalar> v = testing::gaussian<Scalar>(51, n_k, dv);
          const LocalitySensitiveFilters<Scalar> f(kind, d, m, L, 61);
          for (double eta : {0.8, 1.6}) {
            INFO("kind " << int(kind) << " L " << L << " causal " << causal << " min_probes "
                         << min_probes << " eta " << eta);
            LsfOptions opt;
            opt.eta = eta;
            opt.causal = causal;
            opt.min_probes = min_probes;
            opt.scale = 0.7;
            Index pairs = 0;
            CHECK(rel_error(randattn::lsf_attention(f, q, k, v, opt),
                            reference<Scalar>(f, q, k, v, eta, min_probes, 0.7, causal, &pairs)) <
                  1e-6);
            CHECK(randattn::lsf_probe_stats<Scalar>(f, q, k, opt).target_pairs == pairs);
          }
        }
      }
    }
  }
  // α gives the same result as its η; the union counts a key once (not once per table).
  const RowMatrix<double> q = testing::gaussian<double>(1, 40, d),
                          k = testing::gaussian<double>(2, 40, d);
  const RowMatrix<double> v = testing::gaussian<double>(3, 40, dv);
  const LocalitySensitiveFilters<double> f(RotationKind::dense, d, 16, 4, 5);
  LsfOptions by_alpha, by_eta;
  by_alpha.alpha = 0.7;
  by_eta.eta = randattn::filter_threshold(0.7, 16);
  CHECK(randattn::lsf_attention(f, q, k, v, by_alpha) ==
        randattn::lsf_attention(f, q, k, v, by_eta));
  CHECK(rel_error(randattn::lsf_attention(f, q, k, v, by_eta),
                  reference<double>(f, q, k, v, *by_eta.eta, 1, 1 / std::sqrt(double(d)), false)) <
        1e-12);
}

TEMPLATE_TEST_CASE("Fallback: a query whose opened filters hold no valid key opens more", "[lsf]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // Causal, few keys per filter, high threshold: early queries find no past key in their best
  // filters and must fall back; every output is still a convex combination of past values.
  const Index n = 64, d = 8, m = 32;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(7, n, d),
                          k = testing::gaussian<Scalar>(8, n, d);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(9, n, 3);
  for (Index L : {1, 3}) {
    const LocalitySensitiveFilters<Scalar> f(RotationKind::hadamard, d, m, L, 4);
    LsfOptions opt;
    opt.eta = 10.0;  // no filter passes: min_probes best per table, then the fallback
    opt.causal = true;
    const randattn::LsfProbeStats st = randattn::lsf_probe_stats<Scalar>(f, q, k, opt);
    CHECK(st.fallback_queries > 0);
    CHECK(st.opened ==
          n * L + st.fallback_queries);  // one best filter per table, one fallback filter
    const RowMatrix<Scalar> out = randattn::lsf_attention(f, q, k, v, opt);
    CHECK(rel_error(out.row(0), v.row(0)) <
          testing::tolerance<Scalar>());  // position 0 has key 0 only
    CHECK(rel_error(out, reference<Scalar>(f, q, k, v, 10.0, 1, 1 / std::sqrt(double(d)), true)) <
          1e-6);
  }
}

TEMPLATE_TEST_CASE("Self-exclusion: the own key is never a target unless nothing else is valid",
                   "[lsf][exclude_self]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // K = Q: each query's best filter holds its own key, so without the rule it would be scored.
  const Index n = 70, d = 8, m = 16;
  const RowMatrix<Scalar> q = clustered<Scalar>(71, n, d, 5, 0.5);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(72, n, 3);
  const double scale = 1 / std::sqrt(double(d));
  for (Index L : {1, 3}) {
    const LocalitySensitiveFilters<Scalar> f(RotationKind::dense, d, m, L, 73);
    for (bool causal : {false, true}) {
      for (double eta : {0.5, 10.0}) {  // 10: best filters only, many fallbacks
        INFO("L " << L << " causal " << causal << " eta " << eta);
        LsfOptions opt;
        opt.eta = eta;
        opt.causal = causal;
        opt.exclude_self = true;
        Index pairs = 0;
        const RowMatrix<Scalar> out = randattn::lsf_attention(f, q, q, v, opt);
        CHECK(rel_error(out, reference<Scalar>(f, q, q, v, eta, 1, scale, causal, &pairs, true)) <
              1e-6);
        CHECK(randattn::lsf_probe_stats<Scalar>(f, q, q, opt).target_pairs == pairs);
        const randattn::TargetSets sets = randattn::lsf_target_sets<Scalar>(f, q, q, opt);
        for (Index i = 0; i < n; ++i) {
          const bool alone = causal && i == 0;
          for (Index e = sets.start[std::size_t(i)]; e < sets.start[std::size_t(i) + 1]; ++e)
            CHECK((sets.keys[std::size_t(e)] == i) == alone);
        }
        if (causal)  // position 0 has no key but its own
          CHECK(rel_error(out.row(0), v.row(0)) < testing::tolerance<Scalar>());
      }
      // Every filter opened: exact attention under the same rule.
      LsfOptions all;
      all.eta = kNegInf;
      all.causal = causal;
      all.exclude_self = true;
      randattn::ExactOptions eopt;
      eopt.causal = causal;
      eopt.exclude_self = true;
      CHECK(rel_error(randattn::lsf_attention(f, q, q, v, all),
                      randattn::exact_attention(q, q, v, eopt)) < testing::tolerance<Scalar>());
    }
    // One token: its own key is its only key.
    LsfOptions one;
    one.eta = 0.5;
    one.exclude_self = true;
    CHECK(randattn::lsf_attention(f, q.topRows(1), q.topRows(1), v.topRows(1), one) == v.topRows(1));
  }
  LsfOptions opt;
  opt.eta = 0.5;
  opt.exclude_self = true;
  const LocalitySensitiveFilters<Scalar> f(RotationKind::dense, d, m, 2, 73);
  CHECK_THROWS_AS(randattn::lsf_attention(f, q, q.topRows(n - 1), v.topRows(n - 1), opt),
                  std::invalid_argument);
}

TEMPLATE_TEST_CASE("Accumulators merge with other partial results", "[lsf]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // LSF over the first half of the keys (every filter opened) merged with exact attention over
  // the second half is exact attention over all keys.
  const Index n_q = 40, n_k = 100, d = 8, dv = 3;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(1, n_q, d),
                          k = testing::gaussian<Scalar>(2, n_k, d);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(3, n_k, dv);
  const LocalitySensitiveFilters<Scalar> f(RotationKind::dense, d, 6, 2, 1);
  LsfOptions opt;
  opt.eta = kNegInf;
  randattn::SoftmaxAccumulator<Scalar> acc =
      randattn::lsf_attention_accumulate<Scalar>(f, q, k.topRows(50), v.topRows(50), opt);
  acc.merge(randattn::exact_attention_accumulate<Scalar>(q, k.bottomRows(50), v.bottomRows(50)));
  CHECK(rel_error(acc.finalize(), randattn::exact_attention(q, k, v)) <
        testing::tolerance<Scalar>());
}

// ---------------------------------------------------------------------------------------------
// Recall of planted neighbours
// ---------------------------------------------------------------------------------------------

TEST_CASE(
    "Recall of planted neighbours rises with L, falls with η, matches the collision probability",
    "[lsf][statistical]") {
  // Unit queries q_i and keys with k_i at cosine α from q_i (the planted neighbour), the other keys
  // random: at d = 128 a random cosine is about N(0, 1/128), so k_i is the true top-1 of q_i.
  // With values v_j = j and a large scale the output is the index of the best key scored, so
  // out_i == i exactly when k_i was scored.
  const Index n = 2000, d = 128, m = 64;
  const double alpha = 0.6;
  const RowMatrix<double> q = unit(testing::gaussian<double>(101, n, d));
  const auto planted = [&](const RowMatrix<double>& x, std::uint64_t seed) {
    RowMatrix<double> w = testing::gaussian<double>(seed, x.rows(), d);
    for (Index i = 0; i < x.rows(); ++i) {
      w.row(i) -= w.row(i).dot(x.row(i)) * x.row(i);
      w.row(i).normalize();
    }
    return RowMatrix<double>(alpha * x + std::sqrt(1 - alpha * alpha) * w);
  };
  const RowMatrix<double> k = planted(q, 102);
  const RowMatrix<double> logits = q * k.transpose();
  for (Index i = 0; i < n; ++i) {
    Index best = 0;
    logits.row(i).maxCoeff(&best);
    REQUIRE(best == i);
  }
  RowMatrix<double> v(n, 1);
  for (Index j = 0; j < n; ++j) v(j, 0) = double(j);

  // Monte-Carlo estimate of the probability that a pair at cosine α collides in at least one of
  // the L tables of the same filters (key's argmax filter opened by the query), from fresh pairs.
  const Index trials = 20000;
  const RowMatrix<double> mq = unit(testing::gaussian<double>(201, trials, d));
  const RowMatrix<double> mk = planted(mq, 202);
  const auto collision_rate = [&](const LocalitySensitiveFilters<double>& f, double eta) {
    const randattn::HashCodes codes = f.assign(mk);
    std::vector<char> hit(static_cast<std::size_t>(trials), 0);
    for (Index t = 0; t < f.tables(); ++t) {
      const RowMatrix<double> s = f.scores(mq, t);
      for (Index i = 0; i < trials; ++i)
        if (opened_in_table(s, i, eta, 1).count(codes(i, t))) hit[std::size_t(i)] = 1;
    }
    return double(std::count(hit.begin(), hit.end(), 1)) / double(trials);
  };
  const auto recall = [&](const LocalitySensitiveFilters<double>& f, double eta) {
    LsfOptions opt;
    opt.eta = eta;
    opt.scale = 300.0;  // weight of a key at cosine 0.45 against 0.6: e^{-45}
    REQUIRE(randattn::lsf_probe_stats<double>(f, q, k, opt).fallback_queries == 0);
    const RowMatrix<double> out = randattn::lsf_attention(f, q, k, v, opt);
    Index found = 0;
    for (Index i = 0; i < n; ++i) found += std::abs(out(i, 0) - double(i)) < 0.5;
    return double(found) / double(n);
  };
  // Queries are independent given the filters, and so are the Monte-Carlo pairs: both rates are
  // binomial means of the same collision probability P of these filters, and their difference has
  // variance P(1 − P)(1/n + 1/trials). Four standard deviations: a false alarm has probability
  // 6e-5.
  const auto agrees = [&](double r, double p) {
    const double sd = std::sqrt(std::max(p * (1 - p), 1.0 / trials) * (1.0 / n + 1.0 / trials));
    INFO("recall " << r << " Monte-Carlo " << p << " sd " << sd);
    CHECK(std::abs(r - p) <= 4 * sd);
  };
  std::vector<double> by_tables, by_eta;
  for (Index L : {1, 2, 4}) {
    const LocalitySensitiveFilters<double> f(RotationKind::dense, d, m, L, 300);
    by_tables.push_back(recall(f, 1.5));
    agrees(by_tables.back(), collision_rate(f, 1.5));
  }
  for (double eta : {0.8, 1.5, 2.2}) {
    const LocalitySensitiveFilters<double> f(RotationKind::hadamard, d, m, 2, 301);
    by_eta.push_back(recall(f, eta));
    agrees(by_eta.back(), collision_rate(f, eta));
  }
  // The filters of fewer tables (or a higher threshold) open subsets: the recall is monotone, and
  // here strictly so.
  CHECK(by_tables[0] < by_tables[1]);
  CHECK(by_tables[1] < by_tables[2]);
  CHECK(by_eta[0] > by_eta[1]);
  CHECK(by_eta[1] > by_eta[2]);
}

// ---------------------------------------------------------------------------------------------
// Causality, batching, threads, edge cases
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("Causal: changing key j leaves outputs 0 … j−1 bit-identical", "[lsf]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 300, d = 16, dv = 6;
  const RowMatrix<Scalar> q = clustered<Scalar>(71, n, d, 5, 0.5),
                          k = clustered<Scalar>(72, n, d, 5, 0.5);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(73, n, dv);
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    const LocalitySensitiveFilters<Scalar> f(kind, d, 16, 3, 12);
    LsfOptions opt;
    opt.causal = true;
    opt.eta = 1.2;
    const RowMatrix<Scalar> a = randattn::lsf_attention(f, q, k, v, opt);
    for (Index j : {n - 1, n / 2, Index(1)}) {
      INFO("kind " << int(kind) << " j " << j);
      RowMatrix<Scalar> k2 = k, v2 = v;
      k2.row(j) = Scalar(3) * q.row(n - 1);  // found by query n − 1: later outputs change
      v2.row(j) = testing::gaussian<Scalar>(75 + j, 1, dv, 3.0);
      REQUIRE(f.assign(k2).row(j) != f.assign(k).row(j));
      const RowMatrix<Scalar> b = randattn::lsf_attention(f, q, k2, v2, opt);
      CHECK(testing::rows_bit_identical(a, b, j));
      CHECK(!testing::rows_bit_identical(a, b, n));
    }
  }
}

TEMPLATE_TEST_CASE("Batched LSF attention equals per-slice calls, for any thread count",
                   "[lsf][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const randattn::BatchShape shape{2, 3, 120, 130, 16, 7};  // batch, heads, n_q, n_k, d, dv
  const Index s = shape.slices();
  const RowMatrix<Scalar> q = clustered<Scalar>(81, s * shape.n_q, shape.d, 7, 0.6);
  const RowMatrix<Scalar> k = clustered<Scalar>(82, s * shape.n_k, shape.d, 7, 0.6);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(83, s * shape.n_k, shape.dv);
  const LocalitySensitiveFilters<Scalar> f(RotationKind::hadamard, shape.d, 32, 3, 4);
  LsfOptions opt;
  opt.alpha = 0.7;
  RowMatrix<Scalar> out(s * shape.n_q, shape.dv);
  randattn::lsf_attention_batched<Scalar>(f, q.data(), k.data(), v.data(), out.data(), shape, opt);
  for (Index i = 0; i < s; ++i) {
    const auto rows = [&](const RowMatrix<Scalar>& x, Index n) {
      return RowMatrix<Scalar>(x.middleRows(i * n, n));
    };
    CHECK(testing::rows_bit_identical(
        rows(out, shape.n_q),
        randattn::lsf_attention(f, rows(q, shape.n_q), rows(k, shape.n_k), rows(v, shape.n_k), opt),
        shape.n_q));
  }
#if defined(_OPENMP)
  // Blocks of queries (several attention tasks) and of scores run in parallel; the result must
  // not change with the thread count.
  const Index n = 9000;
  const RowMatrix<Scalar> long_q = clustered<Scalar>(84, n, shape.d, 40, 0.6);
  const RowMatrix<Scalar> long_k = clustered<Scalar>(85, n, shape.d, 40, 0.6);
  const RowMatrix<Scalar> long_v = testing::gaussian<Scalar>(86, n, shape.dv);
  const int threads = omp_get_max_threads();
  // A higher target cosine opens about 5 of the 32 filters per table instead of 24 (a seventh of
  // the pairs scored, not half): the split into tasks is what this part checks, and under the
  // sanitizers every pair costs.
  opt.alpha = 0.9;
  for (bool causal : {false, true}) {
    opt.causal = causal;
    omp_set_num_threads(1);
    const RowMatrix<Scalar> one = randattn::lsf_attention(f, long_q, long_k, long_v, opt);
    omp_set_num_threads(3);
    const RowMatrix<Scalar> three = randattn::lsf_attention(f, long_q, long_k, long_v, opt);
    omp_set_num_threads(threads);
    CHECK(testing::rows_bit_identical(one, three, n));
  }
#endif
}

TEMPLATE_TEST_CASE("LSF attention edge cases and argument checks", "[lsf]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index d = 6;
  const LocalitySensitiveFilters<Scalar> f(RotationKind::dense, d, 8, 2, 1);
  LsfOptions opt;
  opt.eta = 1.0;
  // n = 0: empty; n = 1: the query attends to the one key.
  CHECK(randattn::lsf_attention(f, RowMatrix<Scalar>(0, d), RowMatrix<Scalar>(0, d),
                                RowMatrix<Scalar>(0, 3), opt)
            .rows() == 0);
  const RowMatrix<Scalar> q1 = testing::gaussian<Scalar>(1, 1, d),
                          v1 = testing::gaussian<Scalar>(2, 1, 3);
  CHECK(rel_error(randattn::lsf_attention(f, q1, q1, v1, opt), v1) < testing::tolerance<Scalar>());
  // d = 1 (both kinds): every score is ±|a_i|.
  for (RotationKind kind : {RotationKind::dense, RotationKind::hadamard}) {
    const LocalitySensitiveFilters<Scalar> f1(kind, 1, 4, 2, 3);
    const RowMatrix<Scalar> qd = testing::gaussian<Scalar>(3, 40, 1),
                            kd = testing::gaussian<Scalar>(4, 40, 1);
    const RowMatrix<Scalar> vd = testing::gaussian<Scalar>(5, 40, 2);
    CHECK(rel_error(randattn::lsf_attention(f1, qd, kd, vd, opt),
                    reference<Scalar>(f1, qd, kd, vd, 1.0, 1, 1.0, false)) < 1e-6);
  }
  // Zero rows and huge rows: filters see directions, the output stays finite.
  RowMatrix<Scalar> q = testing::gaussian<Scalar>(5, 50, d),
                    k = testing::gaussian<Scalar>(6, 50, d);
  q.row(3).setZero();
  k.row(3).setZero();
  q.row(4) *= Scalar(1e30);
  k.row(7) *= Scalar(1e30);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(7, 50, 3);
  opt.scale = 1e-30;
  const RowMatrix<Scalar> out = randattn::lsf_attention(f, q, k, v, opt);
  CHECK(out.allFinite());
  CHECK(testing::within_value_ranges(out, v));
  opt.scale.reset();
  const auto throws = [&](const LsfOptions& o, const char* phrase) {
    try {
      randattn::lsf_attention(f, testing::gaussian<Scalar>(1, 50, d), k, v, o);
      FAIL("no exception for " << phrase);
    } catch (const std::invalid_argument& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(phrase) != std::string::npos);
    }
  };
  LsfOptions bad;
  throws(bad, "exactly one of eta and alpha");
  bad.eta = 1.0;
  bad.alpha = 0.5;
  throws(bad, "exactly one of eta and alpha");
  bad.alpha.reset();
  bad.eta = std::numeric_limits<double>::quiet_NaN();
  throws(bad, "eta");
  bad.eta = std::numeric_limits<double>::infinity();
  throws(bad, "eta");
  bad.eta.reset();
  for (double a : {0.0, 1.0, -0.5, 1.5}) {
    bad.alpha = a;
    throws(bad, "alpha");
  }
  bad.alpha = 0.5;
  bad.min_probes = 0;
  throws(bad, "min_probes");
  bad.min_probes = 9;
  throws(bad, "min_probes");
  bad.min_probes = 8;
  CHECK_NOTHROW(randattn::lsf_attention(f, q, k, v, bad));
  bad.scale = std::numeric_limits<double>::quiet_NaN();
  throws(bad, "scale");
  // Shapes and values.
  opt = LsfOptions();
  opt.eta = 1.0;
  CHECK_THROWS_AS(randattn::lsf_attention(f, testing::gaussian<Scalar>(1, 5, d + 1), k, v, opt),
                  std::invalid_argument);
  CHECK_THROWS_AS(randattn::lsf_attention(f, q, testing::gaussian<Scalar>(1, 50, d + 1), v, opt),
                  std::invalid_argument);
  CHECK_THROWS_AS(randattn::lsf_attention(f, q, k, RowMatrix<Scalar>(v.topRows(10)), opt),
                  std::invalid_argument);
  CHECK_THROWS_AS(
      randattn::lsf_attention(f, q, RowMatrix<Scalar>(0, d), RowMatrix<Scalar>(0, 3), opt),
      std::invalid_argument);
  opt.causal = true;
  CHECK_THROWS_AS(randattn::lsf_attention(f, q, RowMatrix<Scalar>(k.topRows(49)),
                                          RowMatrix<Scalar>(v.topRows(49)), opt),
                  std::invalid_argument);
  opt.causal = false;
  RowMatrix<Scalar> nan_k = k;
  nan_k(2, 2) = std::numeric_limits<Scalar>::quiet_NaN();
  try {
    randattn::lsf_attention(f, q, nan_k, v, opt);
    FAIL("no exception");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("non-finite") != std::string::npos);
  }
  // Filters: m < 1, L < 1, d < 1, a filter matrix that is not tables * m rows or not finite.
  CHECK_THROWS_AS(LocalitySensitiveFilters<Scalar>(RotationKind::dense, d, 0, 2, 1),
                  std::invalid_argument);
  CHECK_THROWS_AS(LocalitySensitiveFilters<Scalar>(RotationKind::hadamard, d, 8, 0, 1),
                  std::invalid_argument);
  CHECK_THROWS_AS(LocalitySensitiveFilters<Scalar>(RotationKind::dense, 0, 8, 2, 1),
                  std::invalid_argument);
  CHECK_THROWS_AS(LocalitySensitiveFilters<Scalar>(RowMatrix<Scalar>::Ones(7, d), 2),
                  std::invalid_argument);
  RowMatrix<Scalar> a = RowMatrix<Scalar>::Ones(8, d);
  a(1, 1) = std::numeric_limits<Scalar>::infinity();
  CHECK_THROWS_AS(LocalitySensitiveFilters<Scalar>(a, 2), std::invalid_argument);
  // A user matrix is used as is.
  const LocalitySensitiveFilters<Scalar> user(f.matrix(), 2);
  CHECK(randattn::lsf_attention(user, q, k, v, opt) == randattn::lsf_attention(f, q, k, v, opt));
  // Batched: a bad slice throws before any output is written.
  const randattn::BatchShape shape{1, 2, 50, 50, d, 3};
  RowMatrix<Scalar> qq(100, d), kk(100, d), vv(100, 3),
      oo = RowMatrix<Scalar>::Constant(100, 3, Scalar(7));
  qq << q, q;
  kk << k, nan_k;
  vv << v, v;
  CHECK_THROWS_AS(randattn::lsf_attention_batched<Scalar>(f, qq.data(), kk.data(), vv.data(),
                                                          oo.data(), shape, opt),
                  std::invalid_argument);
  CHECK((oo.array() == Scalar(7)).all());
}

TEMPLATE_TEST_CASE("lsf_attention_into equals lsf_attention bit for bit and checks out",
                   "[lsf][into]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using Refs = std::vector<Eigen::Ref<const RowMatrix<Scalar>>>;
  const RowMatrix<Scalar> q = clustered<Scalar>(91, 50, 8, 4, 0.4),
                          k = clustered<Scalar>(92, 50, 8, 4, 0.4),
                          v = testing::gaussian<Scalar>(93, 50, 3);
  const LocalitySensitiveFilters<Scalar> f(RotationKind::dense, 8, 9, 2, 94);
  for (const bool causal : {false, true}) {
    INFO("causal " << causal);
    LsfOptions opt;
    opt.causal = causal;
    opt.alpha = 0.6;
    testing::check_into_form<Scalar>(
        randattn::lsf_attention(f, q, k, v, opt), {q, k, v}, {"q", "k", "v"},
        [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
          randattn::lsf_attention_into(f, in[0], in[1], in[2], out, opt);
        });
  }
}
