#pragma once
// Registered method "sparse-lowrank": exact softmax terms on a support (lsh, lsf, window, blocks,
// clusters or a comma-separated union) plus an unbiased estimate of the keys outside it (remainder none,
// favor, oprf, sderf or sample), merged in log-scaled form (sparse/sparse_lowrank_attention.hpp).
// Each part keeps its own method's options, declared once: lsh's (chunk, rounds, buckets, ...),
// lsf's (filters, tables, eta or alpha, ...) and the random-feature options of favor, oprf and
// sderf (features, projection, fit, rho, calibration_q, calibration_k, ...). Every (batch, head)
// slice uses the same hash, filters and projection; the sampled remainder keys its draws by the
// slice's rows.

#include <randattn/sparse/sparse_lowrank_attention.hpp>
#include <randattn/sparse/sparse_lowrank_backward.hpp>

#include <algorithm>
#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../kept_forward.hpp"
#include "../method.hpp"
#include "features.hpp"
#include "lsf.hpp"
#include "lsh.hpp"

namespace randattn::registry {

class SparseLowRankMethod final : public TypedMethod<SparseLowRankMethod> {
 public:
  const char* name() const override { return "sparse-lowrank"; }
  const char* summary() const override {
    return "exact on a support (lsh, lsf, window, blocks, clusters) + unbiased remainder "
           "(features or samples)";
  }

  static constexpr const char* kSupports[] = {"lsh", "lsf", "window", "blocks", "clusters"};

  bool supports_exclude_self() const override { return true; }

  std::vector<OptionSpec> options() const override {
    OptionSpec support{"support", OptionType::text, std::string("lsh"),
                       "keys scored exactly: lsh, lsf, window, blocks, clusters, or a comma-separated "
                       "union"};
    OptionSpec remainder{"remainder", OptionType::text, std::string("oprf"),
                         "estimate of the other keys: none, favor, oprf, sderf or sample"};
    remainder.choices = {"none", "favor", "oprf", "sderf", "sample"};
    OptionSpec window{"window", OptionType::integer, std::int64_t(64),
                      "window support: keys with |i - j| < w (causal: i - w < j <= i)"};
    window.min = Bound{0};
    OptionSpec sinks{"sinks", OptionType::integer, std::int64_t(0),
                     "window support: the first s keys too"};
    sinks.min = Bound{0};
    OptionSpec block{"block_size", OptionType::integer, std::int64_t(64),
                     "blocks support and sample remainder: keys per block B; clusters support: "
                     "causal chunk"};
    block.min = Bound{1};
    OptionSpec top{"top_blocks", OptionType::integer, std::int64_t(2),
                   "blocks support: key blocks T with the highest bound per query block"};
    top.min = Bound{0};
    OptionSpec samples{"samples", OptionType::integer, std::int64_t(64),
                       "sample remainder: keys drawn per query s (about)"};
    samples.min = Bound{1};
    OptionSpec sampling{"sampling", OptionType::text, std::string("bounds"),
                        "sample remainder: probabilities from block bounds, or uniform"};
    sampling.choices = {"bounds", "uniform"};
    OptionSpec centre{"centre_keys", OptionType::flag, false,
                      "subtract the mean key before hashing, filtering and bounding"};
    OptionSpec prefix{"centre_prefix", OptionType::integer, std::int64_t(64),
                      "causal centring: mean of the first keys (or of calibration_k)"};
    prefix.min = Bound{1};
    OptionSpec clusters{"clusters", OptionType::integer, std::int64_t(16),
                        "clusters support: k-means clusters of the keys per head"};
    clusters.min = Bound{1};
    OptionSpec probe{"probe", OptionType::integer, std::int64_t(2),
                     "clusters support: clusters opened at least per query (<= clusters)"};
    probe.min = Bound{1};
    OptionSpec margin{"margin", OptionType::real, randattn::detail::kClusterMargin,
                      "clusters support: further clusters opened whose bound is within this many "
                      "nats of the best logit (default 24 ln 2; -inf: the probe clusters alone)"};
    margin.finite = true;
    margin.negative_infinity = true;
    std::vector<OptionSpec> out = {support, remainder, window,   sinks,  block,  top,   clusters,
                                   probe,   margin,    samples,  sampling, centre, prefix};
    for (const auto& part : {LshMethod().options(), LsfMethod().options(), OprfFamily::options()})
      for (const OptionSpec& s : part)
        if (std::none_of(out.begin(), out.end(), [&](const OptionSpec& o) { return o.name == s.name; }))
          out.push_back(s);
    return out;
  }

