// Key layouts of registered methods (include/randattn/registry/layout.hpp): the declared layout
// inputs and their checks in both front ends' spellings, self-exclusion of every method that
// supports it under packed sequences and padding (sub-calls that give the same bits for any
// thread count: test_threads.cpp). Also every registered method's batched job on logits beyond
// the floating-point range: the overflow error, never NaN; and half-precision calls and
// gradients (Eigen::half, Eigen::bfloat16), which must be the float32 call on the same inputs
// rounded once.
#include <randattn/registry/layout.hpp>
#include <randattn/registry/registry.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "layout_support.hpp"
#include "support.hpp"


namespace reg = randattn::registry;
using randattn::BatchShape;
using randattn::Index;
using testing::integers;
using testing::options_of;
using testing::run;
using testing::values;

namespace {

const reg::Spelling kCommandLine{true}, kPython{false};

// The message of what fn throws (empty when it throws nothing).
template <typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const reg::OptionError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("Layout inputs are declared once and checked with each front end's spelling",
          "[layout]") {
  std::vector<std::string> names;
  for (const reg::LayoutInputSpec& s : reg::layout_inputs()) names.push_back(s.name);
  CHECK(names ==
        std::vector<std::string>{"key_lengths", "key_padding_mask", "cu_seqlens", "exclude_self"});
  CHECK(reg::shape_rule(reg::layout_input("key_padding_mask")) == "(batch, n_k)");
  CHECK(reg::shape_rule(reg::layout_input("cu_seqlens")) == "(S + 1,)");

  const reg::Method& exact = reg::find_method("exact", kPython);
  const std::vector<std::int64_t> q{2, 4, 6, 3}, kv{2, 2, 6, 3};
  const reg::Settings settings;
  // The same message in both front ends, up to the spelling of the names.
  const auto both = [&](const std::map<std::string, reg::IndexArray>& given,
                        const std::string& python, const std::string& command_line) {
    for (const auto& spelled : {std::make_pair(kPython, python),
                                std::make_pair(kCommandLine, command_line)}) {
      const auto& spell = spelled.first;  // a named variable: lambdas cannot capture bindings
      const reg::CallShape c = reg::call_shape(q, &kv, kv, spell);
      CHECK(message_of([&] { reg::make_layout(exact, given, c, settings, spell); }) ==
            spelled.second);
    }
  };
  both({{"key_lengths", integers({3}, {1, 2, 3})}},
       "key_lengths must have shape (batch,) = (2,), got (3,)",
       "--key-lengths must have shape (batch,) = (2,), got (3,)");
  both({{"key_lengths", integers({2}, {1, 7})}}, "key_lengths[1] must be in [0, 6] (n_k), got 7",
       "--key-lengths[1] must be in [0, 6] (n_k), got 7");
  both({{"key_padding_mask", integers({2, 6}, std::vector<std::int64_t>(12, 0))}},
       "key_padding_mask must be a boolean array, got an integer array",
       "--key-padding-mask must be a boolean array, got an integer array");
  both({{"key_padding_mask", {{2, 5}, std::vector<std::int64_t>(10, 0), true}}},
       "key_padding_mask must have shape (batch, n_k) = (2, 6), got (2, 5)",
       "--key-padding-mask must have shape (batch, n_k) = (2, 6), got (2, 5)");
  both({{"cu_seqlens", integers({1, 2}, {0, 6})}},
       "cu_seqlens must have shape (S + 1,), got (1, 2)",
       "--cu-seqlens must have shape (S + 1,), got (1, 2)");
  both({{"cu_seqlens", integers({3}, {0, 4, 4})}},
       "cu_seqlens must start at 0 and end at n = 6 (at least two offsets)",
       "--cu-seqlens must start at 0 and end at n = 6 (at least two offsets)");
  both({{"key_lengths", integers({2}, {1, 2})},
        {"key_padding_mask", {{2, 6}, std::vector<std::int64_t>(12, 0), true}}},
       "give at most one of key_lengths and key_padding_mask",
       "give at most one of --key-lengths and --key-padding-mask");
  both({}, "", "");

  const std::vector<std::int64_t> k3{2, 3, 6, 3};
  CHECK(message_of([&] { reg::call_shape(q, &k3, k3, kPython); }) ==
        "the heads of k and v (3) must divide the heads of q (4): q (2, 4, 6, 3), k (2, 3, 6, 3), "
        "v (2, 3, 6, 3)");
  CHECK(message_of([&] { reg::call_shape(q, &k3, k3, kCommandLine); }) ==
        "the heads of --k and --v (3) must divide the heads of --q (4): q (2, 4, 6, 3), k (2, 3, "
        "6, 3), v (2, 3, 6, 3)");
  CHECK(reg::call_shape(q, &kv, kv, kPython).kv_heads == 2);
  CHECK(reg::call_shape(q, nullptr, q, kPython).kv_heads == 0);  // shared QK: the queries' heads
}

TEMPLATE_TEST_CASE("Self-exclusion under packed sequences and padding equals the plain method",
                   "[layout][exclude_self]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  const BatchShape shape{2, 2, 12, 12, 4, 3};
  const std::vector<Scalar> q = values<Scalar>(1, shape.slices() * shape.n_q, shape.d);
  const std::vector<Scalar> v = values<Scalar>(2, shape.slices() * shape.n_k, shape.dv);
  for (const char* method : {"exact", "favor", "lsh", "lsf"}) {
    for (bool causal : {false, true}) {
      INFO(method << " causal " << causal);
      // Packed sequences [0, 5) and [5, 12) of K = Q: each one equals a call on its own rows.
      const std::vector<Scalar> packed =
          run<Scalar>(method, shape, 2, {{"cu_seqlens", integers({3}, {0, 5, 12})}}, causal,
                      true, q, q, v);
      for (const auto& [a, e] : {std::pair<Index, Index>{0, 5}, std::pair<Index, Index>{5, 12}}) {
        const BatchShape part{2, 2, e - a, e - a, shape.d, shape.dv};
        std::vector<Scalar> qp, vp;
        for (Index sl = 0; sl < shape.slices(); ++sl) {
          qp.insert(qp.end(), q.begin() + (sl * 12 + a) * shape.d, q.begin() + (sl * 12 + e) * shape.d);
          vp.insert(vp.end(), v.begin() + (sl * 12 + a) * shape.dv,
                    v.begin() + (sl * 12 + e) * shape.dv);
        }
        const std::vector<Scalar> alone = run<Scalar>(method, part, 2, {}, causal, true, qp, qp, vp);
        for (Index sl = 0; sl < shape.slices(); ++sl)
          for (Index i = 0; i < (e - a) * shape.dv; ++i)
            CHECK(packed[std::size_t((sl * 12 + a) * shape.dv + i)] ==
                  alone[std::size_t(sl * (e - a) * shape.dv + i)]);
      }
      // Key lengths (12, 12) are no padding at all.
      CHECK(run<Scalar>(method, shape, 2, {{"key_lengths", integers({2}, {12, 12})}}, causal, true,
                        q, q, v) == run<Scalar>(method, shape, 2, {}, causal, true, q, q, v));
    }
  }
}

TEMPLATE_TEST_CASE("Every registered method reports logits beyond the range, never returns NaN",
                   "[layout][robustness][overflow]", RANDATTN_TEST_SCALARS) {
  using Scalar = TestType;
  // A scale near the type's maximum: the logits of bounded queries and keys overflow. Each
  // method's batched job (what both front ends call) either returns a finite result (random
  // features clamp their log-scales, so their estimate stays finite) or raises the overflow
  // error; NaN or Inf is never handed back.
  const BatchShape shape{2, 2, 6, 6, 2, 1};
  const std::vector<Scalar> q = values<Scalar>(31, shape.slices() * shape.n_q, shape.d),
                            k = values<Scalar>(32, shape.slices() * shape.n_k, shape.d),
                            v = values<Scalar>(33, shape.slices() * shape.n_k, shape.dv);
  for (const auto& method : reg::methods()) {
    for (const bool shared : {false, true}) {
      if (shared && !method->supports_shared_qk()) continue;
      for (const bool causal : {false, true}) {
        reg::Settings settings;
        settings.causal = causal;
        settings.shared_qk = shared;
        settings.seed = 3;
        settings.scale = double(std::numeric_limits<Scalar>::max()) / 2;
        INFO(method->name() << (shared ? ", shared QK" : "") << (causal ? ", causal" : ""));
        std::map<std::string, reg::Value> options = options_of(method->name());
        if (causal && reg::owns(*method, "fit")) {  // a causal fit takes given rows: the first slice's queries
          options["fit"] = std::string("given");
          options["calibration"] = reg::ArrayValue{
              {shape.n_q, shape.d}, std::vector<double>(q.begin(), q.begin() + shape.n_q * shape.d),
              "q"};
        }
        std::vector<Scalar> out(std::size_t(shape.slices() * shape.n_q * shape.dv));
        try {
          const reg::Call call = reg::make_call(*method, options, settings, shape, kPython);
          method->build(call, Scalar())(q.data(), shared ? nullptr : k.data(), v.data(),
                                         out.data());
        } catch (const std::invalid_argument& e) {
          CHECK_THAT(e.what(), Catch::Contains("overflowed the floating-point range"));
          continue;
        }
        for (const Scalar x : out) REQUIRE(std::isfinite(x));
      }
    }
  }
}

// --- Half precision --------------------------------------------------------------------------

namespace {

// The bits of a half value (Eigen::half and Eigen::bfloat16 hold them in `x` / `value`).
template <typename Half>
std::uint16_t half_bits(Half h) {
  return Eigen::numext::bit_cast<std::uint16_t>(h);
}

// values<float>(...) rounded to Half, and those rounded values widened back (exactly).
template <typename Half>
struct RoundedHalfInput {
  std::vector<Half> half;
  std::vector<float> wide;
  RoundedHalfInput(std::uint64_t seed, Index rows, Index cols) {
    for (float x : values<float>(seed, rows, cols)) {
      half.push_back(Half(x));
      wide.push_back(float(half.back()));
    }
  }
};

// One registered call (build_job) of Scalar buffers with the given options; k may be empty
// (shared QK).
template <typename Scalar>
std::vector<Scalar> registered_call(const std::string& name,
                                    std::map<std::string, reg::Value> options,
                                    const BatchShape& shape, Index kv_heads,
                                    const std::map<std::string, reg::IndexArray>& given,
                                    bool causal, const std::vector<Scalar>& q,
                                    const std::vector<Scalar>& k, const std::vector<Scalar>& v) {
  const reg::Method& method = reg::find_method(name, kPython);
  reg::Settings settings;
  settings.causal = causal;
  settings.shared_qk = k.empty();
  settings.seed = 9;
  settings.scale = reg::default_scale(shape.d);
  const std::vector<std::int64_t> qs{shape.batch, shape.heads, shape.n_q, shape.d},
      ks{shape.batch, kv_heads, shape.n_k, shape.d}, vs{shape.batch, kv_heads, shape.n_k, shape.dv};
  const reg::CallShape call_shape = reg::call_shape(qs, k.empty() ? nullptr : &ks, vs, kPython);
  const reg::Layout layout = reg::make_layout(method, given, call_shape, settings, kPython);
  const reg::Call call = reg::make_call(method, std::move(options), settings, shape, kPython);
  std::vector<Scalar> out(std::size_t(shape.slices() * shape.n_q * shape.dv));
  reg::build_job<Scalar>(method, call, layout)(q.data(), k.empty() ? nullptr : k.data(), v.data(),
                                               out.data());
  return out;
}

// half holds float32's values rounded to Half: the same bits as Half(x), and each entry within
// the unit roundoff u relative to x (float16's subnormals, |x| < 2^-14: within 2^-25), so the
// relative error of the whole is at most u too.
template <typename Half>
void check_rounded_half(const std::vector<Half>& half, const std::vector<float>& wide) {
  REQUIRE(half.size() == wide.size());
  const double u = randattn::half_unit_roundoff<Half>();
  const double tiny = std::is_same<Half, Eigen::half>::value ? 0x1p-25 : 0.0;
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < half.size(); ++i) {
    CHECK(half_bits(half[i]) == half_bits(Half(wide[i])));
    const double e = std::abs(double(float(half[i])) - double(wide[i]));
    CHECK(e <= std::max(u * std::abs(double(wide[i])), tiny));
    diff += e * e;
    norm += double(wide[i]) * double(wide[i]);
  }
  CHECK(std::sqrt(diff / norm) <= u);
}

}  // namespace

