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
// Inputs are contiguous row-major (batch, heads, n, d) buffers; the output is (batch, heads, n_q,
// dv).

#include <randattn/io/npy.hpp>
#include <randattn/randattn.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common.hpp"
#ifdef RANDATTN_CLI_MPI
#include "sharded_slices.hpp"
#endif

namespace randattn_cli {

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Options shared by every method.
struct CommonSettings {
  bool causal = false;
  std::optional<double> scale;  // unset: the method's default_scale()
  bool shared_qk = false;       // --k omitted: k is q (only for methods with keys_optional())
  bool report = false;          // --report or --compare given
  bool compare = false;         // --compare given
  std::uint64_t seed = 0;       // --seed: the method's randomness (ignored by exact)
};

class AttentionMethod {
 public:
  virtual ~AttentionMethod() = default;

  virtual const char* name() const = 0;
  virtual const char* summary() const = 0;

  // Registers method-specific options on the `attention` subcommand.
  virtual void add_options(CLI::App& /*cmd*/) {}

  // Logit scale used when --scale is not given (d = query/key feature dimension).
  virtual double default_scale(std::int64_t d) const {
    return 1.0 / std::sqrt(static_cast<double>(d));
  }

  // True when the method adds its own "rel_error" for --compare (e.g. against a reference
  // other than plain exact attention); otherwise the command compares with exact attention.
  virtual bool own_comparison() const { return false; }

  // Adds method-specific fields to the --report line.
  virtual void report(JsonObject& /*json*/) const {}

  // True when the method may run without --k (queries and keys shared, e.g. Reformer's LSH).
  virtual bool keys_optional() const { return false; }

  virtual void run(const float* q, const float* k, const float* v, float* out,
                   const randattn::BatchShape& shape, const CommonSettings& settings) const = 0;
  virtual void run(const double* q, const double* k, const double* v, double* out,
                   const randattn::BatchShape& shape, const CommonSettings& settings) const = 0;
#ifdef RANDATTN_CLI_MPI
  // The same method on this rank's rows of every (batch, head) slice (randattn-mpi); `local` has
  // the local row counts, the other dimensions global.
  virtual void run_sharded(const Shards& shards, const float* q, const float* k, const float* v,
                           float* out, const randattn::BatchShape& local,
                           const CommonSettings& settings) const = 0;
  virtual void run_sharded(const Shards& shards, const double* q, const double* k, const double* v,
                           double* out, const randattn::BatchShape& local,
                           const CommonSettings& settings) const = 0;
#endif

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
  CLI::Option* add_method_option(CLI::App& cmd, const std::string& flag, T& target,
                                 const std::string& help) {
    CLI::Option* opt = cmd.add_option(flag, target, std::string("[") + name() + "] " + help);
    own_options_.push_back(opt);
    return opt;
  }
  // Claims an option registered elsewhere (a flag shared by a family of methods).
  void share_option(CLI::Option* opt) { own_options_.push_back(opt); }
  CLI::Option* add_method_flag(CLI::App& cmd, const std::string& flag, bool& target,
                               const std::string& help) {
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
  void run(const float* q, const float* k, const float* v, float* out,
           const randattn::BatchShape& shape, const CommonSettings& settings) const final {
    static_cast<const Derived&>(*this).template compute<float>(q, k, v, out, shape, settings);
  }
  void run(const double* q, const double* k, const double* v, double* out,
           const randattn::BatchShape& shape, const CommonSettings& settings) const final {
    static_cast<const Derived&>(*this).template compute<double>(q, k, v, out, shape, settings);
  }
#ifdef RANDATTN_CLI_MPI
  void run_sharded(const Shards& shards, const float* q, const float* k, const float* v, float* out,
                   const randattn::BatchShape& local, const CommonSettings& settings) const final {
    static_cast<const Derived&>(*this).template compute_sharded<float>(shards, q, k, v, out, local,
                                                                       settings);
  }
  void run_sharded(const Shards& shards, const double* q, const double* k, const double* v,
                   double* out, const randattn::BatchShape& local,
                   const CommonSettings& settings) const final {
    static_cast<const Derived&>(*this).template compute_sharded<double>(shards, q, k, v, out, local,
                                                                        settings);
  }
#endif
};

// Exact softmax attention (tiled, never forms the n_q x n_k matrix).
class ExactMethod final : public TypedMethod<ExactMethod> {
 public:
  const char* name() const override { return "exact"; }
  const char* summary() const override { return "exact softmax attention"; }

