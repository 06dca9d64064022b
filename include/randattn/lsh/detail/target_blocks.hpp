#pragma once
// The compute kernel of LSH attention: query rows attend to an explicit list of key rows
// (a sorted chunk and its predecessor, or a hash bucket), with the self rule, causal masking
// and the multi-round duplicate correction, through the shared score tile
// (core/detail/score_tile.hpp). Long lists are cut into tiles, so no buffer is larger than a tile,
// whatever the chunk or bucket size.
//
// Duplicate correction. Round rho gives every query and every key a signature s_rho (its chunk
// index in the sorted order, or its bucket; with separate keys the keys' chunks are counted in
// their own sorted order, with as many chunks as the queries have). Key j is a target of query i
// in round rho exactly when
//   s_rho(i) - s_rho(j) = 0, or, for chunks ("adjacent"), = 1 (previous chunk) or = 1 - #chunks
//   (chunk 0 looking back cyclically at the last chunk);
// N_ij counts these rounds in O(r) per pair from the per-token signatures, without any n x n
// table, and the logit of the pair is lowered by log N_ij.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include <Eigen/Core>

#include "../../core/detail/score_tile.hpp"
#include "../../core/softmax_accumulator.hpp"
#include "../../core/types.hpp"
#include "../../detail/gemm.hpp"
#include "../../detail/match_counts.hpp"
#include "../../detail/matrix_pool.hpp"
#include "../../detail/parallel.hpp"
#include "../../hashing/detail/tiles.hpp"
#include "../chunk_plan.hpp"

namespace randattn::detail {

// N_ij of every targeted (query, key) pair, found once before the rounds: per query position
// the sorted distinct key positions it targets in some round and in how many rounds (CSR). With
// it the duplicate correction costs a binary search per scored pair instead of a pass over the
// rounds, so the whole of LSH attention stays linear in the number of rounds.
struct TargetCounts {
  std::vector<std::size_t> offset;  // n_q + 1
  std::vector<std::int32_t> key, rounds;

