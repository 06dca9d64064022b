#pragma once
// The per-round plan of sort-and-chunk LSH attention for one side (the queries, or the keys):
// in every round the tokens stably sorted by (bucket, position), that order cut into chunks of
// c tokens (the last one shorter), and each token's chunk. Chunk g attends to itself and to
// chunk g - 1 (see lsh_attention.hpp). The single-process attention and the sharded one
// (mpi/lsh_attention.hpp) both build their chunks from this plan, so they cut the same chunks.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/validation.hpp"
#include "../detail/vector_pool.hpp"
#include "../hashing/detail/bucket_sort.hpp"
#include "../hashing/hash_codes.hpp"

namespace randattn {

class LshChunkPlan {
 public:
  LshChunkPlan() = default;  // no tokens
  // codes: tokens x rounds bucket codes in [0, buckets); chunk_length c >= 1.
  LshChunkPlan(const HashCodes& codes, Index buckets, Index chunk_length)
      : tokens_(codes.rows()), rounds_(codes.cols()), chunk_(chunk_length) {
    detail::require(chunk_length >= 1 && buckets >= 1, "LshChunkPlan",
                    "need chunk_length >= 1 and buckets >= 1, got ", chunk_length, " and ",
                    buckets);
    const Index n = tokens_, r = rounds_;
    // Storage from the thread's pools, given back by the destructor.
    sorted_ = detail::VectorPool<std::int32_t>::take(static_cast<std::size_t>(n * r));
    sorted_.resize(static_cast<std::size_t>(n * r));
    chunk_of_ = detail::MatrixPool<HashCodes>::take(n, r);
    detail::PooledVector<Index> start(static_cast<std::size_t>(buckets) + 1);
    for (Index rho = 0; rho < r; ++rho) {
      std::int32_t* pr = sorted_.data() + rho * n;
      detail::sort_by_bucket(codes.data() + rho, r, n, buckets, pr, start);
      for (Index s = 0; s < n; ++s) chunk_of_(pr[s], rho) = static_cast<std::int32_t>(s / chunk_);
    }
  }

  LshChunkPlan(const LshChunkPlan&) = default;
  LshChunkPlan(LshChunkPlan&&) = default;
  LshChunkPlan& operator=(const LshChunkPlan&) = default;
  LshChunkPlan& operator=(LshChunkPlan&&) = default;
  ~LshChunkPlan() {
    detail::VectorPool<std::int32_t>::give(std::move(sorted_));
    detail::MatrixPool<HashCodes>::give(std::move(chunk_of_));
  }

  Index tokens() const { return tokens_; }
  Index rounds() const { return rounds_; }
  Index chunk_length() const { return chunk_; }
  // Chunks holding at least one token: ceil(tokens / c).
  Index chunks() const { return (tokens_ + chunk_ - 1) / chunk_; }

  // Round `round`'s sorted order: tokens() token indices.
  const std::int32_t* sorted(Index round) const { return sorted_.data() + round * tokens_; }
  // The tokens of chunk g in round `round`: chunk_size(g) indices from there (none past the end).
  const std::int32_t* chunk(Index round, Index g) const {
    return sorted(round) + std::min(tokens_, g * chunk_);
  }
  Index chunk_size(Index g) const { return std::clamp<Index>(tokens_ - g * chunk_, 0, chunk_); }

  // chunk_of()(t, round): the chunk of token t in that round (tokens x rounds, row-major).
  const HashCodes& chunk_of() const { return chunk_of_; }

 private:
  Index tokens_ = 0, rounds_ = 0, chunk_ = 1;
  std::vector<std::int32_t> sorted_;
  HashCodes chunk_of_;
};

}  // namespace randattn
