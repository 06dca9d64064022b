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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../core/options.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../core/value_headroom.hpp"
#include "../detail/batch.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "cross_polytope.hpp"
#include "target_blocks.hpp"

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
RowMatrix<Scalar> unit_rows(const Eigen::Ref<const RowMatrix<Scalar>>& x) {
  RowMatrix<Scalar> u(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    // Dividing by the largest entry first keeps the norm finite for any finite row.
    const Scalar m = x.row(i).cwiseAbs().maxCoeff();
    if (m == Scalar(0)) {
      u.row(i).setZero();
    } else {
      u.row(i) = x.row(i) / m;
      u.row(i) /= u.row(i).norm();
    }
  }
  return u;
}

template <typename Scalar>
Scalar check_lsh_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                        const Eigen::Ref<const RowMatrix<Scalar>>* k,
                        const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const CrossPolytopeHash<Scalar>& hash, const LshOptions& opt) {
  const Index n_k = k ? k->rows() : q.rows();
  require(opt.chunk >= 1, where, "chunk must be >= 1, got ", opt.chunk);
  const Scalar scale = resolve_scale<Scalar>(where, opt, inverse_sqrt_dim(hash.dim()));
  require(q.rows() == 0 || q.cols() == hash.dim(), where, "q is ", shape_of(q),
          " but the hash was built for dimension ", hash.dim());
  require(v.rows() == n_k, where, "v (", shape_of(v), ") must have one row per key (", n_k, ")");
  require(q.rows() <= Index(std::numeric_limits<std::int32_t>::max()) &&
              n_k <= Index(std::numeric_limits<std::int32_t>::max()),
          where, "at most 2^31 - 1 tokens per sequence");
  if (k) {
    require(k->cols() == q.cols() || k->rows() == 0, where, "q (", shape_of(q), ") and k (",
            shape_of(*k), ") must have the same number of columns d");
    require(!opt.causal || q.rows() == k->rows(), where, "causal attention needs as many queries (",
            q.rows(), ") as keys (", k->rows(), ")");
    require(q.rows() == 0 || k->rows() > 0, where, "attention over zero keys is undefined (q ",
            shape_of(q), ", k ", shape_of(*k), ")");
    require_finite(*k, where, "k", opt.check_finite);
  }
  require_finite(q, where, "q", opt.check_finite);
  require_finite(v, where, "v", opt.check_finite);
  return scale;
}

// Sort-and-chunk: per round the stable sort of the n tokens by bucket (perm, round rho at
// perm[rho n, (rho + 1) n)) and each token's chunk index in that order (chunk_of, n x rounds).
inline void sort_into_chunks(const HashCodes& codes, Index buckets, Index chunk,
                             std::vector<std::int32_t>& perm, HashCodes& chunk_of) {
  const Index n = codes.rows(), r = codes.cols();
  perm.resize(static_cast<std::size_t>(n * r));
  chunk_of.resize(n, r);
  std::vector<Index> start;
  for (Index rho = 0; rho < r; ++rho) {
    std::int32_t* pr = perm.data() + rho * n;
    sort_by_bucket(codes.data() + rho, r, n, buckets, pr, start);
    for (Index s = 0; s < n; ++s) chunk_of(pr[s], rho) = static_cast<std::int32_t>(s / chunk);
  }
}

// Separate-key sort-and-chunk: the key chunk length c_k = ceil(c n_k / n_q) for query chunk
// length c <= n_q, so that ceil(n_q / c) chunks of c_k sorted keys hold every key (the trailing
// ones may be short or empty when n_k < n_q). n_q == n_k gives c_k = c.
inline Index key_chunk_length(Index n_q, Index n_k, Index c) {
  // c <= n_q < 2^31 and n_k < 2^31: the product fits.
  return std::max<Index>(1, (c * n_k + n_q - 1) / n_q);
}

// Self rule of shared QK: each row i of `rows` (no other valid target) attends to itself alone,
// with logit queries(i) . keys(i).
template <typename Scalar>
void attend_to_self(SoftmaxAccumulator<Scalar>& acc, const std::vector<std::int32_t>& rows,
                    const RowMatrix<Scalar>& queries, const RowMatrix<Scalar>& keys,
                    const RowMatrix<Scalar>& values) {
  RowMatrix<Scalar> self(1, values.cols() + 1);
  self(0, values.cols()) = 1;
  for (std::int32_t i : rows) {
    self.leftCols(values.cols()) = values.row(i);
    acc.merge_rows(i, self, Vector<Scalar>::Constant(1, queries.row(i).dot(keys.row(i))));
  }
}

