#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::Index;
using randattn::LinearOptions;
using randattn::RowMatrix;
using randattn::SoftmaxAccumulator;
using randattn::Vector;
using testing::rel_error;

namespace {

// Explicit D^{-1} (A ⊙ mask) [V] with A_ij = exp(sq_i + sk_j) * q_i^T diag(sigma) k_j, in double.
template <typename Scalar>
RowMatrix<double> explicit_linear(const RowMatrix<Scalar>& qf, const Vector<Scalar>& q_log,
                                  const RowMatrix<Scalar>& kf, const Vector<Scalar>& k_log,
                                  const RowMatrix<Scalar>& v, const Vector<Scalar>& signs,
                                  bool causal) {
  const Index n_q = qf.rows(), n_k = kf.rows();
  Eigen::VectorXd sigma = signs.size() ? Eigen::VectorXd(signs.template cast<double>())
                                       : Eigen::VectorXd::Ones(qf.cols());
  Eigen::MatrixXd a =
      qf.template cast<double>() * sigma.asDiagonal() * kf.template cast<double>().transpose();
  for (Index i = 0; i < n_q; ++i) {
    for (Index j = 0; j < n_k; ++j) {
      const double s =
          (q_log.size() ? double(q_log(i)) : 0.0) + (k_log.size() ? double(k_log(j)) : 0.0);
      a(i, j) *= std::exp(s);
      if (causal && j > i) a(i, j) = 0;
    }
  }
  const Eigen::MatrixXd num = a * v.template cast<double>();
  const Eigen::VectorXd den = a.rowwise().sum();
  return den.cwiseInverse().asDiagonal() * num;
}

}  // namespace

TEMPLATE_TEST_CASE("SoftmaxAccumulator merges partial results exactly", "[core][accumulator]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 5, dv = 3;
  // Two partial sums of the same weights, given relative to very different log-scales.
  RowMatrix<Scalar> w1 = testing::uniform<Scalar>(1, n, 4, 0.0, 1.0);
  RowMatrix<Scalar> w2 = testing::uniform<Scalar>(2, n, 6, 0.0, 1.0);
  RowMatrix<Scalar> v1 = testing::gaussian<Scalar>(3, 4, dv),
                    v2 = testing::gaussian<Scalar>(4, 6, dv);
  auto numden = [&](const RowMatrix<Scalar>& w, const RowMatrix<Scalar>& v) {
    RowMatrix<Scalar> nd(n, dv + 1);
    nd.leftCols(dv) = w * v;
    nd.col(dv) = w.rowwise().sum();
    return nd;
  };
  const Vector<Scalar> c1 = Vector<Scalar>::Constant(n, Scalar(3)),
                       c2 = Vector<Scalar>::Constant(n, Scalar(-2));
  // True weights: e^3 w1 and e^-2 w2.
  RowMatrix<double> num = std::exp(3.0) * (w1 * v1).template cast<double>() +
                          std::exp(-2.0) * (w2 * v2).template cast<double>();
  Eigen::VectorXd den = std::exp(3.0) * w1.rowwise().sum().template cast<double>() +
                        std::exp(-2.0) * w2.rowwise().sum().template cast<double>();
  const RowMatrix<double> expected = den.cwiseInverse().asDiagonal() * num;

  SoftmaxAccumulator<Scalar> a(n, dv), b(n, dv);
  a.merge_rows(0, numden(w1, v1), c1);
  b.merge_rows(0, numden(w2, v2), c2);
  SoftmaxAccumulator<Scalar> ab = a, ba = b;
  ab.merge(b);
  ba.merge(a);
  CHECK(rel_error(ab.finalize(), expected) < testing::tolerance<Scalar>());
  CHECK(rel_error(ba.finalize(), expected) < testing::tolerance<Scalar>());
  CHECK((ab.log_scale().array() == Scalar(3)).all());

  // Merging an empty accumulator changes nothing; an empty one finalizes to zeros.
  SoftmaxAccumulator<Scalar> empty(n, dv);
  SoftmaxAccumulator<Scalar> same = ab;
  same.merge(empty);
  CHECK((same.numden().array() == ab.numden().array()).all());
  CHECK((empty.finalize().array() == 0).all());

  CHECK_THROWS_AS(a.merge(SoftmaxAccumulator<Scalar>(n + 1, dv)), std::invalid_argument);
  CHECK_THROWS_AS(a.merge_rows(3, numden(w1, v1), c1), std::invalid_argument);
}

