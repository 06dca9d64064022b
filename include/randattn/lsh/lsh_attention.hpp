#pragma once
// LSH attention (Reformer): softmax attention restricted, for each query, to the keys that
// share a cross-polytope hash bucket with it in one of r rounds.
//
// Shared QK (lsh_attention(hash, qk, v, ...)): the keys are the normalised queries k_j = q_j /
// |q_j| (a zero row gives k_j = 0: logit 0 with every query, never NaN) and the logits are scale *
// q_i . k_j (scale 1/sqrt(d) by default; Reformer's scale 1 when passed, see LshOptions). Per
// round the tokens are stably sorted by (bucket, position) and the sorted order is cut into
// chunks of length c (the last one shorter when c does not divide n, as if padded with masked
// tokens sorting last); every chunk attends to itself and to the previous chunk, cyclically
// (with a single chunk, to itself only). With exact_buckets = true a token attends to its whole
// bucket instead.
//
// Separate keys (lsh_attention(hash, q, k, v, ...)): queries and keys are hashed with the same
// rotations, keys are used as given, logits scale * q_i . k_j.
//  - Sort-and-chunk (default; HyperAttention's sortLSH block diagonal, arXiv 2310.05869): per
//    round the queries and the keys are each stably sorted by (bucket, position), separately. The
//    sorted queries are cut into G = ceil(n_q / c) chunks of length c (the last one shorter); the
//    sorted keys into G chunks of length c_k = ceil(c n_k / n_q): key chunk g holds the keys at
//    sorted positions [g c_k, min((g + 1) c_k, n_k)), so every key is in one chunk, and when
//    n_k < n_q the trailing key chunks may be short or empty. c >= n_q counts as c = n_q (one
//    chunk, holding every key). n_q == n_k gives c_k = c. Query chunk g attends to key chunks g
//    and g - 1 (cyclically, chunk 0 to chunk G - 1; with G = 1 to key chunk 0 only): in round rho,
//    key j is a target of query i iff keychunk_rho(j) is chunk_rho(i) or chunk_rho(i) - 1 mod G.
//  - exact_buckets = true: every query attends to all keys of its bucket.
//
// Target set and weights. P_i is the union over rounds of the round targets of i, with
//  - self rule (shared QK): i itself is masked unless P_i holds no other valid target, in which
//    case the output is v_i (e.g. position 0 under causal masking); separate keys have no self
//    rule;
//  - causal: only keys j <= i are valid (needs n_q == n_k);
//  - dedupe = true (default, the paper's exact union): o_i = softmax over P_i, each key once:
//    a pair seen in N_ij rounds has its logit lowered by log N_ij; dedupe = false: every
//    occurrence counts (the trax/HF behaviour, a softmax over the multiset);
//  - separate keys, fallback (sort-and-chunk and exact buckets alike): a query with no valid key
//    in P_i (e.g. under causal masking, when all keys of its chunks come later) attends to all
//    its valid keys (j <= i under causal), exactly; documented, never NaN, O(n_k) per such query.
// Each chunk or bucket tile and each round contributes a partial [num | den] merged through the
// SoftmaxAccumulator (online softmax), rounds in order, so nothing of size n x n exists and the
// result does not depend on the thread count. Memory O(n (d + dv + r)) per slice.
//
// Causality caveat (sort-and-chunk, shared or separate keys): masking keeps every target j <= i,
// but where the chunk boundaries fall depends on the buckets of all tokens, later ones included;
// changing a later token's hash can move earlier tokens (or keys) between chunks, and so change
// earlier outputs, including whether the fallback runs. Exact-bucket mode has no such coupling:
// its output i depends on tokens 0..i only, bit for bit.
//
// The backward (lsh_gradient.hpp) walks the same chunks and bucket tiles (for_each_chunk,
// BucketTiles) through the same kernel (detail/target_gradient.hpp).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../core/detail/output_check.hpp"
#include "../core/detail/self_rule.hpp"
#include "../core/input_checks.hpp"
#include "../core/options.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../core/value_headroom.hpp"
#include "../detail/batch.hpp"
#include "../detail/fresh_matrix.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/validation.hpp"
#include "../hashing/detail/bucket_sort.hpp"
#include "../hashing/unit_rows.hpp"
#include "chunk_plan.hpp"
#include "cross_polytope.hpp"
#include "detail/target_blocks.hpp"

