#pragma once
// Random-feature attention methods of randattn-cli: favor (positive features), favor-hyp
// (hyperbolic positive features), trig, oprf (optimal positive features), sderf (symmetric
// dense-exponential features), hybrid (angular hybrid of hyperbolic and trig) and
// hybrid-gaussian (Gaussian-kernel hybrid of trig and positive). They share one group of flags
// (--features, --projection, --omega, --lambda-features, --bandwidth, --fit, --rho,
// --calibration; --seed is common), each registered once and owned by the methods that use it.
//
// oprf and sderf fit their parameters once per call: to the queries and keys (--fit
// queries+keys, the default; one statistic averaged over the (batch, heads) slices), or to given
// values (--fit given with --rho, the mean of scale·|q_i + k_j|^2 over pairs, or --calibration,
// rows of sample queries/keys). A fit on the sequence lets every output depend on every key, so
// --causal requires --fit given.

#include <randattn/io/npy.hpp>
#include <randattn/randattn.hpp>

#include <CLI/CLI.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.hpp"
#include "methods.hpp"

namespace randattn_cli {

// Flags shared by the random-feature methods, registered on first use.
class FeatureFlags {
 public:
  std::int64_t features = 256;
  std::string projection = "orthogonal";
  std::uint64_t seed = 0;
  std::string omega_path;
  std::int64_t lambda_features = 16;
  double bandwidth = 1.0;
  std::string fit = "queries+keys";
  double rho = 0;
  std::string calibration_path;

  CLI::Option* option(CLI::App& cmd, const std::string& name) {
    auto found = options_.find(name);
    if (found != options_.end()) return found->second;
    const std::string tag = "[random features] ";
    CLI::Option* opt = nullptr;
    if (name == "features") {
      opt = cmd.add_option("--features", features,
                           tag + "number m of random projections (default 256)")
                ->check(CLI::PositiveNumber);
    } else if (name == "projection") {
      opt =
          cmd.add_option("--projection", projection,
                         tag + "iid, orthogonal (default; Haar blocks, chi row norms) or hadamard")
              ->check(CLI::IsMember({"iid", "orthogonal", "hadamard"}));
    } else if (name == "lambda-features") {
      opt = cmd.add_option(
                   "--lambda-features", lambda_features,
                   tag + "hybrids: random features n_lambda of the weight estimator (default 16)")
                ->check(CLI::PositiveNumber);
    } else if (name == "bandwidth") {
      opt =
          cmd.add_option("--bandwidth", bandwidth,
                         tag +
                             "hybrid-gaussian: bandwidth s of lambda = exp(-s^2 |x - y|^2 / 2) on "
                             "normalised rows (default 1)")
              ->check(CLI::PositiveNumber);
    } else if (name == "fit") {
      opt = cmd.add_option("--fit", fit,
                           tag +
                               "oprf, sderf: fit the parameters to queries+keys (default; not with "
                               "--causal) or to given values (--rho or --calibration)")
                ->check(CLI::IsMember({"queries+keys", "given"}));
    } else if (name == "rho") {
      opt = cmd.add_option(
                   "--rho", rho,
                   tag +
                       "oprf, sderf with --fit given: mean of scale*|q_i + k_j|^2 over query-key "
                       "pairs (sderf: isotropic second moment rho/d I)")
                ->check(CLI::NonNegativeNumber);
    } else if (name == "calibration") {
      opt = cmd.add_option(
          "--calibration", calibration_path,
          tag +
              "oprf, sderf with --fit given: C.npy (r, d), rows of sample queries/keys "
              "to fit to");
    } else if (name == "omega") {
      opt = cmd.add_option(
          "--omega", omega_path,
          tag + "W.npy (m, d): use its rows as the projections omega_i (m = rows of W)");
    }
    options_[name] = opt;
    return opt;
  }

  bool given(const std::string& name) const {
    auto found = options_.find(name);
    return found != options_.end() && found->second->count() > 0;
  }

  // Calls fn with the projection selected by the flags (d = input dimension). With --omega,
  // `features` becomes the number of rows of W.
  template <typename Scalar, typename Fn>
  void with_projection(std::int64_t d, Fn&& fn) {
    if (!omega_path.empty()) {
      if (given("projection")) throw CliError("--omega and --projection cannot be combined");
      randattn::io::NpyArray w;
      try {
        w = randattn::io::read_npy(omega_path);
      } catch (const std::exception& e) {
        throw CliError(std::string("--omega: ") + e.what());
      }
      if (w.ndim() != 2 || w.shape[1] != d || w.shape[0] < 1)
        throw CliError("--omega: expected an (m, " + std::to_string(d) +
                       ") array with m >= 1, got shape " + shape_str(w.shape));
      if (given("features") && w.shape[0] != features)
        throw CliError("--features " + std::to_string(features) + " disagrees with the " +
                       std::to_string(w.shape[0]) + " rows of --omega");
      features = w.shape[0];
      try {
        if (w.is_float32())
          fn(randattn::UserProjection<Scalar>(randattn::io::as_matrix<float>(w)));
        else
          fn(randattn::UserProjection<Scalar>(randattn::io::as_matrix<double>(w)));
      } catch (const std::invalid_argument& e) {
        throw CliError(std::string("--omega: ") + e.what());
      }
      return;
    }
    if (projection == "iid")
      fn(randattn::GaussianProjection<Scalar>(features, d, seed));
    else if (projection == "hadamard")
      fn(randattn::HadamardProjection<Scalar>(features, d, seed));
    else
      fn(randattn::OrthogonalProjection<Scalar>(features, d, seed));
  }

