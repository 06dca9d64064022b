#pragma once
// Registered methods on half-precision buffers (Eigen::half, Eigen::bfloat16): the one
// conversion that build_job() and build_gradient() put around the float32 job or gradient of any
// method, under any layout. q, k and v are widened to float32 (exact), the method runs in float32
// as it would on those float32 inputs, and its output and gradients are rounded to the inputs'
// type once (core/half_precision.hpp). A half call thus gives float32's result on the same
// (rounded) inputs up to that last rounding: relative error at most 2^-11 (float16) or 2^-8
// (bfloat16) per entry, and an error, not an infinity, for a float16 result beyond 65504.

#include <randattn/core/half_precision.hpp>

#include <string>
#include <utility>
#include <vector>

#include "method.hpp"

namespace randattn::registry::detail {

// Entries of a call's buffers: q and out have the query heads, k and v the key/value heads.
struct BufferSizes {
  Index q = 0, k = 0, v = 0, out = 0;
};

inline BufferSizes buffer_sizes(const BatchShape& s, Index kv_heads) {
  const Index key_slices = s.batch * (kv_heads > 0 ? kv_heads : s.heads);
  return {s.slices() * s.n_q * s.d, key_slices * s.n_k * s.d, key_slices * s.n_k * s.dv,
          s.slices() * s.n_q * s.dv};
}

// A call's inputs widened to float32; k stays null under shared QK.
struct Float32Inputs {
  std::vector<float> q, k, v;

  template <typename Half>
  void widen(const Half* hq, const Half* hk, const Half* hv, const BufferSizes& n) {
    const auto copy = [](const Half* from, Index count, std::vector<float>& to) {
      to.resize(std::size_t(count));
      widen_to_float(from, count, to.data());
    };
    copy(hq, n.q, q);
    if (hk)
      copy(hk, n.k, k);
    else
      k.clear();
    copy(hv, n.v, v);
  }
  const float* keys(bool given) const { return given ? k.data() : nullptr; }
};

// "randattn::registry: method 'favor', output".
inline std::string half_result_name(const Method& method, const char* what) {
  return std::string("randattn::registry: method '") + method.name() + "', " + what;
}

// The job of a half call: widen, run the float32 job, round the output.
template <typename Half>
Job<Half> half_job(const Method& method, const Call& call, Index kv_heads, Job<float> job) {
  const BufferSizes sizes = buffer_sizes(call.shape, kv_heads);
  return [&method, call, sizes, job = std::move(job)](const Half* q, const Half* k, const Half* v,
                                                      Half* out) {
    return with_allocation_message<float>(method, call, [&] {
      Float32Inputs in;
      in.widen(q, k, v, sizes);
      std::vector<float> result(std::size_t(sizes.out));
      Report report = job(in.q.data(), in.keys(k != nullptr), in.v.data(), result.data());
      round_to_half(result.data(), sizes.out, out, half_result_name(method, "output"));
      return report;
    });
  };
}

// The gradient of a half call: the float32 gradient on the widened inputs, which it keeps for
// the backward; grad_out is widened and the gradients rounded. Every gradient is checked before
// any is written.
template <typename Half>
class HalfGradient final : public Gradient<Half> {
 public:
  HalfGradient(const Method& method, const Call& call, Index kv_heads, GradientPtr<float> inner)
      : method_(&method),
        call_(call),
        sizes_(buffer_sizes(call.shape, kv_heads)),
        inner_(std::move(inner)) {}

  Report forward(const Half* q, const Half* k, const Half* v, Half* out) override {
    return with_allocation_message<float>(*method_, call_, [&] {
      has_keys_ = k != nullptr;
      in_.widen(q, k, v, sizes_);
      std::vector<float> result(std::size_t(sizes_.out));
      Report report =
          inner_->forward(in_.q.data(), in_.keys(has_keys_), in_.v.data(), result.data());
      round_to_half(result.data(), sizes_.out, out, half_result_name(*method_, "output"));
      return report;
    });
  }

  void backward(const Half* grad_out, Half* dq, Half* dk, Half* dv) override {
    with_allocation_message<float>(*method_, call_, [&] {
      std::vector<float> go(std::size_t(sizes_.out)), gq(std::size_t(sizes_.q)),
          gk(std::size_t(has_keys_ ? sizes_.k : 0)), gv(std::size_t(sizes_.v));
      widen_to_float(grad_out, sizes_.out, go.data());
      inner_->backward(go.data(), gq.data(), has_keys_ ? gk.data() : nullptr, gv.data());
      // All checked before anything is written: a refused call leaves dq, dk and dv unchanged.
      const struct {
        const std::vector<float>& from;
        Half* to;
        const char* name;
      } grads[] = {{gq, dq, "gradient dq"},
                   {gk, has_keys_ ? dk : nullptr, "gradient dk"},
                   {gv, dv, "gradient dv"}};
      for (const auto& g : grads)
        if (g.to)
          check_half_range<Half>(g.from.data(), Index(g.from.size()),
                                 half_result_name(*method_, g.name));
      for (const auto& g : grads)
        if (g.to) round_to_half(g.from.data(), Index(g.from.size()), g.to, g.name);
    });
  }

  std::vector<std::pair<std::string, std::vector<double>>> option_gradients() const override {
    return inner_->option_gradients();
  }

 private:
  const Method* method_;
  Call call_;
  BufferSizes sizes_;
  GradientPtr<float> inner_;
  Float32Inputs in_;  // read by the float32 gradient's backward
  bool has_keys_ = true;
};

}  // namespace randattn::registry::detail