TEMPLATE_TEST_CASE("Denominator guard", "[core][accumulator]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  RowMatrix<Scalar> nd(4, 2);
  nd << 1, 2,    // ordinary row
      1, 0,      // den = 0
      1, -1e-9,  // tiny negative den
      0, 0;      // no weight at all
  SoftmaxAccumulator<Scalar> acc(nd, Vector<Scalar>::Zero(4));
  const Scalar eps = Scalar(1e-6);
  const RowMatrix<Scalar> out = acc.finalize(eps);
  CHECK(out(0, 0) == Scalar(0.5));
  CHECK(out(1, 0) == Scalar(1) / (Scalar(0) + 2 * eps));
  CHECK(out(2, 0) == Scalar(1) / (Scalar(-1e-9) + 2 * eps));
  CHECK(out(3, 0) == 0);
  CHECK(out.allFinite());
  // Without a guard, a zero denominator gives a zero row rather than Inf or NaN.
  const RowMatrix<Scalar> raw = acc.finalize(0);
  CHECK(raw(1, 0) == 0);
  CHECK(raw(3, 0) == 0);
  CHECK_THROWS_AS(acc.finalize(-1), std::invalid_argument);

  // One key whose weight underflows: in the subnormal range the quotient num/den loses its
  // relative precision (it left the values' range in float), so the row is returned as zeros;
  // just above the smallest normal number the one key gets weight 1 as it should.
  const Scalar tiny = std::numeric_limits<Scalar>::min();
  const RowMatrix<Scalar> kf = (RowMatrix<Scalar>(1, 2) << 1, 0).finished();
  const RowMatrix<Scalar> v = RowMatrix<Scalar>::Constant(1, 1, Scalar(24.5874));
  LinearOptions opt;
  opt.denominator_epsilon = 0;
  for (const Scalar q0 : {tiny / 3, tiny * 3}) {
    const RowMatrix<Scalar> qf = (RowMatrix<Scalar>(1, 2) << q0, 0).finished();
    const RowMatrix<Scalar> o = randattn::linear_attention(qf, kf, v, opt);
    randattn::LinearDecoderState<Scalar> state(2, 1, Vector<Scalar>(), 0.0);
    state.append(kf.row(0), v.row(0));
    if (q0 < tiny) {
      CHECK(o(0, 0) == 0);
      CHECK(state.query(qf.row(0))(0) == 0);
    } else {
      CHECK(rel_error(o, v) < testing::tolerance<Scalar>());
      CHECK(std::abs(state.query(qf.row(0))(0) / v(0, 0) - 1) < testing::tolerance<Scalar>());
    }
  }
}