  template <typename Scalar>
  void compute(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out,
               const randattn::BatchShape& shape, const CommonSettings& settings) const {
    randattn::exact_attention_batched(q, k, v, out, shape, options(settings));
  }

#ifdef RANDATTN_CLI_MPI
  // Ring attention, in the layout chosen with --layout.
  template <typename Scalar>
  void compute_sharded(const Shards& shards, const Scalar* q, const Scalar* k, const Scalar* v,
                       Scalar* out, const randattn::BatchShape& local,
                       const CommonSettings& settings) const {
    randattn::mpi::RingOptions opt;
    static_cast<randattn::ExactOptions&>(opt) = options(settings);
    opt.layout = shards.layout;
    for_each_local_slice(q, k, v, out, local,
                         [&](const auto& qs, const auto& ks, const auto& vs, auto& os) {
                           os = randattn::mpi::ring_attention<Scalar>(shards.comm, qs, ks, vs, opt);
                         });
  }
#endif

 private:
  static randattn::ExactOptions options(const CommonSettings& settings) {
    randattn::ExactOptions opt;
    opt.causal = settings.causal;
    opt.scale = settings.scale;
    return opt;
  }
};

// favor, favor-hyp, trig, oprf, sderf, hybrid, hybrid-gaussian (feature_methods.hpp).
inline void add_feature_methods(std::vector<std::unique_ptr<AttentionMethod>>& methods);
// LSH attention (Reformer): cross-polytope buckets, sort-and-chunk or exact buckets, r rounds.
// Without --k the keys are the queries (shared QK: keys normalised, self rule); with --k,
// --exact-buckets is required. Every (batch, head) slice uses the same rotations.
class LshMethod final : public TypedMethod<LshMethod> {
 public:
  const char* name() const override { return "lsh"; }
  const char* summary() const override {
    return "LSH attention (Reformer, cross-polytope buckets)";
  }
  bool keys_optional() const override { return true; }
  // Shared QK compares with exact shared-QK attention (normalised keys, self rule).
  bool own_comparison() const override { return true; }

  void add_options(CLI::App& cmd) override {
    buckets_opt_ = add_method_option(cmd, "--buckets", buckets_,
                                     "Number of buckets b, even (default 2*ceil(n/chunk))");
    add_method_option(cmd, "--chunk", chunk_, "Chunk length c of sort-and-chunk (default 64)");
    rounds_opt_ = add_method_option(cmd, "--rounds", rounds_, "Hash rounds r (default 4)");
    add_method_option(cmd, "--rotations", rotations_path_,
                      "Dense rotations .npy of shape (d, r, b/2), used as is");
    rotation_opt_ = add_method_option(cmd, "--rotation", rotation_,
                                      "Random rotation: dense or hadamard (default dense)")
                        ->check(CLI::IsMember({"dense", "hadamard"}));
    add_method_flag(cmd, "--no-dedupe", no_dedupe_,
                    "Count a key once per round that sees it (trax/HF), not once");
    add_method_flag(cmd, "--exact-buckets", exact_buckets_,
                    "Attend to whole buckets instead of sorted chunks");
  }

  template <typename Scalar>
  void compute(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out,
               const randattn::BatchShape& shape, const CommonSettings& settings) const {
    const randattn::CrossPolytopeHash<Scalar> hash = make_hash<Scalar>(shape, settings.seed);
    const randattn::LshOptions opt = options(hash, settings);

    const auto start = std::chrono::steady_clock::now();
    if (settings.shared_qk)
      randattn::lsh_attention_batched(hash, q, v, out, shape, opt);
    else
      randattn::lsh_attention_batched(hash, q, k, v, out, shape, opt);
    lsh_seconds_ = seconds_since(start);
    compare_ = settings.compare;
    seed_ = settings.seed;
    if (compare_) compare_with_exact(q, k, v, out, shape, opt, settings.shared_qk);
  }

#ifdef RANDATTN_CLI_MPI
  // Sort-and-chunk shared-QK attention across ranks (the hash is drawn from the seed on each rank).
  template <typename Scalar>
  void compute_sharded(const Shards& shards, const Scalar* q, const Scalar* k, const Scalar* v,
                       Scalar* out, const randattn::BatchShape& local,
                       const CommonSettings& settings) const {
    if (!settings.shared_qk)
      throw CliError("randattn-mpi: --method lsh shares queries and keys; omit --k");
    randattn::BatchShape global = local;
    global.n_q = global.n_k = shards.rows;
    const randattn::CrossPolytopeHash<Scalar> hash = make_hash<Scalar>(global, settings.seed);
    const randattn::LshOptions opt = options(hash, settings);
    for_each_local_slice(
        q, k, v, out, local, [&](const auto& qs, const auto&, const auto& vs, auto& os) {
          os = randattn::mpi::lsh_attention<Scalar>(shards.comm, hash, qs, vs, opt);
        });
  }
#endif

