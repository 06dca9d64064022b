// The backward pass of exact attention (include/randattn/core/exact_backward.hpp) and the
// registry's differentiable "exact": gradients against central finite differences in double,
// with blocks small enough for several blocks and a ragged last one, causal and not, with
// exclude_self and with n_q != n_k; float against double; edge cases and rejected input.
#include <randattn/core/exact_backward.hpp>
#include <randattn/registry/registry.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "gradient_check.hpp"
#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using randattn::ExactOptions;
using randattn::Index;
using randattn::RowMatrix;
using randattn::Vector;

template <typename Scalar>
struct ExactProblem {
  RowMatrix<Scalar> q, k, v, grad_out;
};

template <typename Scalar>
ExactProblem<Scalar> problem(Index n_q, Index n_k, Index d, Index dv, std::uint64_t seed = 1) {
  return {testing::gaussian<Scalar>(seed, n_q, d), testing::gaussian<Scalar>(seed + 1, n_k, d),
          testing::gaussian<Scalar>(seed + 2, n_k, dv),
          testing::gaussian<Scalar>(seed + 3, n_q, dv)};
}

template <typename Scalar>
struct Gradients {
  RowMatrix<Scalar> dq, dk, dv;
};

// The forward that keeps the row log-sum-exps, then the backward.
template <typename Scalar>
Gradients<Scalar> backward(const ExactProblem<Scalar>& p, const ExactOptions& opt) {
  RowMatrix<Scalar> out(p.q.rows(), p.v.cols());
  const Vector<Scalar> lse = randattn::exact_attention_forward_into(p.q, p.k, p.v, out, opt);
  Gradients<Scalar> g{RowMatrix<Scalar>(p.q.rows(), p.q.cols()),
                      RowMatrix<Scalar>(p.k.rows(), p.k.cols()),
                      RowMatrix<Scalar>(p.v.rows(), p.v.cols())};
  randattn::exact_attention_backward<Scalar>(p.q, p.k, p.v, out, lse, p.grad_out, g.dq, g.dk, g.dv,
                                             opt);
  return g;
}

// The rows `rows` of m.
RowMatrix<double> rows_of(const RowMatrix<double>& m, const std::vector<Index>& rows) {
  RowMatrix<double> out(Index(rows.size()), m.cols());
  for (std::size_t t = 0; t < rows.size(); ++t) out.row(Index(t)) = m.row(rows[t]);
  return out;
}

// Central differences of <grad_out, exact_attention(q, k, v)> against the backward, for every
// entry of the given rows of q, k and v (all rows when a list is empty).
void check_against_differences(ExactProblem<double>& p, const ExactOptions& opt,
                               std::vector<Index> q_rows = {}, std::vector<Index> k_rows = {}) {
  const testing::OneThread one_thread;
  const auto all = [](Index n) {
    std::vector<Index> r(static_cast<std::size_t>(n));
    for (Index i = 0; i < n; ++i) r[std::size_t(i)] = i;
    return r;
  };
  if (q_rows.empty()) q_rows = all(p.q.rows());
  if (k_rows.empty()) k_rows = all(p.k.rows());
  const Gradients<double> g = backward(p, opt);
  const auto objective = [&] {
    return testing::contract(p.grad_out, randattn::exact_attention(p.q, p.k, p.v, opt));
  };
  const auto check = [&](const char* name, RowMatrix<double>& input, const RowMatrix<double>& grad,
                         const std::vector<Index>& rows) {
    RowMatrix<double> x = rows_of(input, rows);
    testing::check_gradient(name, x, rows_of(grad, rows), [&] {
      for (std::size_t t = 0; t < rows.size(); ++t) input.row(rows[t]) = x.row(Index(t));
      return objective();
    });
    for (std::size_t t = 0; t < rows.size(); ++t) input.row(rows[t]) = x.row(Index(t));
  };
  check("dq", p.q, g.dq, q_rows);
  check("dk", p.k, g.dk, k_rows);
  check("dv", p.v, g.dv, k_rows);
}

ExactOptions options(bool causal, bool exclude_self, Index block) {
  ExactOptions opt;
  opt.causal = causal;
  opt.exclude_self = exclude_self;
  opt.block_size = block;
  return opt;
}

