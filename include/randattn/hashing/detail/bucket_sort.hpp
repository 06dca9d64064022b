#pragma once
// Tokens sorted by hash code: the bucket sort behind LSH's chunks and buckets and LSF's filters.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../../core/types.hpp"
#include "../../detail/pooled_vector.hpp"

namespace randattn::detail {

// Stable counting sort of `n` tokens by code (codes[t * stride] in [0, buckets)): perm lists the
// tokens bucket by bucket in increasing position; bucket c is perm[start[c], start[c + 1]).
inline void sort_by_bucket(const std::int32_t* codes, Index stride, Index n, Index buckets,
                           std::int32_t* perm, std::vector<Index>& start) {
  start.assign(static_cast<std::size_t>(buckets) + 1, 0);
  for (Index t = 0; t < n; ++t) ++start[static_cast<std::size_t>(codes[t * stride]) + 1];
  for (Index c = 0; c < buckets; ++c) start[c + 1] += start[c];
  PooledVector<Index> next(start.size() - 1);
  std::copy(start.begin(), start.end() - 1, next.begin());
  for (Index t = 0; t < n; ++t)
    perm[next[static_cast<std::size_t>(codes[t * stride])]++] = static_cast<std::int32_t>(t);
}

}  // namespace randattn::detail
