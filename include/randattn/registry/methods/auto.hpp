#pragma once
// Registered method "auto": exact attention below a crossover key count n_k, the chosen
// approximation (option `approximation`, default favor) from it on. The crossover is the given
// `crossover` or, by default, the length at which the approximation overtook exact attention for
// the nearest measured head size in crossover_table.hpp (written by scripts/measure_crossover.py).
// A call may give the options of its approximation; the report starts with "method" (the path
// that ran) and "auto_reason".

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../crossover_table.hpp"
#include "../method.hpp"
#include "../method_list.hpp"

namespace randattn::registry {

inline const Method& find_method(const std::string& name, const Spelling& spell);  // registry.hpp

// The key count from which `method` beats exact attention at head size d: the table's row of
// the nearest d (in ratio), or 0 when the table has none for it; `from` names the row.
inline std::int64_t table_crossover(const std::string& method, std::int64_t d, std::string& from) {
  const CrossoverRow* best = nullptr;
  for (const CrossoverRow& row : crossover_table)
    if (method == row.method && (!best || std::abs(std::log(double(row.d) / double(d))) <
                                              std::abs(std::log(double(best->d) / double(d)))))
      best = &row;
  if (!best) {
    from = "no table row for " + method + ": always the approximation";
    return 0;
  }
  from = "table row " + method + " d=" + std::to_string(best->d);
  return best->n;
}

class AutoMethod final : public TypedMethod<AutoMethod> {
 public:
  const char* name() const override { return "auto"; }
  const char* summary() const override {
    return "exact below a crossover key count, the chosen approximation from it on";
  }

  // Exact and the approximation must both honour it.
  bool supports_exclude_self() const override { return true; }

  std::vector<OptionSpec> options() const override {
    OptionSpec approximation{"approximation", OptionType::text, std::string("favor"),
                             "method used from the crossover on"};
    for (const auto& m : methods())
      if (std::string(m->name()) != "exact" && std::string(m->name()) != name())
        approximation.choices.push_back(m->name());
    OptionSpec crossover{"crossover", OptionType::integer, std::monostate{},
                         "key count from which the approximation runs (default: the measured "
                         "table)"};
    crossover.min = Bound{0};
    return {approximation, crossover};
  }

  // Its own options and those of every approximation.
  std::vector<OptionSpec> accepted_options() const override {
    std::vector<OptionSpec> out = options();
    for (const auto& m : methods()) {
      if (std::string(m->name()) == name()) continue;
      for (const OptionSpec& s : m->options()) {
        bool seen = false;
        for (const OptionSpec& o : out) seen = seen || o.name == s.name;
        if (!seen) out.push_back(s);
      }
    }
    return out;
  }

  // Differentiable when the path it picks is (make_gradient refuses one without a backward).
  bool differentiable() const override { return true; }
  std::vector<std::string> differentiable_options() const override {
    std::vector<std::string> out;
    for (const auto& m : methods())
      if (std::string(m->name()) != name())
        for (const std::string& o : m->differentiable_options())
          if (std::find(out.begin(), out.end(), o) == out.end()) out.push_back(o);
    return out;
  }

  template <typename Scalar>
  Job<Scalar> make(const Call& call) const {
    const Route r = route<Scalar>(call);
    const Job<Scalar> job = r.path->build(r.sub, Scalar());
    return [job, report = r.report()](const Scalar* q, const Scalar* k, const Scalar* v,
                                      Scalar* out) {
      Report fields = report;
      const Report own = job(q, k, v, out);
      fields.insert(fields.end(), own.begin(), own.end());
      return fields;
    };
  }

  template <typename Scalar>
  GradientPtr<Scalar> make_gradient(const Call& call) const {
    // The picked path's gradient, with the path in the report.
    class Routed final : public Gradient<Scalar> {
     public:
      Routed(GradientPtr<Scalar> path, Report report)
          : path_(std::move(path)), report_(std::move(report)) {}
      Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) override {
        Report fields = report_;
        const Report own = path_->forward(q, k, v, out);
        fields.insert(fields.end(), own.begin(), own.end());
        return fields;
      }
      void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) override {
        path_->backward(grad_out, dq, dk, dv);
      }
      std::vector<std::pair<std::string, std::vector<double>>> option_gradients() const override {
        return path_->option_gradients();
      }

     private:
      GradientPtr<Scalar> path_;
      Report report_;
    };
    const Route r = route<Scalar>(call);
    return std::make_unique<Routed>(r.path->build_gradient(r.sub, Scalar()), r.report());
  }

 private:
  // The path a call takes, its sub-call and why.
  struct Route {
    const Method* path;
    Call sub;
    std::string reason;
    Report report() const { return {{"method", std::string(path->name())}, {"auto_reason", reason}}; }
  };

  template <typename Scalar>
  Route route(const Call& call) const {
    const Options& o = call.options;
    const Spelling& spell = o.spelling();
    const Method& approx = find_method(o.text("approximation"), spell);
    std::string from = "given";
    const std::int64_t crossover = o.given("crossover")
                                       ? o.integer("crossover")
                                       : table_crossover(approx.name(), call.shape.d, from);
    const bool exact = call.shape.n_k < crossover;
    const Method& path = exact ? find_method("exact", spell) : approx;
    if (call.settings.exclude_self && !approx.supports_exclude_self())
      throw OptionError(spell.setting("approximation", approx.name()) + " does not support " +
                        spell.exclude_self());
    std::map<std::string, Value> given;
    for (const OptionSpec& s : accepted_options()) {
      if (!o.given(s.name) || s.name == "approximation" || s.name == "crossover") continue;
      bool owned = false;
      for (const OptionSpec& a : approx.options()) owned = owned || a.name == s.name;
      if (!owned)
        throw OptionError(o.spelled(s.name) + " is not an option of " +
                          spell.setting("approximation", approx.name()));
      if (!exact) given[s.name] = o.value(s.name);
    }
    Settings settings = call.settings;
    settings.compare = false;  // the front end compares the whole call with exact attention
    if (exact) {               // the approximation's options are checked even when exact runs
      std::map<std::string, Value> approx_given;
      for (const OptionSpec& a : approx.options())
        if (o.given(a.name)) approx_given[a.name] = o.value(a.name);
      (void)approx.build(
          Call{Options(approx.options(), approx_given, spell), settings, call.shape, call.kv_heads},
          Scalar());
      settings.option_gradients.clear();  // exact attention has no options to differentiate
    }
    const std::string reason = "n_k " + std::to_string(call.shape.n_k) + (exact ? " < " : " >= ") +
                               "crossover " + std::to_string(crossover) + " (" + from + ")";
    return {
        &path,
        Call{Options(path.options(), std::move(given), spell), settings, call.shape, call.kv_heads},
        reason};
  }
};

}  // namespace randattn::registry
