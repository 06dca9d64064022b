// Backward of linear attention and of the projected feature maps (favor, favor-hyp, trig):
// finite differences in double, float against double, the causal no-leak property and the
// registry's Gradient.

#include <cmath>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <randattn/core/linear_backward.hpp>
#include <randattn/randattn.hpp>

#include "gradient_check.hpp"
#include "support.hpp"

namespace {

using randattn::Index;
using randattn::RowMatrix;
using randattn::Vector;

// <G, linear_attention(...)> for the core alone.
struct CoreCase {
  Index n, m, dv, chunk;
  bool causal;
};

}  // namespace

TEST_CASE("linear core backward: feature and value gradients equal finite differences",
          "[gradients][features]") {
  for (const CoreCase c : {CoreCase{37, 6, 3, 8, false}, CoreCase{37, 6, 3, 8, true},
                           CoreCase{300, 5, 2, 0, false}, CoreCase{300, 5, 2, 0, true}}) {
    CAPTURE(c.n, c.chunk, c.causal);
    RowMatrix<double> qf = testing::uniform<double>(1, c.n, c.m, 0.1, 1.0);
    RowMatrix<double> kf = testing::uniform<double>(2, c.n, c.m, 0.1, 1.0);
    RowMatrix<double> v = testing::gaussian<double>(3, c.n, c.dv);
    const RowMatrix<double> g = testing::gaussian<double>(4, c.n, c.dv);
    randattn::LinearOptions opt;
    opt.causal = c.causal;
    opt.block_size = c.chunk;
    opt.denominator_epsilon = 0;
    const RowMatrix<double> out = randattn::linear_attention(qf, kf, v, opt);
    RowMatrix<double> dq(c.n, c.m), dk(c.n, c.m), dv(c.n, c.dv);
    randattn::linear_attention_backward(qf, kf, v, out, g, dq, dk, dv, opt);
    const auto f = [&] { return testing::contract(g, randattn::linear_attention(qf, kf, v, opt)); };
    testing::check_gradient("dq_features", qf, dq, f);
    testing::check_gradient("dk_features", kf, dk, f);
    testing::check_gradient("dv", v, dv, f);
  }
}

namespace {

// <G, random_feature_attention(map(ω), q, k, v)> and its backward, checked entry by entry
// against central differences in double: dq, dk, dv and dω.
template <template <typename, typename> class Map>
void check_attention_gradients(Index n, Index chunk, bool causal, std::uint64_t seed) {
  using Proj = randattn::UserProjection<double>;
  const Index d = 4, m = 6, dv = 3;
  CAPTURE(n, chunk, causal);
  RowMatrix<double> omega = testing::gaussian<double>(seed, m, d);
  RowMatrix<double> q = testing::gaussian<double>(seed + 1, n, d);
  RowMatrix<double> k = testing::gaussian<double>(seed + 2, n, d);
  RowMatrix<double> v = testing::gaussian<double>(seed + 3, n, dv);
  const RowMatrix<double> g = testing::gaussian<double>(seed + 4, n, dv);
  randattn::RandomFeatureOptions opt;
  opt.causal = causal;
  opt.block_size = chunk;
  const auto forward = [&] {
    return randattn::random_feature_attention(Map<double, Proj>(Proj(omega)), q, k, v, opt);
  };
  const RowMatrix<double> out = forward();
  RowMatrix<double> dq(n, d), dk(n, d), dvv(n, dv), domega = RowMatrix<double>::Zero(m, d);
  randattn::random_feature_attention_backward(Map<double, Proj>(Proj(omega)), q, k, v, out, g, dq,
                                              dk, dvv, opt, &domega);
  const auto f = [&] { return testing::contract(g, forward()); };
  testing::check_gradient("dq", q, dq, f);
  testing::check_gradient("dk", k, dk, f);
  testing::check_gradient("dv", v, dvv, f);
  testing::check_gradient("domega", omega, domega, f);
  // Without out: recomputed, the same gradients.
  RowMatrix<double> dq2(n, d), dk2(n, d), dv2(n, dv);
  randattn::random_feature_attention_backward(Map<double, Proj>(Proj(omega)), q, k, v,
                                              RowMatrix<double>(), g, dq2, dk2, dv2, opt);
  CHECK((dq2 - dq).cwiseAbs().maxCoeff() <= 1e-12 * (1 + dq.cwiseAbs().maxCoeff()));
  CHECK((dk2 - dk).cwiseAbs().maxCoeff() <= 1e-12 * (1 + dk.cwiseAbs().maxCoeff()));
  // A forward that keeps its features: the same output and, from them, the same gradients, bit
  // for bit (the features are the ones the backward would map, chunk by chunk).
  randattn::SavedFeatures<double> saved;
  RowMatrix<double> out_saved(n, dv);
  randattn::random_feature_attention_into(Map<double, Proj>(Proj(omega)), q, k, v, out_saved,
                                          saved, opt);
  CHECK(out_saved == out);
  RowMatrix<double> dq3(n, d), dk3(n, d), dv3(n, dv), domega3 = RowMatrix<double>::Zero(m, d);
  randattn::random_feature_attention_backward(Map<double, Proj>(Proj(omega)), q, k, v, out, g,
                                              dq3, dk3, dv3, saved, opt, &domega3);
  CHECK(dq3 == dq);
  CHECK(dk3 == dk);
  CHECK(dv3 == dvv);
  CHECK(domega3 == domega);
}

}  // namespace

