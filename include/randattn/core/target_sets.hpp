#pragma once
// Target sets of sparse attention: for every query i the keys it scores exactly, each once, in
// increasing position, stored as CSR (keys[start[i], start[i + 1])). LSH, LSF, window and block
// supports produce them; sparse + low-rank attention scores them exactly and estimates the rest.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/validation.hpp"
#include "types.hpp"

namespace randattn {

struct TargetSets {
  // Storage from the calling thread's pools (detail/pooled_vector.hpp), given back when the sets
  // are destroyed: the next sets of the same size on that thread reuse it.
  detail::PooledVector<Index> start;          // rows + 1 offsets (none for no rows)
  detail::PooledVector<std::int32_t> keys;  // sorted and distinct inside each row

  TargetSets() = default;  // no rows
  // `rows` empty rows, with room for `pairs` keys.
  explicit TargetSets(Index rows, std::size_t pairs = 0)
      : start(std::size_t(rows) + 1), keys(0, pairs) {}
  TargetSets(TargetSets&&) noexcept = default;
  TargetSets& operator=(TargetSets&&) noexcept = default;
  TargetSets(const TargetSets& other)
      : start(0, other.start.size()), keys(0, other.keys.size()) {
    start.assign(other.start.begin(), other.start.end());
    keys.assign(other.keys.begin(), other.keys.end());
  }
  TargetSets& operator=(const TargetSets& other) {
    if (this != &other) *this = TargetSets(other);
    return *this;
  }

  Index rows() const { return start.empty() ? 0 : Index(start.size()) - 1; }
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
    if (start.empty()) start.push_back(0);
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
  explicit RowKeyBits(Index n_k)
      : words_(std::size_t((n_k + 63) / 64)), touched_(0, std::size_t((n_k + 63) / 64)) {}

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
  PooledVector<std::uint64_t> words_;   // zero between rows
  PooledVector<std::int32_t> touched_;  // the nonzero words, each once
};

}  // namespace detail

namespace detail {

constexpr Index kGatherRows = 256;  // rows per parallel block

// One thread's state while gathering rows: the row bitset, and the list its rows' keys go to
// (null: sizes only).
struct GatherState {
  RowKeyBits bits;
  PooledVector<std::int32_t>* keys;
};

// The rows of block b: |S_i| into sizes[i] and, with s.keys, the keys appended there.
template <typename Gather>
void gather_block(Index b, Index n_q, Index n_k, Gather& gather, bool fill_empty, bool causal,
                  GatherState& s, Index* sizes) {
  for (Index i = b * kGatherRows; i < std::min(n_q, (b + 1) * kGatherRows); ++i) {
    gather(i, [&](std::int32_t j) { s.bits.add(j); });
    Index size = 0;
    if (s.bits.empty() && fill_empty) {
      size = valid_keys(i, n_k, causal);
      if (s.keys)
        for (Index j = 0; j < size; ++j) s.keys->push_back(static_cast<std::int32_t>(j));
    } else if (s.keys) {
      const std::size_t before = s.keys->size();
      s.bits.drain_into(*s.keys);
      size = Index(s.keys->size() - before);
    } else {
      size = s.bits.drain_count();
    }
    sizes[i] = size;
  }
}

}  // namespace detail