namespace randattn {

// causal, scale and check_finite: see core/options.hpp. The scale defaults to 1/sqrt(d), as for
// every other method (and as Hugging Face's Reformer, which also divides by sqrt(d)). Reformer's
// own convention, scale 1 on unit keys (a logit scale · q·k̂ = scale · ‖q‖ cos θ carries the
// query norm once), is available by passing scale = 1.
// `chunk` is not a block size: it sets which keys a query sees, and so the result.
struct LshOptions : AttentionOptions {
  Index chunk = 64;            // sort-and-chunk query chunk length c >= 1 (unused with
                               // exact_buckets); separate keys: key chunks of ceil(c n_k / n_q)
  bool exact_buckets = false;  // attend to whole buckets instead of sorted chunks
  bool dedupe = true;          // exact-union correction; false = multiset (trax/HF)
  // Separate keys at the queries' positions (n_q == n_k): the self rule of shared QK, key i
  // masked for query i unless it has no other valid key (implied by shared QK).
  bool exclude_self = false;
};

// Reformer's bucket count for chunk length c: 2 ceil(n / c) (expected bucket size c / 2).
inline Index reformer_buckets(Index n, Index chunk) {
  detail::require(n >= 0 && chunk >= 1, "reformer_buckets",
                  "need n >= 0 and chunk >= 1, got n = ", n, ", chunk = ", chunk);
  return std::max<Index>(2, 2 * ((n + chunk - 1) / chunk));
}

namespace detail {

constexpr Index kChunkTokensPerTask = 1024;  // sorted tokens handled by one parallel task

template <typename Scalar>
Scalar check_lsh_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                        const Eigen::Ref<const RowMatrix<Scalar>>* k,
                        const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const CrossPolytopeHash<Scalar>& hash, const LshOptions& opt) {
  const Eigen::Ref<const RowMatrix<Scalar>>& keys = k ? *k : q;
  require(opt.chunk >= 1, where, "chunk must be >= 1, got ", opt.chunk);
  const Scalar scale = resolve_scale<Scalar>(where, opt, inverse_sqrt_dim(hash.dim()));
  require(q.rows() == 0 || q.cols() == hash.dim(), where, "q is ", shape_of(q),
          " but the hash was built for dimension ", hash.dim());
  require(v.rows() == keys.rows(), where, "v (", shape_of(v), ") must have one row per key (",
          keys.rows(), ")");
  check_attention_shapes<Scalar>(where, q, keys, v);
  check_attention_counts(where, q.rows(), keys.rows(), opt.causal);
  require(!opt.exclude_self || q.rows() == keys.rows(), where,
          "exclude_self needs as many queries (", q.rows(), ") as keys (", keys.rows(), ")");
  if (opt.check_finite) {
    if (k) require_finite(*k, where, "k");
    require_finite(q, where, "q");
    require_finite(v, where, "v");
  }
  return scale;
}

// Separate-key sort-and-chunk: the key chunk length c_k = ceil(c n_k / n_q) for query chunk
// length c <= n_q, so that ceil(n_q / c) chunks of c_k sorted keys hold every key (the trailing
// ones may be short or empty when n_k < n_q). n_q == n_k gives c_k = c.
inline Index key_chunk_length(Index n_q, Index n_k, Index c) {
  // c <= n_q < 2^31 and n_k < 2^31: the product fits.
  return std::max<Index>(1, (c * n_k + n_q - 1) / n_q);
}

}  // namespace detail

// The sort-and-chunk layout of LSH attention, per round: the sorted queries cut into `chunks`
// chunks of c, the sorted keys into as many chunks of ck (see the top of this file); query chunk
// g attends to key chunks g and g - 1 (cyclically; with one chunk, to chunk 0 only). Built once,
// it serves the attention kernel, the target sets and the pair counts alike.
struct LshChunks {
  Index rounds = 0, chunks = 0, c = 0, ck = 0, n_q = 0, n_k = 0;
  bool shared = false;          // shared QK: the keys are the queries (one plan)
  LshChunkPlan queries, keys;   // per round the sorted order and each token's chunk
  detail::TargetCounts counts;  // N_ij, built beyond detail::kCountTableRounds rounds (dedupe)

  const LshChunkPlan& key_plan() const { return shared ? queries : keys; }
  bool has_counts() const { return !counts.offset.empty(); }
  Index key_count(Index g) const { return key_plan().chunk_size(g); }
  const std::int32_t* key_chunk(Index rho, Index g) const { return key_plan().chunk(rho, g); }
  // The key chunks query chunk g attends to: g, and g - 1 when there are several.
  Index previous(Index g) const { return (g + chunks - 1) % chunks; }
  // The round signatures of the duplicate correction (with the tabled counts, if any).
  detail::RoundSignatures signatures() const {
    detail::RoundSignatures sig{queries.chunk_of().data(), key_plan().chunk_of().data(), rounds,
                                chunks > 1, static_cast<std::int32_t>(1 - chunks)};
    sig.counts = has_counts() ? &counts : nullptr;
    return sig;
  }
  // Calls add(j) for every key of query i's chunks in every round (repeats included).
  template <typename Add>
  void for_each_target(Index i, Add&& add) const {
    for (Index rho = 0; rho < rounds; ++rho) {
      const Index g = queries.chunk_of()(i, rho);
      for (Index h : {g, previous(g)}) {
        const std::int32_t* first = key_chunk(rho, h);
        for (Index u = 0; u < key_count(h); ++u) add(first[u]);
        if (chunks == 1) break;
      }
    }
  }
};

namespace detail {

// The layout from hash codes (n x rounds); kcodes null: shared QK. Chunk length c = min(chunk,
// n_q), key chunks of key_chunk_length. With dedupe and more than kCountTableRounds rounds the
// pair counts are tabled once (linear in rounds).
inline LshChunks chunk_layout(const HashCodes& qcodes, const HashCodes* kcodes, Index buckets,
                              Index chunk, bool dedupe) {
  LshChunks l;
  l.rounds = qcodes.cols();
  l.n_q = qcodes.rows();
  l.n_k = kcodes ? kcodes->rows() : l.n_q;
  l.shared = kcodes == nullptr;
  if (l.n_q == 0) return l;
  l.c = std::min(chunk, l.n_q);  // c >= n_q: one chunk, as with c = n_q
  l.chunks = (l.n_q + l.c - 1) / l.c;
  l.ck = l.shared ? l.c : key_chunk_length(l.n_q, l.n_k, l.c);
  l.queries = LshChunkPlan(qcodes, buckets, l.c);
  if (!l.shared) l.keys = LshChunkPlan(*kcodes, buckets, l.ck);
  if (dedupe && l.rounds > kCountTableRounds) l.counts = chunk_target_counts(l.queries, l.key_plan());
  return l;
}

// The operands of the logits: the scaled queries scale·q, and the keys k, or under shared QK (k
// null) the unit rows of q. Into queries and keys, of q's and the keys' shapes.
template <typename Scalar>
void lsh_operands(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                  const Eigen::Ref<const RowMatrix<Scalar>>* k, Scalar scale,
                  RowMatrix<Scalar>& queries, RowMatrix<Scalar>& keys) {
  queries = scale * q;
  if (k) {
    keys = *k;
  } else {
    unit_rows_into<Scalar>(q, keys);
  }
}

// Round rho of the chunks `l` as parallel tasks of consecutive query chunks (a round's chunks
// hold disjoint query rows and disjoint keys). Each task makes its kernel with make() and calls
// visit(kernel, rows, nr, cols, nc, own) for each of its chunks g: the chunk's nr query rows and
// its nc key columns, the own keys of key chunk g first, then those of key chunk g − 1 (with one
// chunk, own = nc). The forward and the backward walk the same chunks.
template <typename Make, typename Visit>
void for_each_chunk(const LshChunks& l, Index rho, Make&& make, Visit&& visit) {
  const LshChunkPlan& qplan = l.queries;
  const LshChunkPlan& kplan = l.key_plan();
  const Index per_task = std::max<Index>(1, kChunkTokensPerTask / l.c);
  const Index tasks = (l.chunks + per_task - 1) / per_task;
  parallel_for(tasks, [&](Index task) {
    auto kernel = make();
    PooledVector<std::int32_t> cols(static_cast<std::size_t>(2 * std::min(l.ck, l.n_k)));
    for (Index g = task * per_task; g < std::min(l.chunks, (task + 1) * per_task); ++g) {
      const std::int32_t* rows = qplan.chunk(rho, g);
      const Index nr = qplan.chunk_size(g);
      const std::int32_t* keys = kplan.chunk(rho, g);
      const Index nk = kplan.chunk_size(g);
      if (l.chunks == 1) {
        visit(kernel, rows, nr, keys, nk, nk);
        continue;
      }
      const std::int32_t* back = kplan.chunk(rho, l.previous(g));
      const Index np = kplan.chunk_size(l.previous(g));
      if (nk + np == 0) continue;
      std::copy(keys, keys + nk, cols.begin());
      std::copy(back, back + np, cols.begin() + nk);
      visit(kernel, rows, nr, cols.data(), nk + np, nk);
    }
  });
}

// Exact buckets, one round at a time: the queries and the keys sorted by bucket, and the tiles of
// at most kTargetRowTile query rows of one bucket against all the keys of that bucket, bucket by
// bucket (a bucket without keys has none).
class BucketTiles {
 public:
  struct Tile {
    Index q0, nq, k0, nk;
  };

