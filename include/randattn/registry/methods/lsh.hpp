#pragma once
// Registered method "lsh": LSH attention (Reformer), cross-polytope buckets, sort-and-chunk or
// exact buckets, r rounds. Under shared QK the keys are the normalised queries, each query's own
// key excluded; separate keys are sorted by bucket apart from the queries, and each query chunk
// attends to the key chunk at its sorted position and the one before (lsh/lsh_attention.hpp).
// Every (batch, head) slice uses the same rotations. Differentiable (lsh/lsh_gradient.hpp): the
// hashes and chunks are held constant; under shared QK dq carries the key path too.

#include <randattn/core/exact_attention.hpp>
#include <randattn/lsh/lsh_attention.hpp>
#include <randattn/lsh/lsh_gradient.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../kept_forward.hpp"
#include "../method.hpp"
#include "features.hpp"  // detail::shape_text

namespace randattn::registry {

namespace lsh_options {

// Shared by lsh and lsf.
inline OptionSpec rotation() {
  OptionSpec s{"rotation", OptionType::text, std::string("dense"),
               "random rotation: dense or hadamard"};
  s.choices = {"dense", "hadamard"};
  return s;
}

}  // namespace lsh_options

class LshMethod final : public TypedMethod<LshMethod> {
 public:
  const char* name() const override { return "lsh"; }
  const char* summary() const override {
    return "LSH attention (Reformer, cross-polytope buckets)";
  }
  bool supports_shared_qk() const override { return true; }
  bool supports_exclude_self() const override { return true; }
  // Shared QK compares with exact shared-QK attention (normalised keys, self rule).
  bool own_comparison() const override { return true; }

  std::vector<OptionSpec> options() const override {
    OptionSpec chunk{"chunk", OptionType::integer, std::int64_t(64),
                     "chunk length c of sort-and-chunk"};
    chunk.min = Bound{1};
    chunk.max = Bound{double(kMaxLshBuckets)};
    OptionSpec buckets{"buckets", OptionType::integer, std::monostate{},
                       "number of buckets b, even (default 2*ceil(n/chunk))"};
    buckets.min = Bound{2};
    buckets.max = Bound{double(kMaxLshBuckets)};
    OptionSpec rounds{"rounds", OptionType::integer, std::int64_t(4), "hash rounds r"};
    rounds.min = Bound{1};
    rounds.max = Bound{double(kMaxLshRounds)};
    return {buckets,
            chunk,
            rounds,
            {"rotations", OptionType::array, std::monostate{},
             "dense rotations of shape (d, r, b/2), used as given"},
            lsh_options::rotation(),
            {"dedupe", OptionType::flag, true,
             "count a key once however many rounds see it (off: once per round, trax/HF)"},
            {"exact_buckets", OptionType::flag, false,
             "attend to whole buckets instead of sorted chunks (chunk then only sets the default "
             "bucket count 2*ceil(n/chunk))"}};
  }

  // Hash codes, sorted orders and chunk signatures (int32, n x rounds), the rotations and the
  // scaled copies of the rows.
  double working_bytes(const Call& call, std::size_t scalar_bytes) const override {
    const BatchShape& s = call.shape;
    const Options& o = call.options;
    const double rounds = double(o.integer("rounds"));
    const double half = o.has("buckets") ? double(o.integer("buckets")) / 2
                                         : double(s.n_k) / double(o.integer("chunk")) + 1;
    return 4.0 * 4.0 * rounds * double(s.n_q + s.n_k) +
           double(scalar_bytes) * (rounds * half * double(s.d) +
                                   double(s.n_q + s.n_k) * double(s.d + s.dv + 2));
  }

