#pragma once
// Registered calls under a key layout, shared by the layout tests (test_layout.cpp) and the
// thread tests (test_threads.cpp).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <randattn/registry/layout.hpp>
#include <randattn/registry/registry.hpp>

#include "support.hpp"

namespace testing {

namespace reg = randattn::registry;
using randattn::BatchShape;

inline reg::IndexArray integers(std::vector<std::int64_t> shape, std::vector<std::int64_t> data) {
  return {std::move(shape), std::move(data), false};
}

inline // Small options of every method that supports self-exclusion, as the Python mask tests use.
std::map<std::string, reg::Value> options_of(const std::string& method) {
  if (method == "favor") return {{"features", std::int64_t(16)}};
  if (method == "lsh") return {{"chunk", std::int64_t(4)}, {"rounds", std::int64_t(2)}};
  if (method == "lsf")
    return {{"filters", std::int64_t(16)}, {"tables", std::int64_t(2)}, {"eta", 0.3}};
  return {};
}

// One registered call: q (batch, heads, n, d), k and v (batch, kv_heads, n, ·), under a layout.
template <typename Scalar>
std::vector<Scalar> run(const std::string& name, const BatchShape& shape, Index kv_heads,
                        const std::map<std::string, reg::IndexArray>& given, bool causal,
                        bool exclude_self, const std::vector<Scalar>& q,
                        const std::vector<Scalar>& k, const std::vector<Scalar>& v) {
  const reg::Method& method = reg::find_method(name, reg::Spelling{false});
  reg::Settings settings;
  settings.causal = causal;
  settings.exclude_self = exclude_self;
  settings.seed = 5;
  settings.scale = reg::default_scale(shape.d);
  const std::vector<std::int64_t> qs{shape.batch, shape.heads, shape.n_q, shape.d},
      ks{shape.batch, kv_heads, shape.n_k, shape.d}, vs{shape.batch, kv_heads, shape.n_k, shape.dv};
  const reg::CallShape call_shape = reg::call_shape(qs, &ks, vs, reg::Spelling{false});
  const reg::Layout layout = reg::make_layout(method, given, call_shape, settings, reg::Spelling{false});
  const reg::Call call = reg::make_call(method, options_of(name), settings, shape, reg::Spelling{false});
  std::vector<Scalar> out(std::size_t(shape.slices() * shape.n_q * shape.dv));
  reg::build_job<Scalar>(method, call, layout)(q.data(), k.data(), v.data(), out.data());
  return out;
}

template <typename Scalar>
std::vector<Scalar> values(std::uint64_t seed, Index rows, Index cols) {
  const randattn::RowMatrix<Scalar> x = gaussian<Scalar>(seed, rows, cols);
  return std::vector<Scalar>(x.data(), x.data() + x.size());
}

}  // namespace testing