TEMPLATE_TEST_CASE("Half-precision calls are the float32 call on the same inputs, rounded once",
                   "[layout][half]", Eigen::half, Eigen::bfloat16) {
  using Half = TestType;
  // Grouped heads (4 query heads on 2 key heads) with key lengths, causal and not: a few methods
  // of every family, and auto.
  const BatchShape shape{2, 4, 19, 19, 8, 3};
  const Index kv_heads = 2;
  const RoundedHalfInput<Half> q(41, shape.slices() * shape.n_q, shape.d),
      k(42, shape.batch * kv_heads * shape.n_k, shape.d),
      v(43, shape.batch * kv_heads * shape.n_k, shape.dv);
  const std::map<std::string, reg::IndexArray> lengths{{"key_lengths", integers({2}, {19, 11})}};
  const std::vector<std::pair<std::string, std::map<std::string, reg::Value>>> runs = {
      {"exact", {}},
      {"favor", {{"features", std::int64_t(16)}}},
      {"hybrid", {{"features", std::int64_t(8)}, {"lambda_features", std::int64_t(4)}}},
      {"hedgehog", {{"features", std::int64_t(8)}}},
      {"lsh", {{"chunk", std::int64_t(4)}, {"rounds", std::int64_t(2)}}},
      {"lsf", {{"filters", std::int64_t(16)}, {"tables", std::int64_t(2)}, {"eta", 0.3}}},
      {"sparse-lowrank",
       {{"support", std::string("window")},
        {"window", std::int64_t(4)},
        {"remainder", std::string("favor")},
        {"features", std::int64_t(16)}}},
      {"auto", {{"crossover", std::int64_t(0)}, {"features", std::int64_t(16)}}},
  };
  for (const auto& [name, options] : runs)
    for (bool causal : {false, true}) {
      INFO(name << " causal " << causal);
      const std::vector<Half> half = registered_call<Half>(name, options, shape, kv_heads, lengths,
                                                           causal, q.half, k.half, v.half);
      check_rounded_half(half, registered_call<float>(name, options, shape, kv_heads, lengths,
                                                      causal, q.wide, k.wide, v.wide));
    }
  // Shared QK (keys := the normalised queries).
  const BatchShape shared{2, 2, 19, 19, 8, 3};
  const RoundedHalfInput<Half> qs(44, shared.slices() * shared.n_q, shared.d),
      vs(45, shared.slices() * shared.n_k, shared.dv);
  const std::map<std::string, reg::Value> lsh{{"chunk", std::int64_t(4)}};
  check_rounded_half(registered_call<Half>("lsh", lsh, shared, 2, {}, true, qs.half, {}, vs.half),
                     registered_call<float>("lsh", lsh, shared, 2, {}, true, qs.wide, {}, vs.wide));
}

