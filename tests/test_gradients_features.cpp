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
