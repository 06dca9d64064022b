#pragma once
// The window support of sparse attention: query i scores the keys with |i - j| < w (causal:
// i - w < j <= i) and the first s "sink" keys (causal: those j <= i), as in sliding-window
// attention with attention sinks. Positions only: no key is looked at, so under causal masking
// output i depends on tokens 0..i alone.

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "../core/target_sets.hpp"
#include "../detail/validation.hpp"

namespace randattn {

struct WindowSupport {
  Index window = 64;  // w >= 0
  Index sinks = 0;    // s >= 0
};

// n_q queries over n_k keys; query i sits at position i.
inline TargetSets window_target_sets(Index n_q, Index n_k, const WindowSupport& w, bool causal) {
  detail::require(w.window >= 0 && w.sinks >= 0, "window_target_sets",
                  "window and sinks must be >= 0, got window = ", w.window, ", sinks = ", w.sinks);
  detail::require(n_q >= 0 && n_k >= 0, "window_target_sets", "negative sizes");
  // Row i: the sinks [0, sinks) and the window [first, end), first >= sinks.
  const auto row = [&](Index i) {
    const Index end = std::min(n_k, causal ? i + 1 : i + w.window);  // exclusive
    const Index sinks = std::min(w.sinks, end);
    return std::array<Index, 3>{sinks, std::max({Index(0), i - w.window + 1, sinks}), end};
  };
  std::size_t pairs = 0;
  for (Index i = 0; i < n_q; ++i) {
    const auto [sinks, first, end] = row(i);
    pairs += std::size_t(sinks + std::max<Index>(0, end - first));
  }
  TargetSets sets(n_q, pairs);
  for (Index i = 0; i < n_q; ++i) {
    const auto [sinks, first, end] = row(i);
    for (Index j = 0; j < sinks; ++j) sets.keys.push_back(static_cast<std::int32_t>(j));
    for (Index j = first; j < end; ++j) sets.keys.push_back(static_cast<std::int32_t>(j));
    sets.start[std::size_t(i) + 1] = Index(sets.keys.size());
  }
  return sets;
}

}  // namespace randattn