TEST_CASE("favor backward: dq, dk, dv, domega equal finite differences", "[gradients][features]") {
  for (const bool causal : {false, true}) {
    check_attention_gradients<randattn::PositiveFeatures>(37, 8, causal, 10);
    check_attention_gradients<randattn::PositiveFeatures>(300, 0, causal, 20);
  }
}

TEST_CASE("favor backward: saved features of another call and overlapping gradients are refused",
          "[gradients][features]") {
  const Index n = 40, d = 8, dv = 4;
  const randattn::PositiveFeatures map(randattn::OrthogonalProjection<float>(16, d, 3));
  const RowMatrix<float> q = testing::gaussian<float>(1, n, d), k = testing::gaussian<float>(2, n, d);
  const RowMatrix<float> v = testing::gaussian<float>(3, n, dv), g = testing::gaussian<float>(4, n, dv);
  randattn::RandomFeatureOptions opt;
  opt.causal = true;
  randattn::SavedFeatures<float> saved;
  RowMatrix<float> out(n, dv), dq(n, d), dk(n, d), dvv(n, dv);
  randattn::random_feature_attention_into(map, q.topRows(n - 1), k.topRows(n - 1),
                                          v.topRows(n - 1), out.topRows(n - 1), saved, opt);
  const auto backward = [&] {
    randattn::random_feature_attention_backward(map, q, k, v, out, g, dq, dk, dvv, saved, opt);
  };
  CHECK_THROWS_WITH(backward(), Catch::Contains("are not this call's"));
  randattn::random_feature_attention_into(map, q, k, v, out, saved, opt);
  opt.scale = 0.5;  // another data normaliser
  CHECK_THROWS_WITH(backward(), Catch::Contains("are not this call's"));
  opt.scale.reset();
  backward();
  RowMatrix<float> both(n, d + d);
  CHECK_THROWS_WITH(randattn::random_feature_attention_backward(
                        map, q, k, v, out, g, both.leftCols(d), both.rightCols(d), dvv, opt),
                    Catch::Contains("dq and dk share memory"));
  RowMatrix<float> q_copy = q;
  CHECK_THROWS_WITH(randattn::random_feature_attention_backward(map, q_copy, k, v, out, g, q_copy,
                                                                dk, dvv, opt),
                    Catch::Contains("dq shares memory with the input q"));
}

TEST_CASE("favor-hyp backward: dq, dk, dv, domega equal finite differences",
          "[gradients][features]") {
  for (const bool causal : {false, true}) {
    check_attention_gradients<randattn::HyperbolicFeatures>(37, 8, causal, 30);
    check_attention_gradients<randattn::HyperbolicFeatures>(300, 0, causal, 40);
  }
}

TEST_CASE("trig backward: dq, dk, dv, domega equal finite differences", "[gradients][features]") {
  for (const bool causal : {false, true}) {
    check_attention_gradients<randattn::TrigFeatures>(37, 8, causal, 50);
    check_attention_gradients<randattn::TrigFeatures>(300, 0, causal, 60);
  }
}

// ---------------------------------------------------------------------------------------------
// Hedgehog: the learned map's backward, alone, in attention and through the registry
// ---------------------------------------------------------------------------------------------

#include <randattn/registry/layout.hpp>
#include <randattn/registry/registry.hpp>

