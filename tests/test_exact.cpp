#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "support.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::ExactOptions;
using randattn::Index;
using randattn::RowMatrix;
using testing::rel_error;

TEMPLATE_TEST_CASE("Tiled exact attention equals the naive reference", "[exact]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 1000, d = 64, dv = 64;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(1, n, d, 2.0);
  const RowMatrix<Scalar> k = testing::gaussian<Scalar>(2, n, d, 2.0);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(3, n, dv);
  for (bool causal : {false, true}) {
    ExactOptions opt;
    opt.causal = causal;
    const RowMatrix<Scalar> naive = randattn::naive_attention(q, k, v, opt);
    for (Index block : {0, 1, 37, 128, 256}) {
      INFO("causal " << causal << " block " << block);
      opt.block_size = block;
      CHECK(rel_error(randattn::exact_attention(q, k, v, opt), naive) <
            testing::tolerance<Scalar>());
    }
  }
}

TEMPLATE_TEST_CASE("Exact attention: scale, rectangular shapes and a double-precision reference",
                   "[exact]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(4, 33, 5),
                          k = testing::gaussian<Scalar>(5, 71, 5),
                          v = testing::gaussian<Scalar>(6, 71, 3);
  ExactOptions opt;
  opt.scale = 0.7;
  // Independent reference: softmax computed entry by entry in double.
  RowMatrix<double> expected(33, 3);
  for (Index i = 0; i < 33; ++i) {
    Eigen::VectorXd logits =
        0.7 * (k.template cast<double>() * q.row(i).template cast<double>().transpose());
    const Eigen::VectorXd w = (logits.array() - logits.maxCoeff()).exp();
    expected.row(i) = (w.transpose() * v.template cast<double>()) / w.sum();
  }
  CHECK(rel_error(randattn::exact_attention(q, k, v, opt), expected) <
        testing::tolerance<Scalar>());
  // Default scale is 1/sqrt(d).
  ExactOptions explicit_default;
  explicit_default.scale = 1.0 / std::sqrt(5.0);
  CHECK(rel_error(randattn::exact_attention(q, k, v),
                  randattn::exact_attention(q, k, v, explicit_default)) == 0);
}

TEMPLATE_TEST_CASE("Exact attention edge cases", "[exact][edge]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using M = RowMatrix<Scalar>;
  // n = 0: empty result of the right width.
  const M empty = randattn::exact_attention(M(0, 4), M(3, 4), M(3, 2));
  CHECK(empty.rows() == 0);
  CHECK(empty.cols() == 2);
  // n = 1: the single value row comes back.
  ExactOptions causal;
  causal.causal = true;
  const M v1 = M::Constant(1, 3, Scalar(2.5));
  CHECK((randattn::exact_attention(M::Ones(1, 4), M::Ones(1, 4), v1, causal).array() == Scalar(2.5))
            .all());
  // d = 1 agrees with the naive reference.
  const M q = testing::gaussian<Scalar>(8, 20, 1), k = testing::gaussian<Scalar>(9, 20, 1),
          v = testing::gaussian<Scalar>(10, 20, 2);
  CHECK(rel_error(randattn::exact_attention(q, k, v, causal),
                  randattn::naive_attention(q, k, v, causal)) < testing::tolerance<Scalar>());
  // Huge norms: logits of order 1e8 stay finite (the max-subtraction stabilises them) and
  // the output is the value of the single dominant key.
  M big_q = testing::gaussian<Scalar>(11, 16, 8, 1e4), big_k = big_q;
  const M out = randattn::exact_attention(big_q, big_k, v.topRows(16));
  CHECK(out.allFinite());
  // First causal row sees only key 0.
  CHECK((randattn::exact_attention(q, k, v, causal).row(0).array() == v.row(0).array()).all());
}

