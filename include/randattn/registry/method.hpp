#pragma once
// The interface of a registered attention method: its name, summary and options, whether it
// shares queries and keys on request, and a builder from a call's resolved options, settings
// and shape to a job over contiguous row-major (batch, heads, n, d) buffers. A job returns the
// method's report fields.

#include <randattn/core/allocation_error.hpp>
#include <randattn/core/half_precision.hpp>
#include <randattn/core/options.hpp>
#include <randattn/core/types.hpp>
#include <randattn/detail/seconds_since.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "options.hpp"

namespace randattn::registry {

// One field of a run's report (a JSON scalar).
// Seeds are reported as std::uint64_t (they span [0, 2^64)).
using ReportValue = std::variant<bool, std::int64_t, std::uint64_t, double, std::string>;
using Report = std::vector<std::pair<std::string, ReportValue>>;

// The settings every method shares, resolved by the front end (see resolve_settings()).
struct Settings {
  bool causal = false;
  double scale = 1.0;  // always resolved: the given scale or default_scale(d)
  std::uint64_t seed = 0;
  bool shared_qk = false;    // keys := normalised queries (methods with supports_shared_qk())
  bool check_finite = true;  // reject NaN and infinities in the inputs
  bool report = false;       // also compute the report's statistics (pairs, predicted error)
  bool compare = false;      // methods with their own reference add "rel_error" (see Method)
  // Queries and keys are the same positions: query i never attends to key i unless it has no
  // other valid key (methods with supports_exclude_self(); implied by shared QK).
  bool exclude_self = false;
  // Array options whose gradient Gradient::option_gradients() returns (methods that declare them
  // in Method::differentiable_options()).
  std::vector<std::string> option_gradients;
};

// What a builder sees.
struct Call {
  Options options;
  Settings settings;
  BatchShape shape;
  // Heads of k and v when fewer than the query heads (grouped-query attention, set by the layout
  // code for the whole call's checks); 0: shape.heads.
  std::int64_t kv_heads = 0;
  const Spelling& spelling() const { return options.spelling(); }
  std::int64_t key_heads() const { return kv_heads ? kv_heads : shape.heads; }
};

// Runs on the inputs (k is null under shared QK) and returns the report fields. Owns
// everything it needs: it may run on another thread or without Python's GIL.
template <typename Scalar>
using Job = std::function<Report(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out)>;

// One differentiable call: a forward that keeps what its backward needs, then the backward.
// The random numbers (projections, hashes, filters, samples) and the discrete choices they make
// (buckets, supports) are fixed by the call's seed and the forward, so the backward is the
// gradient of that same estimate.
template <typename Scalar>
class Gradient {
 public:
  virtual ~Gradient() = default;
  // Writes the same bits into out as the method's job and keeps what backward() needs. The
  // inputs must stay alive and unchanged until backward() returns.
  virtual Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) = 0;
  // The gradients of <grad_out, out> with respect to q, k and v (overwritten; dk is null under
  // shared QK, where dq includes the path through the keys). Call after forward().
  virtual void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) = 0;
  // Gradients with respect to array options named in Settings::option_gradients ("omega"), in
  // the option's row-major shape, after backward(); summed over every slice of the call.
  virtual std::vector<std::pair<std::string, std::vector<double>>> option_gradients() const {
    return {};
  }
};

template <typename Scalar>
using GradientPtr = std::unique_ptr<Gradient<Scalar>>;

class Method {
 public:
  virtual ~Method() = default;
  virtual const char* name() const = 0;
  virtual const char* summary() const = 0;
  // The options the method owns, each declared once (shared ones come from one function).
  virtual std::vector<OptionSpec> options() const = 0;
  // The options a call of the method may give: its own, and for a method that runs others
  // ("auto") theirs too.
  virtual std::vector<OptionSpec> accepted_options() const { return options(); }
  // True when the method can run with keys := normalised queries, self excluded (Reformer).
  virtual bool supports_shared_qk() const { return false; }
  // True when the method honours Settings::exclude_self.
  virtual bool supports_exclude_self() const { return false; }
  // True when the method's report holds its own "rel_error" under Settings::compare (a
  // reference other than plain exact attention, or timings of its own).
  virtual bool own_comparison() const { return false; }
  // Checks the options against the shape and returns the job; throws OptionError.
  virtual Job<float> build(const Call& call, float) const = 0;
  virtual Job<double> build(const Call& call, double) const = 0;
  // True when the method has a backward pass (build_gradient()).
  virtual bool differentiable() const { return false; }
  // The array options the method can differentiate with respect to ("omega").
  virtual std::vector<std::string> differentiable_options() const { return {}; }
  // A differentiable call (see Gradient); throws OptionError for a method without a backward.
  virtual GradientPtr<float> build_gradient(const Call& call, float) const = 0;
  virtual GradientPtr<double> build_gradient(const Call& call, double) const = 0;
  // About how many bytes a call allocates besides its inputs and output (named in the error
  // when an allocation fails).
  virtual double working_bytes(const Call& call, std::size_t scalar_bytes) const {
    const BatchShape& s = call.shape;
    return double(scalar_bytes) * double(s.n_q + s.n_k) * double(s.d + s.dv + 2);
  }
};