namespace hedgehog_test {

namespace reg = randattn::registry;
const reg::Spelling kSpelling{false};

reg::ArrayValue array_of(const std::vector<std::int64_t>& shape, const RowMatrix<double>& x) {
  return reg::ArrayValue{shape, {x.data(), x.data() + x.size()}, "array"};
}

// A registered hedgehog call on (batch, heads, n, d) queries and (batch, kv_heads, n, ·) keys
// and values (rows of the flattened arrays), with weight and bias as matrices of their
// flattened (kv_heads · m, d) and (1, kv_heads · m) shapes.
struct Call {
  randattn::BatchShape shape;
  Index kv_heads, m;
  bool causal;
  RowMatrix<double> weight, bias;

  reg::Call make(reg::Layout& layout, bool gradients) const {
    const reg::Method& method = reg::find_method("hedgehog", kSpelling);
    reg::Settings settings;
    settings.causal = causal;
    settings.scale = 0.7;
    if (gradients) settings.option_gradients = {"weight", "bias"};
    const std::vector<std::int64_t> qs{shape.batch, shape.heads, shape.n_q, shape.d},
        ks{shape.batch, kv_heads, shape.n_k, shape.d},
        vs{shape.batch, kv_heads, shape.n_k, shape.dv};
    layout =
        reg::make_layout(method, {}, reg::call_shape(qs, &ks, vs, kSpelling), settings, kSpelling);
    const std::map<std::string, reg::Value> options{
        {"weight", array_of({kv_heads, m, shape.d}, weight)},
        {"bias", array_of({kv_heads, m}, bias)}};
    return reg::make_call(method, options, settings, shape, kSpelling);
  }

  RowMatrix<double> forward(const RowMatrix<double>& q, const RowMatrix<double>& k,
                            const RowMatrix<double>& v) const {
    reg::Layout layout;
    const reg::Call c = make(layout, false);
    RowMatrix<double> out(q.rows(), v.cols());
    reg::build_job<double>(reg::find_method("hedgehog", kSpelling), c, layout)(
        q.data(), k.data(), v.data(), out.data());
    return out;
  }
};

}  // namespace hedgehog_test

TEST_CASE("hedgehog backward: features_vjp and attention gradients equal finite differences",
          "[hedgehog][gradients]") {
  using Map = randattn::HedgehogFeatures<double>;
  const Index n = 37, d = 4, m = 5, dv = 3;
  RowMatrix<double> w = testing::gaussian<double>(101, m, d, 0.7);
  RowMatrix<double> b = testing::gaussian<double>(102, m, 1);
  RowMatrix<double> x = testing::gaussian<double>(103, n, d);
  const double c = 0.8;
  // The map alone: <G, values> with log_scale 0.
  {
    const RowMatrix<double> g = testing::gaussian<double>(104, n, 2 * m);
    const auto f = [&] { return testing::contract(g, Map(w, b).features(x, c).values); };
    const auto feats = Map(w, b).features(x, c);
    RowMatrix<double> dx = RowMatrix<double>::Zero(n, d), dw = RowMatrix<double>::Zero(m, d);
    Vector<double> db = Vector<double>::Zero(m);
    Map(w, b).features_vjp(x, c, feats.values, feats.log_scale, g, Vector<double>(), dx, &dw, &db);
    testing::check_gradient("dx", x, dx, f);
    testing::check_gradient("dweight", w, dw, f);
    testing::check_gradient("dbias", b, RowMatrix<double>(db), f);
  }
  // In attention, through random_feature_attention_backward with the bias gradient's copy.
  for (const bool causal : {false, true}) {
    CAPTURE(causal);
    RowMatrix<double> q = testing::gaussian<double>(105, n, d),
                      k = testing::gaussian<double>(106, n, d);
    RowMatrix<double> v = testing::gaussian<double>(107, n, dv);
    const RowMatrix<double> g = testing::gaussian<double>(108, n, dv);
    randattn::RandomFeatureOptions opt;
    opt.causal = causal;
    opt.block_size = 8;
    const auto forward = [&] {
      return randattn::random_feature_attention(Map(w, b), q, k, v, opt);
    };
    RowMatrix<double> dq(n, d), dk(n, d), dvv(n, dv), dw = RowMatrix<double>::Zero(m, d);
    Vector<double> db = Vector<double>::Zero(m);
    randattn::random_feature_attention_backward(Map(w, b).with_bias_gradient(&db), q, k, v,
                                                forward(), g, dq, dk, dvv, opt, &dw);
    const auto f = [&] { return testing::contract(g, forward()); };
    testing::check_gradient("dq", q, dq, f);
    testing::check_gradient("dk", k, dk, f);
    testing::check_gradient("dv", v, dvv, f);
    testing::check_gradient("dweight", w, dw, f);
    testing::check_gradient("dbias", b, RowMatrix<double>(db), f);
  }
}

