#pragma once
// A set of key indices in [0, n), filled from several lists (the members of opened clusters, the
// buckets of opened filters) and read back in ascending order: one bit per index. Collecting m
// indices and reading them sorted costs O(m + n/64), where sorting the collected list costs
// O(m log m) (a fifth of clustered decoding's time at n = 131072 with m ≈ 2000). Ascending order
// reads the cache forward and fixes the order of the sums whatever order the lists came in.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>
#include <vector>

#include "../../core/types.hpp"
#include "../../detail/bits.hpp"

namespace randattn::detail {

class SortedIndexSet {
 public:
  // Empties the set and makes room for the indices [0, n).
  void reset(Index n) { words_.assign(static_cast<std::size_t>((n + 63) / 64), 0); }

  // Adds j; false if it was already there.
  bool insert(std::int32_t j) {
    std::uint64_t& word = words_[static_cast<std::size_t>(j) >> 6];
    const std::uint64_t bit = std::uint64_t(1) << (j & 63);
    const bool fresh = (word & bit) == 0;
    word |= bit;
    return fresh;
  }

  // Appends the members in [first, last) to out in ascending order, and empties the set (the
  // members outside [first, last) too).
  void drain(Index first, Index last, std::vector<std::int32_t>& out) {
    for (std::size_t w = 0; w < words_.size(); ++w) {
      std::uint64_t word = words_[w];
      if (word == 0) continue;
      words_[w] = 0;
      const Index base = Index(w) * 64;
      if (base + 64 <= first || base >= last) continue;
      for (; word != 0; word &= word - 1) {
        const Index j = base + count_trailing_zeros(word);
        if (j >= first && j < last) out.push_back(std::int32_t(j));
      }
    }
  }

 private:
  std::vector<std::uint64_t> words_;
};

}  // namespace randattn::detail