  BucketTiles(Index n_q, Index n_k, Index buckets)
      : buckets_(buckets),
        qperm_(static_cast<std::size_t>(n_q)),
        kperm_(static_cast<std::size_t>(n_k)),
        qstart_(std::size_t(buckets) + 1),
        kstart_(std::size_t(buckets) + 1),
        tiles_(0, std::size_t(buckets + n_q / kTargetRowTile + 1)) {}

  // Sorts round rho of the codes (tokens x rounds; the keys' ignored under shared QK).
  void sort(const HashCodes& qcodes, const HashCodes& kcodes, Index rho, bool shared) {
    const Index r = qcodes.cols(), n_q = qcodes.rows(), b = buckets_;
    sort_by_bucket(qcodes.data() + rho, r, n_q, b, qperm_.data(), qstart_);
    if (shared) {
      kperm_.assign(qperm_.begin(), qperm_.end());
      kstart_.assign(qstart_.begin(), qstart_.end());
    } else {
      sort_by_bucket(kcodes.data() + rho, r, kcodes.rows(), b, kperm_.data(), kstart_);
    }
    tiles_.clear();
    for (Index c = 0; c < b; ++c) {
      const Index nk = kstart_[c + 1] - kstart_[c];
      if (nk == 0) continue;
      for (Index q0 = qstart_[c]; q0 < qstart_[c + 1]; q0 += kTargetRowTile)
        tiles_.push_back({q0, std::min(kTargetRowTile, qstart_[c + 1] - q0), kstart_[c], nk});
    }
  }

  Index size() const { return Index(tiles_.size()); }
  const Tile& operator[](Index t) const { return tiles_[std::size_t(t)]; }
  const std::int32_t* rows(const Tile& t) const { return qperm_.data() + t.q0; }
  const std::int32_t* keys(const Tile& t) const { return kperm_.data() + t.k0; }

 private:
  Index buckets_;
  PooledVector<std::int32_t> qperm_, kperm_;
  PooledVector<Index> qstart_, kstart_;
  PooledVector<Tile> tiles_;
};

// The pair counts of exact-bucket rounds (codes tokens x rounds, b buckets): query i targets the
// keys of its bucket in every round.
inline TargetCounts bucket_target_counts(const HashCodes& qc, const HashCodes& kc, Index b) {
  const Index n_q = qc.rows(), n_k = kc.rows(), r = qc.cols();
  // Per round the keys sorted by bucket; query i's targets are the run of its own bucket.
  std::vector<std::int32_t> sorted(static_cast<std::size_t>(r * n_k));
  std::vector<Index> start;
  for (Index rho = 0; rho < r; ++rho)
    sort_by_bucket(kc.data() + rho, r, n_k, b, sorted.data() + rho * n_k, start);
  return count_targets(n_q, [&](Index i, std::vector<std::int32_t>& list) {
    for (Index rho = 0; rho < r; ++rho) {
      const std::int32_t* kr = sorted.data() + rho * n_k;
      const std::int32_t code = qc(i, rho);
      const std::int32_t* first = std::partition_point(
          kr, kr + n_k, [&](std::int32_t j) { return kc(j, rho) < code; });
      const std::int32_t* last = std::partition_point(
          first, kr + n_k, [&](std::int32_t j) { return kc(j, rho) == code; });
      list.insert(list.end(), first, last);
    }
  });
}

// The discrete choices of one slice's forward, kept for its backward: the chunks (sort-and-
// chunk) or the hash codes (exact buckets), and the rows the rounds left without a target.
struct LshChoices {
  LshChunks chunks;
  HashCodes query_codes, key_codes;         // exact buckets; key_codes empty under shared QK
  std::vector<std::int32_t> fallback_rows;  // separate keys: attended to all their valid keys
  std::vector<std::int32_t> self_rows;      // attended to their own key alone (self rule)
};

// One (batch, head) slice. k == nullptr: shared QK. `chunks`: the sort-and-chunk layout, cut by
// the caller; `keep`: where the forward leaves its discrete choices for a backward.
template <typename Scalar>
class LshSlice {
 public:
  LshSlice(const Eigen::Ref<const RowMatrix<Scalar>>& q,
           const Eigen::Ref<const RowMatrix<Scalar>>* k,
           const Eigen::Ref<const RowMatrix<Scalar>>& v, const CrossPolytopeHash<Scalar>& hash,
           const LshOptions& opt, Scalar scale, const LshChunks* chunks = nullptr,
           LshChoices* keep = nullptr)
      : hash_(hash),
        opt_(opt),
        shared_(k == nullptr),
        acc_(q.rows(), v.cols()),
        queries_(q.rows(), q.cols()),
        keys_(q.rows() == 0 ? 0 : shared_ ? q.rows() : k->rows(), q.cols()),
        values_(q.rows() == 0 ? 0 : v.rows(), v.cols()),
        query_codes_(hashes_here(q.rows(), chunks, opt) ? q.rows() : 0, hash.rounds()),
        key_codes_(hashes_here(q.rows(), chunks, opt) && k ? k->rows() : 0, hash.rounds()) {
    if (q.rows() == 0) return;
    lsh_operands(q, k, scale, queries_, keys_);
    values_ = v;
    // Up to rounds terms per key in a numerator (the multiset counts each round).
    value_exponent_ = value_headroom(values_, double(v.rows()) * double(hash.rounds()));
    scale_by_power_of_two(values_, -value_exponent_);
    if (!chunks || opt.exact_buckets) {  // given chunks: hashed once by the caller
      hash.hash_into(q, query_codes_, false);
      if (!shared_) hash.hash_into(*k, key_codes_, false);
    }
    problem_.queries = &queries_;
    problem_.keys = &keys_;
    problem_.values = &values_;
    problem_.exclude_self = shared_ || opt.exclude_self;
    problem_.causal = opt.causal;
    if (opt.exact_buckets) {
      bucket_rounds();
      if (keep) {
        keep->query_codes = query_codes_;
        if (!shared_) keep->key_codes = key_codes_;
      }
    } else if (chunks) {
      chunk_rounds(*chunks);
    } else {
      LshChunks cut = chunk_layout(query_codes_, shared_ ? nullptr : &key_codes_, hash.buckets(),
                                   opt.chunk, opt.dedupe);
      chunk_rounds(cut);
      if (keep) keep->chunks = std::move(cut);
    }
    rows_without_targets(keep);
  }