TEST_CASE("hedgehog registry gradient: per-head maps, grouped heads, causal",
          "[hedgehog][gradients][registry]") {
  namespace reg = hedgehog_test::reg;
  const testing::OneThread one_thread;
  const Index m = 3;
  // Two heads with their own maps (a plain call), and four query heads over two key/value heads
  // (the layout's sub-calls: each key/value head's map used by its two query heads).
  const Index heads = GENERATE(2, 4);
  const bool causal = GENERATE(false, true);
  CAPTURE(heads, causal);
  const randattn::BatchShape shape{2, heads, 9, 9, 3, 2};
  hedgehog_test::Call call{shape,
                           2,
                           m,
                           causal,
                           testing::gaussian<double>(111, 2 * m, 3, 0.7),
                           testing::gaussian<double>(112, 1, 2 * m)};
  RowMatrix<double> q = testing::gaussian<double>(113, 2 * heads * 9, 3);
  RowMatrix<double> k = testing::gaussian<double>(114, 2 * 2 * 9, 3);
  RowMatrix<double> v = testing::gaussian<double>(115, 2 * 2 * 9, 2);
  const RowMatrix<double> g = testing::gaussian<double>(116, q.rows(), 2);

  reg::Layout layout;
  const reg::Call c = call.make(layout, true);
  const reg::Method& method = reg::find_method("hedgehog", hedgehog_test::kSpelling);
  reg::GradientPtr<double> grad = reg::build_gradient<double>(method, c, layout);
  RowMatrix<double> out(q.rows(), 2), dq(q.rows(), 3), dk(k.rows(), 3), dv(v.rows(), 2);
  grad->forward(q.data(), k.data(), v.data(), out.data());
  CHECK(out == call.forward(q, k, v));  // the job's bits
  grad->backward(g.data(), dq.data(), dk.data(), dv.data());
  const auto options = grad->option_gradients();
  REQUIRE(options.size() == 2);
  REQUIRE(options[0].first == "weight");
  REQUIRE(options[1].first == "bias");
  REQUIRE(options[0].second.size() == std::size_t(2 * m * 3));
  REQUIRE(options[1].second.size() == std::size_t(2 * m));
  const RowMatrix<double> dw =
      Eigen::Map<const RowMatrix<double>>(options[0].second.data(), 2 * m, 3);
  const RowMatrix<double> db =
      Eigen::Map<const RowMatrix<double>>(options[1].second.data(), 1, 2 * m);

  const auto f = [&] { return testing::contract(g, call.forward(q, k, v)); };
  testing::check_gradient("dq", q, dq, f);
  testing::check_gradient("dk", k, dk, f);
  testing::check_gradient("dv", v, dv, f);
  testing::check_gradient("dweight", call.weight, dw, f);
  testing::check_gradient("dbias", call.bias, db, f);

  if (heads == 4) {
    // The same as a plain call whose four heads read repeated keys and values and repeated maps:
    // the outputs bit for bit, each key/value head's weight and bias gradients the sum of its two
    // query heads'.
    const auto repeat = [](const RowMatrix<double>& x, Index blocks, Index rows) {
      RowMatrix<double> out(2 * x.rows(), x.cols());
      for (Index b = 0; b < blocks; ++b)
        out.middleRows(2 * b * rows, rows) = out.middleRows((2 * b + 1) * rows, rows) =
            x.middleRows(b * rows, rows);
      return out;
    };
    hedgehog_test::Call plain{shape,
                              4,
                              m,
                              causal,
                              repeat(call.weight, 2, m),
                              repeat(call.bias.transpose(), 2, m).transpose()};
    const RowMatrix<double> k4 = repeat(k, 4, 9), v4 = repeat(v, 4, 9);
    reg::Layout plain_layout;
    const reg::Call pc = plain.make(plain_layout, true);
    REQUIRE(plain_layout.plain(shape));
    reg::GradientPtr<double> pg = reg::build_gradient<double>(method, pc, plain_layout);
    RowMatrix<double> out4(q.rows(), 2), dq4(q.rows(), 3), dk4(k4.rows(), 3), dv4(v4.rows(), 2);
    pg->forward(q.data(), k4.data(), v4.data(), out4.data());
    CHECK(out4 == out);
    pg->backward(g.data(), dq4.data(), dk4.data(), dv4.data());
    const auto po = pg->option_gradients();
    const RowMatrix<double> dw4 =
        Eigen::Map<const RowMatrix<double>>(po[0].second.data(), 4 * m, 3);
    const RowMatrix<double> db4 =
        Eigen::Map<const RowMatrix<double>>(po[1].second.data(), 4 * m, 1);
    for (Index h = 0; h < 2; ++h) {
      CHECK((dw4.middleRows(2 * h * m, m) + dw4.middleRows((2 * h + 1) * m, m) -
             dw.middleRows(h * m, m))
                .cwiseAbs()
                .maxCoeff() < 1e-12);
      CHECK((db4.middleRows(2 * h * m, m) + db4.middleRows((2 * h + 1) * m, m) -
             db.middleCols(h * m, m).transpose())
                .cwiseAbs()
                .maxCoeff() < 1e-12);
    }
  }
}

