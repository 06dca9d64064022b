// Backward of LSH and LSF attention against central finite differences of the same seeded call
// (tests/gradient_check.hpp), in double. The hashes, chunks and filters are held constant by the
// backward; every finite difference checks that its perturbation left them unchanged (the hash
// codes for LSH, the target sets and probe counts for LSF), so a difference never straddles a
// change of bucket.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <randattn/registry/methods/lsf.hpp>
#include <randattn/registry/methods/lsh.hpp>
#include <randattn/registry/registry.hpp>

#include "gradient_check.hpp"
#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::CrossPolytopeHash;
using randattn::HashCodes;
using randattn::Index;
using randattn::LocalitySensitiveFilters;
using randattn::LsfOptions;
using randattn::LshOptions;
using randattn::RotationKind;
using randattn::RowMatrix;

namespace {

using Mat = RowMatrix<double>;

// check_gradient on a subset of x's rows (all of them when `rows` is empty): the other rows keep
// their values, f sees the whole x.
void check_rows(const std::string& what, Mat& x, const Mat& grad, const std::vector<Index>& rows,
                const std::function<double()>& f) {
  if (rows.empty()) {
    testing::check_gradient(what, x, grad, f);
    return;
  }
  Mat xs(Index(rows.size()), x.cols()), gs(Index(rows.size()), x.cols());
  for (std::size_t t = 0; t < rows.size(); ++t) {
    xs.row(Index(t)) = x.row(rows[t]);
    gs.row(Index(t)) = grad.row(rows[t]);
  }
  testing::check_gradient(what, xs, gs, [&] {
    for (std::size_t t = 0; t < rows.size(); ++t) x.row(rows[t]) = xs.row(Index(t));
    const double value = f();
    return value;
  });
  for (std::size_t t = 0; t < rows.size(); ++t) x.row(rows[t]) = xs.row(Index(t));
}

// Every `step`-th row, and the last.
std::vector<Index> spread_rows(Index n, Index step) {
  std::vector<Index> rows;
  if (step <= 1) return rows;
  for (Index i = 0; i < n; i += step) rows.push_back(i);
  if (rows.back() != n - 1) rows.push_back(n - 1);
  return rows;
}

struct LshCase {
  Index n = 37, n_k = 37, d = 6, dv = 5, chunk = 8, rounds = 3;
  bool shared = false, causal = false, exact_buckets = false, dedupe = true, exclude_self = false;
  Index row_step = 1;  // check every row_step-th row
};

std::string describe(const LshCase& c) {
  return std::string(c.shared ? "shared" : "separate") + (c.causal ? " causal" : "") +
         (c.exact_buckets ? " buckets" : " chunks") + (c.dedupe ? " union" : " multiset") +
         (c.exclude_self ? " exclude_self" : "") + " n=" + std::to_string(c.n) +
         " n_k=" + std::to_string(c.n_k) + " c=" + std::to_string(c.chunk) +
         " r=" + std::to_string(c.rounds);
}

// LSH attention's gradients, each entry against finite differences; returns the residuals'
// fallback and self-rule row counts.
std::pair<std::size_t, std::size_t> check_lsh(const LshCase& c) {
  INFO(describe(c));
  Mat q = testing::clustered<double>(11, c.n, c.d, 5, 0.6);
  Mat k = c.shared ? Mat(0, c.d) : testing::clustered<double>(12, c.n_k, c.d, 5, 0.6);
  Mat v = testing::gaussian<double>(13, c.n_k, c.dv);
  const Mat g = testing::gaussian<double>(14, c.n, c.dv);
  const CrossPolytopeHash<double> hash(RotationKind::dense, c.d,
                                       randattn::reformer_buckets(c.n_k, c.chunk), c.rounds, 3);
  LshOptions opt;
  opt.chunk = c.chunk;
  opt.causal = c.causal;
  opt.exact_buckets = c.exact_buckets;
  opt.dedupe = c.dedupe;
  opt.exclude_self = c.exclude_self;
  Mat out(c.n, c.dv), dq(c.n, c.d), dk(c.n_k, c.d), dv(c.n_k, c.dv);
  const auto saved = c.shared ? randattn::lsh_attention_forward<double>(hash, q, v, out, opt)
                              : randattn::lsh_attention_forward<double>(hash, q, k, v, out, opt);
  // The saving forward writes lsh_attention's bits.
  const Mat plain = c.shared ? randattn::lsh_attention(hash, q, v, opt)
                             : randattn::lsh_attention(hash, q, k, v, opt);
  CHECK(out == plain);
  if (c.shared)
    randattn::lsh_attention_backward<double>(saved, q, v, out, g, dq, dv);
  else
    randattn::lsh_attention_backward<double>(saved, q, k, v, out, g, dq, dk, dv);
  const HashCodes qcodes = hash.hash(q, false);
  const HashCodes kcodes = c.shared ? HashCodes() : hash.hash(k, false);
  int moved = 0;  // perturbations that changed a hash code
  const auto f = [&] {
    if (hash.hash(q, false) != qcodes || (!c.shared && hash.hash(k, false) != kcodes)) ++moved;
    const Mat o = c.shared ? randattn::lsh_attention(hash, q, v, opt)
                           : randattn::lsh_attention(hash, q, k, v, opt);
    return testing::contract(g, o);
  };
  check_rows("dq", q, dq, spread_rows(c.n, c.row_step), f);
  if (!c.shared) check_rows("dk", k, dk, spread_rows(c.n_k, c.row_step), f);
  check_rows("dv", v, dv, spread_rows(c.n_k, c.row_step), f);
  CHECK(moved == 0);
  return {saved.choices.fallback_rows.size(), saved.choices.self_rows.size()};
}

}  // namespace