TEMPLATE_TEST_CASE("Half-precision gradients are the float32 gradients, rounded once",
                   "[layout][half][gradient]", Eigen::half, Eigen::bfloat16) {
  using Half = TestType;
  const BatchShape shape{1, 2, 23, 23, 4, 3};
  const RoundedHalfInput<Half> q(51, shape.slices() * shape.n_q, shape.d),
      k(52, shape.slices() * shape.n_k, shape.d), v(53, shape.slices() * shape.n_k, shape.dv),
      g(54, shape.slices() * shape.n_q, shape.dv);
  for (const char* name : {"exact", "favor", "lsh"}) {
    INFO(name);
    const reg::Method& method = reg::find_method(name, kPython);
    reg::Settings settings;
    settings.causal = true;
    settings.seed = 4;
    settings.scale = reg::default_scale(shape.d);
    const reg::Call call = reg::make_call(method, options_of(name), settings, shape, kPython);
    const reg::Layout plain;
    // Both directions on Scalar buffers: out, dq, dk, dv.
    const auto run = [&](auto scalar, const auto& qq, const auto& kk, const auto& vv,
                         const auto& gg) {
      using Scalar = decltype(scalar);
      std::vector<std::vector<Scalar>> r{
          std::vector<Scalar>(gg.size()), std::vector<Scalar>(qq.size()),
          std::vector<Scalar>(kk.size()), std::vector<Scalar>(vv.size())};
      const reg::GradientPtr<Scalar> grad = reg::build_gradient<Scalar>(method, call, plain);
      grad->forward(qq.data(), kk.data(), vv.data(), r[0].data());
      grad->backward(gg.data(), r[1].data(), r[2].data(), r[3].data());
      return r;
    };
    const auto half = run(Half(), q.half, k.half, v.half, g.half);
    const auto wide = run(float(), q.wide, k.wide, v.wide, g.wide);
    for (std::size_t i = 0; i < half.size(); ++i) check_rounded_half(half[i], wide[i]);
  }
}