  // What every slice of a call shares: the support (with the hash or filters it points to), the
  // options, the remainder's name and the report's fixed entries.
  template <typename Scalar>
  struct Setup {
    std::shared_ptr<SupportSpec<Scalar>> spec;
    std::shared_ptr<const CrossPolytopeHash<Scalar>> hash;
    std::shared_ptr<const LocalitySensitiveFilters<Scalar>> filters;
    SparseLowRankOptions opt;
    Report report;
    std::string remainder;
  };

  template <typename Scalar>
  static Setup<Scalar> setup(const Call& call) {
    const Options& o = call.options;
    const Spelling& spell = o.spelling();
    const std::vector<std::string> parts = support_parts(o);
    const auto has = [&](const char* p) {
      return std::find(parts.begin(), parts.end(), p) != parts.end();
    };
    const std::string remainder = o.text("remainder");
    auto spec = std::make_shared<SupportSpec<Scalar>>();
    std::shared_ptr<const CrossPolytopeHash<Scalar>> hash;
    std::shared_ptr<const LocalitySensitiveFilters<Scalar>> filters;
    Report report = {{"support", o.text("support")}, {"remainder", remainder}};
    if (has("lsh")) {
      hash = std::make_shared<const CrossPolytopeHash<Scalar>>(LshMethod::make_hash<Scalar>(call));
      spec->lsh = hash.get();
      spec->lsh_options = LshMethod::make_options(call);
      if (!spec->lsh_options.dedupe && (remainder != "none" || parts.size() > 1))
        throw OptionError(spell.setting("dedupe", "false") +
                          " counts a key once per round; a remainder or a union needs each key "
                          "once");
      report.insert(report.end(), {{"buckets", std::int64_t(hash->buckets())},
                                   {"chunk", o.integer("chunk")},
                                   {"rounds", std::int64_t(hash->rounds())}});
    }
    if (has("lsf")) {
      spec->lsf_options = LsfMethod::make_options(call);
      filters = std::make_shared<const LocalitySensitiveFilters<Scalar>>(
          LsfMethod::make_filters<Scalar>(call));
      spec->lsf = filters.get();
      report.insert(report.end(), {{"filters", o.integer("filters")},
                                   {"tables", o.integer("tables")}});
    }
    if (has("window")) {
      spec->window = WindowSupport{o.integer("window"), o.integer("sinks")};
      if (o.integer("window") == 0 && o.integer("sinks") == 0)
        throw OptionError("the window support needs " + spell.setting("window", "1") +
                          " or more, or " + spell.option("sinks"));
      report.insert(report.end(), {{"window", o.integer("window")}, {"sinks", o.integer("sinks")}});
    }
    if (has("blocks")) {
      spec->blocks = BlockSupport{o.integer("block_size"), o.integer("top_blocks")};
      report.insert(report.end(), {{"block_size", o.integer("block_size")},
                                   {"top_blocks", o.integer("top_blocks")}});
    }
    if (has("clusters")) {
      if (o.integer("probe") > o.integer("clusters"))
        throw OptionError(o.spelled("probe") + " must be at most " + o.spelled("clusters") + " (" +
                          std::to_string(o.integer("clusters")) + "), got " +
                          std::to_string(o.integer("probe")));
      spec->clusters = ClusterSupport{o.integer("clusters"), o.integer("probe"),
                                      o.integer("block_size"), o.real("margin")};
      report.insert(report.end(), {{"clusters", o.integer("clusters")}, {"probe", o.integer("probe")}});
      if (!has("blocks")) report.emplace_back("block_size", o.integer("block_size"));
    }
    if (remainder == "favor" || remainder == "oprf" || remainder == "sderf") check_features(call);
    SparseLowRankOptions opt;
    opt.causal = call.settings.causal;
    opt.scale = call.settings.scale;
    opt.check_finite = call.settings.check_finite;
    opt.seed = call.settings.seed;
    opt.exclude_self = call.settings.exclude_self;
    opt.centre_keys = o.flag("centre_keys");
    opt.centre_prefix = o.integer("centre_prefix");
    report.emplace_back("centre_keys", opt.centre_keys);
    if (o.given("calibration_k")) {
      const std::vector<std::int64_t>& c = o.array("calibration_k").shape;
      const bool ok = (c.size() == 2 || (c.size() == 3 && c[0] == call.shape.heads)) &&
                      c.back() == call.shape.d && c[c.size() - 2] >= 1;
      if (!ok)
        throw OptionError(o.spelled("calibration_k") + ": expected an (r, d) or (heads, r, d) " +
                          "array with d = " + std::to_string(call.shape.d) + ", got shape " +
                          detail::shape_text(c));
    }
    // Feature remainders report the seed with their projection.
    if (remainder == "none" || remainder == "sample")
      report.emplace_back("seed", call.settings.seed);
    return {spec, hash, filters, opt, report, remainder};
  }