  SoftmaxAccumulator<Scalar>& accumulator() { return acc_; }
  // The accumulator holds the attention of 2^-e v (value_headroom.hpp): outputs scale by 2^e.
  int value_exponent() const { return value_exponent_; }

 private:
  const HashCodes& key_codes() const { return shared_ ? query_codes_ : key_codes_; }

  // Whether the slice hashes q and k itself (not given chunks by the caller).
  static bool hashes_here(Index n_q, const LshChunks* chunks, const LshOptions& opt) {
    return n_q > 0 && (!chunks || opt.exact_buckets);
  }

  // Sort-and-chunk. Signature of a token in a round: its chunk index. Shared QK: one sort, key
  // chunks are the query chunks. Separate keys: queries and keys sorted separately, key chunk g
  // holds sorted keys [g c_k, (g + 1) c_k) (see the top of this file).
  void chunk_rounds(const LshChunks& l) {
    const RoundSignatures sig = l.signatures();
    problem_.dedupe = opt_.dedupe ? &sig : nullptr;
    // Chunks write disjoint rows; each round completes before the next merges.
    for (Index rho = 0; rho < l.rounds; ++rho)
      for_each_chunk(
          l, rho, [&] { return TargetBlockKernel<Scalar>(problem_); },
          [&](TargetBlockKernel<Scalar>& kernel, const std::int32_t* rows, Index nr,
              const std::int32_t* cols, Index nc, Index) {
            kernel.attend(rows, nr, cols, nc, acc_);
          });
    problem_.dedupe = nullptr;
  }

  // Exact buckets. Signature of a token in a round: its bucket.
  void bucket_rounds() {
    const Index n_q = queries_.rows(), n_k = keys_.rows(), r = hash_.rounds(), b = hash_.buckets();
    RoundSignatures sig{query_codes_.data(), key_codes().data(), r, false, 0};
    problem_.dedupe = opt_.dedupe ? &sig : nullptr;
    TargetCounts counts;
    if (opt_.dedupe && r > kCountTableRounds) {
      counts = bucket_target_counts(query_codes_, key_codes(), b);
      sig.counts = &counts;
    }
    BucketTiles tiles(n_q, n_k, b);
    for (Index rho = 0; rho < r; ++rho) {
      tiles.sort(query_codes_, key_codes_, rho, shared_);
      // A bucket's queries are cut into row tiles; each task writes its own rows.
      const Index per_task = std::max<Index>(1, kChunkTokensPerTask / kTargetRowTile);
      parallel_for((tiles.size() + per_task - 1) / per_task, [&](Index group) {
        TargetBlockKernel<Scalar> kernel(problem_);
        const Index end = std::min(tiles.size(), (group + 1) * per_task);
        for (Index t = group * per_task; t < end; ++t)
          kernel.attend(tiles.rows(tiles[t]), tiles[t].nq, tiles.keys(tiles[t]), tiles[t].nk, acc_);
      });
    }
    problem_.dedupe = nullptr;
  }