TEST_CASE("Half-precision results beyond the type's range are an error, not an infinity",
          "[layout][half][robustness]") {
  using randattn::check_half_range;
  using randattn::round_to_half;
  // The thresholds: the largest finite value is kept, the first value that rounds to infinity
  // (the largest plus half its spacing, a tie rounded to even) is refused, non-finite values pass.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<Eigen::half> h(4);
  const std::vector<float> fits{65519.99f, -65504.0f, inf, std::nanf("")};
  round_to_half(fits.data(), 4, h.data(), "x");
  CHECK(float(h[0]) == 65504.0f);
  CHECK(float(h[1]) == -65504.0f);
  CHECK(std::isinf(float(h[2])));
  CHECK(std::isnan(float(h[3])));
  const std::vector<float> over{1.0f, -65520.0f};
  CHECK_THROWS_WITH(round_to_half(over.data(), 2, h.data(), "x"),
                    "x: entry 1 is -65520, beyond the largest finite float16 (65504); pass "
                    "bfloat16 or float32 inputs for a wider range");
  CHECK(float(h[0]) == 65504.0f);  // nothing written
  CHECK_NOTHROW(check_half_range<Eigen::bfloat16>(over.data(), 2, "x"));
  const std::vector<float> wide{0x1.fep127f, 0x1.ffp127f};
  CHECK_NOTHROW(check_half_range<Eigen::bfloat16>(wide.data(), 1, "x"));
  CHECK_THROWS_AS(check_half_range<Eigen::bfloat16>(wide.data(), 2, "x"),
                  randattn::invalid_argument);
  // The unit roundoffs are half of each type's machine epsilon, the spacing above 1 (from the
  // bits: Eigen 3.4's numeric_limits<half>::epsilon() is 2^-13, not 2^-10).
  const auto spacing_above_one = [](auto one) {
    using Half = decltype(one);
    const auto next = Eigen::numext::bit_cast<Half>(std::uint16_t(half_bits(one) + 1));
    return double(float(next)) - 1.0;
  };
  CHECK(randattn::half_unit_roundoff<Eigen::half>() == spacing_above_one(Eigen::half(1.0f)) / 2);
  CHECK(randattn::half_unit_roundoff<Eigen::bfloat16>() ==
        spacing_above_one(Eigen::bfloat16(1.0f)) / 2);

  // Through the registry: uniform attention of 16 queries over 4 keys gives dv = 4 * grad_out,
  // 240000 for a grad_out of 60000, beyond float16; the gradients are left as they were.
  const BatchShape shape{1, 1, 16, 4, 2, 1};
  const reg::Method& exact = reg::find_method("exact", kPython);
  reg::Settings settings;
  settings.scale = 1;
  const reg::Call call = reg::make_call(exact, {}, settings, shape, kPython);
  const std::vector<Eigen::half> q(32, Eigen::half(0.0f)), k(8, Eigen::half(1.0f)),
      v(4, Eigen::half(1.0f)), g(16, Eigen::half(60000.0f));
  std::vector<Eigen::half> out(16), dq(32, Eigen::half(7.0f)), dk(8, Eigen::half(7.0f)),
      dv(4, Eigen::half(7.0f));
  const auto grad = reg::build_gradient<Eigen::half>(exact, call, reg::Layout{});
  grad->forward(q.data(), k.data(), v.data(), out.data());
  for (Eigen::half o : out) CHECK(float(o) == 1.0f);
  CHECK_THROWS_WITH(grad->backward(g.data(), dq.data(), dk.data(), dv.data()),
                    Catch::StartsWith("randattn::registry: method 'exact', gradient dv: entry 0 "
                                      "is 240000, beyond the largest finite float16"));
  for (const auto* grads : {&dq, &dk, &dv})
    for (Eigen::half x : *grads) CHECK(float(x) == 7.0f);
  // In bfloat16 the same gradient fits: 4 * bfloat16(60000), rounded.
  const auto to_bf16 = [](const std::vector<Eigen::half>& x) {
    std::vector<Eigen::bfloat16> y;
    for (Eigen::half h : x) y.push_back(Eigen::bfloat16(float(h)));
    return y;
  };
  std::vector<Eigen::bfloat16> bout(16), bdq(32), bdk(8), bdv(4);
  const auto bgrad = reg::build_gradient<Eigen::bfloat16>(exact, call, reg::Layout{});
  bgrad->forward(to_bf16(q).data(), to_bf16(k).data(), to_bf16(v).data(), bout.data());
  bgrad->backward(to_bf16(g).data(), bdq.data(), bdk.data(), bdv.data());
  const float expected = float(Eigen::bfloat16(4 * float(Eigen::bfloat16(60000.0f))));
  for (Eigen::bfloat16 x : bdv) CHECK(float(x) == expected);
}
