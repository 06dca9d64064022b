#pragma once
// Registered method "lsf": locality-sensitive-filter attention. Keys are stored in their best
// filter per table; queries open every filter scoring at least eta (or the eta of a target cosine
// alpha), at least min_probes per table, with a fallback so no query is empty. Separate keys
// only; honours exclude_self. Every (batch, head) slice uses the same filters; rotation (shared with lsh) picks dense
// Gaussian or Hadamard filters. Differentiable (lsf/lsf_gradient.hpp): the filters and probes
// are held constant.

#include <randattn/core/exact_attention.hpp>
#include <randattn/lsf/lsf_attention.hpp>
#include <randattn/lsf/lsf_gradient.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../kept_forward.hpp"
#include "../method.hpp"
#include "lsh.hpp"  // lsh_options::rotation

namespace randattn::registry {

class LsfMethod final : public TypedMethod<LsfMethod> {
 public:
  const char* name() const override { return "lsf"; }
  const char* summary() const override {
    return "locality-sensitive-filter attention (asymmetric filters)";
  }
  bool own_comparison() const override { return true; }
  bool supports_exclude_self() const override { return true; }

  std::vector<OptionSpec> options() const override {
    OptionSpec filters{"filters", OptionType::integer, std::int64_t(256), "filters m per table"};
    filters.min = Bound{1};
    filters.max = Bound{double(kMaxLsfFilters)};
    OptionSpec tables{"tables", OptionType::integer, std::int64_t(4),
                      "independent filter tables L"};
    tables.min = Bound{1};
    tables.max = Bound{double(kMaxLsfTables)};
    OptionSpec eta{"eta", OptionType::real, std::monostate{},
                   "threshold on normalised filter scores (or alpha)"};
    eta.finite = true;
    eta.negative_infinity = true;  // opens every filter
    OptionSpec alpha{"alpha", OptionType::real, std::monostate{},
                     "target cosine in (0, 1): eta = alpha sqrt(2 ln m) - sqrt(2 (1 - alpha^2) ln "
                     "ln m)"};
    alpha.min = Bound{0, true};
    alpha.max = Bound{1, true};
    OptionSpec min_probes{"min_probes", OptionType::integer, std::int64_t(1),
                          "best filters opened per table whatever eta"};
    min_probes.min = Bound{1};
    return {filters, tables, eta, alpha, min_probes, lsh_options::rotation()};
  }

  // The filters (tables x m x d), the keys' filter lists and the copies of the rows.
  double working_bytes(const Call& call, std::size_t scalar_bytes) const override {
    const BatchShape& s = call.shape;
    const double tables = double(call.options.integer("tables"));
    const double filters = double(call.options.integer("filters"));
    return double(scalar_bytes) * (tables * filters * double(s.d) + 2 * tables * filters +
                                   double(s.n_q + s.n_k) * double(s.d + s.dv + 2)) +
           8.0 * tables * double(s.n_k);
  }

  template <typename Scalar>
  Job<Scalar> make(const Call& call) const {
    const LsfOptions opt = make_options(call);
    auto lsf =
        std::make_shared<const LocalitySensitiveFilters<Scalar>>(make_filters<Scalar>(call));
    return [lsf, opt, call](const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
      const auto start = std::chrono::steady_clock::now();
      lsf_attention_batched(*lsf, q, k, v, out, call.shape, opt);
      return report_of(call, *lsf, opt, q, k, v, out, seconds_since(start));
    };
  }

  bool differentiable() const override { return true; }

  // Per (batch, head) slice, lsf_attention_forward and lsf_attention_backward (lsf_gradient.hpp)
  // with the job's filters and options: the forward writes the job's bits.
  template <typename Scalar>
  GradientPtr<Scalar> make_gradient(const Call& call) const;

  // The report of a call that took lsf_seconds and wrote out: filters opened and logits
  // computed, slice by slice, and the comparison with exact attention when the settings ask
  // (outside the timed call).
  template <typename Scalar>
  static Report report_of(const Call& call, const LocalitySensitiveFilters<Scalar>& lsf,
                          const LsfOptions& opt, const Scalar* q, const Scalar* k,
                          const Scalar* v, const Scalar* out, double lsf_seconds) {
    const Settings& s = call.settings;
    const BatchShape& shape = call.shape;
    if (!s.report) return Report{};
    double scored = 0, eta = 0;
    for (Index i = 0; i < shape.slices(); ++i) {
      const LsfProbeStats st =
          lsf_probe_stats<Scalar>(lsf, randattn::detail::slice_of(q, i, shape.n_q, shape.d),
                                  randattn::detail::slice_of(k, i, shape.n_k, shape.d), opt);
      scored += double(st.target_pairs);
      eta = st.eta;
    }
    Report r = {{"filters", call.options.integer("filters")},
                {"tables", call.options.integer("tables")}};
    r.emplace_back("eta", eta);
    r.emplace_back("min_probes", opt.min_probes);
    r.emplace_back("rotation", call.options.text("rotation"));
    r.emplace_back("seed", s.seed);
    r.emplace_back("pairs_scored",
                   scored / (double(shape.slices()) * double(shape.n_q) * double(shape.n_k)));
    if (!s.compare) return r;
    std::vector<Scalar> exact(static_cast<std::size_t>(shape.slices() * shape.n_q * shape.dv));
    ExactOptions eopt;
    eopt.causal = opt.causal;
    eopt.scale = opt.scale;
    eopt.exclude_self = opt.exclude_self;
    const auto exact_start = std::chrono::steady_clock::now();
    exact_attention_batched(q, k, v, exact.data(), shape, eopt);
    const double exact_seconds = seconds_since(exact_start);
    r.emplace_back("lsf_seconds", lsf_seconds);
    r.emplace_back("exact_seconds", exact_seconds);
    r.emplace_back("speedup", exact_seconds / lsf_seconds);
    r.emplace_back("rel_error", relative_error(out, exact.data(), exact.size()));
    return r;
  }