TEST_CASE("LSH backward equals finite differences: chunks and buckets, union and multiset",
          "[gradients][lsh]") {
  std::size_t fallback = 0, self = 0;
  for (bool shared : {false, true})
    for (bool causal : {false, true})
      for (bool buckets : {false, true})
        for (bool dedupe : {true, false}) {
          LshCase c;
          c.shared = shared;
          c.causal = causal;
          c.exact_buckets = buckets;
          c.dedupe = dedupe;
          const auto [f, s] = check_lsh(c);
          fallback += f;
          self += s;
        }
  // The fallback (separate keys, causal) and the self rule (shared, causal row 0) were exercised.
  CHECK(fallback > 0);
  CHECK(self > 0);
}

TEST_CASE("LSH backward at n = 300, chunk 64, two rounds", "[gradients][lsh]") {
  for (bool shared : {false, true})
    for (bool causal : {false, true}) {
      LshCase c;
      c.n = c.n_k = 300;
      c.d = 4;
      c.dv = 3;
      c.chunk = 64;
      c.rounds = 2;
      c.shared = shared;
      c.causal = causal;
      c.row_step = 23;
      check_lsh(c);
    }
}

TEST_CASE("LSH backward: more keys than queries, exclude_self, tabled pair counts",
          "[gradients][lsh]") {
  LshCase fewer;
  fewer.n_k = 53;  // key chunks of ceil(8 * 53 / 37) = 12
  check_lsh(fewer);
  fewer.exact_buckets = true;
  check_lsh(fewer);
  LshCase self;
  self.causal = true;
  self.exclude_self = true;
  check_lsh(self);
  for (bool buckets : {false, true}) {  // beyond kCountTableRounds rounds: counts from a table
    LshCase many;
    many.n = many.n_k = 14;
    many.d = 2;
    many.dv = 2;
    many.chunk = 4;
    many.rounds = randattn::detail::kCountTableRounds + 2;
    many.exact_buckets = buckets;
    many.shared = buckets;
    check_lsh(many);
  }
}