TEST_CASE("Exact attention validates its arguments", "[exact][validation]") {
  using M = RowMatrix<double>;
  const M q = M::Ones(4, 3), k = M::Ones(5, 3), v = M::Ones(5, 2);
  CHECK_THROWS_AS(randattn::exact_attention(q, M::Ones(5, 4), v), std::invalid_argument);
  CHECK_THROWS_AS(randattn::exact_attention(q, k, M::Ones(4, 2)), std::invalid_argument);
  CHECK_THROWS_AS(randattn::exact_attention(q, M(0, 3), M(0, 2)), std::invalid_argument);
  CHECK_THROWS_AS(randattn::exact_attention(M(4, 0), M(5, 0), v), std::invalid_argument);
  ExactOptions causal;
  causal.causal = true;
  CHECK_THROWS_AS(randattn::exact_attention(q, k, v, causal), std::invalid_argument);
  ExactOptions bad_scale;
  bad_scale.scale = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(randattn::exact_attention(q, k, v, bad_scale), std::invalid_argument);
  ExactOptions bad_block;
  bad_block.block_size = 1000;
  CHECK_THROWS_AS(randattn::exact_attention(q, k, v, bad_block), std::invalid_argument);
  M inf_q = q;
  inf_q(3, 0) = std::numeric_limits<double>::infinity();
  try {
    randattn::exact_attention(inf_q, k, v);
    FAIL("Inf input was accepted");
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("exact_attention") != std::string::npos);
    CHECK(what.find("q (4x3)") != std::string::npos);
  }
  // Finite inputs whose logits overflow: a clear error, never NaN.
  try {
    randattn::exact_attention(M::Constant(4, 3, 1e200), M::Constant(5, 3, 1e200), v);
    FAIL("overflowing logits were accepted");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("overflowed") != std::string::npos);
  }
  // Opting out of the check lets non-finite values propagate.
  ExactOptions unchecked;
  unchecked.check_finite = false;
  CHECK_FALSE(randattn::exact_attention(inf_q, k, v, unchecked).allFinite());
  try {
    randattn::exact_attention(q, M::Ones(5, 4), v);
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    CHECK(what.find("4x3") != std::string::npos);
    CHECK(what.find("5x4") != std::string::npos);
  }
}

TEMPLATE_TEST_CASE("Batched exact attention equals per-slice calls for any thread count",
                   "[exact][batched][threads]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  randattn::BatchShape shape;
  shape.batch = 2;
  shape.heads = 2;
  shape.n_q = 150;
  shape.n_k = 150;
  shape.d = 16;
  shape.dv = 8;
  const Index s = shape.slices();
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(1, s * shape.n_q, shape.d);
  const RowMatrix<Scalar> k = testing::gaussian<Scalar>(2, s * shape.n_k, shape.d);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(3, s * shape.n_k, shape.dv);
  for (bool causal : {false, true}) {
    ExactOptions opt;
    opt.causal = causal;
    opt.block_size = 64;
    RowMatrix<Scalar> out(s * shape.n_q, shape.dv);
    randattn::exact_attention_batched(q.data(), k.data(), v.data(), out.data(), shape, opt);
    for (Index i = 0; i < s; ++i) {
      const RowMatrix<Scalar> slice = randattn::exact_attention(
          q.middleRows(i * shape.n_q, shape.n_q), k.middleRows(i * shape.n_k, shape.n_k),
          v.middleRows(i * shape.n_k, shape.n_k), opt);
      CHECK((out.middleRows(i * shape.n_q, shape.n_q).array() == slice.array()).all());
    }
#if defined(_OPENMP)
    RowMatrix<Scalar> one(out.rows(), out.cols()), two(out.rows(), out.cols());
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    randattn::exact_attention_batched(q.data(), k.data(), v.data(), one.data(), shape, opt);
    omp_set_num_threads(2);
    randattn::exact_attention_batched(q.data(), k.data(), v.data(), two.data(), shape, opt);
    // A single slice is parallel over query blocks instead.
    RowMatrix<Scalar> single_one(shape.n_q, shape.dv), single_two(shape.n_q, shape.dv);
    omp_set_num_threads(1);
    single_one = randattn::exact_attention(q.topRows(shape.n_q), k.topRows(shape.n_k),
                                           v.topRows(shape.n_k), opt);
    omp_set_num_threads(2);
    single_two = randattn::exact_attention(q.topRows(shape.n_q), k.topRows(shape.n_k),
                                           v.topRows(shape.n_k), opt);
    omp_set_num_threads(saved);
    CHECK((one.array() == two.array()).all());
    CHECK((single_one.array() == single_two.array()).all());
#endif
  }
  CHECK_THROWS_AS(
      randattn::exact_attention_batched<Scalar>(nullptr, nullptr, nullptr, nullptr, shape),
      std::invalid_argument);
}