TEMPLATE_TEST_CASE("Linear core equals the explicit masked product", "[core][linear]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const double tol = testing::tolerance<Scalar>();
  const Index n = 301, m = 24, dv = 7;
  for (bool with_signs : {false, true}) {
    for (double spread : {0.0, 8.0}) {
      const auto p = testing::linear_problem<Scalar>(100 + 10 * with_signs + Index(spread), n, m,
                                                     dv, spread, with_signs);
      for (bool causal : {false, true}) {
        const RowMatrix<double> expected =
            explicit_linear(p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, causal);
        for (Index chunk : {1, 7, 64, 100, 301, 512}) {
          INFO("signs " << with_signs << " spread " << spread << " causal " << causal << " chunk "
                        << chunk);
          LinearOptions opt;
          opt.causal = causal;
          opt.block_size = chunk;
          const RowMatrix<Scalar> out = randattn::linear_attention_accumulate<Scalar>(
                                            p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, opt)
                                            .finalize(Scalar(opt.denominator_epsilon));
          CHECK(rel_error(out, expected) < tol);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("Causal and bidirectional linear core at awkward sizes, default chunks",
                   "[core][linear][causal]", RANDATTN_TEST_SCALARS) {
  // Sizes around the default causal chunk (32 rows) and its groups (16 chunks): one row, fewer
  // rows than a chunk, one chunk exactly, a chunk and a row, a partial last chunk and a partial
  // last group; feature and value widths that leave a remainder past the last whole vector
  // register (m = 37, dv + 1 = 18) or none (dv + 1 = 48), and the benchmark's widths.
  using Scalar = TestType;
  const double tol = testing::tolerance<Scalar>();
  struct Widths {
    Index m, dv;
  };
  for (const Widths wd : {Widths{37, 17}, Widths{16, 47}, Widths{256, 64}}) {
    for (const Index n : {1, 5, 32, 33, 100, 545}) {
      if (wd.m == 256 && n > 100) continue;  // the wide case only where it is cheap
      const auto p = testing::linear_problem<Scalar>(700 + n, n, wd.m, wd.dv, 6.0, n % 2 == 1);
      for (bool causal : {false, true}) {
        INFO("n " << n << " m " << wd.m << " dv " << wd.dv << " causal " << causal);
        LinearOptions opt;
        opt.causal = causal;
        const RowMatrix<Scalar> out = randattn::linear_attention_accumulate<Scalar>(
                                          p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, opt)
                                          .finalize(Scalar(opt.denominator_epsilon));
        const RowMatrix<double> expected =
            explicit_linear(p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, causal);
        CHECK(rel_error(out, expected) < tol);
      }
    }
  }
}

TEMPLATE_TEST_CASE("Linear core with ScaledFeatures and plain matrices", "[core][linear]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const auto p = testing::linear_problem<Scalar>(7, 50, 8, 3, 2.0, false);
  const randattn::ScaledFeatures<Scalar> q{p.qf, p.q_log}, k{p.kf, p.k_log};
  const RowMatrix<double> expected =
      explicit_linear(p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, false);
  CHECK(rel_error(randattn::linear_attention(q, k, p.v), expected) < testing::tolerance<Scalar>());
  const RowMatrix<double> plain_expected =
      explicit_linear(p.qf, Vector<Scalar>(), p.kf, Vector<Scalar>(), p.v, p.signs, true);
  LinearOptions opt;
  opt.causal = true;
  CHECK(rel_error(randattn::linear_attention(p.qf, p.kf, p.v, opt), plain_expected) <
        testing::tolerance<Scalar>());
}

TEMPLATE_TEST_CASE("Causal linear core never looks at future keys", "[core][linear][causal]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 200, m = 16, dv = 5;
  for (bool scaled : {false, true}) {
    for (Index chunk : {1, 32, 64, 256}) {
      INFO("scaled " << scaled << " chunk " << chunk);
      auto p = testing::linear_problem<Scalar>(31, n, m, dv, scaled ? 6.0 : 0.0, true);
      LinearOptions opt;
      opt.causal = true;
      opt.block_size = chunk;
      const RowMatrix<Scalar> before = randattn::linear_attention_accumulate<Scalar>(
                                           p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, opt)
                                           .finalize(Scalar(1e-6));
      // The last key becomes dominant: far larger features and (when scaled) a log-scale that
      // would underflow every other key if it were used as a shared stabiliser.
      p.kf.row(n - 1).setConstant(Scalar(50));
      if (scaled) p.k_log(n - 1) = Scalar(80);
      const RowMatrix<Scalar> after = randattn::linear_attention_accumulate<Scalar>(
                                          p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, opt)
                                          .finalize(Scalar(1e-6));
      CHECK(testing::rows_bit_identical(before, after, n - 1));
      CHECK_FALSE(testing::rows_bit_identical(before, after, n));
    }
  }
}

TEMPLATE_TEST_CASE("Streaming decoder equals causal linear attention", "[core][linear][decoder]",
                   RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 90, m = 12, dv = 4;
  for (bool scaled : {false, true}) {
    const auto p = testing::linear_problem<Scalar>(55, n, m, dv, scaled ? 5.0 : 0.0, true);
    LinearOptions opt;
    opt.causal = true;
    opt.block_size = 16;
    const RowMatrix<Scalar> causal = randattn::linear_attention_accumulate<Scalar>(
                                         p.qf, p.q_log, p.kf, p.k_log, p.v, p.signs, opt)
                                         .finalize(Scalar(opt.denominator_epsilon));
    randattn::LinearDecoderState<Scalar> state(m, dv, p.signs);
    RowMatrix<Scalar> streamed(n, dv);
    for (Index t = 0; t < n; ++t) {
      state.append(p.kf.row(t), p.v.row(t), scaled ? p.k_log(t) : Scalar(0));
      const Scalar q_log = scaled ? p.q_log(t) : Scalar(0);
      state.query_into(p.qf.row(t), q_log, streamed.row(t));
      REQUIRE(RowMatrix<Scalar>(streamed.row(t)) ==
              RowMatrix<Scalar>(state.query(p.qf.row(t), q_log)));
    }
    CHECK(state.length() == n);
    CHECK(rel_error(streamed, causal) < testing::tolerance<Scalar>());
  }
  randattn::LinearDecoderState<Scalar> state(m, dv);
  CHECK_THROWS_AS(state.query(Vector<Scalar>::Ones(m)), std::invalid_argument);
  state.append(Vector<Scalar>::Ones(m), Vector<Scalar>::Ones(dv));
  RowMatrix<Scalar> short_out(1, dv - 1);
  CHECK_THROWS_WITH(state.query_into(Vector<Scalar>::Ones(m), Scalar(0), short_out),
                    Catch::Contains("out has 3 entries, expected 4"));
  CHECK_THROWS_AS(state.append(Vector<Scalar>::Ones(m + 1), Vector<Scalar>::Ones(dv)),
                  std::invalid_argument);
  CHECK_THROWS_AS(randattn::LinearDecoderState<Scalar>(0, dv), std::invalid_argument);
}

TEST_CASE("Linear core validates its arguments", "[core][linear][validation]") {
  using M = RowMatrix<double>;
  const M q = M::Ones(4, 3), k = M::Ones(5, 3), v = M::Ones(5, 2);
  const Vector<double> none;
  auto call = [&](const M& qq, const M& kk, const M& vv, const Vector<double>& ql,
                  const Vector<double>& kl, const Vector<double>& s, LinearOptions opt = {}) {
    return randattn::linear_attention_accumulate<double>(qq, ql, kk, kl, vv, s, opt);
  };
  CHECK_NOTHROW(call(q, k, v, none, none, none));
  CHECK_THROWS_AS(call(q, M::Ones(5, 4), v, none, none, none), std::invalid_argument);
  CHECK_THROWS_AS(call(q, k, M::Ones(4, 2), none, none, none), std::invalid_argument);
  CHECK_THROWS_AS(call(q, k, v, Vector<double>::Zero(3), none, none), std::invalid_argument);
  CHECK_THROWS_AS(call(q, k, v, none, Vector<double>::Zero(4), none), std::invalid_argument);
  CHECK_THROWS_AS(call(q, k, v, none, none, Vector<double>::Ones(2)), std::invalid_argument);
  CHECK_THROWS_AS(call(q, k, v, none, none, Vector<double>::Constant(3, 0.5)),
                  std::invalid_argument);
  LinearOptions causal;
  causal.causal = true;
  CHECK_THROWS_AS(call(q, k, v, none, none, none, causal), std::invalid_argument);
  LinearOptions bad_chunk;
  bad_chunk.block_size = -1;
  CHECK_THROWS_AS(call(q, k, v, none, none, none, bad_chunk), std::invalid_argument);
  CHECK_THROWS_AS(call(q, M(0, 3), M(0, 2), none, none, none), std::invalid_argument);
  M nan_k = k;
  nan_k(2, 1) = std::numeric_limits<double>::quiet_NaN();
  try {
    call(q, nan_k, v, none, none, none);
    FAIL("NaN input was accepted");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("k_features") != std::string::npos);
    CHECK(std::string(e.what()).find("(2, 1)") != std::string::npos);
  }
  LinearOptions unchecked;
  unchecked.check_finite = false;
  CHECK_NOTHROW(call(q, nan_k, v, none, none, none, unchecked));
  M nan_v = v;
  nan_v(4, 0) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH(call(q, k, nan_v, none, none, none), Catch::Contains("v (5x2)"));
  M inf_q = q;
  inf_q(0, 2) = -std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(call(inf_q, k, v, none, none, none), Catch::Contains("q_features (4x3)"));
  CHECK_THROWS_AS(call(q, k, v, none, Vector<double>::Constant(5, std::nan("")), none),
                  std::invalid_argument);
  // Finite features whose products overflow: a clear error, never Inf or NaN.
  CHECK_THROWS_WITH(call(M::Constant(4, 3, 1e200), M::Constant(5, 3, 1e200), v, none, none, none),
                    Catch::Contains("overflowed"));

  // Edge cases: no queries gives an empty result; one token and one feature work.
  CHECK(call(M(0, 3), k, v, none, none, none).finalize().rows() == 0);
  const M one_q = M::Constant(1, 1, 2.0), one_k = M::Constant(1, 1, 3.0),
          one_v = M::Constant(1, 1, -4.0);
  CHECK(call(one_q, one_k, one_v, none, none, none, causal).finalize()(0, 0) == -4.0);
}

TEMPLATE_TEST_CASE("linear_attention_into equals linear_attention bit for bit and checks out",
                   "[core][linear][into]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using Refs = std::vector<Eigen::Ref<const RowMatrix<Scalar>>>;
  const auto p = testing::linear_problem<Scalar>(61, 37, 8, 3, 2.0, true);
  const randattn::ScaledFeatures<Scalar> q{p.qf, p.q_log}, k{p.kf, p.k_log};
  for (const bool causal : {false, true}) {
    INFO("causal " << causal);
    LinearOptions opt;
    opt.causal = causal;
    opt.block_size = 8;
    testing::check_into_form<Scalar>(
        randattn::linear_attention(p.qf, p.kf, p.v, opt), {p.qf, p.kf, p.v},
        {"q_features", "k_features", "v"}, [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
          randattn::linear_attention_into(in[0], in[1], in[2], out, opt);
        });
    // The features and signs are held by value here; v is the input an out can alias.
    testing::check_into_form<Scalar>(
        randattn::linear_attention(q, k, p.v, opt, p.signs), {p.v}, {"v"},
        [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
          randattn::linear_attention_into(q, k, in[0], out, opt, p.signs);
        });
  }
  // An out (4 x 1) mapped onto the storage of a scaled feature matrix, a log-scale or the signs.
  const auto small = testing::linear_problem<Scalar>(62, 4, 8, 1, 2.0, true);
  randattn::ScaledFeatures<Scalar> qs{small.qf, small.q_log}, ks{small.kf, small.k_log};
  Vector<Scalar> signs = small.signs;
  const auto rejects = [&](Scalar* data, const std::string& name) {
    INFO(name);
    const Eigen::Matrix<Scalar, Eigen::Dynamic, 1> before =
        Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>(data, 4);
    Eigen::Map<RowMatrix<Scalar>> out(data, 4, 1);
    CHECK_THROWS_WITH(randattn::linear_attention_into(qs, ks, small.v, out, {}, signs),
                      Catch::Contains("shares memory with the input " + name));
    CHECK(Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>(data, 4) == before);
  };
  rejects(qs.values.data() + 3, "q_features");
  rejects(qs.log_scale.data(), "q_log_scale");
  rejects(ks.values.data() + 28, "k_features");
  rejects(ks.log_scale.data(), "k_log_scale");
  rejects(signs.data() + 2, "signs");
  RowMatrix<Scalar> out(4, 1);
  randattn::linear_attention_into(qs, ks, small.v, out, {}, signs);
  CHECK(out == randattn::linear_attention(qs, ks, small.v, {}, signs));
}

TEST_CASE("Batched linear attention refuses an out overlapping any input buffer, unwritten",
          "[core][linear][into]") {
  const auto p = testing::linear_problem<double>(63, 4, 8, 2, 1.0, true);
  const randattn::BatchShape shape{1, 1, 4, 4, 8, 2};
  // Every input in one buffer (q_features, q_log_scale, k_features, k_log_scale, v, signs), with
  // room for an 8-entry out after the last.
  std::vector<double> pool(32 + 4 + 32 + 4 + 8 + 8 + 8);
  const Index offset[] = {0, 32, 36, 68, 72, 80, 88};
  const auto put = [&](const auto& x, Index at) {
    std::copy(x.data(), x.data() + x.size(), pool.begin() + at);
  };
  put(p.qf, offset[0]), put(p.q_log, offset[1]), put(p.kf, offset[2]), put(p.k_log, offset[3]);
  put(p.v, offset[4]), put(p.signs, offset[5]);
  const double* base = pool.data();
  const auto run = [&](double* out) {
    randattn::linear_attention_batched(base + offset[0], base + offset[1], base + offset[2],
                                       base + offset[3], base + offset[4], base + offset[5], out,
                                       shape);
  };
  const char* names[] = {"q_features", "q_log_scale", "k_features", "k_log_scale", "v", "signs"};
  for (int i = 0; i < 6; ++i) {
    INFO(names[i]);
    const std::vector<double> before = pool;
    CHECK_THROWS_WITH(run(pool.data() + offset[i + 1] - 1),
                      Catch::Contains(std::string("out shares memory with the input ") + names[i]));
    CHECK(pool == before);
  }
  run(pool.data() + offset[6]);
  RowMatrix<double> separate(4, 2);
  run(separate.data());
  CHECK(std::equal(separate.data(), separate.data() + 8, pool.begin() + offset[6]));
}

TEMPLATE_TEST_CASE("row_dots: every entry as one dot product, whatever tile it falls in",
                   "[core][kernels]", RANDATTN_TEST_SCALARS) {
  // The reference is a 1 x 1 tile (packets along the depth, Eigen's predux, then the rest of the
  // depth); the wider tiles, with their joint horizontal sums, must give the same bits. The
  // shapes cover every tile size and remainder, depths with and without a partial packet.
  using Matrix = RowMatrix<TestType>;
  for (const Index depth : {Index(1), Index(7), Index(8), Index(17), Index(128)}) {
    for (const Index m : {Index(1), Index(2), Index(3), Index(5), Index(9)}) {
      for (const Index n : {Index(1), Index(2), Index(4), Index(6), Index(7), Index(9)}) {
        const Matrix a = Matrix::Random(m, depth), b = Matrix::Random(n, depth);
        Matrix out(m, n), one(1, 1);
        randattn::detail::row_dots(out, a, b);
        for (Index i = 0; i < m; ++i) {
          for (Index j = 0; j < n; ++j) {
            randattn::detail::row_panel::dot_tile<1, 1>(one, a.row(i), b.row(j), 0, 0);
            CHECK(out(i, j) == one(0, 0));
            const double exact = a.row(i).template cast<double>().dot(b.row(j).template cast<double>());
            CHECK(std::abs(double(out(i, j)) - exact) <=
                  4 * double(depth) * double(std::numeric_limits<TestType>::epsilon()) *
                      a.row(i).norm() * b.row(j).norm());
          }
        }
        if (m == n) {
          Matrix lower = Matrix::Zero(m, n);
          randattn::detail::row_dots(lower, a, b, true);
          for (Index i = 0; i < m; ++i)
            for (Index j = 0; j <= i; ++j) CHECK(lower(i, j) == out(i, j));
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("row_panel_product: every entry one chain of multiply-adds, whatever the tile",
                   "[core][kernels]", RANDATTN_TEST_SCALARS) {
  // Row by row (tiles of one row) against all rows at once (the tallest tiles and every
  // remainder), both panel widths, from zero and onto a start: the same bits. Columns cover
  // whole wide panels, narrower ones and the tail past the last packet, which goes through
  // Eigen's product and is compared only against the exact product.
  using Matrix = RowMatrix<TestType>;
  for (const Index depth : {Index(1), Index(9), Index(64), Index(300)}) {
    for (const Index rows : {Index(1), Index(2), Index(4), Index(5), Index(7), Index(13),
                             Index(31)}) {
      for (const Index cols : {Index(1), Index(8), Index(17), Index(65), Index(128)}) {
        const Matrix a = Matrix::Random(rows, depth), b = Matrix::Random(depth, cols);
        const Matrix start = Matrix::Random(rows, cols);
        Matrix all(rows, cols), streamed = start, by_row(rows, cols);
        randattn::detail::row_panel_product(all, a, b, false);
        randattn::detail::row_panel_product_streamed(streamed, a, b, true);
        for (Index i = 0; i < rows; ++i)
          randattn::detail::row_panel_product(by_row.row(i), a.row(i), b, false);
        const Index packed = cols / randattn::detail::row_panel::packet_size<TestType> *
                             randattn::detail::row_panel::packet_size<TestType>;
        CHECK(all.leftCols(packed) == by_row.leftCols(packed));
        Matrix onto = start;
        randattn::detail::row_panel_product(onto, a, b, true);
        CHECK(streamed == onto);
        const Eigen::MatrixXd exact = a.template cast<double>() * b.template cast<double>();
        const double tol = 4 * double(depth) * double(std::numeric_limits<TestType>::epsilon());
        CHECK(((all.template cast<double>() - exact).array().abs() <=
               tol * (a.template cast<double>().cwiseAbs() * b.template cast<double>().cwiseAbs())
                         .array())
                  .all());
      }
    }
  }
}

TEMPLATE_TEST_CASE("gathered rows: the contiguous kernels' bits on rows listed by index",
                   "[core][kernels]", RANDATTN_TEST_SCALARS) {
  // gathered_dots against row_dots of each listed row alone (every depth, stored types
  // included); gathered_weighted_sum against row_panel_product over a copy of the listed rows in
  // list order, onto the same start: the same bits on whole packets of columns, the columns past
  // the last packet within rounding of the exact sum. Lists with gaps, runs, repeats and
  // remainders of four rows.
  using Scalar = TestType;
  using randattn::detail::widen;
  constexpr Index ps = randattn::detail::row_panel::packet_size<Scalar>;
  const auto check_storage = [&](auto tag) {
    using T = decltype(tag);
    INFO("storage of " << sizeof(T) << " bytes");
    const Index n = 40;
    const std::vector<std::int32_t> idx_all = {0, 3, 4, 5, 6, 7, 11, 11, 20, 21, 22, 39, 38, 17};
    for (const Index width : {Index(1), Index(7), Index(2 * ps), Index(2 * ps + 1),
                              Index(13 * ps + 3), Index(16 * ps)}) {
      INFO("width " << width);
      const RowMatrix<Scalar> source = RowMatrix<Scalar>::Random(n, width);
      RowMatrix<T> stored(n, width);
      for (Index i = 0; i < n; ++i)
        for (Index c = 0; c < width; ++c)
          stored(i, c) = std::is_integral<T>::value ? T(std::lround(127 * double(source(i, c))))
                                                    : randattn::detail::narrow<T>(source(i, c));
      const Vector<Scalar> q = Vector<Scalar>::Random(width);
      const RowMatrix<Scalar> q_row = q.transpose();
      for (const Index m : {Index(0), Index(1), Index(4), Index(7), Index(14)}) {
        INFO("m " << m);
        const std::int32_t* idx = idx_all.data();
        Vector<Scalar> dots(m), w = Vector<Scalar>::Random(m);
        randattn::detail::gathered_dots(dots.data(), stored.data(), width, idx, m, q.data(), width);
        RowMatrix<Scalar> one(1, 1);
        RowMatrix<T> copy(m, width);
        for (Index u = 0; u < m; ++u) {
          randattn::detail::row_dots(one, stored.middleRows(idx[u], 1), q_row);
          CHECK(dots(u) == one(0, 0));
          copy.row(u) = stored.row(idx[u]);
        }
        const Vector<Scalar> start = Vector<Scalar>::Random(width);
        Vector<Scalar> num = start;
        randattn::detail::gathered_weighted_sum(num.data(), w.data(), stored.data(), width, idx, m,
                                                width);
        RowMatrix<Scalar> ref = start.transpose();
        randattn::detail::row_panel_product(ref, w.transpose(), copy, true);
        const Index packed = width / ps * ps;
        CHECK(num.head(packed).transpose() == ref.leftCols(packed));
        for (Index c = packed; c < width; ++c) {
          double exact = double(start(c)), bound = std::abs(double(start(c)));
          for (Index u = 0; u < m; ++u) {
            const double term = double(w(u)) * double(widen<Scalar>(copy(u, c)));
            exact += term;
            bound += std::abs(term);
          }
          CHECK(std::abs(double(num(c)) - exact) <=
                2 * double(m + 1) * double(std::numeric_limits<Scalar>::epsilon()) * bound);
        }
      }
    }
  };
  check_storage(Scalar());
  if constexpr (std::is_same<Scalar, float>::value) {
    check_storage(Eigen::bfloat16());
    check_storage(Eigen::half());
    check_storage(std::int8_t());
  } else {
    check_storage(float());
  }
}