  template <typename Scalar>
  Job<Scalar> make(const Call& call) const {
    return [call, plan = setup<Scalar>(call)](const Scalar* q, const Scalar* k, const Scalar* v,
                                              Scalar* out) {
      return attend<Scalar>(call, plan, q, k, v, out,
                            [&](auto&& qs, auto&& ks, auto&& vs, auto&& os, const auto& remainder,
                                const SparseLowRankOptions& opt, SparseLowRankStats* st,
                                const std::shared_ptr<const void>&) {
                              sparse_lowrank_accumulate<Scalar>(qs, ks, vs, *plan.spec, remainder,
                                                                opt, st)
                                  .finalize_into(os);
                            });
    };
  }

  bool differentiable() const override { return true; }

  template <typename Scalar>
  GradientPtr<Scalar> make_gradient(const Call& call) const;

  // Runs slice(q_s, k_s, v_s, out_s, remainder, options, stats, keep) on every (batch, head)
  // slice in order, `keep` holding what a feature remainder's map needs alive, and returns the
  // call's report.
  template <typename Scalar, typename Slice>
  static Report attend(const Call& call, const Setup<Scalar>& plan, const Scalar* q,
                       const Scalar* k, const Scalar* v, Scalar* out, Slice&& slice) {
    const std::string& remainder = plan.remainder;
    SparseLowRankStats st;
    Report r = plan.report;
    const auto run = [&](const auto& make_remainder, const std::shared_ptr<const void>& keep) {
      const BatchShape& shape = call.shape;
      for (Index s = 0; s < shape.slices(); ++s) {
        SparseLowRankOptions slice_opt = plan.opt;
        slice_opt.row_offset = std::uint64_t(s * shape.n_q);
        slice_opt.key_mean = causal_key_mean(call, s);
        slice(randattn::detail::slice_of(q, s, shape.n_q, shape.d),
              randattn::detail::slice_of(k, s, shape.n_k, shape.d),
              randattn::detail::slice_of(v, s, shape.n_k, shape.dv),
              randattn::detail::slice_of(out, s, shape.n_q, shape.dv), make_remainder(s),
              slice_opt, &st, keep);
      }
    };
    if (remainder == "none") {
      run([](Index) { return NoRemainder{}; }, nullptr);
    } else if (remainder == "sample") {
      SampledRemainder rule;
      rule.samples = double(call.options.integer("samples"));
      rule.uniform = call.options.text("sampling") == "uniform";
      rule.block_size = call.options.integer("block_size");
      run([&](Index) { return rule; }, nullptr);
    } else {
      const detail::SliceView<Scalar> data{q, k, call.shape};
      const auto with_maps = [&](const auto& maps, const RandomFeatureOptions&) {
        using Maps = std::decay_t<decltype(maps)>;
        using Map = std::decay_t<decltype(maps.front())>;
        const auto kept = std::make_shared<const Maps>(maps);
        run([&](Index s) { return FeatureRemainder<Map>{kept->of_slice(s), {}}; }, kept);
      };
      Report features;
      if (remainder == "favor")
        features = FeatureMethod<FavorFamily>::with_map<Scalar>(call, &data, with_maps);
      else if (remainder == "oprf")
        features = FeatureMethod<OprfFamily>::with_map<Scalar>(call, &data, with_maps);
      else
        features = FeatureMethod<SderfFamily>::with_map<Scalar>(call, &data, with_maps);
      r.insert(r.end(), features.begin(), features.end());
    }
    const double pairs = double(call.shape.slices()) * double(call.shape.n_q) *
                         double(call.shape.n_k);
    r.emplace_back("pairs_scored", pairs > 0 ? double(st.pairs_scored) / pairs : 0.0);
    if (remainder == "sample")
      r.emplace_back("samples", double(st.samples) /
                                    double(std::max<Index>(1, call.shape.slices() * call.shape.n_q)));
    r.emplace_back("clamped_rows", std::int64_t(st.clamped_rows));
    r.emplace_back("support_seconds", st.support_seconds);
    r.emplace_back("exact_seconds", st.exact_seconds);
    r.emplace_back("remainder_seconds", st.remainder_seconds);
    return r;
  }