  void report(JsonObject& json) const override {
    json.add("buckets", used_buckets_)
        .add("chunk", chunk_)
        .add("rounds", used_rounds_)
        .add("rotation", rotations_path_.empty() ? rotation_ : std::string("file"))
        .add("dedupe", !no_dedupe_)
        .add("exact_buckets", exact_buckets_)
        .add("seed", static_cast<std::int64_t>(seed_));
    if (compare_) {
      json.add("lsh_seconds", lsh_seconds_)
          .add("exact_seconds", exact_seconds_)
          .add("speedup", exact_seconds_ / lsh_seconds_)
          .add("rel_error", rel_error_);
    }
  }

 private:
  // Checks the flags and records what the report shows.
  template <typename Scalar>
  randattn::LshOptions options(const randattn::CrossPolytopeHash<Scalar>& hash,
                               const CommonSettings& settings) const {
    if (!settings.shared_qk && !exact_buckets_)
      throw CliError(
          "--k needs --exact-buckets (sort-and-chunk attention shares queries and keys; omit --k)");
    randattn::LshOptions opt;
    opt.chunk = chunk_;
    opt.exact_buckets = exact_buckets_;
    opt.causal = settings.causal;
    opt.scale = settings.scale;
    opt.dedupe = !no_dedupe_;
    used_buckets_ = hash.buckets();
    used_rounds_ = hash.rounds();
    return opt;
  }

  template <typename Scalar>
  randattn::CrossPolytopeHash<Scalar> make_hash(const randattn::BatchShape& shape,
                                                std::uint64_t seed) const {
    // The default bucket count depends on the chunk: check it first.
    if (chunk_ < 1) throw CliError("--chunk must be at least 1, got " + std::to_string(chunk_));
    if (rotations_path_.empty()) {
      const std::int64_t buckets =
          buckets_opt_->count() ? buckets_ : randattn::reformer_buckets(shape.n_k, chunk_);
      const auto kind = rotation_ == "hadamard" ? randattn::RotationKind::hadamard
                                                : randattn::RotationKind::dense;
      return randattn::CrossPolytopeHash<Scalar>(kind, shape.d, buckets, rounds_, seed);
    }
    if (rotation_opt_->count()) throw CliError("--rotation and --rotations exclude each other");
    randattn::io::NpyArray r;
    try {
      r = randattn::io::read_npy(rotations_path_);
    } catch (const std::exception& e) {
      throw CliError(std::string("--rotations: ") + e.what());
    }
    if (r.ndim() != 3 || r.shape[0] != shape.d || r.shape[1] < 1 || r.shape[2] < 1)
      throw CliError("--rotations: expected shape (d, r, b/2) with d = " + std::to_string(shape.d) +
                     ", got " + shape_str(r.shape));
    if (rounds_opt_->count() && rounds_ != r.shape[1])
      throw CliError("--rounds " + std::to_string(rounds_) +
                     " disagrees with --rotations of shape " + shape_str(r.shape));
    if (buckets_opt_->count() && buckets_ != 2 * r.shape[2])
      throw CliError("--buckets " + std::to_string(buckets_) +
                     " disagrees with --rotations of shape " + shape_str(r.shape));
    randattn::RowMatrix<Scalar> m(r.shape[0], r.shape[1] * r.shape[2]);
    std::visit([&](const auto& data) { std::copy(data.begin(), data.end(), m.data()); }, r.data);
    return randattn::CrossPolytopeHash<Scalar>(std::move(m), r.shape[1]);
  }