TEST_CASE("hedgehog registry: option errors name the shapes", "[hedgehog][registry]") {
  namespace reg = hedgehog_test::reg;
  const reg::Method& method = reg::find_method("hedgehog", hedgehog_test::kSpelling);
  const randattn::BatchShape shape{1, 4, 6, 6, 3, 2};
  const auto build = [&](std::map<std::string, reg::Value> options, Index kv_heads) {
    reg::Settings settings;
    settings.scale = 0.5;
    const std::vector<std::int64_t> qs{1, 4, 6, 3}, ks{1, kv_heads, 6, 3}, vs{1, kv_heads, 6, 2};
    const reg::Layout layout =
        reg::make_layout(method, {}, reg::call_shape(qs, &ks, vs, hedgehog_test::kSpelling),
                         settings, hedgehog_test::kSpelling);
    const reg::Call c = reg::make_call(method, options, settings, shape, hedgehog_test::kSpelling);
    (void)reg::build_job<float>(method, c, layout);
  };
  const auto w = [](std::vector<std::int64_t> s) {
    std::int64_t size = 1;
    for (std::int64_t x : s) size *= x;
    return reg::ArrayValue{s, std::vector<double>(std::size_t(size), 0.5), "array"};
  };
  CHECK_NOTHROW(build({{"weight", w({2, 5, 3})}, {"bias", w({2, 5})}}, 2));
  CHECK_NOTHROW(build({{"weight", w({5, 3})}, {"bias", w({5})}}, 2));  // one map for every head
  CHECK_THROWS_WITH(build({{"weight", w({2, 5, 3})}}, 2),
                    "weight and bias go together: bias is missing");
  CHECK_THROWS_WITH(build({{"bias", w({2, 5})}}, 2),
                    "weight and bias go together: weight is missing");
  CHECK_THROWS_WITH(
      build({{"weight", w({4, 5, 3})}, {"bias", w({4, 5})}}, 2),
      "weight: expected a (kv_heads, m, d) = (2, m, 3) array (the key/value heads and "
      "d of the input; or (m, d) for every head) with m >= 1, got shape (4, 5, 3)");
  CHECK_THROWS_WITH(build({{"weight", w({2, 5, 4})}, {"bias", w({2, 5})}}, 2),
                    Catch::Contains("got shape (2, 5, 4)"));
  CHECK_THROWS_WITH(
      build({{"weight", w({2, 5, 3})}, {"bias", w({2, 4})}}, 2),
      "bias: expected shape (2, 5) to match weight of shape (2, 5, 3), got shape (2, 4)");
  CHECK_THROWS_WITH(build({{"weight", w({5, 3})}, {"bias", w({1, 5})}}, 2),
                    Catch::Contains("bias: expected shape (5,)"));
  CHECK_THROWS_WITH(
      build({{"weight", w({2, 5, 3})}, {"bias", w({2, 5})}, {"features", std::int64_t(4)}}, 2),
      "features=4 disagrees with the m = 5 rows of weight");
  reg::ArrayValue nan = w({2, 5});
  nan.data[3] = std::nan("");
  CHECK_THROWS_WITH(build({{"weight", w({2, 5, 3})}, {"bias", nan}}, 2),
                    "bias holds a non-finite value at flat index 3");
  CHECK_THROWS_AS(build({{"weight", w({2, 5, 3})}}, 2), reg::OptionError);
  // The gradient of a weight that was not given.
  reg::Settings settings;
  settings.option_gradients = {"weight"};
  const reg::Call c = reg::make_call(method, {}, settings, randattn::BatchShape{1, 1, 4, 4, 3, 2},
                                     hedgehog_test::kSpelling);
  CHECK_THROWS_WITH(method.build_gradient(c, double()),
                    "the gradient of weight needs weight given");
}