TEST_CASE("LSH backward: float within 1e-4 of double, thread count, bad gradients",
          "[gradients][lsh]") {
  const Index n = 300, d = 8, dv = 6;
  const Mat q = testing::clustered<double>(21, n, d, 6, 0.5), k = testing::clustered<double>(22, n, d, 6, 0.5);
  const Mat v = testing::gaussian<double>(23, n, dv), g = testing::gaussian<double>(24, n, dv);
  LshOptions opt;
  opt.chunk = 64;
  opt.causal = true;
  const CrossPolytopeHash<double> hd(RotationKind::dense, d, 10, 3, 4);
  const CrossPolytopeHash<float> hf(RotationKind::dense, d, 10, 3, 4);
  const RowMatrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>(),
                         gf = g.cast<float>();
  REQUIRE(hd.hash(q, false) == hf.hash(qf, false));  // same buckets in both types
  REQUIRE(hd.hash(k, false) == hf.hash(kf, false));
  Mat out(n, dv), dq(n, d), dk(n, d), dvv(n, dv);
  const auto sd = randattn::lsh_attention_forward<double>(hd, q, k, v, out, opt);
  randattn::lsh_attention_backward<double>(sd, q, k, v, out, g, dq, dk, dvv);
  RowMatrix<float> outf(n, dv), dqf(n, d), dkf(n, d), dvf(n, dv);
  const auto sf = randattn::lsh_attention_forward<float>(hf, qf, kf, vf, outf, opt);
  randattn::lsh_attention_backward<float>(sf, qf, kf, vf, outf, gf, dqf, dkf, dvf);
  // float rounding (6e-8) times the few hundred terms of a row's softmax and products.
  CHECK(testing::rel_error(dqf, dq) < 1e-4);
  CHECK(testing::rel_error(dkf, dk) < 1e-4);
  CHECK(testing::rel_error(dvf, dvv) < 1e-4);
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  RowMatrix<float> dq1(n, d), dk1(n, d), dv1(n, dv);
  randattn::lsh_attention_backward<float>(sf, qf, kf, vf, outf, gf, dq1, dk1, dv1);
  omp_set_num_threads(3);
  RowMatrix<float> dq3(n, d), dk3(n, d), dv3(n, dv);
  randattn::lsh_attention_backward<float>(sf, qf, kf, vf, outf, gf, dq3, dk3, dv3);
  omp_set_num_threads(threads);
  CHECK(dq1 == dq3);
  CHECK(dk1 == dk3);
  CHECK(dv1 == dv3);
#endif
  // Wrong shapes and a non-finite grad_out are refused before anything is written.
  Mat dq0 = Mat::Constant(n, d, 7);
  CHECK_THROWS_AS(randattn::lsh_attention_backward<double>(sd, q, k, v, out, g.topRows(n - 1), dq0,
                                                           dk, dvv),
                  std::invalid_argument);
  Mat bad = g;
  bad(3, 1) = NAN;
  CHECK_THROWS_AS(randattn::lsh_attention_backward<double>(sd, q, k, v, out, bad, dq0, dk, dvv),
                  std::invalid_argument);
  Mat small(n, d - 1);
  CHECK_THROWS_AS(randattn::lsh_attention_backward<double>(sd, q, k, v, out, g, dq0, small, dvv),
                  std::invalid_argument);
  CHECK((dq0.array() == 7).all());
  CHECK_THROWS_AS(randattn::lsh_attention_backward<double>(sd, q, v, out, g, dq0, dvv),
                  std::invalid_argument);  // shared-QK form on a separate-key forward
}

