#pragma once
// Registered method "hedgehog": linear attention over the learned Hedgehog feature map
// (features/hedgehog.hpp), φ(x) = [softmax(u); softmax(−u)] with u = W (c x) + b, run by the
// random-feature machinery (FeatureMethod: causal and bidirectional, every layout, the backward).
//
// Options: weight (kv_heads, m, d) and bias (kv_heads, m), given together, one map per key/value
// head: query head h of a grouped-query call uses the map of key/value head h / group, as it
// reads that head's keys. An (m, d) weight with an (m,) bias is one map for every head. Without
// them, the seeded map of m = features (default 64): W = OrthogonalProjection(m, d, seed), b = 0,
// the same for every head. The gradients of weight and bias (differentiable options) have the
// given arrays' shapes, each head's entry summed over the slices that used it.

#include <randattn/randattn.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../feature_options.hpp"
#include "features.hpp"

namespace randattn::registry {

struct HedgehogFamily {
  static constexpr const char* name = "hedgehog";
  static constexpr const char* summary =
      "Hedgehog learned feature map [softmax(u); softmax(-u)], u = W x + b, one map per key/value "
      "head (2m features)";
  static constexpr bool fitted = false;
  static constexpr const char* weight_option = "weight";
  static constexpr const char* bias_option = "bias";
  static constexpr bool parameters_per_map = true;

  static std::vector<OptionSpec> options() {
    namespace f = feature_options;
    return {f::hedgehog_features(), f::weight(), f::bias()};
  }

  // weight and bias together, in matching shapes that fit the call (d, key/value heads).
  static void check(const Call& call) {
    const Options& o = call.options;
    const std::string weight = o.spelled("weight"), bias = o.spelled("bias");
    if (o.given("weight") != o.given("bias"))
      throw OptionError(weight + " and " + bias +
                        " go together: " + (o.given("weight") ? bias : weight) + " is missing");
    if (!o.given("weight")) return;
    const ArrayValue& w = o.array("weight");
    const ArrayValue& b = o.array("bias");
    const std::int64_t d = call.shape.d, heads = call.key_heads();
    const bool per_head = w.shape.size() == 3;
    const bool ok = (w.shape.size() == 2 || (per_head && w.shape[0] == heads)) &&
                    w.shape.back() == d && w.shape[w.shape.size() - 2] >= 1;
    if (!ok)
      throw OptionError(weight + ": expected a (kv_heads, m, d) = (" + std::to_string(heads) +
                        ", m, " + std::to_string(d) +
                        ") array (the key/value heads and d of the "
                        "input; or (m, d) for every head) with m >= 1, got shape " +
                        detail::shape_text(w.shape));
    const std::int64_t m = w.shape[w.shape.size() - 2];
    const std::vector<std::int64_t> want =
        per_head ? std::vector<std::int64_t>{heads, m} : std::vector<std::int64_t>{m};
    if (b.shape != want)
      throw OptionError(bias + ": expected shape " + detail::shape_text(want) + " to match " +
                        weight + " of shape " + detail::shape_text(w.shape) + ", got shape " +
                        detail::shape_text(b.shape));
    if (o.given("features") && o.integer("features") != m)
      throw OptionError(o.spelling().setting("features", std::to_string(o.integer("features"))) +
                        " disagrees with the m = " + std::to_string(m) + " rows of " + weight);
    for (const auto* a : {&w, &b})
      for (std::size_t i = 0; i < a->data.size(); ++i)
        if (!std::isfinite(a->data[i]))
          throw OptionError((a == &w ? weight : bias) + " holds a non-finite value at flat index " +
                            std::to_string(i));
  }

  // The given maps (one per head, or one for every head) or the seeded one.
  template <typename Scalar>
  static detail::SliceMaps<HedgehogFeatures<Scalar>> maps(const Call& call) {
    const Options& o = call.options;
    if (!o.given("weight"))
      return detail::SliceMaps<HedgehogFeatures<Scalar>>(
          HedgehogFeatures<Scalar>(o.integer("features"), call.shape.d, call.settings.seed));
    const ArrayValue& w = o.array("weight");
    const ArrayValue& b = o.array("bias");
    const Index heads = w.shape.size() == 3 ? Index(w.shape[0]) : 1;
    const Index m = w.shape[w.shape.size() - 2], d = w.shape.back();
    std::vector<HedgehogFeatures<Scalar>> maps;
    maps.reserve(std::size_t(heads));
    for (Index h = 0; h < heads; ++h)
      maps.emplace_back(ConstRowMatrixMap<double>(w.data.data() + h * m * d, m, d),
                        Eigen::Map<const Eigen::VectorXd>(b.data.data() + h * m, m));
    return detail::SliceMaps<HedgehogFeatures<Scalar>>(std::move(maps));
  }

  static void report(const Call& call, Report& r) {
    const Options& o = call.options;
    if (o.given("weight")) {
      const ArrayValue& w = o.array("weight");
      r = {{"features", w.shape[w.shape.size() - 2]},
           {"weight", w.source},
           {"bias", o.array("bias").source}};
    } else {
      r = {{"features", o.integer("features")}, {"seed", std::uint64_t(call.settings.seed)}};
    }
  }
};

}  // namespace randattn::registry
