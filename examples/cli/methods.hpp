#pragma once
// Attention methods selectable with `randattn-cli attention --method NAME`.
//
// To add a method:
//   1. write a class deriving from TypedMethod<YourClass> with
//        const char* name() const;  const char* summary() const;
//        template <class Scalar> void compute(const Scalar* q, const Scalar* k, const Scalar* v,
//                                             Scalar* out, const randattn::BatchShape&,
//                                             const CommonSettings&) const;
//      and optionally add_options() (method-specific flags, registered through add_method_option
//      so that they are rejected when another method is selected), default_scale() and
//      report() (extra fields of the --report JSON line);
//   2. append it in make_methods() below.
// Inputs are contiguous row-major (batch, heads, n, d) buffers; the output is (batch, heads, n_q, dv).

#include <randattn/randattn.hpp>

#include <CLI/CLI.hpp>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"

namespace randattn_cli {

// Options shared by every method.
struct CommonSettings {
  bool causal = false;
  std::optional<double> scale;  // unset: the method's default_scale()
};

class AttentionMethod {
 public:
  virtual ~AttentionMethod() = default;

  virtual const char* name() const = 0;
  virtual const char* summary() const = 0;

  // Registers method-specific options on the `attention` subcommand.
  virtual void add_options(CLI::App& /*cmd*/) {}

  // Logit scale used when --scale is not given (d = query/key feature dimension).
  virtual double default_scale(std::int64_t d) const { return 1.0 / std::sqrt(static_cast<double>(d)); }

  // Adds method-specific fields to the --report line.
  virtual void report(JsonObject& /*json*/) const {}

  virtual void run(const float* q, const float* k, const float* v, float* out,
                   const randattn::BatchShape& shape, const CommonSettings& settings) const = 0;
  virtual void run(const double* q, const double* k, const double* v, double* out,
                   const randattn::BatchShape& shape, const CommonSettings& settings) const = 0;

  // Options registered by add_options(); giving any of them with a method that does not own
  // them is an error. An option shared by a family of methods is owned by each of them.
  const std::vector<CLI::Option*>& own_options() const { return own_options_; }
  bool owns(const CLI::Option* opt) const {
    for (const CLI::Option* o : own_options_)
      if (o == opt) return true;
    return false;
  }

 protected:
  template <typename T>
  CLI::Option* add_method_option(CLI::App& cmd, const std::string& flag, T& target, const std::string& help) {
    CLI::Option* opt = cmd.add_option(flag, target, std::string("[") + name() + "] " + help);
    own_options_.push_back(opt);
    return opt;
  }
  // Claims an option registered elsewhere (a flag shared by a family of methods).
  void share_option(CLI::Option* opt) { own_options_.push_back(opt); }
  CLI::Option* add_method_flag(CLI::App& cmd, const std::string& flag, bool& target, const std::string& help) {
    CLI::Option* opt = cmd.add_flag(flag, target, std::string("[") + name() + "] " + help);
    own_options_.push_back(opt);
    return opt;
  }

 private:
  std::vector<CLI::Option*> own_options_;
};

// Implements both run() overloads from one `compute<Scalar>` template of Derived.
template <typename Derived>
class TypedMethod : public AttentionMethod {
 public:
  void run(const float* q, const float* k, const float* v, float* out, const randattn::BatchShape& shape,
           const CommonSettings& settings) const final {
    static_cast<const Derived&>(*this).template compute<float>(q, k, v, out, shape, settings);
  }
  void run(const double* q, const double* k, const double* v, double* out, const randattn::BatchShape& shape,
           const CommonSettings& settings) const final {
    static_cast<const Derived&>(*this).template compute<double>(q, k, v, out, shape, settings);
  }
};

// Exact softmax attention (tiled, never forms the n_q x n_k matrix).
class ExactMethod final : public TypedMethod<ExactMethod> {
 public:
  const char* name() const override { return "exact"; }
  const char* summary() const override { return "exact softmax attention"; }

  template <typename Scalar>
  void compute(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out, const randattn::BatchShape& shape,
               const CommonSettings& settings) const {
    randattn::ExactOptions opt;
    opt.causal = settings.causal;
    opt.scale = settings.scale;
    randattn::exact_attention_batched(q, k, v, out, shape, opt);
  }
};

// favor, favor-hyp, trig, hybrid, hybrid-gaussian (feature_methods.hpp).
inline void add_feature_methods(std::vector<std::unique_ptr<AttentionMethod>>& methods);

inline std::vector<std::unique_ptr<AttentionMethod>> make_methods() {
  std::vector<std::unique_ptr<AttentionMethod>> methods;
  methods.push_back(std::make_unique<ExactMethod>());
  add_feature_methods(methods);
  return methods;
}

}  // namespace randattn_cli

#include "feature_methods.hpp"

