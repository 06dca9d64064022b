#pragma once
// The options every attention entry point shares. Each family's option struct derives from one
// of these, so a concept has one name and one meaning everywhere:
//   causal        query i sees keys j <= i only (needs as many queries as keys);
//   check_finite  NaN or Inf in an input throws std::invalid_argument naming the first entry;
//   scale         logits are scale · q·k. The default depends on the family: 1/sqrt(d) for exact,
//                 random-feature, sparse-score and filter attention; 1 for LSH, whose keys are
//                 unit vectors (logits scale · ‖q‖ cos θ), as in Reformer.
// A family that computes in tiles or chunks whose length changes rounding only (never what is
// computed) names that length `block_size`, with 0 for its automatic choice.

#include <cmath>
#include <optional>

#include "../detail/validation.hpp"
#include "types.hpp"

namespace randattn {

// For entry points that take features or weights rather than logits (no scale).
struct CoreOptions {
  bool causal = false;
  bool check_finite = true;
};

struct AttentionOptions : CoreOptions {
  std::optional<double> scale;
};

namespace detail {

// The logit scale in the input's type: opt.scale, or the family's default. Throws when it is
// not finite, or not representable in Scalar.
template <typename Scalar>
Scalar resolve_scale(const char* where, const AttentionOptions& opt, double fallback) {
  require(!opt.scale || std::isfinite(*opt.scale), where, "scale must be finite, got ",
          opt.scale ? *opt.scale : 0.0);
  const double scale = opt.scale ? *opt.scale : fallback;
  require(std::isfinite(static_cast<Scalar>(scale)), where, "scale ", scale,
          " is not representable in the input's floating-point type");
  return static_cast<Scalar>(scale);
}

// 1/sqrt(d), the default scale of every family but LSH.
inline double inverse_sqrt_dim(Index d) { return 1.0 / std::sqrt(double(d > 0 ? d : 1)); }

}  // namespace detail

}  // namespace randattn