namespace detail {

// "float32", "float64", "float16" or "bfloat16".
template <typename Scalar>
const char* scalar_name() {
  return scalar_type_name<Scalar>();
}

// Runs fn(); a failed allocation becomes an allocation_error naming the method and the bytes
// the call needs.
template <typename Scalar, typename Fn>
auto with_allocation_message(const Method& method, const Call& call, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const allocation_error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw allocation_error(std::string("randattn::registry: method ") + method.name(),
                           method.working_bytes(call, sizeof(Scalar)));
  }
}

}  // namespace detail

// Implements both build() overloads from Derived::make<Scalar>(call), and both
// build_gradient() overloads from Derived::make_gradient<Scalar>(call) when Derived declares
// itself differentiable(). All refuse a scale the input's type cannot represent, and report
// failed allocations with the size the call needs.
template <typename Derived>
class TypedMethod : public Method {
 public:
  Job<float> build(const Call& call, float) const final { return typed<float>(call); }
  Job<double> build(const Call& call, double) const final { return typed<double>(call); }
  GradientPtr<float> build_gradient(const Call& call, float) const final {
    return typed_gradient<float>(call);
  }
  GradientPtr<double> build_gradient(const Call& call, double) const final {
    return typed_gradient<double>(call);
  }

  // The default of a method without a backward; differentiable methods define their own.
  template <typename Scalar>
  GradientPtr<Scalar> make_gradient(const Call&) const {
    throw OptionError(std::string("method '") + name() + "' has no backward pass");
  }

 private:
  template <typename Scalar>
  void check_scale(const Call& call) const {
    const double scale = call.settings.scale;
    if (!(std::abs(scale) <= double(std::numeric_limits<Scalar>::max()))) {
      char text[32];
      std::snprintf(text, sizeof text, "%g", scale);
      throw OptionError(call.spelling().option("scale") + " = " + text +
                        " is not representable in " + detail::scalar_name<Scalar>());
    }
  }

  template <typename Scalar>
  GradientPtr<Scalar> typed_gradient(const Call& call) const {
    check_scale<Scalar>(call);
    if (!differentiable())
      throw OptionError(std::string("method '") + name() + "' has no backward pass");
    for (const std::string& option : call.settings.option_gradients) {
      bool known = false;
      for (const std::string& o : differentiable_options()) known = known || o == option;
      if (!known)
        throw OptionError(std::string("method '") + name() + "' has no gradient with respect to " +
                          call.spelling().option(option));
    }
    return detail::with_allocation_message<Scalar>(*this, call, [&] {
      return static_cast<const Derived&>(*this).template make_gradient<Scalar>(call);
    });
  }

  template <typename Scalar>
  Job<Scalar> typed(const Call& call) const {
    check_scale<Scalar>(call);
    Job<Scalar> job = detail::with_allocation_message<Scalar>(
        *this, call, [&] { return static_cast<const Derived&>(*this).template make<Scalar>(call); });
    const Method* self = this;
    return [self, call, job = std::move(job)](const Scalar* q, const Scalar* k, const Scalar* v,
                                              Scalar* out) {
      return detail::with_allocation_message<Scalar>(*self, call,
                                                     [&] { return job(q, k, v, out); });
    };
  }
};

// The logit scale of every method when none is given: 1/sqrt(d).
inline double default_scale(std::int64_t d) { return randattn::detail::inverse_sqrt_dim(d); }

using randattn::detail::seconds_since;

// ‖out − exact‖_F / ‖exact‖_F in double.
template <typename Scalar>
double relative_error(const Scalar* out, const Scalar* exact, std::size_t count) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < count; ++i) {
    diff += (double(out[i]) - double(exact[i])) * (double(out[i]) - double(exact[i]));
    norm += double(exact[i]) * double(exact[i]);
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace randattn::registry