  // Rows whose target set is empty after all rounds: shared QK attends to itself (self rule),
  // separate keys fall back to all valid keys.
  void rows_without_targets(LshChoices* keep) {
    PooledVector<std::int32_t> empty(0, std::size_t(acc_.rows()));
    for (Index i = 0; i < acc_.rows(); ++i)
      if (acc_.log_scale()(i) == -std::numeric_limits<Scalar>::infinity())
        empty.push_back(static_cast<std::int32_t>(i));
    if (empty.empty()) return;
    if (shared_) {
      attend_to_self(acc_, empty, queries_, keys_, values_);
      if (keep) keep->self_rows.assign(empty.begin(), empty.end());
      return;
    }
    if (keep) keep->fallback_rows.assign(empty.begin(), empty.end());
    PooledVector<std::int32_t> all(static_cast<std::size_t>(keys_.rows()));
    std::iota(all.begin(), all.end(), 0);
    const Index tiles = (Index(empty.size()) + kTargetRowTile - 1) / kTargetRowTile;
    parallel_for(tiles, [&](Index t) {
      TargetBlockKernel<Scalar> kernel(problem_);
      const Index r0 = t * kTargetRowTile;
      kernel.attend(empty.data() + r0, std::min(kTargetRowTile, Index(empty.size()) - r0),
                    all.data(), Index(all.size()), acc_);
    });
    if (!opt_.exclude_self) return;
    // Self rule: a row whose only valid key is its own attends to it.
    PooledVector<std::int32_t> alone(0, empty.size());
    for (std::int32_t i : empty)
      if (acc_.log_scale()(i) == -std::numeric_limits<Scalar>::infinity()) alone.push_back(i);
    if (!alone.empty()) attend_to_self(acc_, alone, queries_, keys_, values_);
    if (keep) keep->self_rows.assign(alone.begin(), alone.end());
  }

  const CrossPolytopeHash<Scalar>& hash_;
  const LshOptions& opt_;
  bool shared_;
  SoftmaxAccumulator<Scalar> acc_;
  int value_exponent_ = 0;
  // Copies of the inputs (scaled, unit or reduced in range) and their codes, from the thread's
  // pool (detail/matrix_pool.hpp).
  Scratch<RowMatrix<Scalar>> queries_, keys_, values_;
  Scratch<HashCodes> query_codes_, key_codes_;
  TargetProblem<Scalar> problem_;
};

template <typename Scalar>
SoftmaxAccumulator<Scalar> lsh_accumulate(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                          const Eigen::Ref<const RowMatrix<Scalar>>* k,
                                          const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                          const CrossPolytopeHash<Scalar>& hash,
                                          const LshOptions& opt, int* value_exponent = nullptr,
                                          const LshChunks* chunks = nullptr,
                                          LshChoices* keep = nullptr) {
  const Scalar scale = check_lsh_inputs<Scalar>("lsh_attention", q, k, v, hash, opt);
  LshSlice<Scalar> slice(q, k, v, hash, opt, scale, chunks, keep);
  // value_exponent given: the caller finalizes and scales the output back itself.
  SoftmaxAccumulator<Scalar> acc =
      value_exponent ? std::move(slice.accumulator())
                     : unscaled_accumulator(std::move(slice.accumulator()), slice.value_exponent());
  if (value_exponent) *value_exponent = slice.value_exponent();
  check_accumulator_finite("lsh_attention", acc, opt.check_finite);
  return acc;
}

}  // namespace detail

// The checks of LSH attention's arguments (the shared input contract of core/input_checks.hpp,
// the hash's dimension, chunk >= 1, at most 2^31 - 1 tokens) and its logit scale. Shared QK:
// qk n x d, v n x dv.
template <typename Scalar>
Scalar check_lsh_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& qk,
                        const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const CrossPolytopeHash<Scalar>& hash, const LshOptions& opt) {
  return detail::check_lsh_inputs<Scalar>(where, qk, nullptr, v, hash, opt);
}

// Separate keys: q n_q x d, k n_k x d, v n_k x dv.
template <typename Scalar>
Scalar check_lsh_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                        const Eigen::Ref<const RowMatrix<Scalar>>& k,
                        const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const CrossPolytopeHash<Scalar>& hash, const LshOptions& opt) {
  return detail::check_lsh_inputs<Scalar>(where, q, &k, v, hash, opt);
}

namespace detail {

// Σ_i |P_i| (see the top of this file): the distinct valid (query, key) pairs one slice scores.
// A shared-QK row left with no other target scores itself; a separate-key row with no valid key
// in P_i scores all its valid keys (the fallback). Inputs are checked by the caller.
template <typename Scalar>
Index lsh_target_pairs(const CrossPolytopeHash<Scalar>& hash,
                       const Eigen::Ref<const RowMatrix<Scalar>>& q,
                       const Eigen::Ref<const RowMatrix<Scalar>>* k, const LshOptions& opt) {
  const bool shared = k == nullptr;
  const Index n_q = q.rows(), n_k = shared ? n_q : k->rows(), r = hash.rounds();
  if (n_q == 0) return 0;
  const HashCodes qcodes = hash.hash(q, false);
  const HashCodes kcodes = shared ? qcodes : hash.hash(*k, false);
  // Per round, the keys a query of round signature s sees: by chunk (sorted chunk and the one
  // before) or by bucket.
  std::vector<std::vector<std::int32_t>> key_lists(static_cast<std::size_t>(r));
  std::vector<std::vector<Index>> key_start(static_cast<std::size_t>(r));
  std::optional<LshChunkPlan> qplan, kplan;
  Index chunks = 0;
  if (opt.exact_buckets) {
    for (Index rho = 0; rho < r; ++rho) {
      key_lists[std::size_t(rho)].resize(std::size_t(n_k));
      sort_by_bucket(kcodes.data() + rho, r, n_k, hash.buckets(),
                     key_lists[std::size_t(rho)].data(), key_start[std::size_t(rho)]);
    }
  } else {
    const Index c = std::min(opt.chunk, n_q);
    chunks = (n_q + c - 1) / c;
    qplan.emplace(qcodes, hash.buckets(), c);
    kplan.emplace(kcodes, hash.buckets(), shared ? c : key_chunk_length(n_q, n_k, c));
  }
  Index pairs = 0;
  std::vector<std::int32_t> seen;
  for (Index i = 0; i < n_q; ++i) {
    seen.clear();
    const auto add = [&](const std::int32_t* keys, Index count) {
      for (Index u = 0; u < count; ++u) {
        const std::int32_t j = keys[u];
        if ((opt.causal && j > i) || (shared && j == i)) continue;
        seen.push_back(j);
      }
    };
    for (Index rho = 0; rho < r; ++rho) {
      if (opt.exact_buckets) {
        const std::vector<Index>& start = key_start[std::size_t(rho)];
        const Index b = qcodes(i, rho);
        add(key_lists[std::size_t(rho)].data() + start[std::size_t(b)],
            start[std::size_t(b) + 1] - start[std::size_t(b)]);
      } else {
        const Index g = qplan->chunk_of()(i, rho);
        add(kplan->chunk(rho, g), kplan->chunk_size(g));
        if (chunks > 1) {
          const Index prev = (g + chunks - 1) % chunks;
          add(kplan->chunk(rho, prev), kplan->chunk_size(prev));
        }
      }
    }
    std::sort(seen.begin(), seen.end());
    const Index distinct = Index(std::unique(seen.begin(), seen.end()) - seen.begin());
    if (distinct > 0)
      pairs += distinct;
    else
      pairs += shared ? 1 : (opt.causal ? i + 1 : n_k);
  }
  return pairs;
}

}  // namespace detail

