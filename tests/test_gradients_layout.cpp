// Gradients of registered methods under key layouts (include/randattn/registry/layout.hpp): key
// padding (a prefix and a scattered mask), packed sequences, grouped-query heads and
// self-exclusion, causal and not, against central finite differences of the same registered
// call; the forward's bits equal the job's; masked keys get zero gradients.
#include <randattn/registry/layout.hpp>
#include <randattn/registry/registry.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "gradient_check.hpp"
#include "support.hpp"

namespace reg = randattn::registry;
using randattn::BatchShape;
using randattn::Index;
using randattn::RowMatrix;

namespace {

const reg::Spelling kPythonSpelling{false};

// One registered call on (batch, heads, n, d) queries and (batch, kv_heads, n, ·) keys and
// values, under a layout: its job, and its differentiable form.
struct LayoutCall {
  std::string method;
  std::map<std::string, reg::Value> options;
  BatchShape shape;
  Index kv_heads;
  std::map<std::string, reg::IndexArray> given;
  bool causal = false, exclude_self = false;
  std::vector<std::string> option_gradients;  // array options whose gradient is checked

  reg::Call call(const reg::Method& m, reg::Layout& layout) const {
    reg::Settings settings;
    settings.option_gradients = option_gradients;
    settings.causal = causal;
    settings.exclude_self = exclude_self;
    settings.seed = 3;
    settings.scale = reg::default_scale(shape.d);
    const std::vector<std::int64_t> qs{shape.batch, shape.heads, shape.n_q, shape.d},
        ks{shape.batch, kv_heads, shape.n_k, shape.d},
        vs{shape.batch, kv_heads, shape.n_k, shape.dv};
    layout = reg::make_layout(m, given, reg::call_shape(qs, &ks, vs, kPythonSpelling), settings, kPythonSpelling);
    return reg::make_call(m, options, settings, shape, kPythonSpelling);
  }

  template <typename Scalar>
  RowMatrix<Scalar> forward(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                            const RowMatrix<Scalar>& v) const {
    const reg::Method& m = reg::find_method(method, kPythonSpelling);
    reg::Layout layout;
    const reg::Call c = call(m, layout);
    RowMatrix<Scalar> out(q.rows(), v.cols());
    reg::build_job<Scalar>(m, c, layout)(q.data(), k.data(), v.data(), out.data());
    return out;
  }
};

// Inputs stored as (rows, cols) matrices of the flattened (batch, heads, n, ·) arrays; the
// gradients of the array options lc.option_gradients names are checked too.
void check_layout_gradients(LayoutCall lc) {
  const BatchShape& s = lc.shape;
  RowMatrix<double> q = testing::gaussian<double>(11, s.batch * s.heads * s.n_q, s.d);
  RowMatrix<double> k = testing::gaussian<double>(12, s.batch * lc.kv_heads * s.n_k, s.d);
  RowMatrix<double> v = testing::gaussian<double>(13, s.batch * lc.kv_heads * s.n_k, s.dv);
  const RowMatrix<double> g = testing::gaussian<double>(14, q.rows(), s.dv);

  const reg::Method& m = reg::find_method(lc.method, kPythonSpelling);
  reg::Layout layout;
  const reg::Call c = lc.call(m, layout);
  reg::GradientPtr<double> grad = reg::build_gradient<double>(m, c, layout);
  RowMatrix<double> out(q.rows(), s.dv);
  grad->forward(q.data(), k.data(), v.data(), out.data());
  CHECK(out == lc.forward(q, k, v));  // the same bits as the job
  RowMatrix<double> dq(q.rows(), q.cols()), dk(k.rows(), k.cols()), dv(v.rows(), v.cols());
  grad->backward(g.data(), dq.data(), dk.data(), dv.data());

  const auto f = [&] { return testing::contract(g, lc.forward(q, k, v)); };
  testing::check_gradient("dq", q, dq, f);
  testing::check_gradient("dk", k, dk, f);
  testing::check_gradient("dv", v, dv, f);

  const auto option_grads = grad->option_gradients();
  REQUIRE(option_grads.size() == lc.option_gradients.size());
  for (const auto& [name, values] : option_grads) {
    auto& array = std::get<reg::ArrayValue>(lc.options.at(name));
    REQUIRE(array.shape.size() == 2);
    REQUIRE(values.size() == array.data.size());
    RowMatrix<double> x = Eigen::Map<const RowMatrix<double>>(array.data.data(), array.shape[0],
                                                              array.shape[1]);
    const RowMatrix<double> gx = Eigen::Map<const RowMatrix<double>>(values.data(), x.rows(),
                                                                     x.cols());
    const auto f_option = [&] {
      std::copy(x.data(), x.data() + x.size(), array.data.begin());
      return testing::contract(g, lc.forward(q, k, v));
    };
    testing::check_gradient(name, x, gx, f_option);
  }
}

reg::IndexArray array(std::vector<std::int64_t> shape, std::vector<std::int64_t> data,
                      bool boolean = false) {
  return {std::move(shape), std::move(data), boolean};
}

}  // namespace