  template <typename Scalar>
  Job<Scalar> make(const Call& call) const {
    const Settings& s = call.settings;
    auto hash = std::make_shared<const CrossPolytopeHash<Scalar>>(make_hash<Scalar>(call));
    const LshOptions opt = make_options(call);
    const Report report = head_report(call, *hash, opt);
    return [hash, opt, report, s, shape = call.shape](const Scalar* q, const Scalar* k,
                                                      const Scalar* v, Scalar* out) {
      const auto start = std::chrono::steady_clock::now();
      if (s.shared_qk)
        lsh_attention_batched(*hash, q, v, out, shape, opt);
      else
        lsh_attention_batched(*hash, q, k, v, out, shape, opt);
      return full_report(report, *hash, q, k, v, out, shape, opt, s, seconds_since(start));
    };
  }

  bool differentiable() const override { return true; }

  // Per (batch, head) slice, lsh_attention_forward and lsh_attention_backward (lsh_gradient.hpp)
  // with the job's hash and options: the forward writes the job's bits.
  template <typename Scalar>
  GradientPtr<Scalar> make_gradient(const Call& call) const;

  // The options of lsh_attention the call selects (public: sparse-lowrank's lsh support).
  static LshOptions make_options(const Call& call) {
    LshOptions opt;
    opt.chunk = call.options.integer("chunk");
    opt.exact_buckets = call.options.flag("exact_buckets");
    opt.causal = call.settings.causal;
    opt.scale = call.settings.scale;
    opt.dedupe = call.options.flag("dedupe");
    opt.check_finite = call.settings.check_finite;
    // Shared QK has the self rule already.
    opt.exclude_self = call.settings.exclude_self && !call.settings.shared_qk;
    return opt;
  }

  // The hash the options select for this shape (public: the distributed runner draws the same).
  template <typename Scalar>
  static CrossPolytopeHash<Scalar> make_hash(const Call& call) {
    const Options& o = call.options;
    const Spelling& spell = o.spelling();
    const std::int64_t chunk = o.integer("chunk");
    if (!o.given("rotations")) {
      const std::int64_t buckets =
          o.has("buckets") ? o.integer("buckets") : reformer_buckets(call.shape.n_k, chunk);
      const auto kind =
          o.text("rotation") == "hadamard" ? RotationKind::hadamard : RotationKind::dense;
      return CrossPolytopeHash<Scalar>(kind, call.shape.d, buckets, o.integer("rounds"),
                                       call.settings.seed);
    }
    if (o.given("rotation"))
      throw OptionError(o.spelled("rotation") + " and " + o.spelled("rotations") +
                        " exclude each other");
    const ArrayValue& r = o.array("rotations");
    const std::string shape = detail::shape_text(r.shape);
    if (r.shape.size() != 3 || r.shape[0] != call.shape.d || r.shape[1] < 1 || r.shape[2] < 1)
      throw OptionError(o.spelled("rotations") + ": expected shape (d, r, b/2) with d = " +
                        std::to_string(call.shape.d) + ", got " + shape);
    if (o.given("rounds") && o.integer("rounds") != r.shape[1])
      throw OptionError(spell.setting("rounds", std::to_string(o.integer("rounds"))) +
                        " disagrees with " + o.spelled("rotations") + " of shape " + shape);
    if (o.given("buckets") && o.integer("buckets") != 2 * r.shape[2])
      throw OptionError(spell.setting("buckets", std::to_string(o.integer("buckets"))) +
                        " disagrees with " + o.spelled("rotations") + " of shape " + shape);
    RowMatrix<Scalar> m(r.shape[0], r.shape[1] * r.shape[2]);
    std::copy(r.data.begin(), r.data.end(), m.data());
    return CrossPolytopeHash<Scalar>(std::move(m), r.shape[1]);
  }

  // The report's entries known before the call.
  template <typename Scalar>
  static Report head_report(const Call& call, const CrossPolytopeHash<Scalar>& hash,
                            const LshOptions& opt) {
    const Options& o = call.options;
    return {{"buckets", std::int64_t(hash.buckets())},
            {"chunk", opt.chunk},
            {"rounds", std::int64_t(hash.rounds())},
            {"rotation", o.given("rotations") ? std::string("file") : o.text("rotation")},
            {"dedupe", opt.dedupe},
            {"exact_buckets", opt.exact_buckets},
            {"seed", call.settings.seed}};
  }