// Message of the std::invalid_argument fn throws ("" if none).
template <typename Fn>
std::string invalid_argument_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("Exact backward equals finite differences at n = 37 with blocks of 8",
          "[gradients][exact]") {
  // Blocks of 8: five query and key blocks, the last one of 5 rows.
  for (const bool causal : {false, true})
    for (const bool exclude_self : {false, true}) {
      CAPTURE(causal, exclude_self);
      ExactProblem<double> p = problem<double>(37, 37, 3, 2);
      check_against_differences(p, options(causal, exclude_self, 8));
    }
  // More queries than keys, and fewer.
  for (const auto& [n_q, n_k] : {std::pair<Index, Index>{37, 21}, {21, 37}}) {
    CAPTURE(n_q, n_k);
    ExactProblem<double> p = problem<double>(n_q, n_k, 3, 2, 7);
    check_against_differences(p, options(false, false, 8));
  }
}

TEST_CASE("Exact backward equals finite differences at n = 300 with the default block",
          "[gradients][exact]") {
  // Blocks of 128: 128, 128, 44. Rows at both sides of each block edge and the last one.
  const std::vector<Index> rows{0, 1, 127, 128, 200, 255, 256, 299};
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    ExactProblem<double> p = problem<double>(300, 300, 4, 3, 11);
    check_against_differences(p, options(causal, false, 0), rows, rows);
  }
  // exclude_self, causal.
  ExactProblem<double> self = problem<double>(300, 300, 4, 3, 13);
  check_against_differences(self, options(true, true, 0), rows, rows);
  // n_q != n_k.
  ExactProblem<double> wide = problem<double>(300, 259, 4, 3, 17);
  check_against_differences(wide, options(false, false, 0), rows, {0, 127, 128, 258});
}

TEST_CASE("Exact backward at the edges: one key, d = 1, no queries, large logits",
          "[gradients][exact]") {
  SECTION("one key, and d = dv = 1") {
    for (const bool exclude_self : {false, true}) {
      ExactProblem<double> one = problem<double>(exclude_self ? 1 : 5, 1, 2, 2, 3);
      check_against_differences(one, options(false, exclude_self, 0));
    }
    ExactProblem<double> narrow = problem<double>(19, 19, 1, 1, 5);
    check_against_differences(narrow, options(true, false, 4));
  }
  SECTION("no queries: zero key and value gradients") {
    const ExactProblem<double> p = problem<double>(0, 6, 3, 2);
    const Gradients<double> g = backward(p, ExactOptions{});
    CHECK(g.dq.size() == 0);
    CHECK(g.dk.isZero(0));
    CHECK(g.dv.isZero(0));
  }
  SECTION("logits of a thousand: finite, and the dense gradient") {
    // Rows of norm ~ 100 with the scale 1/sqrt(d): logits up to ~1e4, far beyond exp's range.
    ExactProblem<double> p = problem<double>(41, 41, 4, 3, 23);
    p.q *= 100;
    p.k *= 100;
    const ExactOptions opt = options(true, false, 8);
    const Gradients<double> g = backward(p, opt);
    REQUIRE(g.dq.allFinite());
    REQUIRE(g.dk.allFinite());
    REQUIRE(g.dv.allFinite());
    // Dense softmax with its row maxima subtracted (causal mask), and its gradient.
    const double scale = 0.5;
    RowMatrix<double> s = scale * p.q * p.k.transpose();
    for (Index i = 0; i < s.rows(); ++i) {
      s.row(i).tail(s.cols() - i - 1).setConstant(-INFINITY);
      s.row(i).array() = (s.row(i).array() - s.row(i).maxCoeff()).exp();
      s.row(i) /= s.row(i).sum();
    }
    const RowMatrix<double> out = s * p.v;
    const Eigen::VectorXd delta = (p.grad_out.array() * out.array()).rowwise().sum();
    const RowMatrix<double> ds =
        s.array() * ((p.grad_out * p.v.transpose()).array().colwise() - delta.array());
    // A logit of 1e4 carries an absolute rounding error of about (d + 1)·1e4·2^-53 ≈ 6e-12, and
    // so does each probability relatively: 1e-10 leaves a margin.
    CHECK(testing::rel_error(g.dv, RowMatrix<double>(s.transpose() * p.grad_out)) < 1e-10);
    // Nearly one-hot rows: ds is a difference of nearly equal terms, so compare with its scale.
    const RowMatrix<double> dq = scale * ds * p.k, dk = scale * ds.transpose() * p.q;
    // Rows whose probabilities are exactly 0 and 1 have dS = 0 up to rounding of dP − D, which
    // is of size 2^-53·|dO||v|: the absolute floor.
    const double floor = 1e-13 * p.grad_out.norm() * p.v.norm() * (p.q.norm() + p.k.norm());
    CHECK((g.dq - dq).norm() <= 1e-10 * (scale * ds.cwiseAbs() * p.k.cwiseAbs()).norm() + floor);
    CHECK((g.dk - dk).norm() <=
          1e-10 * (scale * ds.cwiseAbs().transpose() * p.q.cwiseAbs()).norm() + floor);
  }
  SECTION("a row without weight (lse = -inf) contributes nothing") {
    const ExactProblem<double> p = problem<double>(20, 20, 3, 2, 29);
    const ExactOptions opt = options(false, false, 8);
    RowMatrix<double> out(20, 2);
    Vector<double> lse = randattn::exact_attention_forward_into(p.q, p.k, p.v, out, opt);
    lse(6) = -std::numeric_limits<double>::infinity();
    out.row(6).setZero();
    Gradients<double> g{RowMatrix<double>(20, 3), RowMatrix<double>(20, 3), RowMatrix<double>(20, 2)};
    randattn::exact_attention_backward<double>(p.q, p.k, p.v, out, lse, p.grad_out, g.dq, g.dk,
                                               g.dv, opt);
    // The same as the gradients with row 6's incoming gradient zero.
    ExactProblem<double> without = p;
    without.grad_out.row(6).setZero();
    const Gradients<double> expected = backward(without, opt);
    CHECK(g.dq.row(6).isZero(0));
    CHECK(testing::rel_error(g.dq, expected.dq) < 1e-14);
    CHECK(testing::rel_error(g.dk, expected.dk) < 1e-14);
    CHECK(testing::rel_error(g.dv, expected.dv) < 1e-14);
  }
}

