#pragma once
// Registered method "lsf": locality-sensitive-filter attention. Keys are stored in their best
// filter per table; queries open every filter scoring at least eta (or the eta of a target cosine
// alpha), at least min_probes per table, with a fallback so no query is empty. Separate keys
// only; honours exclude_self. Every (batch, head) slice uses the same filters; rotation (shared with lsh) picks dense
// Gaussian or Hadamard filters.

#include <randattn/core/exact_attention.hpp>
#include <randattn/lsf/lsf_attention.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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
    const Options& o = call.options;
    const Settings& s = call.settings;
    const LsfOptions opt = make_options(call);
    auto lsf =
        std::make_shared<const LocalitySensitiveFilters<Scalar>>(make_filters<Scalar>(call));
    const std::int64_t filters = o.integer("filters");
    const std::string rotation = o.text("rotation");
    Report head = {{"filters", filters}, {"tables", o.integer("tables")}};
    Report tail = {
        {"min_probes", opt.min_probes}, {"rotation", rotation}, {"seed", s.seed}};
    return [lsf, opt, head, tail, s, shape = call.shape](const Scalar* q, const Scalar* k,
                                                         const Scalar* v, Scalar* out) {
      const auto start = std::chrono::steady_clock::now();
      lsf_attention_batched(*lsf, q, k, v, out, shape, opt);
      const double lsf_seconds = seconds_since(start);
      if (!s.report) return Report{};
      // Filters opened and logits computed, slice by slice (outside the timed call).
      double scored = 0, eta = 0;
      for (Index i = 0; i < shape.slices(); ++i) {
        const LsfProbeStats st =
            lsf_probe_stats<Scalar>(*lsf, randattn::detail::slice_of(q, i, shape.n_q, shape.d),
                                    randattn::detail::slice_of(k, i, shape.n_k, shape.d), opt);
        scored += double(st.target_pairs);
        eta = st.eta;
      }
      Report r = head;
      r.emplace_back("eta", eta);
      r.insert(r.end(), tail.begin(), tail.end());
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
    };
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

}  // namespace randattn::registry