  std::int32_t of(Index i, Index j) const {
    const std::int32_t* first = key.data() + offset[std::size_t(i)];
    const std::int32_t* last = key.data() + offset[std::size_t(i) + 1];
    const std::int32_t* at = std::lower_bound(first, last, static_cast<std::int32_t>(j));
    return at != last && *at == j ? rounds[std::size_t(at - key.data())] : 0;
  }
};

// The counts of n_q query positions; targets(i, list) appends the key positions query i targets
// in every round, repeats included. The lists are sorted and run-length counted block by block.
// `rows` (sorted, distinct; null: every position) restricts the table to the positions a caller
// scores; the others get no entries.
template <typename Targets>
TargetCounts count_targets(Index n_q, Targets&& targets,
                           const std::vector<std::int32_t>* rows = nullptr) {
  constexpr Index kBlock = 64;
  const Index listed = rows ? Index(rows->size()) : n_q;
  const Index blocks = (listed + kBlock - 1) / kBlock;
  std::vector<TargetCounts> part(static_cast<std::size_t>(blocks));
  parallel_for(blocks, [&](Index b) {
    TargetCounts& out = part[std::size_t(b)];
    std::vector<std::int32_t> list;
    for (Index t = b * kBlock; t < std::min(listed, (b + 1) * kBlock); ++t) {
      list.clear();
      targets(rows ? Index((*rows)[std::size_t(t)]) : t, list);
      std::sort(list.begin(), list.end());
      for (std::size_t u = 0; u < list.size();) {
        std::size_t e = u;
        while (e < list.size() && list[e] == list[u]) ++e;
        out.key.push_back(list[u]);
        out.rounds.push_back(static_cast<std::int32_t>(e - u));
        u = e;
      }
      out.offset.push_back(out.key.size());
    }
  });
  TargetCounts all;
  all.offset.assign(std::size_t(n_q) + 1, 0);
  Index t = 0;  // listed rows seen
  for (const TargetCounts& p : part) {
    std::size_t previous = 0;
    for (std::size_t end : p.offset) {  // each listed row's length first, summed below
      const std::size_t i = rows ? std::size_t((*rows)[std::size_t(t)]) : std::size_t(t);
      all.offset[i + 1] = end - previous;
      previous = end;
      ++t;
    }
    all.key.insert(all.key.end(), p.key.begin(), p.key.end());
    all.rounds.insert(all.rounds.end(), p.rounds.begin(), p.rounds.end());
  }
  std::partial_sum(all.offset.begin(), all.offset.end(), all.offset.begin());
  return all;
}

// Rounds beyond which the counts are looked up in a TargetCounts rather than recounted per pair
// (same counts, so the same bits either way).
constexpr Index kCountTableRounds = 64;

// The counts of sort-and-chunk rounds: in round rho query i targets the keys of its chunk g and of
// chunk g - 1 (cyclically; with one chunk, chunk 0 only), in the queries' and the keys' plans
// (the same plan for shared QK). `rows` as for count_targets. Linear in the number of rounds.
inline TargetCounts chunk_target_counts(const LshChunkPlan& queries, const LshChunkPlan& keys,
                                        const std::vector<std::int32_t>* rows = nullptr) {
  const Index chunks = queries.chunks(), r = queries.rounds();
  return count_targets(
      queries.tokens(),
      [&](Index i, std::vector<std::int32_t>& list) {
        for (Index rho = 0; rho < r; ++rho) {
          const Index g = queries.chunk_of()(i, rho);
          list.insert(list.end(), keys.chunk(rho, g), keys.chunk(rho, g) + keys.chunk_size(g));
          if (chunks == 1) continue;
          const Index back = (g + chunks - 1) % chunks;
          list.insert(list.end(), keys.chunk(rho, back),
                      keys.chunk(rho, back) + keys.chunk_size(back));
        }
      },
      rows);
}

// Per-round signatures of queries and keys (row-major n x rounds) and the target relation.
struct RoundSignatures {
  const std::int32_t* query = nullptr;
  const std::int32_t* key = nullptr;
  Index rounds = 0;
  bool adjacent = false;  // chunks: same or previous chunk; buckets: same bucket
  std::int32_t wrap = 0;  // 1 - #chunks: chunk 0 looking back at the last chunk
  const TargetCounts* counts = nullptr;  // set: N_ij looked up instead of counted per round
};

// Everything a kernel needs; the matrices are owned by the caller.
template <typename Scalar>
struct TargetProblem {
  const RowMatrix<Scalar>* queries = nullptr;  // n_q x d, already multiplied by the scale
  const RowMatrix<Scalar>* keys = nullptr;     // n_k x d
  const RowMatrix<Scalar>* values = nullptr;   // n_k x dv
  bool exclude_self = false;                   // shared QK: key i is masked for query i
  bool causal = false;                         // key j is masked for query i when j > i
  const RoundSignatures* dedupe = nullptr;     // null: every occurrence counts (no correction)
  // Global position of each stored row (masks and signatures use positions, the accumulator
  // uses stored rows); null: row t is at position t. Lets a shard hold a gathered subset.
  const std::int32_t* position = nullptr;
};

// The dedupe count of the score tile: the number of rounds in which key cols[u] is a target of
// query i, from the per-round signatures (the keys' gathered per tile into `key_sig`).
struct RoundCounter {
  using SignatureMatrix =
      Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const RoundSignatures* sig = nullptr;
  const SignatureMatrix* key_sig = nullptr;  // rounds x tile columns

  void operator()(Index i, const TileIndex& cols, std::int32_t* cnt) const {
    if (sig->counts) {
      for (Index u = 0; u < cols.size; ++u) cnt[u] += sig->counts->of(i, cols[u]);
      return;
    }
    const std::int32_t* qs = sig->query + i * sig->rounds;
    for (Index rho = 0; rho < sig->rounds; ++rho) {
      const std::int32_t a = qs[rho];
      const std::int32_t* ks = &(*key_sig)(rho, 0);
      if (sig->adjacent) {
        add_adjacent_matches(a, ks, cols.size, sig->wrap, cnt);
      } else {
        add_matches(a, ks, cols.size, cnt);
      }
    }
  }
};

// Query rows attending to an explicit list of key rows: gathers the rows into tiles and runs
// the shared score tile on them.
template <typename Scalar>
class TargetBlockKernel {
 public:
  explicit TargetBlockKernel(const TargetProblem<Scalar>& problem)
      : p_(problem),
        q_(kTargetRowTile, problem.queries->cols()),
        k_(kTargetColTile, problem.keys->cols()),
        v_(kTargetColTile, problem.values->cols()),
        tile_(kTargetRowTile, kTargetColTile, problem.values->cols()),
        key_sig_(problem.dedupe ? problem.dedupe->rounds : 0, kTargetColTile) {
    mask_.causal = p_.causal;
    mask_.exclude_self = p_.exclude_self;
    counter_.sig = p_.dedupe;
    counter_.key_sig = &key_sig_;
    mask_.dedupe = p_.dedupe ? &counter_ : nullptr;
  }