TEST_CASE("Gradients under key layouts equal finite differences", "[gradients][layout]") {
  const std::string method =
      GENERATE(as<std::string>{}, "exact", "lsf", "favor", "hybrid-gaussian");
  std::map<std::string, reg::Value> options;
  if (method == "lsf") options = {{"filters", std::int64_t(8)}, {"tables", std::int64_t(2)}, {"eta", 0.3}};
  // A given projection, summed over every piece that used it; the hybrid's stacks its weight
  // estimator's 2 rows and its two bases' 3 rows each.
  const bool learned = method == "favor" || method == "hybrid-gaussian";
  if (learned) {
    const Index rows = method == "favor" ? 6 : 8;
    const RowMatrix<double> omega = testing::gaussian<double>(15, rows, 3);
    options = {{"omega", reg::ArrayValue{{rows, 3}, {omega.data(), omega.data() + omega.size()}, "omega"}}};
    if (method == "hybrid-gaussian") options["lambda_features"] = std::int64_t(2);
  }
  const std::vector<std::string> option_gradients =
      learned ? std::vector<std::string>{"omega"} : std::vector<std::string>{};
  const BatchShape shape{2, 4, 9, 9, 3, 2};
  const bool causal = GENERATE(false, true);
  CAPTURE(method, causal);
  SECTION("grouped heads with key lengths (a prefix)") {
    check_layout_gradients({method, options, shape, 2, {{"key_lengths", array({2}, {6, 9})}},
                            causal, false, option_gradients});
  }
  SECTION("scattered key padding") {
    std::vector<std::int64_t> mask(2 * 9, 0);
    mask[2] = mask[3] = mask[7] = 1;      // batch item 0: two runs of padding
    mask[9 + 0] = mask[9 + 8] = 1;        // batch item 1: first and last
    check_layout_gradients({method, options, shape, 4,
                            {{"key_padding_mask", array({2, 9}, mask, true)}}, causal, false,
                            option_gradients});
  }
  SECTION("packed sequences") {
    check_layout_gradients({method, options, shape, 1,
                            {{"cu_seqlens", array({4}, {0, 4, 5, 9})}}, causal, false,
                            option_gradients});
  }
  if (method == "exact") {
    SECTION("self-exclusion with scattered padding") {
      std::vector<std::int64_t> mask(2 * 9, 0);
      mask[4] = mask[9 + 1] = 1;
      LayoutCall lc{method, options, shape, 2, {{"key_padding_mask", array({2, 9}, mask, true)}},
                    causal, true, {}};
      check_layout_gradients(lc);
    }
  }
}

TEST_CASE("Masked keys get zero gradients and a key read by several heads sums them",
          "[gradients][layout]") {
  const BatchShape shape{1, 4, 7, 7, 3, 2};
  LayoutCall lc{"exact", {}, shape, 1, {{"key_lengths", array({1}, {5})}}, false, false, {}};
  const RowMatrix<double> q = testing::gaussian<double>(1, 4 * 7, 3);
  const RowMatrix<double> k = testing::gaussian<double>(2, 7, 3);
  const RowMatrix<double> v = testing::gaussian<double>(3, 7, 2);
  const RowMatrix<double> g = testing::gaussian<double>(4, 4 * 7, 2);
  const reg::Method& m = reg::find_method("exact", kPythonSpelling);
  reg::Layout layout;
  const reg::Call c = lc.call(m, layout);
  reg::GradientPtr<double> grad = reg::build_gradient<double>(m, c, layout);
  RowMatrix<double> out(q.rows(), 2), dq(q.rows(), 3), dk(7, 3), dv(7, 2);
  grad->forward(q.data(), k.data(), v.data(), out.data());
  grad->backward(g.data(), dq.data(), dk.data(), dv.data());
  CHECK(dk.bottomRows(2).isZero(0));
  CHECK(dv.bottomRows(2).isZero(0));
  // dv of a key is the sum over the query heads of their attention weights times grad_out.
  RowMatrix<double> expected = RowMatrix<double>::Zero(7, 2);
  for (Index h = 0; h < 4; ++h) {
    const RowMatrix<double> qh = q.middleRows(h * 7, 7);
    RowMatrix<double> p = (qh * k.topRows(5).transpose()) / std::sqrt(3.0);
    for (Index i = 0; i < 7; ++i) {
      p.row(i).array() = (p.row(i).array() - p.row(i).maxCoeff()).exp();
      p.row(i) /= p.row(i).sum();
    }
    expected.topRows(5) += p.transpose() * g.middleRows(h * 7, 7);
  }
  CHECK((dv - expected).cwiseAbs().maxCoeff() < 1e-12);
}
