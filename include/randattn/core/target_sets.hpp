#pragma once
// Target sets of sparse attention: for every query i the keys it scores exactly, each once, in
// increasing position, stored as CSR (keys[start[i], start[i + 1])). LSH, LSF, window and block
// supports produce them; sparse + low-rank attention scores them exactly and estimates the rest.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../detail/validation.hpp"
#include "types.hpp"

namespace randattn {

struct TargetSets {
  std::vector<Index> start{0};      // rows + 1 offsets
  std::vector<std::int32_t> keys;  // sorted and distinct inside each row

  Index rows() const { return Index(start.size()) - 1; }
  Index size(Index i) const { return start[std::size_t(i) + 1] - start[std::size_t(i)]; }
  const std::int32_t* begin(Index i) const { return keys.data() + start[std::size_t(i)]; }
  const std::int32_t* end(Index i) const { return keys.data() + start[std::size_t(i) + 1]; }
  Index pairs() const { return Index(keys.size()); }
  bool contains(Index i, Index j) const {
    return std::binary_search(begin(i), end(i), static_cast<std::int32_t>(j));
  }

  // Appends row `rows()` from an unsorted list with repeats (sorted and made distinct here).
  void append_row(std::vector<std::int32_t>& list) {
    std::sort(list.begin(), list.end());
    list.erase(std::unique(list.begin(), list.end()), list.end());
    keys.insert(keys.end(), list.begin(), list.end());
    start.push_back(Index(keys.size()));
  }
};

// Row by row union of sets over the same queries.
inline TargetSets union_of(const std::vector<const TargetSets*>& parts) {
  detail::require(!parts.empty(), "union_of", "no target sets given");
  TargetSets out;
  const Index n = parts.front()->rows();
  for (const TargetSets* p : parts)
    detail::require(p->rows() == n, "union_of", "target sets over ", n, " and ", p->rows(),
                    " queries");
  std::vector<std::int32_t> row;
  for (Index i = 0; i < n; ++i) {
    row.clear();
    for (const TargetSets* p : parts) row.insert(row.end(), p->begin(i), p->end(i));
    out.append_row(row);
  }
  return out;
}

// The keys valid for query i: all n_k, or j <= i under causal masking.
inline Index valid_keys(Index i, Index n_k, bool causal) {
  return causal ? std::min(i + 1, n_k) : n_k;
}

}  // namespace randattn