  // The whole report of a call that took lsh_seconds and wrote out (the pairs scored and the
  // comparison with exact attention when the settings ask, outside the timed call).
  template <typename Scalar>
  static Report full_report(Report r, const CrossPolytopeHash<Scalar>& hash, const Scalar* q,
                            const Scalar* k, const Scalar* v, const Scalar* out,
                            const BatchShape& shape, const LshOptions& opt, const Settings& s,
                            double lsh_seconds) {
    if (s.report)
      r.emplace_back("pairs_scored", pairs_scored(hash, q, k, shape, opt, s.shared_qk));
    if (s.compare) add_comparison(r, q, k, v, out, shape, opt, s.shared_qk, lsh_seconds);
    return r;
  }

 private:
  // The fraction of all (query, key) pairs the call scored (outside the timed call).
  template <typename Scalar>
  static double pairs_scored(const CrossPolytopeHash<Scalar>& hash, const Scalar* q,
                             const Scalar* k, const BatchShape& shape, const LshOptions& opt,
                             bool shared_qk) {
    using CMap = Eigen::Map<const RowMatrix<Scalar>>;
    double pairs = 0;
    for (Index i = 0; i < shape.slices(); ++i) {
      const CMap qs(q + i * shape.n_q * shape.d, shape.n_q, shape.d);
      pairs += double(
          shared_qk ? lsh_target_pairs<Scalar>(hash, qs, opt)
                    : lsh_target_pairs<Scalar>(
                          hash, qs, CMap(k + i * shape.n_k * shape.d, shape.n_k, shape.d), opt));
    }
    const double all = double(shape.slices()) * double(shape.n_q) * double(shape.n_k);
    return all > 0 ? pairs / all : 0.0;
  }

  template <typename Scalar>
  static void add_comparison(Report& r, const Scalar* q, const Scalar* k, const Scalar* v,
                             const Scalar* out, const BatchShape& shape, const LshOptions& opt,
                             bool shared_qk, double lsh_seconds) {
    std::vector<Scalar> exact(static_cast<std::size_t>(shape.slices() * shape.n_q * shape.dv));
    const auto start = std::chrono::steady_clock::now();
    if (shared_qk) {
      using CMap = Eigen::Map<const RowMatrix<Scalar>>;
      for (Index s = 0; s < shape.slices(); ++s) {
        Eigen::Map<RowMatrix<Scalar>>(exact.data() + s * shape.n_q * shape.dv, shape.n_q,
                                      shape.dv) =
            shared_qk_attention(CMap(q + s * shape.n_q * shape.d, shape.n_q, shape.d),
                                CMap(v + s * shape.n_k * shape.dv, shape.n_k, shape.dv), opt);
      }
    } else {
      ExactOptions eopt;
      eopt.causal = opt.causal;
      eopt.scale = opt.scale;
      exact_attention_batched(q, k, v, exact.data(), shape, eopt);
    }
    const double exact_seconds = seconds_since(start);
    r.emplace_back("lsh_seconds", lsh_seconds);
    r.emplace_back("exact_seconds", exact_seconds);
    r.emplace_back("speedup", exact_seconds / lsh_seconds);
    r.emplace_back("rel_error", relative_error(out, exact.data(), exact.size()));
  }
};

// The differentiable call of "lsh" on a plain (batch, heads, n, d) layout.
template <typename Scalar>
class LshGradient final : public Gradient<Scalar> {
 public:
  LshGradient(std::shared_ptr<const CrossPolytopeHash<Scalar>> hash, const LshOptions& opt,
              const Settings& settings, const BatchShape& shape, Report report)
      : hash_(std::move(hash)), opt_(opt), settings_(settings), shape_(shape),
        report_(std::move(report)) {}