TEMPLATE_TEST_CASE("Exact attention excludes each query's own key unless it is alone",
                   "[exact][exclude_self]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const Index n = 300, d = 16;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(7, n, d, 2.0);
  const RowMatrix<Scalar> v = testing::gaussian<Scalar>(8, n, d);
  for (bool causal : {false, true}) {
    ExactOptions opt;
    opt.causal = causal;
    opt.exclude_self = true;
    const RowMatrix<Scalar> naive = randattn::naive_attention(q, q, v, opt);  // K = Q
    // Causal: position 0 has no other key and attends to itself.
    if (causal) CHECK(naive.row(0) == v.row(0));
    for (Index block : {0, 1, 37}) {
      INFO("causal " << causal << " block " << block);
      opt.block_size = block;
      const RowMatrix<Scalar> out = randattn::exact_attention(q, q, v, opt);
      CHECK(rel_error(out, naive) < testing::tolerance<Scalar>());
      if (causal) CHECK(out.row(0) == v.row(0));
    }
  }
  // A single position keeps its own key; unequal counts are refused.
  ExactOptions opt;
  opt.exclude_self = true;
  CHECK(randattn::exact_attention(q.topRows(1), q.topRows(1), v.topRows(1), opt) == v.topRows(1));
  CHECK_THROWS_AS(randattn::exact_attention(q.topRows(3), q.topRows(4), v.topRows(4), opt),
                  std::invalid_argument);
}

TEMPLATE_TEST_CASE("exact_attention_into equals exact_attention bit for bit and checks out",
                   "[exact][into]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  using Refs = std::vector<Eigen::Ref<const RowMatrix<Scalar>>>;
  const RowMatrix<Scalar> q = testing::gaussian<Scalar>(41, 19, 6),
                          k = testing::gaussian<Scalar>(42, 19, 6),
                          v = testing::gaussian<Scalar>(43, 19, 4);
  for (const bool causal : {false, true}) {
    INFO("causal " << causal);
    ExactOptions opt;
    opt.causal = causal;
    opt.block_size = 8;
    testing::check_into_form<Scalar>(
        randattn::exact_attention(q, k, v, opt), {q, k, v}, {"q", "k", "v"},
        [&](const Refs& in, Eigen::Ref<RowMatrix<Scalar>> out) {
          randattn::exact_attention_into(in[0], in[1], in[2], out, opt);
        });
  }
  // No queries: a 0 x dv out is accepted and nothing is written.
  const RowMatrix<Scalar> none(0, 6);
  RowMatrix<Scalar> empty(0, 4);
  randattn::exact_attention_into(none, k, v, empty);
  CHECK(empty.rows() == 0);
  RowMatrix<Scalar> one = RowMatrix<Scalar>::Constant(1, 4, Scalar(7));
  CHECK_THROWS_AS(randattn::exact_attention_into(none, k, v, one), randattn::invalid_argument);
  CHECK((one.array() == Scalar(7)).all());
  // A column-major out receives the same values.
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> column_major(19, 4);
  randattn::exact_attention_into(q, k, v, column_major);
  CHECK(column_major == randattn::exact_attention(q, k, v));
  // An expression as input is evaluated into a temporary of its own: no aliasing is possible.
  RowMatrix<Scalar> out(19, 4);
  randattn::exact_attention_into(q * Scalar(2), k, v, out);
  CHECK(out == randattn::exact_attention(RowMatrix<Scalar>(q * Scalar(2)), k, v));
}

TEST_CASE("Batched exact attention refuses an out overlapping an input, unwritten",
          "[exact][into]") {
  const randattn::BatchShape shape{1, 2, 6, 6, 3, 3};  // d == dv: every buffer has 36 entries
  std::vector<double> pool(4 * 36);
  for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = std::sin(double(i));
  const double *q = pool.data(), *k = q + 36, *v = k + 36;
  for (const auto& [name, start] : {std::pair<const char*, Index>{"q", 35}, {"k", 40}, {"v", 72}}) {
    INFO(name);
    const std::vector<double> before = pool;
    CHECK_THROWS_WITH(
        randattn::exact_attention_batched(q, k, v, pool.data() + start, shape),
        Catch::Contains(std::string("exact_attention_batched: out shares memory with the input ") +
                        name));
    CHECK(pool == before);
  }
  // Right after v: no shared entry.
  randattn::exact_attention_batched(q, k, v, pool.data() + 108, shape);
  std::vector<double> separate(36);
  randattn::exact_attention_batched(q, k, v, separate.data(), shape);
  CHECK(std::equal(separate.begin(), separate.end(), pool.begin() + 108));
}
