#pragma once
// Registered method "exact": exact softmax attention (tiled, never forms the n_q x n_k matrix).

#include <randattn/core/exact_attention.hpp>

#include "../method.hpp"

namespace randattn::registry {

class ExactMethod final : public TypedMethod<ExactMethod> {
 public:
  const char* name() const override { return "exact"; }
  const char* summary() const override { return "exact softmax attention"; }
  std::vector<OptionSpec> options() const override { return {}; }
  bool supports_exclude_self() const override { return true; }

  template <typename Scalar>
  Job<Scalar> make(const Call& call) const {
    ExactOptions opt;
    opt.causal = call.settings.causal;
    opt.scale = call.settings.scale;
    opt.check_finite = call.settings.check_finite;
    opt.exclude_self = call.settings.exclude_self;
    return
        [opt, shape = call.shape](const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
          exact_attention_batched(q, k, v, out, shape, opt);
          return Report{};
        };
  }
};

}  // namespace randattn::registry