// One (batch, head) slice. k == nullptr: shared QK.
template <typename Scalar>
class LshSlice {
 public:
  LshSlice(const Eigen::Ref<const RowMatrix<Scalar>>& q,
           const Eigen::Ref<const RowMatrix<Scalar>>* k,
           const Eigen::Ref<const RowMatrix<Scalar>>& v, const CrossPolytopeHash<Scalar>& hash,
           const LshOptions& opt, Scalar scale)
      : hash_(hash), opt_(opt), shared_(k == nullptr), acc_(q.rows(), v.cols()) {
    if (q.rows() == 0) return;
    queries_ = scale * q;
    keys_ = shared_ ? unit_rows<Scalar>(q) : RowMatrix<Scalar>(*k);
    values_ = v;
    // Up to rounds terms per key in a numerator (the multiset counts each round).
    value_exponent_ = value_headroom(values_, double(v.rows()) * double(hash.rounds()));
    scale_by_power_of_two(values_, -value_exponent_);
    query_codes_ = hash.hash(q, false);
    if (!shared_) key_codes_ = hash.hash(*k, false);
    problem_.queries = &queries_;
    problem_.keys = &keys_;
    problem_.values = &values_;
    problem_.exclude_self = shared_;
    problem_.causal = opt.causal;
    if (opt.exact_buckets)
      bucket_rounds();
    else
      chunk_rounds();
    rows_without_targets();
  }

  SoftmaxAccumulator<Scalar>& accumulator() { return acc_; }
  // The accumulator holds the attention of 2^-e v (value_headroom.hpp): outputs scale by 2^e.
  int value_exponent() const { return value_exponent_; }

 private:
  const HashCodes& key_codes() const { return shared_ ? query_codes_ : key_codes_; }

  // Sort-and-chunk. Signature of a token in a round: its chunk index. Shared QK: one sort, key
  // chunks are the query chunks. Separate keys: queries and keys sorted separately, key chunk g
  // holds sorted keys [g c_k, (g + 1) c_k) (see the top of this file).
  void chunk_rounds() {
    const Index n_q = queries_.rows(), n_k = keys_.rows(), r = hash_.rounds();
    const Index c = std::min(opt_.chunk, n_q);  // c >= n_q: one chunk, as with c = n_q
    const Index chunks = (n_q + c - 1) / c;
    const Index ck = shared_ ? c : key_chunk_length(n_q, n_k, c);
    std::vector<std::int32_t> qperm, kperm_storage;
    HashCodes qchunk, kchunk_storage;
    sort_into_chunks(query_codes_, hash_.buckets(), c, qperm, qchunk);
    if (!shared_) sort_into_chunks(key_codes_, hash_.buckets(), ck, kperm_storage, kchunk_storage);
    const std::vector<std::int32_t>& kperm = shared_ ? qperm : kperm_storage;
    const HashCodes& kchunk = shared_ ? qchunk : kchunk_storage;
    RoundSignatures sig{qchunk.data(), kchunk.data(), r, chunks > 1,
                        static_cast<std::int32_t>(1 - chunks)};
    problem_.dedupe = opt_.dedupe ? &sig : nullptr;

    // Sorted keys of key chunk g: [g ck, g ck + key_count(g)); empty beyond the last key.
    const auto key_count = [&](Index g) { return std::clamp<Index>(n_k - g * ck, 0, ck); };
    TargetCounts counts;
    if (opt_.dedupe && r > kCountTableRounds) {
      counts = count_targets(n_q, [&](Index i, std::vector<std::int32_t>& list) {
        for (Index rho = 0; rho < r; ++rho) {
          const std::int32_t* kr = kperm.data() + rho * n_k;
          const Index g = qchunk(i, rho);
          for (Index h : {g, chunks > 1 ? (g + chunks - 1) % chunks : g}) {
            list.insert(list.end(), kr + h * ck, kr + h * ck + key_count(h));
            if (chunks == 1) break;
          }
        }
      });
      sig.counts = &counts;
    }
    const Index per_task = std::max<Index>(1, kChunkTokensPerTask / c);
    const Index tasks = (chunks + per_task - 1) / per_task;
    for (Index rho = 0; rho < r; ++rho) {
      const std::int32_t* qr = qperm.data() + rho * n_q;
      const std::int32_t* kr = kperm.data() + rho * n_k;
      // Chunks write disjoint rows; each round completes before the next merges.
      parallel_for(tasks, [&](Index task) {
        TargetBlockKernel<Scalar> kernel(problem_);
        std::vector<std::int32_t> cols(static_cast<std::size_t>(2 * std::min(ck, n_k)));
        for (Index g = task * per_task; g < std::min(chunks, (task + 1) * per_task); ++g) {
          const Index r0 = g * c, nr = std::min(c, n_q - r0);
          const Index k0 = g * ck, nk = key_count(g);
          if (chunks == 1) {
            kernel.attend(qr + r0, nr, kr + k0, nk, acc_);
            continue;
          }
          const Index prev = (g + chunks - 1) % chunks;
          const Index p0 = prev * ck, np = key_count(prev);
          if (nk + np == 0) continue;
          std::copy(kr + k0, kr + k0 + nk, cols.begin());
          std::copy(kr + p0, kr + p0 + np, cols.begin() + nk);
          kernel.attend(qr + r0, nr, cols.data(), nk + np, acc_);
        }
      });
    }
    problem_.dedupe = nullptr;
  }