 private:
  // The parts of the support option, checked: known, each once.
  static std::vector<std::string> support_parts(const Options& o) {
    std::vector<std::string> parts;
    const std::string& text = o.text("support");
    std::string all;
    for (const char* s : kSupports) all += std::string(all.empty() ? "" : ", ") + s;
    std::size_t from = 0;
    while (true) {
      const std::size_t comma = text.find(',', from);
      const std::string part = text.substr(from, comma == std::string::npos ? comma : comma - from);
      if (std::find(std::begin(kSupports), std::end(kSupports), part) == std::end(kSupports))
        throw OptionError(o.spelled("support") + ": unknown support '" + part + "' (available: " +
                          all + ", or a comma-separated union)");
      if (std::find(parts.begin(), parts.end(), part) != parts.end())
        throw OptionError(o.spelled("support") + ": '" + part + "' is listed twice");
      parts.push_back(part);
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
    return parts;
  }

  static void check_features(const Call& call) {
    const Options& o = call.options;
    const std::string& remainder = o.text("remainder");
    if (remainder == "favor") {
      for (const char* name : {"fit", "rho", "calibration", "calibration_q", "calibration_k"})
        if (o.given(name))
          throw OptionError(o.spelled(name) + " applies to the oprf and sderf remainders, not " +
                            o.spelling().setting("remainder", "favor"));
      FeatureMethod<FavorFamily>::check(call);
    } else if (remainder == "oprf") {
      FeatureMethod<OprfFamily>::check(call);
    } else {
      FeatureMethod<SderfFamily>::check(call);
    }
  }

  // Causal centring from given calibration keys (head h's rows for slice s), else none (the
  // prefix of the slice's keys).
  static std::optional<Eigen::RowVectorXd> causal_key_mean(const Call& call, Index s) {
    const Options& o = call.options;
    if (!call.settings.causal || !o.flag("centre_keys") || !o.given("calibration_k"))
      return std::nullopt;
    const ArrayValue& a = o.array("calibration_k");
    const RowMatrix<double> rows = detail::matrix_of<double>(a, s % call.shape.heads);
    return Eigen::RowVectorXd(rows.colwise().mean());
  }
};

namespace detail {

// The differentiable call of "sparse-lowrank": each slice's forward keeps its discrete choices
// (sparse/sparse_lowrank_backward.hpp), and its backward is that slice's.
template <typename Scalar>
class SparseLowRankGradient final : public Gradient<Scalar> {
 public:
  SparseLowRankGradient(const Call& call, SparseLowRankMethod::Setup<Scalar> plan)
      : call_(call), plan_(std::move(plan)) {}

  Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) override {
    const BatchShape& shape = call_.shape;
    randattn::detail::check_batch_qkv_output("sparse_lowrank_attention", shape, q, k, v, out);
    backwards_.clear();
    Report r = SparseLowRankMethod::attend<Scalar>(
        call_, plan_, q, k, v, out,
        [&](auto&& qs, auto&& ks, auto&& vs, auto&& os, const auto& remainder,
            const SparseLowRankOptions& opt, SparseLowRankStats* st,
            const std::shared_ptr<const void>& keep) {
          using Remainder = std::decay_t<decltype(remainder)>;
          auto saved = std::make_shared<const SparseLowRankSaved<Scalar, Remainder>>(
              sparse_lowrank_forward<Scalar, Remainder>(qs, ks, vs, *plan_.spec, os, remainder,
                                                        opt, st));
          const Index s = Index(backwards_.size());
          backwards_.push_back([this, saved, keep, s](const Scalar* grad_out, Scalar* dq,
                                                      Scalar* dk, Scalar* dv) {
            const BatchShape& b = call_.shape;
            namespace rd = randattn::detail;
            sparse_lowrank_backward<Scalar, Remainder>(
                *saved, kept_.q(s), kept_.k(s), kept_.v(s), kept_.out(s),
                rd::slice_of(grad_out, s, b.n_q, b.dv), rd::slice_of(dq, s, b.n_q, b.d),
                rd::slice_of(dk, s, b.n_k, b.d), rd::slice_of(dv, s, b.n_k, b.dv));
          });
        });
    kept_.keep(q, k, v, out, shape);
    return r;
  }

  void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) override {
    kept_.require_forward();
    clear_key_gradients_without_queries(call_.shape, dk, dv);
    for (auto& slice_backward : backwards_) slice_backward(grad_out, dq, dk, dv);
  }

 private:
  Call call_;
  SparseLowRankMethod::Setup<Scalar> plan_;
  std::vector<std::function<void(const Scalar*, Scalar*, Scalar*, Scalar*)>> backwards_;
  KeptForward<Scalar> kept_;
};

}  // namespace detail

template <typename Scalar>
GradientPtr<Scalar> SparseLowRankMethod::make_gradient(const Call& call) const {
  return std::make_unique<detail::SparseLowRankGradient<Scalar>>(call, setup<Scalar>(call));
}

}  // namespace randattn::registry