  Report forward(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) override {
    const char* where = "lsh_attention_batched";
    const bool shared = settings_.shared_qk;
    const BatchShape& s = shape_;
    randattn::detail::check_batch_qkv_output(where, s, q, shared ? nullptr : k, v, out,
                                             shared ? "qk" : "q");
    saved_.clear();
    saved_.resize(std::size_t(s.slices()));
    const auto start = std::chrono::steady_clock::now();
    randattn::detail::for_each_slice(
        where, s, q && v && out && (shared || k),
        [&](Index i) {
          const auto qs = slice_of(q, i, s.n_q, s.d);
          const auto vs = slice_of(v, i, s.n_k, s.dv);
          if (shared)
            check_lsh_inputs<Scalar>(where, qs, vs, *hash_, opt_);
          else
            check_lsh_inputs<Scalar>(where, qs, slice_of(k, i, s.n_k, s.d), vs, *hash_, opt_);
        },
        [&](Index i) {
          auto o = randattn::detail::slice_of(out, i, s.n_q, s.dv);
          saved_[std::size_t(i)] =
              shared ? lsh_attention_forward<Scalar>(*hash_, slice_of(q, i, s.n_q, s.d),
                                                     slice_of(v, i, s.n_k, s.dv), o, opt_)
                     : lsh_attention_forward<Scalar>(*hash_, slice_of(q, i, s.n_q, s.d),
                                                     slice_of(k, i, s.n_k, s.d),
                                                     slice_of(v, i, s.n_k, s.dv), o, opt_);
        });
    const double seconds = seconds_since(start);
    kept_.keep(q, k, v, out, s);
    return LshMethod::full_report(report_, *hash_, q, k, v, out, s, opt_, settings_, seconds);
  }

  void backward(const Scalar* grad_out, Scalar* dq, Scalar* dk, Scalar* dv) override {
    const BatchShape& s = shape_;
    const bool shared = settings_.shared_qk;
    kept_.require_forward();
    const char* where = "lsh_attention_backward";
    randattn::detail::require(s.slices() * s.n_q == 0 || (grad_out && dq && dv && (shared || dk)),
                              where, "null gradient pointer");
    randattn::detail::require_finite(grad_out, s.slices() * s.n_q * s.dv, where, "grad_out");
    detail::clear_key_gradients_without_queries(s, shared ? nullptr : dk, dv);
    if (s.n_q == 0) return;
    randattn::detail::parallel_for(s.slices(), [&](Index i) {
      auto dqs = slice_of(dq, i, s.n_q, s.d);
      auto dvs = slice_of(dv, i, s.n_k, s.dv);
      const auto gs = slice_of(grad_out, i, s.n_q, s.dv);
      if (shared)
        lsh_attention_backward<Scalar>(saved_[std::size_t(i)], kept_.q(i), kept_.v(i),
                                       kept_.out(i), gs, dqs, dvs);
      else
        lsh_attention_backward<Scalar>(saved_[std::size_t(i)], kept_.q(i), kept_.k(i),
                                       kept_.v(i), kept_.out(i), gs, dqs,
                                       slice_of(dk, i, s.n_k, s.d), dvs);
    });
  }

 private:
  template <typename T>
  static auto slice_of(T* base, Index i, Index rows, Index cols) {
    return randattn::detail::slice_of(base, i, rows, cols);
  }

  std::shared_ptr<const CrossPolytopeHash<Scalar>> hash_;
  LshOptions opt_;
  Settings settings_;
  BatchShape shape_;
  Report report_;
  std::vector<LshResiduals<Scalar>> saved_;
  detail::KeptForward<Scalar> kept_;
};

template <typename Scalar>
GradientPtr<Scalar> LshMethod::make_gradient(const Call& call) const {
  auto hash = std::make_shared<const CrossPolytopeHash<Scalar>>(make_hash<Scalar>(call));
  const LshOptions opt = make_options(call);
  Report report = head_report(call, *hash, opt);
  return std::make_unique<LshGradient<Scalar>>(std::move(hash), opt, call.settings, call.shape,
                                               std::move(report));
}

}  // namespace randattn::registry