namespace {

struct LsfCase {
  Index n = 37, n_k = 37, d = 6, dv = 5, filters = 8, tables = 3, min_probes = 1;
  double eta = 0.4;
  bool causal = false, exclude_self = false;
  Index row_step = 1;
  int directions = 0;  // > 0: check that many random directions instead of entries
  Index clusters = 5;
};

// What the filters chose: the target sets and the probe counts (opened filters, logits scored).
std::vector<std::int64_t> filter_choices(const LocalitySensitiveFilters<double>& filters,
                                         const Mat& q, const Mat& k, const LsfOptions& opt) {
  const randattn::TargetSets sets = randattn::lsf_target_sets<double>(filters, q, k, opt);
  const randattn::LsfProbeStats st = randattn::lsf_probe_stats<double>(filters, q, k, opt);
  std::vector<std::int64_t> out{st.opened, st.logits, st.fallback_queries};
  out.insert(out.end(), sets.start.begin(), sets.start.end());
  out.insert(out.end(), sets.keys.begin(), sets.keys.end());
  return out;
}

// LSF attention's gradients against finite differences; returns them (dq, dk, dv).
std::vector<Mat> check_lsf(const LsfCase& c) {
  INFO("LSF n=" << c.n << " n_k=" << c.n_k << " L=" << c.tables << " eta=" << c.eta
                << (c.causal ? " causal" : "") << (c.exclude_self ? " exclude_self" : ""));
  Mat q = testing::clustered<double>(31, c.n, c.d, c.clusters, 0.6);
  Mat k = testing::clustered<double>(32, c.n_k, c.d, c.clusters, 0.6);
  Mat v = testing::gaussian<double>(33, c.n_k, c.dv);
  const Mat g = testing::gaussian<double>(34, c.n, c.dv);
  const LocalitySensitiveFilters<double> filters(RotationKind::dense, c.d, c.filters, c.tables, 8);
  LsfOptions opt;
  opt.eta = c.eta;
  opt.min_probes = c.min_probes;
  opt.causal = c.causal;
  opt.exclude_self = c.exclude_self;
  Mat out(c.n, c.dv), dq(c.n, c.d), dk(c.n_k, c.d), dv(c.n_k, c.dv);
  const auto saved = randattn::lsf_attention_forward<double>(filters, q, k, v, out, opt);
  CHECK(out == randattn::lsf_attention(filters, q, k, v, opt));  // lsf_attention's bits
  randattn::lsf_attention_backward<double>(saved, q, k, v, out, g, dq, dk, dv);
  const std::vector<std::int64_t> chosen = filter_choices(filters, q, k, opt);
  int moved = 0;  // perturbations that changed a filter choice
  const auto f = [&] {
    if (filter_choices(filters, q, k, opt) != chosen) ++moved;
    return testing::contract(g, randattn::lsf_attention(filters, q, k, v, opt));
  };
  if (c.directions > 0) {
    testing::check_directions("lsf", {&q, &k, &v}, {dq, dk, dv}, f, c.directions, 35);
  } else {
    check_rows("dq", q, dq, spread_rows(c.n, c.row_step), f);
    check_rows("dk", k, dk, spread_rows(c.n_k, c.row_step), f);
    check_rows("dv", v, dv, spread_rows(c.n_k, c.row_step), f);
  }
  CHECK(moved == 0);
  return {dq, dk, dv};
}

// Exact softmax attention's gradients in double, dense (small n only).
std::vector<Mat> exact_gradients(const Mat& q, const Mat& k, const Mat& v, const Mat& g,
                                 double scale, bool causal) {
  Mat s = scale * q * k.transpose();
  for (Index i = 0; i < s.rows(); ++i)
    for (Index j = i + 1; causal && j < s.cols(); ++j) s(i, j) = -INFINITY;
  Mat p = (s.colwise() - s.rowwise().maxCoeff()).array().exp();
  p.array().colwise() /= p.rowwise().sum().array();
  const Mat o = p * v;
  const Mat dp = g * v.transpose();
  const Eigen::VectorXd dot = (g.array() * o.array()).rowwise().sum();
  const Mat ds = p.array() * (dp.array().colwise() - dot.array());
  return {scale * ds * k, scale * ds.transpose() * q, p.transpose() * g};
}

}  // namespace

TEST_CASE("LSF backward equals finite differences: partial probes, causal, exclude_self",
          "[gradients][lsf]") {
  for (bool causal : {false, true})
    for (Index tables : {1, 3}) {
      LsfCase c;
      c.causal = causal;
      c.tables = tables;
      check_lsf(c);
    }
  LsfCase self;
  self.causal = true;
  self.exclude_self = true;
  self.min_probes = 2;
  check_lsf(self);
  LsfCase fewer;  // fewer keys than queries, a high threshold: min_probes and the fallback
  fewer.n_k = 23;
  fewer.eta = 2.0;
  check_lsf(fewer);
}

TEST_CASE("LSF backward with eta = -inf is exact attention's gradient", "[gradients][lsf]") {
  for (bool causal : {false, true}) {
    LsfCase c;
    c.eta = -INFINITY;
    c.causal = causal;
    c.row_step = 9;
    const std::vector<Mat> grads = check_lsf(c);
    const Mat q = testing::clustered<double>(31, c.n, c.d, 5, 0.6);
    const Mat k = testing::clustered<double>(32, c.n_k, c.d, 5, 0.6);
    const Mat v = testing::gaussian<double>(33, c.n_k, c.dv);
    const Mat g = testing::gaussian<double>(34, c.n, c.dv);
    const std::vector<Mat> exact = exact_gradients(q, k, v, g, 1 / std::sqrt(double(c.d)), causal);
    for (std::size_t t = 0; t < 3; ++t) CHECK(testing::rel_error(grads[t], exact[t]) < 1e-12);
  }
}