TEST_CASE("Exact backward in float is within its rounding bound of double", "[gradients][exact]") {
  // The same inputs (float values) in both types. Each gradient entry is a sum over the n keys
  // (dK, dV: over the n queries) of products formed from a score s = scale·q·k (d terms), its
  // probability exp(s − L) and dP = dO·v (dv terms). Worst-case rounding of a sum of n terms is
  // γ_n = n·u relative to the sum of their magnitudes (u = 2^-24); the exponential adds about
  // |s|·d·u to each probability, and dS = P ∘ (dP − D) sums to zero over a row, so the sum of
  // magnitudes exceeds the gradient's own norm by a factor κ, measured below for these inputs
  // (dense, in double). Bound: ‖g_float − g_double‖ ≤ (n + d·max|s| + dv)·u·κ·‖g_double‖, and
  // κ is a few: the bound is about 1e-4 here, a worst case; rounding errors of random sign give
  // about sqrt(n)·u in practice.
  const Index n = 300, d = 16, dv = 16;
  const ExactProblem<float> pf = problem<float>(n, n, d, dv, 31);
  const ExactProblem<double> pd{pf.q.cast<double>(), pf.k.cast<double>(), pf.v.cast<double>(),
                           pf.grad_out.cast<double>()};
  const double u = std::ldexp(1.0, -24);
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    const ExactOptions opt = options(causal, false, 0);
    const Gradients<float> gf = backward(pf, opt);
    const Gradients<double> gd = backward(pd, opt);
    // κ: the norm of the sums of magnitudes |dS| |K| over the norm of dS K (likewise dK, dV).
    const double scale = 1 / std::sqrt(double(d));
    RowMatrix<double> s = scale * pd.q * pd.k.transpose();
    for (Index i = 0; causal && i < n; ++i) s.row(i).tail(n - i - 1).setConstant(-INFINITY);
    const double max_logit = s.cwiseAbs().unaryExpr([](double x) {
      return std::isfinite(x) ? x : 0.0;
    }).maxCoeff();
    for (Index i = 0; i < n; ++i) {
      s.row(i).array() = (s.row(i).array() - s.row(i).maxCoeff()).exp();
      s.row(i) /= s.row(i).sum();
    }
    const RowMatrix<double> out = s * pd.v;
    const Eigen::VectorXd delta = (pd.grad_out.array() * out.array()).rowwise().sum();
    const RowMatrix<double> ds =
        s.array() * ((pd.grad_out * pd.v.transpose()).array().colwise() - delta.array());
    const double kappa_q = (ds.cwiseAbs() * pd.k.cwiseAbs()).norm() / (ds * pd.k).norm();
    const double kappa_k = (ds.cwiseAbs().transpose() * pd.q.cwiseAbs()).norm() /
                           (ds.transpose() * pd.q).norm();
    const double kappa_v = (s.transpose() * pd.grad_out.cwiseAbs()).norm() /
                           (s.transpose() * pd.grad_out).norm();
    const double rounding = (double(n) + double(d) * max_logit + double(dv)) * u;
    CAPTURE(kappa_q, kappa_k, kappa_v, rounding);
    CHECK(testing::rel_error(gf.dq, gd.dq) <= rounding * kappa_q);
    CHECK(testing::rel_error(gf.dk, gd.dk) <= rounding * kappa_k);
    CHECK(testing::rel_error(gf.dv, gd.dv) <= rounding * kappa_v);
  }
}