  // Merges into `acc` the softmax partials of query rows rows[0..nr) over key rows cols[0..nc).
  void attend(const std::int32_t* rows, Index nr, const std::int32_t* cols, Index nc,
              SoftmaxAccumulator<Scalar>& acc) {
    for_each_tile(
        rows, nr, cols, nc, [](const TileIndex&) {},
        [&](const TileIndex& row_index, const TileIndex& col_index) {
          tile_.exponentiate();
          tile_.merge_into(acc, row_index, values(col_index.size));
        });
  }

  // The tiles of attend(rows, nr, cols, nc), in its order: per row tile, gathers the queries and
  // calls begin_rows(row_index); per column tile with a valid key, gathers the keys and values,
  // leaves the masked logits in tile().scores() and calls step(row_index, col_index). The indices
  // are stored rows (rows + r0, cols + c0).
  template <typename BeginRows, typename Step>
  void for_each_tile(const std::int32_t* rows, Index nr, const std::int32_t* cols, Index nc,
                     BeginRows&& begin_rows, Step&& step) {
    for (Index r0 = 0; r0 < nr; r0 += kTargetRowTile) {
      const Index br = std::min(kTargetRowTile, nr - r0);
      for (Index t = 0; t < br; ++t) q_.row(t) = p_.queries->row(rows[r0 + t]);
      const TileIndex row_index = TileIndex::gathered(rows + r0, br);
      const TileIndex row_pos = positions(row_index, row_pos_);
      const Index max_row = row_pos.max();
      begin_rows(row_index);
      for (Index c0 = 0; c0 < nc; c0 += kTargetColTile) {
        const TileIndex col_index =
            TileIndex::gathered(cols + c0, std::min(kTargetColTile, nc - c0));
        const TileIndex col_pos = positions(col_index, col_pos_);
        if (p_.causal && col_pos.min() > max_row) continue;
        gather_keys(col_index, col_pos);
        const Index bc = col_index.size;
        tile_.logits(queries(br), keys(bc));
        tile_.mask(row_pos, col_pos, mask_);
        step(row_index, col_index);
      }
    }
  }

  // The current tile and its gathered rows: br queries (scaled), bc keys and values.
  ScoreTile<Scalar>& tile() { return tile_; }
  auto queries(Index br) const { return q_.topRows(br); }
  auto keys(Index bc) const { return k_.topRows(bc); }
  auto values(Index bc) const { return v_.topRows(bc); }

 private:
  // The positions of stored rows `ids` (the ids themselves without a position map).
  TileIndex positions(const TileIndex& ids, std::vector<std::int32_t>& buffer) const {
    if (!p_.position) return ids;
    buffer.resize(std::size_t(ids.size));
    for (Index t = 0; t < ids.size; ++t) buffer[std::size_t(t)] = p_.position[ids[t]];
    return TileIndex::gathered(buffer.data(), ids.size);
  }

  void gather_keys(const TileIndex& cols, const TileIndex& col_pos) {
    const RoundSignatures* sig = p_.dedupe;
    for (Index u = 0; u < cols.size; ++u) {
      k_.row(u) = p_.keys->row(cols[u]);
      v_.row(u) = p_.values->row(cols[u]);
      if (sig && !sig->counts)
        for (Index rho = 0; rho < sig->rounds; ++rho)
          key_sig_(rho, u) = sig->key[col_pos[u] * sig->rounds + rho];
    }
  }

  const TargetProblem<Scalar>& p_;
  // From the thread's pool: a kernel made per task allocates nothing once the thread made one.
  Scratch<RowMatrix<Scalar>> q_, k_, v_;
  ScoreTile<Scalar> tile_;
  Scratch<RoundCounter::SignatureMatrix> key_sig_;
  RoundCounter counter_;
  TileMask<RoundCounter> mask_;
  std::vector<std::int32_t> row_pos_, col_pos_;
};

}  // namespace randattn::detail