TEST_CASE("LSF backward at n = 300", "[gradients][lsf]") {
  for (bool causal : {false, true}) {
    LsfCase c;
    c.n = c.n_k = 300;
    c.d = 4;
    c.dv = 3;
    c.filters = 16;
    c.tables = 2;
    c.eta = 0.5;
    c.causal = causal;
    c.row_step = 37;
    check_lsf(c);
  }
}

TEST_CASE("LSF backward: float within 1e-4 of double, thread count", "[gradients][lsf]") {
  const Index n = 300, d = 8, dv = 6;
  const Mat q = testing::clustered<double>(41, n, d, 6, 0.5), k = testing::clustered<double>(42, n, d, 6, 0.5);
  const Mat v = testing::gaussian<double>(43, n, dv), g = testing::gaussian<double>(44, n, dv);
  const LocalitySensitiveFilters<double> fd(RotationKind::dense, d, 16, 3, 4);
  const LocalitySensitiveFilters<float> ff(RotationKind::dense, d, 16, 3, 4);
  LsfOptions opt;
  opt.eta = 0.6;
  opt.causal = true;
  const RowMatrix<float> qf = q.cast<float>(), kf = k.cast<float>(), vf = v.cast<float>(),
                         gf = g.cast<float>();
  // The same choices in both types.
  REQUIRE(randattn::lsf_target_sets<double>(fd, q, k, opt).keys ==
          randattn::lsf_target_sets<float>(ff, qf, kf, opt).keys);
  Mat out(n, dv), dq(n, d), dk(n, d), dvv(n, dv);
  const auto sd = randattn::lsf_attention_forward<double>(fd, q, k, v, out, opt);
  randattn::lsf_attention_backward<double>(sd, q, k, v, out, g, dq, dk, dvv);
  RowMatrix<float> outf(n, dv), dqf(n, d), dkf(n, d), dvf(n, dv);
  const auto sf = randattn::lsf_attention_forward<float>(ff, qf, kf, vf, outf, opt);
  randattn::lsf_attention_backward<float>(sf, qf, kf, vf, outf, gf, dqf, dkf, dvf);
  CHECK(testing::rel_error(dqf, dq) < 1e-4);
  CHECK(testing::rel_error(dkf, dk) < 1e-4);
  CHECK(testing::rel_error(dvf, dvv) < 1e-4);
#if defined(_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  RowMatrix<float> dq1(n, d), dk1(n, d), dv1(n, dv);
  randattn::lsf_attention_backward<float>(sf, qf, kf, vf, outf, gf, dq1, dk1, dv1);
  omp_set_num_threads(3);
  RowMatrix<float> dq3(n, d), dk3(n, d), dv3(n, dv);
  randattn::lsf_attention_backward<float>(sf, qf, kf, vf, outf, gf, dq3, dk3, dv3);
  omp_set_num_threads(threads);
  CHECK(dq1 == dq3);
  CHECK(dk1 == dk3);
  CHECK(dv1 == dv3);
#endif
  Mat bad = g;
  bad(0, 0) = INFINITY;
  Mat dq0 = Mat::Constant(n, d, 7);
  CHECK_THROWS_AS(randattn::lsf_attention_backward<double>(sd, q, k, v, out, bad, dq0, dk, dvv),
                  std::invalid_argument);
  CHECK((dq0.array() == 7).all());
}