// Target sets of n_q queries over n_k keys built row by row, in parallel blocks of rows, into
// one CSR: gather(i, add) calls add(j) for every key j of row i (any order, repeats allowed,
// 0 <= j < n_k), and the row keeps each key once, sorted. With `fill_empty` a row left empty
// gets every valid key (valid_keys(i, n_k, causal)). `pairs`: the room taken for the keys from
// the thread's pool, at least as many as the rows will hold, so that the next sets of the same
// size find it there again (more keys cost a reallocation). The result does not depend on the
// thread count.
template <typename Gather>
TargetSets gather_target_sets(Index n_q, Index n_k, Gather&& gather, bool fill_empty = false,
                              bool causal = false, std::size_t pairs = 0) {
  TargetSets sets(n_q, pairs);
  const Index blocks = (n_q + detail::kGatherRows - 1) / detail::kGatherRows;
  // On one thread the rows are appended to the sets in order. On several, each thread appends
  // the rows of its blocks to a list of its own, block b at lists[at[2b]] from at[2b + 1], and
  // the blocks are copied in order once all are gathered.
  const bool several = detail::runs_parallel(blocks);
  std::vector<detail::PooledVector<std::int32_t>> lists;
  detail::PooledVector<Index> at(several ? 2 * std::size_t(blocks) : 0);
  if (several) {
    const Index threads = detail::available_threads();
    lists.reserve(std::size_t(threads));
    for (Index t = 0; t < threads; ++t) lists.emplace_back(0, pairs / std::size_t(threads) + 1);
  }
  std::atomic<std::size_t> next_list{0};
  detail::parallel_for_with(
      blocks,
      [&] {
        return detail::GatherState{detail::RowKeyBits(n_k),
                                   several ? &lists[next_list++] : &sets.keys};
      },
      [&](Index b, detail::GatherState& s) {
        if (several) {
          at[2 * std::size_t(b)] = Index(s.keys - lists.data());
          at[2 * std::size_t(b) + 1] = Index(s.keys->size());
        }
        detail::gather_block(b, n_q, n_k, gather, fill_empty, causal, s, sets.start.data() + 1);
      });
  for (Index i = 0; i < n_q; ++i) sets.start[std::size_t(i) + 1] += sets.start[std::size_t(i)];
  if (several) {
    sets.keys.resize(std::size_t(sets.start.back()));
    for (Index b = 0; b < blocks; ++b) {
      const Index first = sets.start[std::size_t(b * detail::kGatherRows)];
      const Index last = sets.start[std::size_t(std::min(n_q, (b + 1) * detail::kGatherRows))];
      const std::int32_t* from = lists[std::size_t(at[2 * std::size_t(b)])].data() +
                                 at[2 * std::size_t(b) + 1];
      std::copy(from, from + (last - first), sets.keys.begin() + first);
    }
  }
  return sets;
}

// The sizes |S_i| of the rows gather_target_sets would build, without storing the keys (n_q
// entries, storage from the thread's pool).
template <typename Gather>
detail::PooledVector<Index> gather_target_sizes(Index n_q, Index n_k, Gather&& gather,
                                                bool fill_empty = false, bool causal = false) {
  detail::PooledVector<Index> sizes(static_cast<std::size_t>(n_q));
  detail::parallel_for_with(
      (n_q + detail::kGatherRows - 1) / detail::kGatherRows,
      [&] { return detail::GatherState{detail::RowKeyBits(n_k), nullptr}; },
      [&](Index b, detail::GatherState& s) {
        detail::gather_block(b, n_q, n_k, gather, fill_empty, causal, s, sizes.data());
      });
  return sizes;
}

namespace detail {

// Row by row union of parts[0, count) over the same queries.
inline TargetSets union_of(const TargetSets* const* parts, std::size_t count) {
  require(count > 0, "union_of", "no target sets given");
  const Index n = parts[0]->rows();
  std::int32_t n_k = 0;    // one past the largest key
  std::size_t pairs = 0;  // the union holds at most the parts' keys
  for (std::size_t p = 0; p < count; ++p) {
    require(parts[p]->rows() == n, "union_of", "target sets over ", n, " and ", parts[p]->rows(),
            " queries");
    for (std::int32_t j : parts[p]->keys) n_k = std::max(n_k, j + 1);
    pairs += parts[p]->keys.size();
  }
  return gather_target_sets(
      n, n_k,
      [&](Index i, auto&& add) {
        for (std::size_t p = 0; p < count; ++p)
          for (const std::int32_t* j = parts[p]->begin(i); j < parts[p]->end(i); ++j) add(*j);
      },
      false, false, pairs);
}

}  // namespace detail

// Row by row union of sets over the same queries.
inline TargetSets union_of(const std::vector<const TargetSets*>& parts) {
  return detail::union_of(parts.data(), parts.size());
}

}  // namespace randattn