  // Exact buckets. Signature of a token in a round: its bucket.
  void bucket_rounds() {
    const Index n_q = queries_.rows(), n_k = keys_.rows(), r = hash_.rounds(), b = hash_.buckets();
    RoundSignatures sig{query_codes_.data(), key_codes().data(), r, false, 0};
    problem_.dedupe = opt_.dedupe ? &sig : nullptr;
    TargetCounts counts;
    if (opt_.dedupe && r > kCountTableRounds) {
      // Per round the keys sorted by bucket; query i's targets are the run of its own bucket.
      const HashCodes& kc = key_codes();
      std::vector<std::int32_t> sorted(static_cast<std::size_t>(r * n_k));
      std::vector<Index> start;
      for (Index rho = 0; rho < r; ++rho)
        sort_by_bucket(kc.data() + rho, r, n_k, b, sorted.data() + rho * n_k, start);
      counts = count_targets(n_q, [&](Index i, std::vector<std::int32_t>& list) {
        for (Index rho = 0; rho < r; ++rho) {
          const std::int32_t* kr = sorted.data() + rho * n_k;
          const std::int32_t code = query_codes_(i, rho);
          const std::int32_t* first = std::partition_point(
              kr, kr + n_k, [&](std::int32_t j) { return kc(j, rho) < code; });
          const std::int32_t* last = std::partition_point(
              first, kr + n_k, [&](std::int32_t j) { return kc(j, rho) == code; });
          list.insert(list.end(), first, last);
        }
      });
      sig.counts = &counts;
    }
    std::vector<std::int32_t> qperm(static_cast<std::size_t>(n_q)),
        kperm(static_cast<std::size_t>(n_k));
    std::vector<Index> qstart, kstart;
    struct Task {
      Index q0, nq, k0, nk;
    };
    std::vector<Task> tasks;
    for (Index rho = 0; rho < r; ++rho) {
      sort_by_bucket(query_codes_.data() + rho, r, n_q, b, qperm.data(), qstart);
      if (shared_) {
        kperm = qperm;
        kstart = qstart;
      } else {
        sort_by_bucket(key_codes_.data() + rho, r, n_k, b, kperm.data(), kstart);
      }
      // A bucket's queries are cut into row tiles; each task writes its own rows.
      tasks.clear();
      for (Index c = 0; c < b; ++c) {
        const Index nk = kstart[c + 1] - kstart[c];
        if (nk == 0) continue;
        for (Index q0 = qstart[c]; q0 < qstart[c + 1]; q0 += kTargetRowTile)
          tasks.push_back({q0, std::min(kTargetRowTile, qstart[c + 1] - q0), kstart[c], nk});
      }
      const Index per_task = std::max<Index>(1, kChunkTokensPerTask / kTargetRowTile);
      parallel_for((Index(tasks.size()) + per_task - 1) / per_task, [&](Index group) {
        TargetBlockKernel<Scalar> kernel(problem_);
        const Index end = std::min(Index(tasks.size()), (group + 1) * per_task);
        for (Index t = group * per_task; t < end; ++t)
          kernel.attend(qperm.data() + tasks[t].q0, tasks[t].nq, kperm.data() + tasks[t].k0,
                        tasks[t].nk, acc_);
      });
    }
    problem_.dedupe = nullptr;
  }

  // Rows whose target set is empty after all rounds: shared QK attends to itself (self rule),
  // separate keys fall back to all valid keys.
  void rows_without_targets() {
    std::vector<std::int32_t> empty;
    for (Index i = 0; i < acc_.rows(); ++i)
      if (acc_.log_scale()(i) == -std::numeric_limits<Scalar>::infinity())
        empty.push_back(static_cast<std::int32_t>(i));
    if (empty.empty()) return;
    if (shared_) {
      attend_to_self(acc_, empty, queries_, keys_, values_);
      return;
    }
    std::vector<std::int32_t> all(static_cast<std::size_t>(keys_.rows()));
    std::iota(all.begin(), all.end(), 0);
    const Index tiles = (Index(empty.size()) + kTargetRowTile - 1) / kTargetRowTile;
    parallel_for(tiles, [&](Index t) {
      TargetBlockKernel<Scalar> kernel(problem_);
      const Index r0 = t * kTargetRowTile;
      kernel.attend(empty.data() + r0, std::min(kTargetRowTile, Index(empty.size()) - r0),
                    all.data(), Index(all.size()), acc_);
    });
  }