namespace {

namespace reg = randattn::registry;

// The registered method's gradient on a (2, 2, n, d) call: its forward writes the job's bits,
// and its backward equals, slice by slice, the library's backward with the same seeded hash or
// filters (itself checked against finite differences above).
template <typename Scalar>
void check_registry(const std::string& name, std::map<std::string, reg::Value> options,
                    bool shared_qk, bool causal) {
  INFO(name << (shared_qk ? " shared" : "") << (causal ? " causal" : ""));
  const reg::Spelling python{false};
  const randattn::BatchShape shape{2, 2, 37, 37, 6, 5};
  const reg::Method& method = reg::find_method(name, python);
  REQUIRE(method.differentiable());
  reg::Settings settings;
  settings.causal = causal;
  settings.shared_qk = shared_qk;
  settings.seed = 9;
  settings.scale = reg::default_scale(shape.d);
  const reg::Call call = reg::make_call(method, options, settings, shape, python);
  const Index nq = shape.slices() * shape.n_q, nk = shape.slices() * shape.n_k;
  const RowMatrix<Scalar> q = testing::clustered<Scalar>(51, nq, shape.d, 5, 0.6);
  const RowMatrix<Scalar> k = testing::clustered<Scalar>(52, nk, shape.d, 5, 0.6);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(53, nk, shape.dv);
  const RowMatrix<Scalar> g = testing::gaussian<Scalar>(54, nq, shape.dv);
  const Scalar* kp = shared_qk ? nullptr : k.data();
  RowMatrix<Scalar> job_out(nq, shape.dv), out(nq, shape.dv);
  method.build(call, Scalar())(q.data(), kp, v.data(), job_out.data());
  const reg::GradientPtr<Scalar> grad = method.build_gradient(call, Scalar());
  grad->forward(q.data(), kp, v.data(), out.data());
  CHECK(out == job_out);
  RowMatrix<Scalar> dq(nq, shape.d), dk(nk, shape.d), dv(nk, shape.dv);
  grad->backward(g.data(), dq.data(), shared_qk ? nullptr : dk.data(), dv.data());
  for (Index s = 0; s < shape.slices(); ++s) {
    const auto rows = [&](const RowMatrix<Scalar>& x, Index n) { return x.middleRows(s * n, n); };
    RowMatrix<Scalar> o(shape.n_q, shape.dv), dqs(shape.n_q, shape.d), dks(shape.n_k, shape.d),
        dvs(shape.n_k, shape.dv);
    if (name == "lsh") {
      const auto hash = reg::LshMethod::make_hash<Scalar>(call);
      const LshOptions opt = reg::LshMethod::make_options(call);
      if (shared_qk) {
        const auto saved = randattn::lsh_attention_forward<Scalar>(hash, rows(q, shape.n_q),
                                                                   rows(v, shape.n_k), o, opt);
        randattn::lsh_attention_backward<Scalar>(saved, rows(q, shape.n_q), rows(v, shape.n_k), o,
                                                 rows(g, shape.n_q), dqs, dvs);
      } else {
        const auto saved = randattn::lsh_attention_forward<Scalar>(
            hash, rows(q, shape.n_q), rows(k, shape.n_k), rows(v, shape.n_k), o, opt);
        randattn::lsh_attention_backward<Scalar>(saved, rows(q, shape.n_q), rows(k, shape.n_k),
                                                 rows(v, shape.n_k), o, rows(g, shape.n_q), dqs,
                                                 dks, dvs);
      }
    } else {
      const auto filters = reg::LsfMethod::make_filters<Scalar>(call);
      const LsfOptions opt = reg::LsfMethod::make_options(call);
      const auto saved = randattn::lsf_attention_forward<Scalar>(
          filters, rows(q, shape.n_q), rows(k, shape.n_k), rows(v, shape.n_k), o, opt);
      randattn::lsf_attention_backward<Scalar>(saved, rows(q, shape.n_q), rows(k, shape.n_k),
                                               rows(v, shape.n_k), o, rows(g, shape.n_q), dqs,
                                               dks, dvs);
    }
    CHECK(rows(dq, shape.n_q) == dqs);
    if (!shared_qk) CHECK(rows(dk, shape.n_k) == dks);
    CHECK(rows(dv, shape.n_k) == dvs);
  }
  RowMatrix<Scalar> bad = g;
  bad(5, 2) = std::numeric_limits<Scalar>::quiet_NaN();
  CHECK_THROWS_AS(grad->backward(bad.data(), dq.data(), shared_qk ? nullptr : dk.data(), dv.data()),
                  std::invalid_argument);
}

}  // namespace

TEST_CASE("Registry: lsh and lsf are differentiable, forward bits equal the job's",
          "[gradients][lsh][lsf]") {
  for (bool causal : {false, true}) {
    check_registry<double>("lsh", {{"chunk", std::int64_t(8)}, {"rounds", std::int64_t(2)}},
                           true, causal);
    check_registry<float>("lsh", {{"chunk", std::int64_t(8)}, {"rounds", std::int64_t(2)}},
                          false, causal);
    check_registry<double>("lsh",
                           {{"chunk", std::int64_t(8)},
                            {"rounds", std::int64_t(3)},
                            {"exact_buckets", true},
                            {"dedupe", false}},
                           false, causal);
    check_registry<float>(
        "lsf", {{"filters", std::int64_t(8)}, {"tables", std::int64_t(2)}, {"eta", 0.3}}, false,
        causal);
  }
}