TEST_CASE("Exact backward does not depend on the thread count", "[gradients][exact]") {
  const ExactProblem<float> p = problem<float>(200, 200, 8, 8, 37);
  for (const bool causal : {false, true}) {
    const ExactOptions opt = options(causal, false, 16);
    const Gradients<float> one = [&] {
#if defined(_OPENMP)
      const int threads = omp_get_max_threads();
      omp_set_num_threads(1);
      const Gradients<float> g = backward(p, opt);
      omp_set_num_threads(threads);
      return g;
#else
      return backward(p, opt);
#endif
    }();
#if defined(_OPENMP)
    const int threads = omp_get_max_threads();
    omp_set_num_threads(std::max(2, threads));
#endif
    const Gradients<float> many = backward(p, opt);
#if defined(_OPENMP)
    omp_set_num_threads(threads);
#endif
    CHECK(testing::rows_bit_identical(one.dq, many.dq, 200));
    CHECK(testing::rows_bit_identical(one.dk, many.dk, 200));
    CHECK(testing::rows_bit_identical(one.dv, many.dv, 200));
  }
}

TEST_CASE("Exact backward rejects bad input before writing", "[gradients][exact]") {
  const ExactProblem<double> p = problem<double>(12, 12, 3, 2);
  const ExactOptions opt;
  RowMatrix<double> out(12, 2);
  const Vector<double> lse = randattn::exact_attention_forward_into(p.q, p.k, p.v, out, opt);
  RowMatrix<double> dq = RowMatrix<double>::Constant(12, 3, 7.0),
                    dk = RowMatrix<double>::Constant(12, 3, 7.0),
                    dv = RowMatrix<double>::Constant(12, 2, 7.0);
  const auto run = [&](const RowMatrix<double>& grad_out, const Vector<double>& l) {
    return invalid_argument_of([&] {
      randattn::exact_attention_backward<double>(p.q, p.k, p.v, out, l, grad_out, dq, dk, dv, opt);
    });
  };
  const auto untouched = [&] {
    return (dq.array() == 7.0).all() && (dk.array() == 7.0).all() && (dv.array() == 7.0).all();
  };
  CHECK_THAT(run(RowMatrix<double>::Zero(12, 3), lse),
             Catch::Contains("grad_out is 12x3, expected 12x2"));
  CHECK_THAT(run(RowMatrix<double>::Zero(11, 2), lse), Catch::Contains("grad_out is 11x2"));
  RowMatrix<double> bad = p.grad_out;
  bad(4, 1) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THAT(run(bad, lse), Catch::Contains("grad_out") && Catch::Contains("non-finite"));
  bad(4, 1) = std::numeric_limits<double>::infinity();
  CHECK_THAT(run(bad, lse), Catch::Contains("grad_out") && Catch::Contains("(4, 1)"));
  CHECK_THAT(run(p.grad_out, lse.head(11)), Catch::Contains("lse has 11 entries, expected"));
  Vector<double> nan_lse = lse;
  nan_lse(3) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THAT(run(p.grad_out, nan_lse), Catch::Contains("lse(3)"));
  CHECK(untouched());
  // Gradients of the wrong shape, or sharing memory with an input.
  RowMatrix<double> dq_wrong(12, 2);
  CHECK_THAT(invalid_argument_of([&] {
               randattn::exact_attention_backward<double>(p.q, p.k, p.v, out, lse, p.grad_out,
                                                          dq_wrong, dk, dv, opt);
             }),
             Catch::Contains("dq is 12x2, expected 12x3"));
  RowMatrix<double> q_copy = p.q;
  CHECK_THAT(invalid_argument_of([&] {
               randattn::exact_attention_backward<double>(q_copy, p.k, p.v, out, lse, p.grad_out,
                                                          q_copy, dk, dv, opt);
             }),
             Catch::Contains("dq shares memory with the input q"));
  CHECK(untouched());
}