// The number of distinct (query, key) pairs lsh_attention scores on these inputs: Σ_i |P_i|,
// with the self rule (shared QK) and the fallback (separate keys) counted as the pairs they
// score. Divided by n_q n_k it is the fraction of the exact attention's pairs. O(n r c) time for
// chunks of length c (O(r Σ bucket sizes) with exact buckets). Shared QK: qk n x d.
template <typename Scalar>
Index lsh_target_pairs(const CrossPolytopeHash<Scalar>& hash,
                       const Eigen::Ref<const RowMatrix<Scalar>>& qk, const LshOptions& opt = {}) {
  const RowMatrix<Scalar> no_values(qk.rows(), 0);
  detail::check_lsh_inputs<Scalar>("lsh_target_pairs", qk, nullptr, no_values, hash, opt);
  return detail::lsh_target_pairs<Scalar>(hash, qk, nullptr, opt);
}

// Separate keys: q n_q x d, k n_k x d.
template <typename Scalar>
Index lsh_target_pairs(const CrossPolytopeHash<Scalar>& hash,
                       const Eigen::Ref<const RowMatrix<Scalar>>& q,
                       const Eigen::Ref<const RowMatrix<Scalar>>& k, const LshOptions& opt = {}) {
  const RowMatrix<Scalar> no_values(k.rows(), 0);
  detail::check_lsh_inputs<Scalar>("lsh_target_pairs", q, &k, no_values, hash, opt);
  return detail::lsh_target_pairs<Scalar>(hash, q, &k, opt);
}

// Shared-QK LSH attention as an accumulator (for merging with other partial results):
// qk n x d, v n x dv.
template <typename Scalar>
SoftmaxAccumulator<Scalar> lsh_attention_accumulate(const CrossPolytopeHash<Scalar>& hash,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& qk,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                    const LshOptions& opt = {}) {
  return detail::lsh_accumulate<Scalar>(qk, nullptr, v, hash, opt);
}

// Separate-key LSH attention (sort-and-chunk or exact buckets) as an accumulator: q n_q x d, k n_k
// x d, v n_k x dv.
template <typename Scalar>
SoftmaxAccumulator<Scalar> lsh_attention_accumulate(const CrossPolytopeHash<Scalar>& hash,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                    const LshOptions& opt = {}) {
  return detail::lsh_accumulate<Scalar>(q, &k, v, hash, opt);
}

// The same with the chunks already cut: `chunks` must be lsh_chunks(hash, q, k, opt) (sort-and-
// chunk only), so that a caller that also needs the target sets hashes once. Bit for bit the
// result of the overload above.
template <typename Scalar>
SoftmaxAccumulator<Scalar> lsh_attention_accumulate(const LshChunks& chunks,
                                                    const CrossPolytopeHash<Scalar>& hash,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                    const LshOptions& opt = {}) {
  detail::require(!opt.exact_buckets && chunks.n_q == q.rows() && chunks.n_k == k.rows() &&
                      chunks.rounds == hash.rounds() && !chunks.shared &&
                      (q.rows() == 0 || chunks.c == std::min(opt.chunk, q.rows())),
                  "lsh_attention_accumulate", "the chunks were not cut from these q, k and options");
  return detail::lsh_accumulate<Scalar>(q, &k, v, hash, opt, nullptr, &chunks);
}

// The chunks of q and k under `hash` (sort-and-chunk; opt.exact_buckets unused), hashed once.
template <typename Scalar>
LshChunks lsh_chunks(const CrossPolytopeHash<Scalar>& hash,
                     const Eigen::Ref<const RowMatrix<Scalar>>& q,
                     const Eigen::Ref<const RowMatrix<Scalar>>& k, const LshOptions& opt) {
  detail::Scratch<HashCodes> qcodes(q.rows(), hash.rounds()), kcodes(k.rows(), hash.rounds());
  hash.hash_into(q, qcodes, false);
  hash.hash_into(k, kcodes, false);
  return detail::chunk_layout(qcodes, &kcodes, hash.buckets(), opt.chunk, opt.dedupe);
}

namespace detail {

// Row i of the target sets of the chunks `l`: its chunks' keys cut at the causal limit.
inline auto chunk_targets(const LshChunks& l, bool causal) {
  return [&l, causal](Index i, auto&& add) {
    const Index valid = valid_keys(i, l.n_k, causal);
    l.for_each_target(i, [&](std::int32_t j) {
      if (j < valid) add(j);
    });
  };
}

// Room for the target sets of the chunks `l`: per query, the keys of its chunks in every round
// (its valid keys at most).
inline std::size_t chunk_target_room(const LshChunks& l, bool causal) {
  const Index per_round = l.chunks > 1 ? 2 * l.ck : l.ck;
  std::size_t room = 0;
  for (Index i = 0; i < l.n_q; ++i)
    room += std::size_t(std::min(valid_keys(i, l.n_k, causal), l.rounds * per_round));
  return room;
}

}  // namespace detail

// The target sets of sort-and-chunk LSH attention with the chunks `l` (see lsh_target_sets).
inline TargetSets lsh_target_sets(const LshChunks& l, bool causal) {
  return gather_target_sets(l.n_q, l.n_k, detail::chunk_targets(l, causal), true, causal,
                            detail::chunk_target_room(l, causal));
}

