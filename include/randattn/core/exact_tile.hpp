#pragma once
// One tile of exact softmax attention, the step every exact path repeats (the tiled
// exact_attention, and the ring attention of the MPI layer): queries against a block of keys,
// with the causal mask taken from global positions, merged into a SoftmaxAccumulator. Callers
// that hold a part of the sequence pass the global positions of their rows, so masks are those
// of the whole sequence.

#include <randattn/detail/intrinsics.hpp>

#include <Eigen/Core>

#include "detail/score_tile.hpp"
#include "softmax_accumulator.hpp"
#include "types.hpp"

namespace randattn {

// Rows and columns of an exact tile when the caller does not choose (block_size = 0).
constexpr Index kDefaultExactTile = detail::kDefaultTileSize;

template <typename Scalar>
class ExactTile {
 public:
  // Buffers for tiles of at most max_rows queries x max_cols keys and value_dim value columns.
  // exclude_self: the key at a query's own position is masked (queries and keys are the same
  // positions).
  ExactTile(Index max_rows, Index max_cols, Index value_dim, bool causal, bool exclude_self = false)
      : tile_(max_rows, max_cols, value_dim) {
    mask_.causal = causal;
    mask_.exclude_self = exclude_self;
  }

  // Merges into rows [acc_row, acc_row + q.rows()) of acc the partials [num | den] of the queries
  // q (already multiplied by the logit scale) at global positions [q_position, ...) over the
  // keys k and values v at global positions [k_position, ...). Causal: key positions after a
  // query's position are masked.
  template <typename Q, typename K, typename V>
  void attend(const Q& q, Index q_position, const K& k, const V& v, Index k_position,
              SoftmaxAccumulator<Scalar>& acc, Index acc_row) {
    tile_.logits(q, k);
    tile_.mask(detail::TileIndex::range(q_position, q.rows()),
               detail::TileIndex::range(k_position, k.rows()), mask_);
    tile_.exponentiate();
    tile_.merge_into(acc, detail::TileIndex::range(acc_row, q.rows()), v);
  }

 private:
  detail::ScoreTile<Scalar> tile_;
  detail::TileMask<> mask_;
};

}  // namespace randattn
