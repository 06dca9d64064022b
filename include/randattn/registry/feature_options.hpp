#pragma once
// The options of the random-feature methods (features, projection, omega, lambda_features,
// bandwidth, fit, rho, calibration, calibration_q, calibration_k) and of the learned Hedgehog map
// (hedgehog_features, weight, bias), each declared once: the registered methods
// (methods/features.hpp, methods/hedgehog.hpp) and Python's FeatureMap take them from here.

#include <cstdint>
#include <string>
#include <variant>

#include "options.hpp"

namespace randattn::registry {

namespace feature_options {

inline OptionSpec features() {
  OptionSpec s{"features", OptionType::integer, std::int64_t(256),
               "number m of random projections"};
  s.min = Bound{1};
  s.max = Bound{double(kMaxFeatures)};
  return s;
}
inline OptionSpec projection() {
  OptionSpec s{"projection", OptionType::text, std::string("orthogonal"),
               "iid, orthogonal (Haar blocks, chi row norms) or hadamard"};
  s.choices = {"iid", "orthogonal", "hadamard"};
  return s;
}
inline OptionSpec omega() {
  return {"omega", OptionType::array, std::monostate{},
          "(r, d) array of the projections: omega_i (m = r), or for hybrids tau then each "
          "base's omega (r = lambda_features + 2m)"};
}
inline OptionSpec lambda_features() {
  OptionSpec s{"lambda_features", OptionType::integer, std::int64_t(16),
               "hybrids: random features n_lambda of the weight estimator"};
  s.min = Bound{1};
  s.max = Bound{double(kMaxFeatures)};
  return s;
}
inline OptionSpec bandwidth() {
  OptionSpec s{"bandwidth", OptionType::real, 1.0,
               "hybrid-gaussian: bandwidth s of lambda = exp(-s^2 |x - y|^2 / 2) on normalised "
               "rows"};
  s.min = Bound{0, true};
  s.finite = true;
  return s;
}
inline OptionSpec fit() {
  OptionSpec s{"fit", OptionType::text, std::string("queries+keys"),
               "oprf, sderf: fit the parameters to queries+keys (not with causal) or to given "
               "values (rho or calibration)"};
  s.choices = {"queries+keys", "given"};
  return s;
}
inline OptionSpec rho() {
  OptionSpec s{"rho", OptionType::real, std::monostate{},
               "oprf, sderf with fit given: mean of scale*|q_i + k_j|^2 over query-key pairs "
               "(sderf: isotropic second moment rho/d I)"};
  s.min = Bound{0};
  s.finite = true;
  return s;
}
inline OptionSpec calibration() {
  OptionSpec s{"calibration", OptionType::array, std::monostate{},
               "oprf, sderf with fit given: (r, d) or per-head (heads, r, d) array, rows of sample "
               "queries/keys (each row used as both) to fit to"};
  s.head_axis = HeadAxis::query_heads;
  return s;
}
inline OptionSpec calibration_q() {
  OptionSpec s{"calibration_q", OptionType::array, std::monostate{},
               "oprf, sderf with fit given: (r, d) or per-head (heads, r, d) sample queries, with "
               "calibration_k"};
  s.head_axis = HeadAxis::query_heads;
  return s;
}
inline OptionSpec calibration_k() {
  OptionSpec s{"calibration_k", OptionType::array, std::monostate{},
               "oprf, sderf with fit given: (r, d) or per-head (heads, r, d) sample keys, with "
               "calibration_q"};
  s.head_axis = HeadAxis::query_heads;
  return s;
}

// Hedgehog's m: the same option as the random features' (one --features flag), with the
// default of the learned map.
inline OptionSpec hedgehog_features() {
  OptionSpec s = features();
  s.fallback = std::int64_t(64);
  s.help = "rows m of W (2m features): the seeded map's size, or the given weight's";
  return s;
}
inline OptionSpec weight() {
  OptionSpec s{"weight", OptionType::array, std::monostate{},
               "hedgehog: (kv_heads, m, d) array, W of u = W (c x) + b for each key/value head "
               "(or (m, d) for every head); with bias"};
  s.head_axis = HeadAxis::kv_heads;
  s.head_entry_rank = 2;
  return s;
}
inline OptionSpec bias() {
  OptionSpec s{"bias", OptionType::array, std::monostate{},
               "hedgehog: (kv_heads, m) array, b of u = W (c x) + b for each key/value head (or "
               "(m,) for every head); with weight"};
  s.head_axis = HeadAxis::kv_heads;
  s.head_entry_rank = 1;
  return s;
}

}  // namespace feature_options

}  // namespace randattn::registry
