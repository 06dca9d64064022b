#pragma once
// Random-feature attention methods of randattn-cli: favor (positive features), favor-hyp
// (hyperbolic positive features) and trig. They share one group of flags (--features,
// --projection, --seed, --omega), registered once and owned by every method of the family.

#include <randattn/io/npy.hpp>
#include <randattn/randattn.hpp>

#include <CLI/CLI.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
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

  CLI::Option* option(CLI::App& cmd, const std::string& name) {
    auto found = options_.find(name);
    if (found != options_.end()) return found->second;
    const std::string tag = "[random features] ";
    CLI::Option* opt = nullptr;
    if (name == "features") {
      opt = cmd.add_option("--features", features, tag + "number m of random projections (default 256)")
                ->check(CLI::PositiveNumber);
    } else if (name == "projection") {
      opt = cmd.add_option("--projection", projection,
                           tag + "iid, orthogonal (default; Haar blocks, chi row norms) or hadamard")
                ->check(CLI::IsMember({"iid", "orthogonal", "hadamard"}));
    } else if (name == "seed") {
      opt = cmd.add_option("--seed", seed, tag + "seed of the random projection (default 0)");
    } else if (name == "omega") {
      opt = cmd.add_option("--omega", omega_path,
                           tag + "W.npy (m, d): use its rows as the projections omega_i (m = rows of W)");
    }
    options_[name] = opt;
    return opt;
  }

  bool given(const std::string& name) const {
    auto found = options_.find(name);
    return found != options_.end() && found->second->count() > 0;
  }

  // Calls fn with the projection selected by the flags (d = input dimension).
  template <typename Scalar, typename Fn>
  void with_projection(std::int64_t d, Fn&& fn) const {
    if (!omega_path.empty()) {
      if (given("projection")) throw CliError("--omega and --projection cannot be combined");
      randattn::io::NpyArray w;
      try {
        w = randattn::io::read_npy(omega_path);
      } catch (const std::exception& e) {
        throw CliError(std::string("--omega: ") + e.what());
      }
      if (w.ndim() != 2 || w.shape[1] != d || w.shape[0] < 1)
        throw CliError("--omega: expected an (m, " + std::to_string(d) + ") array with m >= 1, got shape " +
                       shape_str(w.shape));
      if (given("features") && w.shape[0] != features)
        throw CliError("--features " + std::to_string(features) + " disagrees with the " +
                       std::to_string(w.shape[0]) + " rows of --omega");
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

// A random-feature method: Family supplies name, summary, the flags it uses and the map built
// from a projection. The map's feature dimension is reported.
template <typename Family>
class FeatureMethod final : public TypedMethod<FeatureMethod<Family>> {
 public:
  explicit FeatureMethod(std::shared_ptr<FeatureFlags> flags) : flags_(std::move(flags)) {}

  const char* name() const override { return Family::name; }
  const char* summary() const override { return Family::summary; }

  void add_options(CLI::App& cmd) override {
    for (const char* flag : {"features", "projection", "seed", "omega"}) this->share_option(flags_->option(cmd, flag));
  }

  void report(JsonObject& json) const override {
    flags_->report(json);
    if (feature_dim_ > 0) json.add("feature_dim", feature_dim_);
  }

  template <typename Scalar>
  void compute(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out, const randattn::BatchShape& shape,
               const CommonSettings& settings) const {
    randattn::RandomFeatureOptions opt;
    opt.causal = settings.causal;
    opt.scale = settings.scale;
    flags_->with_projection<Scalar>(shape.d, [&](auto projection) {
      using Projection = decltype(projection);
      const typename Family::template Map<Scalar, Projection> map(std::move(projection));
      feature_dim_ = map.feature_dim();
      if (!flags_->omega_path.empty()) flags_->features = map.projections();
      randattn::random_feature_attention_batched(map, q, k, v, out, shape, opt);
    });
  }

 private:
  std::shared_ptr<FeatureFlags> flags_;
  mutable std::int64_t feature_dim_ = 0;
};

struct FavorFamily {
  static constexpr const char* name = "favor";
  static constexpr const char* summary = "FAVOR+ positive random features (m features)";
  template <typename Scalar, typename Projection>
  using Map = randattn::PositiveFeatures<Scalar, Projection>;
};

struct FavorHypFamily {
  static constexpr const char* name = "favor-hyp";
  static constexpr const char* summary = "hyperbolic positive random features (2m features)";
  template <typename Scalar, typename Projection>
  using Map = randattn::HyperbolicFeatures<Scalar, Projection>;
};

struct TrigFamily {
  static constexpr const char* name = "trig";
  static constexpr const char* summary = "trigonometric random features (2m features, guarded denominator)";
  template <typename Scalar, typename Projection>
  using Map = randattn::TrigFeatures<Scalar, Projection>;
};

inline void add_feature_methods(std::vector<std::unique_ptr<AttentionMethod>>& methods) {
  auto flags = std::make_shared<FeatureFlags>();
  methods.push_back(std::make_unique<FeatureMethod<FavorFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<FavorHypFamily>>(flags));
  methods.push_back(std::make_unique<FeatureMethod<TrigFamily>>(flags));
}

}  // namespace randattn_cli