  template <typename Scalar>
  void compare_with_exact(const Scalar* q, const Scalar* k, const Scalar* v, const Scalar* out,
                          const randattn::BatchShape& shape, const randattn::LshOptions& opt,
                          bool shared_qk) const {
    std::vector<Scalar> exact(static_cast<std::size_t>(shape.slices() * shape.n_q * shape.dv));
    const auto start = std::chrono::steady_clock::now();
    if (shared_qk) {
      using CMap = Eigen::Map<const randattn::RowMatrix<Scalar>>;
      for (randattn::Index s = 0; s < shape.slices(); ++s) {
        Eigen::Map<randattn::RowMatrix<Scalar>>(exact.data() + s * shape.n_q * shape.dv, shape.n_q,
                                                shape.dv) =
            randattn::shared_qk_attention(CMap(q + s * shape.n_q * shape.d, shape.n_q, shape.d),
                                          CMap(v + s * shape.n_k * shape.dv, shape.n_k, shape.dv),
                                          opt);
      }
    } else {
      randattn::ExactOptions eopt;
      eopt.causal = opt.causal;
      eopt.scale = opt.scale ? *opt.scale : 1.0;
      randattn::exact_attention_batched(q, k, v, exact.data(), shape, eopt);
    }
    exact_seconds_ = seconds_since(start);
    rel_error_ = relative_error(out, exact.data(), exact.size());
  }

  std::int64_t buckets_ = 0;
  std::int64_t chunk_ = 64;
  std::int64_t rounds_ = 4;
  std::string rotations_path_;
  std::string rotation_ = "dense";
  bool no_dedupe_ = false;
  bool exact_buckets_ = false;
  mutable std::uint64_t seed_ = 0;
  mutable bool compare_ = false;
  CLI::Option* buckets_opt_ = nullptr;
  CLI::Option* rounds_opt_ = nullptr;
  CLI::Option* rotation_opt_ = nullptr;
  // Filled by compute() for report().
  mutable std::int64_t used_buckets_ = 0, used_rounds_ = 0;
  mutable double lsh_seconds_ = 0, exact_seconds_ = 0, rel_error_ = 0;
};

// Locality-sensitive-filter attention: keys stored in their best filter per table, queries open
// every filter scoring at least eta (or the eta of a target cosine alpha), at least --min-probes
// per table, with a fallback so no query is empty. Separate keys required (no shared QK). Every
// (batch, head) slice uses the same filters. --rotation (shared with lsh) picks dense Gaussian or
// Hadamard filters.
class LsfMethod final : public TypedMethod<LsfMethod> {
 public:
  const char* name() const override { return "lsf"; }
  const char* summary() const override {
    return "locality-sensitive-filter attention (asymmetric filters)";
  }
  bool own_comparison() const override { return true; }

  void add_options(CLI::App& cmd) override {
    add_method_option(cmd, "--filters", filters_, "Filters m per table (default 256)");
    add_method_option(cmd, "--tables", tables_, "Independent filter tables L (default 4)");
    eta_opt_ =
        add_method_option(cmd, "--eta", eta_, "Threshold on normalised filter scores (or --alpha)");
    alpha_opt_ = add_method_option(
        cmd, "--alpha", alpha_,
        "Target cosine in (0, 1): eta = alpha sqrt(2 ln m) - sqrt(2 (1 - alpha^2) ln ln m)");
    add_method_option(cmd, "--min-probes", min_probes_,
                      "Best filters opened per table whatever eta (default 1)");
    rotation_opt_ = cmd.get_option("--rotation");  // registered by lsh: dense or hadamard
    share_option(rotation_opt_);
  }

#ifdef RANDATTN_CLI_MPI
  // Filter attention is not distributed: its key filters would have to be gathered on every rank.
  template <typename Scalar>
  void compute_sharded(const Shards&, const Scalar*, const Scalar*, const Scalar*, Scalar*,
                       const randattn::BatchShape&, const CommonSettings&) const {
    throw CliError("randattn-mpi: --method lsf is not distributed; run it with randattn-cli");
  }
#endif

