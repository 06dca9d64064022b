#pragma once
// The block support of sparse attention (Quest-style, arXiv 2406.10774, applied to blocks of
// queries): queries and keys are cut into blocks of B consecutive positions; query block g scores
// its own key block g and the T key blocks with the highest upper bound on q·k
// (block_bounds.hpp), the bound of a key block for a query block being the largest over its
// queries. Ties go to the lower block index; no randomness.
// Causal: only key blocks before g compete (their keys precede every query of block g), and the
// own block is masked to j <= i; a key's block bound is used only by later query blocks, so
// outputs 0..j-1 do not depend on key j at all.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include <Eigen/Core>

#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/validation.hpp"
#include "block_bounds.hpp"

namespace randattn {

struct BlockSupport {
  Index block_size = 64;  // B >= 1
  Index top_blocks = 2;   // T >= 0
};

// q n_q x d, k n_k x d (centred or not: the ranking uses the keys as given).
template <typename Scalar>
TargetSets block_target_sets(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                             const Eigen::Ref<const RowMatrix<Scalar>>& k, const BlockSupport& b,
                             bool causal) {
  detail::require(b.block_size >= 1 && b.top_blocks >= 0, "block_target_sets",
                  "need block_size >= 1 and top_blocks >= 0, got ", b.block_size, " and ",
                  b.top_blocks);
  const Index n_q = q.rows(), n_k = k.rows(), B = b.block_size;
  if (n_q == 0) return TargetSets();
  const KeyBlockBounds<Scalar> bounds(k, B);
  const Index key_blocks = bounds.blocks(), query_blocks = (n_q + B - 1) / B;
  // Room: T + 1 blocks of keys per query (its valid keys at most).
  std::size_t pairs = 0;
  for (Index i = 0; i < n_q; ++i)
    pairs += std::size_t(
        std::min(valid_keys(i, n_k, causal), (std::min(b.top_blocks, key_blocks) + 1) * B));
  TargetSets sets(n_q, pairs);
  detail::PooledVector<Index> order(0, std::size_t(key_blocks) + 1);
  detail::Scratch<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>> best(1, key_blocks);
  for (Index g = 0; g < query_blocks; ++g) {
    const Index i0 = g * B, rows = std::min(B, n_q - i0);
    // Competing key blocks: all but the own one (causal: those before it).
    const Index candidates = causal ? std::min(g, key_blocks) : key_blocks;
    order.clear();
    for (Index c = 0; c < candidates; ++c)
      if (c != g) order.push_back(c);
    const Index top = std::min<Index>(b.top_blocks, Index(order.size()));
    if (top > 0) {
      detail::Scratch<RowMatrix<Scalar>> ub(rows, key_blocks);
      bounds.bounds_into(q.middleRows(i0, rows), ub);
      best = ub.colwise().maxCoeff();
      std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](Index x, Index y) {
        return best(x) > best(y) || (best(x) == best(y) && x < y);
      });
    }
    order.resize(std::size_t(top));
    if (g < key_blocks) order.push_back(g);
    std::sort(order.begin(), order.end());
    for (Index i = i0; i < i0 + rows; ++i) {  // blocks in increasing order: keys sorted, distinct
      const Index valid = valid_keys(i, n_k, causal);
      for (Index c : order)
        for (Index j = c * B; j < std::min(valid, c * B + bounds.block_size(c)); ++j)
          sets.keys.push_back(static_cast<std::int32_t>(j));
      sets.start[std::size_t(i) + 1] = Index(sets.keys.size());
    }
  }
  return sets;
}

}  // namespace randattn
