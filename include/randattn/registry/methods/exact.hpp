#pragma once
// Registered method "exact": exact softmax attention (tiled, never forms the n_q x n_k matrix).

#include <randattn/core/exact_attention.hpp>
#include <randattn/core/exact_backward.hpp>

#include <memory>
#include <stdexcept>
#include <vector>

#include "../kept_forward.hpp"
#include "../method.hpp"

namespace randattn::registry {

class ExactMethod final : public TypedMethod<ExactMethod> {
 public:
  const char* name() const override { return "exact"; }
  const char* summary() const override { return "exact softmax attention"; }
  std::vector<OptionSpec> options() const override { return {}; }
  bool supports_exclude_self() const override { return true; }

  bool differentiable() const override { return true; }

  template <typename Scalar>
  Job<Scalar> make(const Call& call) const {
    return [opt = options_of(call), shape = call.shape](const Scalar* q, const Scalar* k,
                                                        const Scalar* v, Scalar* out) {
      exact_attention_batched(q, k, v, out, shape, opt);
      return Report{};
    };
  }

  // The forward keeps the output and the row log-sum-exps; the backward recomputes the score
  // tiles from them (core/exact_backward.hpp).
  template <typename Scalar>
  GradientPtr<Scalar> make_gradient(const Call& call) const {
    class ExactGradient final : public Gradient<Scalar> {
     public:
      ExactGradient(const ExactOptions& opt, const BatchShape& shape) : opt_(opt), shape_(shape) {}

      Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) override {
        const BatchShape& s = shape_;
        lse_.resize(std::size_t(s.slices() * s.n_q));
        exact_attention_forward_batched(q, k, v, out, lse_.data(), s, opt_);
        kept_.keep(q, k, v, out, s);
        return {};
      }

      void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) override {
        kept_.require_forward();
        exact_attention_backward_batched(kept_.q(), kept_.k(), kept_.v(), kept_.out(),
                                         lse_.data(), grad_out, dq, dk, dv, shape_, opt_);
      }

     private:
      ExactOptions opt_;
      BatchShape shape_;
      detail::KeptForward<Scalar> kept_;
      std::vector<Scalar> lse_;
    };
    return std::make_unique<ExactGradient>(options_of(call), call.shape);
  }

 private:
  static ExactOptions options_of(const Call& call) {
    ExactOptions opt;
    opt.causal = call.settings.causal;
    opt.scale = call.settings.scale;
    opt.check_finite = call.settings.check_finite;
    opt.exclude_self = call.settings.exclude_self;
    return opt;
  }
};

}  // namespace randattn::registry