  void report(JsonObject& json) const {
    json.add("features", features);
    if (omega_path.empty())
      json.add("projection", projection).add("seed", static_cast<std::int64_t>(seed));
    else
      json.add("projection", "user").add("omega", omega_path);
  }

 private:
  std::map<std::string, CLI::Option*> options_;
};

// The (batch, heads) slices of contiguous q and k buffers as matrices.
template <typename Scalar>
struct SliceView {
  const Scalar* q_data;
  const Scalar* k_data;
  randattn::BatchShape shape;
  randattn::ConstRowMatrixMap<Scalar> q(randattn::Index s) const {
    return {q_data + s * shape.n_q * shape.d, shape.n_q, shape.d};
  }
  randattn::ConstRowMatrixMap<Scalar> k(randattn::Index s) const {
    return {k_data + s * shape.n_k * shape.d, shape.n_k, shape.d};
  }
};

// A random-feature method: Family supplies name, summary, the flags it uses and
// make<Scalar>(projection, flags, d), the map built on that projection (hybrids take only its
// kind). The map's feature dimension is reported.
template <typename Family>
class FeatureMethod final : public TypedMethod<FeatureMethod<Family>> {
 public:
  explicit FeatureMethod(std::shared_ptr<FeatureFlags> flags) : flags_(std::move(flags)) {}

  const char* name() const override { return Family::name; }
  const char* summary() const override { return Family::summary; }

  void add_options(CLI::App& cmd) override {
    for (const char* flag : Family::flags) this->share_option(flags_->option(cmd, flag));
  }

  void report(JsonObject& json) const override {
    flags_->report(json);
    Family::report(*flags_, json);
    if (feature_dim_ > 0) json.add("feature_dim", feature_dim_);
    if (predicted_rel_mse_) json.add("predicted_rel_mse", *predicted_rel_mse_);
  }

  template <typename Scalar>
  void compute(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out,
               const randattn::BatchShape& shape, const CommonSettings& settings) const {
    const SliceView<Scalar> data{q, k, shape};
    with_map<Scalar>(shape.d, settings, &data,
                     [&](const auto& map, const randattn::RandomFeatureOptions& opt) {
                       randattn::random_feature_attention_batched(map, q, k, v, out, shape, opt);
                     });
  }

#ifdef RANDATTN_CLI_MPI
  // Every rank draws the same map from the seed; only key summaries move.
  template <typename Scalar>
  void compute_sharded(const Shards& shards, const Scalar* q, const Scalar* k, const Scalar* v,
                       Scalar* out, const randattn::BatchShape& local,
                       const CommonSettings& settings) const {
    with_map<Scalar>(
        local.d, settings, nullptr,
        [&](const auto& map, const randattn::RandomFeatureOptions& opt) {
          for_each_local_slice(
              q, k, v, out, local, [&](const auto& qs, const auto& ks, const auto& vs, auto& os) {
                os = randattn::mpi::random_feature_attention(shards.comm, map, qs, ks, vs, opt);
              });
        });
  }
#endif

 private:
  // Maps with a fit(q, k, normaliser) step (oprf, sderf).
  template <typename Map, typename = void>
  struct is_fitted : std::false_type {};
  template <typename Map>
  struct is_fitted<Map, std::void_t<decltype(&Map::fit)>> : std::true_type {};
  // Maps with a closed-form kernel MSE (features/kernel_variance.hpp).
  template <typename Map, typename = void>
  struct has_closed_form_mse : std::false_type {};
  template <typename Map>
  struct has_closed_form_mse<
      Map, std::void_t<decltype(randattn::kernel_relative_mse(
               std::declval<const Map&>(), Eigen::VectorXd(), Eigen::VectorXd()))>>
      : std::true_type {};