  const CrossPolytopeHash<Scalar>& hash_;
  const LshOptions& opt_;
  bool shared_;
  SoftmaxAccumulator<Scalar> acc_;
  int value_exponent_ = 0;
  RowMatrix<Scalar> queries_, keys_, values_;
  HashCodes query_codes_, key_codes_;
  TargetProblem<Scalar> problem_;
};

template <typename Scalar>
SoftmaxAccumulator<Scalar> lsh_accumulate(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                          const Eigen::Ref<const RowMatrix<Scalar>>* k,
                                          const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                          const CrossPolytopeHash<Scalar>& hash,
                                          const LshOptions& opt, int* value_exponent = nullptr) {
  const Scalar scale = check_lsh_inputs<Scalar>("lsh_attention", q, k, v, hash, opt);
  LshSlice<Scalar> slice(q, k, v, hash, opt, scale);
  // value_exponent given: the caller finalizes and scales the output back itself.
  SoftmaxAccumulator<Scalar> acc =
      value_exponent ? std::move(slice.accumulator())
                     : unscaled_accumulator(std::move(slice.accumulator()), slice.value_exponent());
  if (value_exponent) *value_exponent = slice.value_exponent();
  // Inputs were checked above, so a non-finite result (or a row whose logits all overflowed
  // to -inf) means overflow: report it rather than return NaN or an empty row.
  check_result_finite("lsh_attention", acc.numden(), opt.check_finite, [] {});
  check_result_finite("lsh_attention", acc.log_scale(), opt.check_finite, [] {});
  return acc;
}

}  // namespace detail

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

// Shared-QK LSH attention (Reformer): qk n x d, v n x dv -> n x dv.
template <typename DQ, typename DV>
RowMatrix<typename DQ::Scalar> lsh_attention(const CrossPolytopeHash<typename DQ::Scalar>& hash,
                                             const Eigen::MatrixBase<DQ>& qk,
                                             const Eigen::MatrixBase<DV>& v,
                                             const LshOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DV::Scalar>::value,
                "qk and v must share the scalar type");
  // Every row holds its largest term exp(0), so den >= 1.
  int e = 0;
  RowMatrix<Scalar> out = detail::lsh_accumulate<Scalar>(qk, nullptr, v, hash, opt, &e).finalize();
  detail::scale_by_power_of_two(out, e);
  return out;
}

// Separate-key LSH attention (sort-and-chunk or exact buckets): q n_q x d, k n_k x d, v n_k x dv ->
// n_q x dv.
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> lsh_attention(const CrossPolytopeHash<typename DQ::Scalar>& hash,
                                             const Eigen::MatrixBase<DQ>& q,
                                             const Eigen::MatrixBase<DK>& k,
                                             const Eigen::MatrixBase<DV>& v,
                                             const LshOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value,
                "q, k and v must share the scalar type");
  const Eigen::Ref<const RowMatrix<Scalar>> keys(k);
  int e = 0;
  RowMatrix<Scalar> out = detail::lsh_accumulate<Scalar>(q, &keys, v, hash, opt, &e).finalize();
  detail::scale_by_power_of_two(out, e);
  return out;
}

// Exact shared-QK attention with the same keys, scale, self rule and causal mask: the limit of
// lsh_attention with a single chunk (c >= n), computed in tiles (O(n) memory, O(n^2) time).
// Only opt.scale, opt.causal and opt.check_finite are used.
template <typename DQ, typename DV>
RowMatrix<typename DQ::Scalar> shared_qk_attention(const Eigen::MatrixBase<DQ>& qk,
                                                   const Eigen::MatrixBase<DV>& v,
                                                   const LshOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  const RowMatrix<Scalar> q = qk;
  const CrossPolytopeHash<Scalar> one_bucket(
      RowMatrix<Scalar>::Zero(std::max<Index>(q.cols(), 1), 1), 1);
  LshOptions single = opt;
  single.exact_buckets = true;  // every token hashes to bucket 0: one bucket holds the sequence
  single.dedupe = false;
  return lsh_attention(one_bucket, q, v, single);
}

namespace detail {

template <typename Scalar>
void lsh_batched(const CrossPolytopeHash<Scalar>& hash, const Scalar* q, const Scalar* k,
                 const Scalar* v, Scalar* out, const BatchShape& shape, const LshOptions& opt) {
  const char* where = "lsh_attention_batched";
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
        lsh.accumulator().finalize_into(o);
        scale_by_power_of_two(o, lsh.value_exponent());
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