// Their sizes |P_i| alone (the pairs each query scores), without the sets (storage from the
// thread's pool).
inline detail::PooledVector<Index> lsh_target_sizes(const LshChunks& l, bool causal) {
  return gather_target_sizes(l.n_q, l.n_k, detail::chunk_targets(l, causal), true, causal);
}

// The target set P_i of every query of separate-key LSH attention (sort-and-chunk or exact
// buckets): the keys lsh_attention scores for query i, each once, after the causal mask and with
// the fallback (a query without a valid target gets every valid key). q n_q x d, k n_k x d.
template <typename Scalar>
TargetSets lsh_target_sets(const CrossPolytopeHash<Scalar>& hash,
                           const Eigen::Ref<const RowMatrix<Scalar>>& q,
                           const Eigen::Ref<const RowMatrix<Scalar>>& k, const LshOptions& opt = {}) {
  const RowMatrix<Scalar> no_values(k.rows(), 0);
  detail::check_lsh_inputs<Scalar>("lsh_target_sets", q, &k, no_values, hash, opt);
  if (!opt.exact_buckets) return lsh_target_sets(lsh_chunks<Scalar>(hash, q, k, opt), opt.causal);
  const Index n_q = q.rows(), n_k = k.rows(), r = hash.rounds(), b = hash.buckets();
  detail::Scratch<HashCodes> qc(n_q, r), kc(n_k, r);
  hash.hash_into(q, qc, false);
  hash.hash_into(k, kc, false);
  // Per round the keys sorted by bucket, bucket c at [start[rho (b + 1) + c], ... + 1).
  detail::PooledVector<std::int32_t> sorted(static_cast<std::size_t>(r * n_k));
  detail::PooledVector<Index> start(static_cast<std::size_t>(r * (b + 1))),
      ks(static_cast<std::size_t>(b + 1));
  for (Index rho = 0; rho < r; ++rho) {
    detail::sort_by_bucket(kc.data() + rho, r, n_k, b, sorted.data() + rho * n_k, ks);
    std::copy(ks.begin(), ks.end(), start.begin() + rho * (b + 1));
  }
  // Room: per query, its buckets' keys in every round (its valid keys at most).
  std::size_t room = 0;
  for (Index i = 0; i < n_q; ++i) {
    Index keys = 0;
    for (Index rho = 0; rho < r; ++rho) {
      const Index* bucket = start.data() + rho * (b + 1) + qc(i, rho);
      keys += bucket[1] - bucket[0];
    }
    room += std::size_t(std::min(keys, valid_keys(i, n_k, opt.causal)));
  }
  return gather_target_sets(
      n_q, n_k,
      [&](Index i, auto&& add) {
        const Index valid = valid_keys(i, n_k, opt.causal);
        for (Index rho = 0; rho < r; ++rho) {
          const Index* bucket = start.data() + rho * (b + 1) + qc(i, rho);
          for (Index t = bucket[0]; t < bucket[1]; ++t)
            if (sorted[std::size_t(rho * n_k + t)] < valid) add(sorted[std::size_t(rho * n_k + t)]);
        }
      },
      true, opt.causal, room);
}

namespace detail {

// LSH attention of q (with keys k, or q itself when k is null) written into a checked `out`: the
// one body of both overloads and their `_into` forms.
template <typename Scalar, typename DO>
void lsh_attention_into_impl(const CrossPolytopeHash<Scalar>& hash,
                             const Eigen::Ref<const RowMatrix<Scalar>>& q,
                             const Eigen::Ref<const RowMatrix<Scalar>>* k,
                             const Eigen::Ref<const RowMatrix<Scalar>>& v,
                             const Eigen::MatrixBase<DO>& out, const LshOptions& opt) {
  static_assert(std::is_same<Scalar, typename DO::Scalar>::value,
                "the inputs and out must share the scalar type");
  if (k) {
    check_output("lsh_attention", out, q.rows(), v.cols(),
                 {named_input("q", q), named_input("k", *k), named_input("v", v)});
  } else {
    check_output("lsh_attention", out, q.rows(), v.cols(),
                 {named_input("qk", q), named_input("v", v)});
  }
  // Every row holds its largest term exp(0), so den >= 1.
  int e = 0;
  lsh_accumulate<Scalar>(q, k, v, hash, opt, &e).finalize_into(out);
  unscale_output(out, e);
}

}  // namespace detail

// Shared-QK LSH attention written into `out` (n x dv, sharing no memory with qk or v). A rejected
// `out` is not written.
template <typename DQ, typename DV, typename DO>
void lsh_attention_into(const CrossPolytopeHash<typename DQ::Scalar>& hash,
                        const Eigen::MatrixBase<DQ>& qk, const Eigen::MatrixBase<DV>& v,
                        const Eigen::MatrixBase<DO>& out, const LshOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DV::Scalar>::value,
                "qk and v must share the scalar type");
  detail::lsh_attention_into_impl<Scalar>(hash, qk, nullptr, v, out, opt);
}

// Shared-QK LSH attention (Reformer): qk n x d, v n x dv -> n x dv.
template <typename DQ, typename DV>
RowMatrix<typename DQ::Scalar> lsh_attention(const CrossPolytopeHash<typename DQ::Scalar>& hash,
                                             const Eigen::MatrixBase<DQ>& qk,
                                             const Eigen::MatrixBase<DV>& v,
                                             const LshOptions& opt = {}) {
  RowMatrix<typename DQ::Scalar> out(qk.rows(), v.cols());
  lsh_attention_into(hash, qk, v, out, opt);
  return out;
}

// Separate-key LSH attention written into `out` (n_q x dv, sharing no memory with q, k or v). A
// rejected `out` is not written.
template <typename DQ, typename DK, typename DV, typename DO>
void lsh_attention_into(const CrossPolytopeHash<typename DQ::Scalar>& hash,
                        const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                        const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
                        const LshOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value,
                "q, k and v must share the scalar type");
  const Eigen::Ref<const RowMatrix<Scalar>> keys(k);
  detail::lsh_attention_into_impl<Scalar>(hash, q, &keys, v, out, opt);
}