  // Rows of the fitted statistic: every (batch, heads) slice, or the calibration rows.
  template <typename Map>
  void fit_map(Map& map, const SliceView<typename Map::Scalar>* sequence, double normaliser,
               bool causal) const {
    using Scalar = typename Map::Scalar;
    const FeatureFlags& f = *flags_;
    if (f.fit == "queries+keys") {
      if (!sequence)
        throw CliError(
            "--fit queries+keys needs every query and key in one process; use --fit given with "
            "--rho or --calibration");
      const SliceView<Scalar>& data = *sequence;
      if (causal)
        throw CliError(
            "--fit queries+keys would let every causal output depend on every key; use --fit given "
            "with --rho or --calibration");
      if (f.given("rho") || f.given("calibration"))
        throw CliError("--rho and --calibration need --fit given");
      if (data.shape.slices() == 0 || data.shape.n_q == 0)
        return;  // no output rows: nothing to fit
      Family::fit(
          map,
          [&](auto statistic) {
            auto sum = statistic(data.q(0), data.k(0));
            for (randattn::Index s = 1; s < data.shape.slices(); ++s)
              sum += statistic(data.q(s), data.k(s));
            return decltype(sum)(sum / double(data.shape.slices()));
          },
          normaliser);
      return;
    }
    if (f.given("rho") == f.given("calibration"))
      throw CliError("--fit given needs exactly one of --rho and --calibration");
    if (f.given("rho")) {
      Family::set_rho(map, f.rho);
      return;
    }
    randattn::io::NpyArray c;
    try {
      c = randattn::io::read_npy(f.calibration_path);
    } catch (const std::exception& e) {
      throw CliError(std::string("--calibration: ") + e.what());
    }
    const std::int64_t d = map.input_dim();
    if (c.ndim() != 2 || c.shape[1] != d || c.shape[0] < 1)
      throw CliError("--calibration: expected an (r, " + std::to_string(d) +
                     ") array with r >= 1, got shape " + shape_str(c.shape));
    const randattn::RowMatrix<Scalar> rows =
        c.is_float32() ? randattn::io::as_matrix<float>(c).template cast<Scalar>().eval()
                       : randattn::io::as_matrix<double>(c).template cast<Scalar>().eval();
    try {
      map.fit(rows, rows, normaliser);
    } catch (const std::invalid_argument& e) {
      throw CliError(std::string("--calibration: ") + e.what());
    }
  }

  // Mean closed-form relative kernel MSE over 1024 sampled pairs of each slice, averaged.
  template <typename Map>
  static double predicted_rel_mse(const Map& map, const SliceView<typename Map::Scalar>& data,
                                  double normaliser) {
    double sum = 0;
    for (randattn::Index s = 0; s < data.shape.slices(); ++s)
      sum += randattn::mean_kernel_relative_mse(map, data.q(s), data.k(s), normaliser);
    return sum / double(std::max<randattn::Index>(1, data.shape.slices()));
  }

  // Calls fn(map, options) with the map the flags select, fitted (oprf, sderf) to the rows of
  // `data` or to the given statistic. data == nullptr: the rows are sharded across processes, so
  // only a given statistic fits, and no predicted error is computed.
  template <typename Scalar, typename Fn>
  void with_map(std::int64_t d, const CommonSettings& settings, const SliceView<Scalar>* data,
                Fn&& fn) const {
    randattn::RandomFeatureOptions opt;
    opt.causal = settings.causal;
    opt.scale = settings.scale;
    flags_->seed = settings.seed;
    const double normaliser = std::sqrt(settings.scale ? *settings.scale : this->default_scale(d));
    flags_->with_projection<Scalar>(d, [&](auto projection) {
      auto map = Family::template make<Scalar>(std::move(projection), *flags_, d);
      if constexpr (is_fitted<decltype(map)>::value)
        fit_map(map, data, normaliser, settings.causal);
      feature_dim_ = map.feature_dim();
      if constexpr (has_closed_form_mse<decltype(map)>::value)
        if (data && settings.report && data->shape.slices() > 0 && data->shape.n_q > 0)
          predicted_rel_mse_ = predicted_rel_mse(map, *data, normaliser);
      fn(std::as_const(map), opt);
    });
  }