  template <typename Scalar>
  void compute(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out,
               const randattn::BatchShape& shape, const CommonSettings& settings) const {
    if (filters_ < 1)
      throw CliError("--filters must be at least 1, got " + std::to_string(filters_));
    if (tables_ < 1) throw CliError("--tables must be at least 1, got " + std::to_string(tables_));
    if (eta_opt_->count() == alpha_opt_->count())
      throw CliError("give exactly one of --eta and --alpha");
    if (eta_opt_->count() && !std::isfinite(eta_)) throw CliError("--eta must be a finite number");
    if (alpha_opt_->count() && !(alpha_ > 0 && alpha_ < 1))
      throw CliError("--alpha must be in (0, 1), got " + std::to_string(alpha_));
    if (min_probes_ < 1 || min_probes_ > filters_)
      throw CliError("--min-probes must be in [1, --filters = " + std::to_string(filters_) +
                     "], got " + std::to_string(min_probes_));
    rotation_ = rotation_opt_->count() ? rotation_opt_->as<std::string>() : std::string("dense");
    const auto kind =
        rotation_ == "hadamard" ? randattn::RotationKind::hadamard : randattn::RotationKind::dense;
    const randattn::LocalitySensitiveFilters<Scalar> filters(kind, shape.d, filters_, tables_,
                                                             settings.seed);
    randattn::LsfOptions opt;
    if (eta_opt_->count()) opt.eta = eta_;
    if (alpha_opt_->count()) opt.alpha = alpha_;
    opt.min_probes = min_probes_;
    opt.causal = settings.causal;
    opt.scale = settings.scale;

    const auto start = std::chrono::steady_clock::now();
    randattn::lsf_attention_batched(filters, q, k, v, out, shape, opt);
    lsf_seconds_ = seconds_since(start);
    seed_ = settings.seed;
    compare_ = settings.compare;
    if (!settings.report) return;
    // Filters opened and logits computed, slice by slice (outside the timed call).
    double scored = 0;
    for (randattn::Index s = 0; s < shape.slices(); ++s) {
      const randattn::LsfProbeStats st = randattn::lsf_probe_stats<Scalar>(
          filters, randattn::detail::slice_of(q, s, shape.n_q, shape.d),
          randattn::detail::slice_of(k, s, shape.n_k, shape.d), opt);
      scored += double(st.target_pairs);
      eta_used_ = st.eta;
    }
    pairs_scored_ = scored / (double(shape.slices()) * double(shape.n_q) * double(shape.n_k));
    if (!compare_) return;
    std::vector<Scalar> exact(static_cast<std::size_t>(shape.slices() * shape.n_q * shape.dv));
    randattn::ExactOptions eopt;
    eopt.causal = opt.causal;
    eopt.scale = opt.scale;
    const auto exact_start = std::chrono::steady_clock::now();
    randattn::exact_attention_batched(q, k, v, exact.data(), shape, eopt);
    exact_seconds_ = seconds_since(exact_start);
    rel_error_ = relative_error(out, exact.data(), exact.size());
  }

  void report(JsonObject& json) const override {
    json.add("filters", filters_)
        .add("tables", tables_)
        .add("eta", eta_used_)
        .add("min_probes", min_probes_)
        .add("rotation", rotation_)
        .add("seed", static_cast<std::int64_t>(seed_))
        .add("pairs_scored", pairs_scored_);
    if (compare_) {
      json.add("lsf_seconds", lsf_seconds_)
          .add("exact_seconds", exact_seconds_)
          .add("speedup", exact_seconds_ / lsf_seconds_)
          .add("rel_error", rel_error_);
    }
  }

 private:
  std::int64_t filters_ = 256;
  std::int64_t tables_ = 4;
  double eta_ = 0, alpha_ = 0;
  std::int64_t min_probes_ = 1;
  CLI::Option* eta_opt_ = nullptr;
  CLI::Option* alpha_opt_ = nullptr;
  CLI::Option* rotation_opt_ = nullptr;
  // Filled by compute() for report().
  mutable std::string rotation_ = "dense";
  mutable std::uint64_t seed_ = 0;
  mutable bool compare_ = false;
  mutable double eta_used_ = 0, pairs_scored_ = 0, lsf_seconds_ = 0, exact_seconds_ = 0,
                 rel_error_ = 0;
};

inline std::vector<std::unique_ptr<AttentionMethod>> make_methods() {
  std::vector<std::unique_ptr<AttentionMethod>> methods;
  methods.push_back(std::make_unique<ExactMethod>());
  add_feature_methods(methods);
  methods.push_back(std::make_unique<LshMethod>());
  methods.push_back(std::make_unique<LsfMethod>());  // after lsh: shares its --rotation
  return methods;
}

}  // namespace randattn_cli

#include "feature_methods.hpp"