TEST_CASE("Registry: exact is differentiable, with the job's bits and the library's gradients",
          "[gradients][exact]") {
  namespace reg = randattn::registry;
  const reg::Method& method = reg::find_method("exact", reg::Spelling{false});
  REQUIRE(method.differentiable());
  randattn::BatchShape shape;
  shape.batch = 2, shape.heads = 2, shape.n_q = 37, shape.n_k = 37, shape.d = 3, shape.dv = 2;
  const Index slices = shape.slices(), n = shape.n_q;
  const auto flat = [](const RowMatrix<double>& m) {
    return std::vector<double>(m.data(), m.data() + m.size());
  };
  const std::vector<double> q = flat(testing::gaussian<double>(41, slices * n, 3)),
                            k = flat(testing::gaussian<double>(42, slices * n, 3)),
                            v = flat(testing::gaussian<double>(43, slices * n, 2)),
                            go = flat(testing::gaussian<double>(44, slices * n, 2));
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    reg::Settings settings;
    settings.causal = causal;
    settings.scale = reg::default_scale(shape.d);
    const reg::Call call = reg::make_call(method, {}, settings, shape, reg::Spelling{false});
    std::vector<double> job_out(q.size() / 3 * 2), out(job_out.size());
    method.build(call, double())(q.data(), k.data(), v.data(), job_out.data());
    const reg::GradientPtr<double> gradient = method.build_gradient(call, double());
    gradient->forward(q.data(), k.data(), v.data(), out.data());
    CHECK(std::memcmp(out.data(), job_out.data(), out.size() * sizeof(double)) == 0);

    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
    std::fill(out.begin(), out.end(), -1.0);  // the gradient keeps its own copy of the output
    gradient->backward(go.data(), dq.data(), dk.data(), dv.data());
    ExactOptions opt;
    opt.causal = causal;
    for (Index s = 0; s < slices; ++s) {
      using Map = Eigen::Map<const RowMatrix<double>>;
      ExactProblem<double> p{Map(q.data() + s * n * 3, n, 3), Map(k.data() + s * n * 3, n, 3),
                        Map(v.data() + s * n * 2, n, 2), Map(go.data() + s * n * 2, n, 2)};
      const Gradients<double> g = backward(p, opt);
      CHECK(std::memcmp(g.dq.data(), dq.data() + s * n * 3, sizeof(double) * n * 3) == 0);
      CHECK(std::memcmp(g.dk.data(), dk.data() + s * n * 3, sizeof(double) * n * 3) == 0);
      CHECK(std::memcmp(g.dv.data(), dv.data() + s * n * 2, sizeof(double) * n * 2) == 0);
    }
    // A non-finite incoming gradient in any slice is rejected before anything is written.
    std::vector<double> bad = go;
    bad.back() = std::numeric_limits<double>::infinity();
    std::fill(dq.begin(), dq.end(), 7.0);
    CHECK_THAT(invalid_argument_of(
                   [&] { gradient->backward(bad.data(), dq.data(), dk.data(), dv.data()); }),
               Catch::Contains("grad_out") && Catch::Contains("non-finite"));
    CHECK(std::all_of(dq.begin(), dq.end(), [](double x) { return x == 7.0; }));
  }
}