  // The options of lsf_attention the call selects, checked (public: sparse-lowrank's lsf
  // support).
  static LsfOptions make_options(const Call& call) {
    const Options& o = call.options;
    if (o.given("eta") == o.given("alpha"))
      throw OptionError("give exactly one of " + o.spelled("eta") + " and " + o.spelled("alpha"));
    const std::int64_t filters = o.integer("filters");
    if (o.integer("min_probes") > filters)
      throw OptionError(o.spelled("min_probes") + " must be in [1, " +
                        o.spelling().setting("filters", std::to_string(filters)) + "], got " +
                        std::to_string(o.integer("min_probes")));
    LsfOptions opt;
    if (o.given("eta")) opt.eta = o.real("eta");
    if (o.given("alpha")) opt.alpha = o.real("alpha");
    opt.min_probes = o.integer("min_probes");
    opt.causal = call.settings.causal;
    opt.scale = call.settings.scale;
    opt.check_finite = call.settings.check_finite;
    opt.exclude_self = call.settings.exclude_self;
    return opt;
  }

  // The filters the call selects.
  template <typename Scalar>
  static LocalitySensitiveFilters<Scalar> make_filters(const Call& call) {
    const Options& o = call.options;
    const auto kind =
        o.text("rotation") == "hadamard" ? RotationKind::hadamard : RotationKind::dense;
    return LocalitySensitiveFilters<Scalar>(kind, call.shape.d, o.integer("filters"),
                                            o.integer("tables"), call.settings.seed);
  }
};

// The differentiable call of "lsf" on a plain (batch, heads, n, d) layout.
template <typename Scalar>
class LsfGradient final : public Gradient<Scalar> {
 public:
  LsfGradient(std::shared_ptr<const LocalitySensitiveFilters<Scalar>> lsf, const LsfOptions& opt,
              const Call& call)
      : lsf_(std::move(lsf)), opt_(opt), call_(call) {}

  Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) override {
    const char* where = "lsf_attention_batched";
    const BatchShape& s = call_.shape;
    randattn::detail::check_batch_qkv_output(where, s, q, k, v, out);
    saved_.clear();
    saved_.resize(std::size_t(s.slices()));
    const auto start = std::chrono::steady_clock::now();
    randattn::detail::for_each_slice(
        where, s, q && k && v && out,
        [&](Index i) {
          randattn::detail::check_lsf_inputs<Scalar>(where, slice_of(q, i, s.n_q, s.d),
                                                     slice_of(k, i, s.n_k, s.d),
                                                     slice_of(v, i, s.n_k, s.dv), *lsf_, opt_);
        },
        [&](Index i) {
          auto o = slice_of(out, i, s.n_q, s.dv);
          saved_[std::size_t(i)] = lsf_attention_forward<Scalar>(
              *lsf_, slice_of(q, i, s.n_q, s.d), slice_of(k, i, s.n_k, s.d),
              slice_of(v, i, s.n_k, s.dv), o, opt_);
        });
    const double seconds = seconds_since(start);
    kept_.keep(q, k, v, out, s);
    return LsfMethod::report_of(call_, *lsf_, opt_, q, k, v, out, seconds);
  }

  void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) override {
    const BatchShape& s = call_.shape;
    kept_.require_forward();
    const char* where = "lsf_attention_backward";
    randattn::detail::require(s.slices() * s.n_q == 0 || (grad_out && dq && dk && dv), where,
                              "null gradient pointer");
    randattn::detail::require_finite(grad_out, s.slices() * s.n_q * s.dv, where, "grad_out");
    detail::clear_key_gradients_without_queries(s, dk, dv);
    if (s.n_q == 0) return;
    randattn::detail::parallel_for(s.slices(), [&](Index i) {
      lsf_attention_backward<Scalar>(saved_[std::size_t(i)], kept_.q(i), kept_.k(i), kept_.v(i),
                                     kept_.out(i), slice_of(grad_out, i, s.n_q, s.dv),
                                     slice_of(dq, i, s.n_q, s.d), slice_of(dk, i, s.n_k, s.d),
                                     slice_of(dv, i, s.n_k, s.dv));
    });
  }

 private:
  template <typename T>
  static auto slice_of(T* base, Index i, Index rows, Index cols) {
    return randattn::detail::slice_of(base, i, rows, cols);
  }

  std::shared_ptr<const LocalitySensitiveFilters<Scalar>> lsf_;  // the residuals refer to it
  LsfOptions opt_;
  Call call_;
  std::vector<LsfResiduals<Scalar>> saved_;
  detail::KeptForward<Scalar> kept_;
};

template <typename Scalar>
GradientPtr<Scalar> LsfMethod::make_gradient(const Call& call) const {
  const LsfOptions opt = make_options(call);
  auto lsf =
      std::make_shared<const LocalitySensitiveFilters<Scalar>>(make_filters<Scalar>(call));
  return std::make_unique<LsfGradient<Scalar>>(std::move(lsf), opt, call);
}

}  // namespace randattn::registry