  std::shared_ptr<FeatureFlags> flags_;
  mutable std::int64_t feature_dim_ = 0;
  mutable std::optional<double> predicted_rel_mse_;
};

// One map on the given projection.
template <template <typename, typename> class Map>
struct SingleMap {
  static constexpr const char* flags[] = {"features", "projection", "omega"};
  template <typename Scalar, typename Projection>
  static Map<Scalar, Projection> make(Projection projection, const FeatureFlags&, std::int64_t) {
    return Map<Scalar, Projection>(std::move(projection));
  }
  static void report(const FeatureFlags&, JsonObject&) {}
};

struct FavorFamily : SingleMap<randattn::PositiveFeatures> {
  static constexpr const char* name = "favor";
  static constexpr const char* summary = "FAVOR+ positive random features (m features)";
};

struct FavorHypFamily : SingleMap<randattn::HyperbolicFeatures> {
  static constexpr const char* name = "favor-hyp";
  static constexpr const char* summary = "hyperbolic positive random features (2m features)";
};

struct TrigFamily : SingleMap<randattn::TrigFeatures> {
  static constexpr const char* name = "trig";
  static constexpr const char* summary =
      "trigonometric random features (2m features, guarded denominator)";
};

// Maps fitted to a statistic of the queries and keys (see the header comment). `fit` receives
// a callable that averages a pair statistic over the slices.
template <template <typename, typename> class Map>
struct FittedMap : SingleMap<Map> {
  static constexpr const char* flags[] = {"features", "projection", "omega",
                                          "fit",      "rho",        "calibration"};
  static void report(const FeatureFlags& f, JsonObject& json) {
    json.add("fit", f.fit);
    if (f.given("rho")) json.add("rho", f.rho);
    if (f.given("calibration")) json.add("calibration", f.calibration_path);
  }
};

struct OprfFamily : FittedMap<randattn::OptimalPositiveFeatures> {
  static constexpr const char* name = "oprf";
  static constexpr const char* summary =
      "optimal positive random features, A fitted to the data (m features)";
  template <typename Map, typename Average>
  static void fit(Map& map, Average&& average, double c) {
    using Scalar = typename Map::Scalar;
    map.set_rho(average([&](const auto& q, const auto& k) {
      Eigen::VectorXd rho(1);
      rho(0) = randattn::pair_sum_sq_norm<Scalar>(q, k, c);
      return rho;
    })(0));
  }
  template <typename Map>
  static void set_rho(Map& map, double rho) {
    map.set_rho(rho);
  }
};

struct SderfFamily : FittedMap<randattn::DenseExponentialFeatures> {
  static constexpr const char* name = "sderf";
  static constexpr const char* summary =
      "symmetric dense-exponential random features, fitted to the data's second moment (m "
      "features)";
  template <typename Map, typename Average>
  static void fit(Map& map, Average&& average, double c) {
    using Scalar = typename Map::Scalar;
    map.set_moment(average([&](const auto& q, const auto& k) {
      return randattn::pair_sum_second_moment<Scalar>(q, k, c);
    }));
  }
  template <typename Map>
  static void set_rho(Map& map, double rho) {
    const randattn::Index d = map.input_dim();
    map.set_moment(Eigen::MatrixXd::Identity(d, d) * (rho / double(d)));
  }
};

// Hybrids draw their own projections of the selected kind. --omega is not among their flags, so
// a user projection never reaches them; it maps to the default kind to keep the dispatch generic.
template <typename Scalar, typename P>
using DrawnProjection = std::conditional_t<std::is_same<P, randattn::UserProjection<Scalar>>::value,
                                           randattn::OrthogonalProjection<Scalar>, P>;

struct HybridFamily {
  static constexpr const char* name = "hybrid";
  static constexpr const char* summary =
      "angular hybrid lambda*hyperbolic + (1-lambda)*trig, lambda = angle/pi (guarded denominator)";
  static constexpr const char* flags[] = {"features", "projection", "lambda-features"};
  template <typename Scalar, typename Projection>
  static randattn::HybridFeatures<Scalar> make(Projection, const FeatureFlags& f, std::int64_t d) {
    return randattn::angular_hybrid<Scalar, DrawnProjection<Scalar, Projection>>(
        f.features, f.lambda_features, d, f.seed);
  }
  static void report(const FeatureFlags& f, JsonObject& json) {
    json.add("lambda_features", f.lambda_features);
  }
};

struct HybridGaussianFamily {
  static constexpr const char* name = "hybrid-gaussian";
  static constexpr const char* summary =
      "Gaussian hybrid lambda*trig + (1-lambda)*positive, lambda = exp(-s^2|x-y|^2/2) (guarded "
      "denominator)";
  static constexpr const char* flags[] = {"features", "projection", "lambda-features", "bandwidth"};
  template <typename Scalar, typename Projection>
  static randattn::HybridFeatures<Scalar> make(Projection, const FeatureFlags& f, std::int64_t d) {
    return randattn::gaussian_hybrid<Scalar, DrawnProjection<Scalar, Projection>>(
        f.features, f.lambda_features, d, f.bandwidth, f.seed);
  }
  static void report(const FeatureFlags& f, JsonObject& json) {
    json.add("lambda_features", f.lambda_features).add("bandwidth", f.bandwidth);
  }
};

inline void add_feature_methods(std::vector<std::unique_ptr<AttentionMethod>>& methods) {
  auto flags = std::make_shared<FeatureFlags>();
  methods.push_back(std::make_unique<FeatureMethod<FavorFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<FavorHypFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<TrigFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<OprfFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<SderfFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<HybridFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<HybridGaussianFamily>>(flags));
}

}  // namespace randattn_cli