// Separate-key LSH attention (sort-and-chunk or exact buckets): q n_q x d, k n_k x d, v n_k x dv ->
// n_q x dv.
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> lsh_attention(const CrossPolytopeHash<typename DQ::Scalar>& hash,
                                             const Eigen::MatrixBase<DQ>& q,
                                             const Eigen::MatrixBase<DK>& k,
                                             const Eigen::MatrixBase<DV>& v,
                                             const LshOptions& opt = {}) {
  auto out = detail::fresh_matrix<RowMatrix<typename DQ::Scalar>>(q.rows(), v.cols());
  lsh_attention_into(hash, q, k, v, out, opt);
  return out;
}

// Exact shared-QK attention written into `out` (n x dv, sharing no memory with qk or v). A
// rejected `out` is not written.
template <typename DQ, typename DV, typename DO>
void shared_qk_attention_into(const Eigen::MatrixBase<DQ>& qk, const Eigen::MatrixBase<DV>& v,
                              const Eigen::MatrixBase<DO>& out, const LshOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  const Eigen::Ref<const RowMatrix<Scalar>> qr(qk), vr(v);
  detail::check_output("shared_qk_attention", out, qr.rows(), vr.cols(),
                       {detail::named_input("qk", qr), detail::named_input("v", vr)});
  // The hash of one bucket for this dimension, kept per thread for the next call.
  const Index dim = std::max<Index>(qr.cols(), 1);
  thread_local std::optional<CrossPolytopeHash<Scalar>> one_bucket;
  if (!one_bucket || one_bucket->dim() != dim)
    one_bucket.emplace(RowMatrix<Scalar>::Zero(dim, 1), 1);
  LshOptions single = opt;
  single.exact_buckets = true;  // every token hashes to bucket 0: one bucket holds the sequence
  single.dedupe = false;
  lsh_attention_into(*one_bucket, qr, vr, out, single);
}

// Exact shared-QK attention with the same keys, scale, self rule and causal mask: the limit of
// lsh_attention with a single chunk (c >= n), computed in tiles (O(n) memory, O(n^2) time).
// Only opt.scale, opt.causal and opt.check_finite are used.
template <typename DQ, typename DV>
RowMatrix<typename DQ::Scalar> shared_qk_attention(const Eigen::MatrixBase<DQ>& qk,
                                                   const Eigen::MatrixBase<DV>& v,
                                                   const LshOptions& opt = {}) {
  RowMatrix<typename DQ::Scalar> out(qk.rows(), v.cols());
  shared_qk_attention_into(qk, v, out, opt);
  return out;
}

namespace detail {

template <typename Scalar>
void lsh_batched(const CrossPolytopeHash<Scalar>& hash, const Scalar* q, const Scalar* k,
                 const Scalar* v, Scalar* out, const BatchShape& shape, const LshOptions& opt) {
  const char* where = "lsh_attention_batched";
  check_batch_qkv_output(where, shape, q, k, v, out, k ? "q" : "qk");
  require(k || shape.n_k == shape.n_q, where, "shared QK needs n_k == n_q, got ", shape.n_k,
          " and ", shape.n_q);
  // One slice's inputs; k == nullptr: shared QK.
  struct Slice {
    Eigen::Ref<const RowMatrix<Scalar>> q, k, v;
    bool shared;
    const Eigen::Ref<const RowMatrix<Scalar>>* keys() const { return shared ? nullptr : &k; }
  };
  const auto slice = [&](Index s) {
    return Slice{slice_of(q, s, shape.n_q, shape.d), slice_of(k ? k : q, s, shape.n_k, shape.d),
                 slice_of(v, s, shape.n_k, shape.dv), k == nullptr};
  };
  const Scalar scale = resolve_scale<Scalar>(where, opt, inverse_sqrt_dim(hash.dim()));
  for_each_slice(
      where, shape, q && v && out,
      [&](Index s) {
        const Slice in = slice(s);
        check_lsh_inputs<Scalar>(where, in.q, in.keys(), in.v, hash, opt);
      },
      [&](Index s) {
        const Slice in = slice(s);
        auto o = slice_of(out, s, shape.n_q, shape.dv);
        LshSlice<Scalar> lsh(in.q, in.keys(), in.v, hash, opt, scale);
        check_accumulator_finite(where, lsh.accumulator(), opt.check_finite);
        lsh.accumulator().finalize_into(o);
        unscale_output(o, lsh.value_exponent());
      });
}

}  // namespace detail

// Batched multi-head shared-QK LSH attention over contiguous row-major buffers:
// qk (batch, heads, n, d), v (batch, heads, n, dv) -> out (batch, heads, n, dv); shape.n_k =
// shape.n_q. Every slice uses the same rotations. Slices run in parallel, each on one thread.
template <typename Scalar>
void lsh_attention_batched(const CrossPolytopeHash<Scalar>& hash, const Scalar* qk, const Scalar* v,
                           Scalar* out, const BatchShape& shape, const LshOptions& opt = {}) {
  detail::lsh_batched<Scalar>(hash, qk, nullptr, v, out, shape, opt);
}

// Batched separate-key LSH attention (sort-and-chunk or exact buckets): q (batch, heads, n_q, d),
// k (batch, heads, n_k, d), v (batch, heads, n_k, dv) -> out (batch, heads, n_q, dv).
template <typename Scalar>
void lsh_attention_batched(const CrossPolytopeHash<Scalar>& hash, const Scalar* q, const Scalar* k,
                           const Scalar* v, Scalar* out, const BatchShape& shape,
                           const LshOptions& opt = {}) {
  detail::require(k != nullptr || shape.slices() == 0 || shape.n_q == 0, "lsh_attention_batched",
                  "null key pointer (use the overload without k for shared QK)");
  detail::lsh_batched<Scalar>(hash, q, k, v, out, shape, opt);
}

}  // namespace randattn
