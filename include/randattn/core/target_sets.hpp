#pragma once
// Target sets of sparse attention: for every query i the keys it scores exactly, each once, in
// increasing position, stored as CSR (keys[start[i], start[i + 1])). LSH, LSF, window and block
// supports produce them; sparse + low-rank attention scores them exactly and estimates the rest.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../detail/parallel.hpp"
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

// The keys valid for query i: all n_k, or j <= i under causal masking.
inline Index valid_keys(Index i, Index n_k, bool causal) {
  return causal ? std::min(i + 1, n_k) : n_k;
}

namespace detail {

// One row's keys made sorted and distinct through a bitset over the key positions: O(1) per
// key added, then either a scan of the words between the lowest and highest touched one or a
// sort of the touched words, whichever is shorter; no per-row allocation once warm.
class RowKeyBits {
 public:
  explicit RowKeyBits(Index n_k) : words_(std::size_t((n_k + 63) / 64), 0) {}

  void add(std::int32_t j) {
    std::uint64_t& w = words_[std::size_t(j) >> 6];
    if (w == 0) touched_.push_back(std::int32_t(std::size_t(j) >> 6));
    w |= std::uint64_t(1) << (std::uint32_t(j) & 63);
  }
  bool empty() const { return touched_.empty(); }

  // The number of keys; clears the row.
  Index drain_count() {
    Index n = 0;
    for (std::int32_t w : touched_) {
      n += __builtin_popcountll(words_[std::size_t(w)]);
      words_[std::size_t(w)] = 0;
    }
    touched_.clear();
    return n;
  }

  // Appends the keys in increasing order to `out` and clears the row.
  void drain_into(std::vector<std::int32_t>& out) {
    if (touched_.empty()) return;
    const auto [lo, hi] = std::minmax_element(touched_.begin(), touched_.end());
    const std::size_t span = std::size_t(*hi - *lo) + 1;
    const auto emit = [&](std::size_t w) {
      for (std::uint64_t bits = words_[w]; bits != 0; bits &= bits - 1)
        out.push_back(std::int32_t(w * 64 + std::size_t(__builtin_ctzll(bits))));
      words_[w] = 0;
    };
    // A span of s words costs s; sorting t touched words about t log2 t.
    if (span <= 8 * touched_.size()) {
      for (std::size_t w = std::size_t(*lo); w <= std::size_t(*hi); ++w)
        if (words_[w] != 0) emit(w);
    } else {
      std::sort(touched_.begin(), touched_.end());
      for (std::int32_t w : touched_) emit(std::size_t(w));
    }
    touched_.clear();
  }

 private:
  std::vector<std::uint64_t> words_;
  std::vector<std::int32_t> touched_;
};

}  // namespace detail

namespace detail {

// The rows of gather_target_sets (keys kept) or their sizes alone, per block of rows.
template <bool kKeys, typename Gather>
void gather_rows(Index n_q, Index n_k, Gather&& gather, bool fill_empty, bool causal,
                 std::vector<std::vector<std::int32_t>>& keys,
                 std::vector<std::vector<Index>>& sizes) {
  constexpr Index kRows = 256;
  const Index blocks = (n_q + kRows - 1) / kRows;
  keys.assign(static_cast<std::size_t>(kKeys ? blocks : 0), {});
  sizes.assign(static_cast<std::size_t>(blocks), {});
  parallel_for_with(
      blocks, [&] { return RowKeyBits(n_k); },
      [&](Index b, RowKeyBits& bits) {
        for (Index i = b * kRows; i < std::min(n_q, (b + 1) * kRows); ++i) {
          gather(i, [&](std::int32_t j) { bits.add(j); });
          Index size = 0;
          if (bits.empty() && fill_empty) {
            size = valid_keys(i, n_k, causal);
            if constexpr (kKeys)
              for (Index j = 0; j < size; ++j)
                keys[std::size_t(b)].push_back(static_cast<std::int32_t>(j));
          } else if constexpr (kKeys) {
            const std::size_t before = keys[std::size_t(b)].size();
            bits.drain_into(keys[std::size_t(b)]);
            size = Index(keys[std::size_t(b)].size() - before);
          } else {
            size = bits.drain_count();
          }
          sizes[std::size_t(b)].push_back(size);
        }
      });
}

}  // namespace detail

// Target sets of n_q queries over n_k keys built row by row, in parallel blocks of rows, into
// one CSR: gather(i, add) calls add(j) for every key j of row i (any order, repeats allowed,
// 0 <= j < n_k), and the row keeps each key once, sorted. With `fill_empty` a row left empty
// gets every valid key (valid_keys(i, n_k, causal)). The result does not depend on the thread
// count.
template <typename Gather>
TargetSets gather_target_sets(Index n_q, Index n_k, Gather&& gather, bool fill_empty = false,
                              bool causal = false) {
  std::vector<std::vector<std::int32_t>> part;
  std::vector<std::vector<Index>> sizes;
  detail::gather_rows<true>(n_q, n_k, gather, fill_empty, causal, part, sizes);
  TargetSets sets;
  sets.start.reserve(std::size_t(n_q) + 1);
  std::size_t total = 0;
  for (const auto& k : part) total += k.size();
  sets.keys.reserve(total);
  for (std::size_t b = 0; b < part.size(); ++b) {
    for (Index s : sizes[b]) sets.start.push_back(sets.start.back() + s);
    sets.keys.insert(sets.keys.end(), part[b].begin(), part[b].end());
    std::vector<std::int32_t>().swap(part[b]);
  }
  return sets;
}

// The sizes |S_i| of the rows gather_target_sets would build, without storing the keys.
template <typename Gather>
std::vector<Index> gather_target_sizes(Index n_q, Index n_k, Gather&& gather,
                                       bool fill_empty = false, bool causal = false) {
  std::vector<std::vector<std::int32_t>> no_keys;
  std::vector<std::vector<Index>> sizes;
  detail::gather_rows<false>(n_q, n_k, gather, fill_empty, causal, no_keys, sizes);
  std::vector<Index> out;
  out.reserve(std::size_t(n_q));
  for (const auto& s : sizes) out.insert(out.end(), s.begin(), s.end());
  return out;
}

// Row by row union of sets over the same queries.
inline TargetSets union_of(const std::vector<const TargetSets*>& parts) {
  detail::require(!parts.empty(), "union_of", "no target sets given");
  const Index n = parts.front()->rows();
  std::int32_t n_k = 0;  // one past the largest key
  for (const TargetSets* p : parts) {
    detail::require(p->rows() == n, "union_of", "target sets over ", n, " and ", p->rows(),
                    " queries");
    for (std::int32_t j : p->keys) n_k = std::max(n_k, j + 1);
  }
  return gather_target_sets(n, n_k, [&](Index i, auto&& add) {
    for (const TargetSets* p : parts)
      for (const std::int32_t* j = p->begin(i); j < p->end(i); ++j) add(*j);
  });
}

}  // namespace randattn
