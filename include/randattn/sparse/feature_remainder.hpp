#pragma once
// The low-rank remainder of sparse + low-rank attention (Scatterbrain, arXiv 2110.15343): with
// feature estimates φ(q)ᵀφ(k) ≈ exp(scale q·k), the keys outside the support S_i are estimated by
//   R_i = φ(q_i)ᵀ (Σ_{valid j} φ(k_j) [v_j | 1]) − Σ_{j ∈ S_i} φ(q_i)ᵀ φ(k_j) [v_j | 1],
// unbiased for Σ_{valid j ∉ S_i} exp(scale q_i·k_j) [v_j | 1] whenever the features are, and
// exactly zero where S_i holds every valid key (such rows skip the estimate). The first term is
// random-feature attention's accumulator (causal prefix sums under causal masking: keys j <= i
// only), the second a correction over the support, O(|S_i| M) per query; q and k are mapped
// once for both.
//
// Denominator rule. The true remainder denominator is a sum of positive weights, but its estimate
// can come out <= 0 (signed features, or cancellation in the difference when the support holds
// almost all of the estimated mass). Such a row drops its remainder (numerator and denominator:
// the output is the support's exact softmax) and is counted in `clamped_rows`. This is the one
// source of bias of the estimate.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../attention/random_feature_attention.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/chunk_products.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../lsh/lsh_attention.hpp"

namespace randattn {

namespace detail {

// Subtracts Σ_{j ∈ S_i} φ(q_i)ᵀ φ(k_j) [v_j | 1] from row i of (nd, log_scale), S_i the explicit
// target set, key by key: O(|S_i| M) per query.
template <typename Scalar>
void subtract_on_targets(const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
                         const Vector<Scalar>& signs, const Eigen::Ref<const RowMatrix<Scalar>>& v,
                         const TargetSets& sets, RowMatrix<Scalar>& nd, Vector<Scalar>& log_scale) {
  const Index n_q = qf.rows(), dv = v.cols();
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  parallel_for((n_q + 63) / 64, [&](Index t) {
    Scratch<Vector<Scalar>> fq(qf.dim());
    Scratch<RowMatrix<Scalar>> correction(1, dv + 1);
    for (Index i = t * 64; i < std::min(n_q, (t + 1) * 64); ++i) {
      if (sets.size(i) == 0) continue;
      fq = qf.values.row(i).transpose();
      if (signs.size() > 0) fq.array() *= signs.array();
      Scalar top = kNegInf;
      for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j)
        top = std::max(top, kf.log_scale(*j));
      correction.setZero();
      for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j) {
        const Scalar w = kf.values.row(*j).dot(fq) * std::exp(kf.log_scale(*j) - top);
        correction.leftCols(dv).noalias() += w * v.row(*j);
        correction(0, dv) += w;
      }
      correction = -correction;
      merge_scaled(nd.row(i), log_scale(i), correction, qf.log_scale(i) + top);
    }
  });
}

// The pair counts N_ij of sort-and-chunk LSH as its kernel counts them (target_blocks.hpp): from
// the chunk signatures, or the chunks' table beyond kCountTableRounds rounds (so the work stays
// linear in rounds).
inline RoundSignatures chunk_signatures(const LshChunks& l) {
  RoundSignatures sig{l.queries.chunk_of().data(), l.key_plan().chunk_of().data(), l.rounds,
                      l.chunks > 1, static_cast<std::int32_t>(1 - l.chunks)};
  sig.counts = l.has_counts() ? &l.counts : nullptr;
  return sig;
}

// A rows x cols matrix on the first entries of `buffer` (at least rows x cols of them), laid out
// as a RowMatrix of that shape, so that products over it round as over one: working storage
// sized once for the largest chunk serves every chunk.
template <typename Scalar>
Eigen::Map<RowMatrix<Scalar>, Eigen::AlignedMax> shaped(RowMatrix<Scalar>& buffer, Index rows,
                                                        Index cols) {
  return Eigen::Map<RowMatrix<Scalar>, Eigen::AlignedMax>(buffer.data(), rows, cols);
}

// The pair counts of one query row against the key columns `cols` of its chunk pair (at most
// `room`), from the signatures (the columns' gathered once per chunk pair) or the chunks'
// table. Storage from the thread's pools.
struct ChunkPairCounts {
  const LshChunks* l;
  RoundSignatures sig;
  Scratch<RoundCounter::SignatureMatrix> key_sig;  // rounds x room (none with the table)
  PooledVector<std::int32_t> count;
  TileIndex col_index;

  ChunkPairCounts(const LshChunks& chunks, Index room)
      : l(&chunks),
        sig(chunk_signatures(chunks)),
        key_sig(sig.counts ? 0 : chunks.rounds, room),
        count(0, std::size_t(room)) {}

  void set_columns(const std::vector<std::int32_t>& cols) {
    const Index nc = Index(cols.size());
    if (!sig.counts)
      for (Index t = 0; t < nc; ++t)
        for (Index r = 0; r < l->rounds; ++r) key_sig(r, t) = l->key_plan().chunk_of()(cols[t], r);
    col_index = TileIndex::gathered(cols.data(), nc);
    count.resize(std::size_t(nc));
  }
  // count[t] = N_{i, cols[t]}.
  void of_row(Index i) {
    std::fill(count.begin(), count.end(), 0);
    const RoundCounter counter{&sig, &key_sig};
    counter(i, col_index, count.data());
  }
};

// Σ_t inverse[count[t]] over the unmasked columns: each distinct key of the row once over the
// rounds. Two running sums halve the chain of dependent additions.
template <typename Masked>
double distinct_keys(const std::vector<std::int32_t>& count, const double* inverse,
                     Masked&& masked) {
  const auto term = [&](std::size_t t) { return masked(t) ? 0.0 : inverse[count[t]]; };
  double a = 0, b = 0;
  std::size_t t = 0;
  for (; t + 1 < count.size(); t += 2) {
    a += term(t);
    b += term(t + 1);
  }
  if (t < count.size()) a += term(t);
  return a + b;
}

// The rows of query chunk g in round rho as features (times the map's signs), into fq (nr rows).
template <typename Scalar>
void gather_query_features(const ScaledFeatures<Scalar>& qf, const Vector<Scalar>& signs,
                           const std::int32_t* rows, Index nr, Eigen::Ref<RowMatrix<Scalar>> fq) {
  for (Index u = 0; u < nr; ++u) fq.row(u) = qf.values.row(rows[u]);
  if (signs.size() > 0) fq.array().rowwise() *= signs.transpose().array();
}

// The same for LSH sort-and-chunk target sets, chunk by chunk: per round, query chunk g against
// key chunks g and g - 1, each pair weighted by 1/N_ij (N_ij rounds share it, so the pair counts
// once over the rounds). Rows merge round after round; within a round each row belongs to one
// chunk, so results do not depend on the thread count. `distinct` (if given, n_q entries)
// receives Σ 1/N_ij over the row's unmasked pairs: each distinct key of S_i once (before the
// fallback of a row left without keys), so |S_i| comes from the counts already taken.
//
// Without causal masking every key of a chunk counts for every query of the chunks that see it,
// so the correction factors: with G_h = Σ_{j ∈ chunk h} φ(k_j) [v_j | 1] (M x (dv + 1), once per
// key chunk and round), query i's sum over its two chunks is φ(q_i)ᵀ (G_g + G_{g-1}), and only the
// pairs seen in N_ij > 1 rounds give back (1 - 1/N_ij) of their weight, pair by pair (a few per
// cent of the pairs on Gaussian data). That is 2M(dv + 1) flops per key and per query and round
// against 4 c_k (M + dv + 1) per query pair by pair, and each key chunk's features are gathered
// once per round instead of twice. Causal masking drops about half of each chunk's pairs, query
// by query: there the pairs are weighed as one product per chunk pair.
template <typename Scalar>
void subtract_on_chunks(const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
                        const Vector<Scalar>& signs, const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const LshChunks& l, bool causal, RowMatrix<Scalar>& nd,
                        Vector<Scalar>& log_scale, double* distinct = nullptr) {
  const Index m = qf.dim(), dv = v.cols();
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  Scratch<Eigen::VectorXd> inverse(l.rounds + 1);  // 1/N_ij, N_ij <= rounds
  inverse(0) = 0.0;
  for (Index c = 1; c < inverse.size(); ++c) inverse(c) = 1.0 / double(c);
  // Key rows `cols` (at most `room`) as features scaled by exp(log_scale - top), top their
  // largest log-scale, and their [v | 1] rows.
  struct KeyRows {
    PooledVector<std::int32_t> cols;
    Scratch<RowMatrix<Scalar>> feature_rows, value_rows;  // room x M, room x (dv + 1)
    Scratch<RowMatrix<Scalar>> g;  // featuresᵀ values (the factored form), M x (dv + 1)
    Scalar top = kNegInf;
    KeyRows(Index room, Index m, Index dv, bool factored)
        : cols(0, std::size_t(room)),
          feature_rows(room, m),
          value_rows(room, dv + 1),
          g(factored ? m : 0, dv + 1) {}
    auto features() { return shaped(feature_rows, Index(cols.size()), feature_rows.cols()); }
    auto values() { return shaped(value_rows, Index(cols.size()), value_rows.cols()); }
    void load(const ScaledFeatures<Scalar>& kf, const Eigen::Ref<const RowMatrix<Scalar>>& v) {
      const Index nk = Index(cols.size()), dv = v.cols();
      top = kNegInf;
      for (std::int32_t j : cols) top = std::max(top, kf.log_scale(j));
      for (Index t = 0; t < nk; ++t) {
        feature_rows.row(t) = std::exp(kf.log_scale(cols[t]) - top) * kf.values.row(cols[t]);
        value_rows.row(t).head(dv) = v.row(cols[t]);
        value_rows(t, dv) = 1;
      }
    }
  };
  // Per thread and round, from the thread's pools, sized for the largest chunks: c queries, key
  // chunks of ck.
  struct Work {
    KeyRows prev, cur;
    ChunkPairCounts pairs;
    PooledVector<std::int32_t> cols;
    Scratch<RowMatrix<Scalar>> fq_rows, weight_rows, gsum, correction_rows;
    Work(const LshChunks& l, Index m, Index dv, bool causal)
        : prev(causal ? 0 : l.ck, m, dv, !causal),
          cur(causal ? 2 * l.ck : l.ck, m, dv, !causal),
          pairs(l, 2 * l.ck),
          cols(0, causal ? 0 : std::size_t(2 * l.ck)),
          fq_rows(l.c, m),
          weight_rows(causal ? l.c : 0, 2 * l.ck),
          gsum(causal ? 0 : m, dv + 1),
          correction_rows(l.c, dv + 1) {}
  };
  const auto make = [&] { return Work(l, m, dv, causal); };
  const auto merge_rows = [&](const std::int32_t* rows, Index nr, const auto& c, Scalar top) {
    for (Index u = 0; u < nr; ++u)
      merge_scaled(nd.row(rows[u]), log_scale(rows[u]), c.row(u), qf.log_scale(rows[u]) + top);
  };
  const auto add_distinct = [&](Index i, const std::vector<std::int32_t>& count, auto&& masked) {
    if (distinct) distinct[i] += distinct_keys(count, inverse.data(), masked);
  };

  if (causal) {
    for (Index rho = 0; rho < l.rounds; ++rho) {
      parallel_for_with(l.chunks, make, [&](Index g, Work& s) {
        const std::int32_t* rows = l.queries.chunk(rho, g);
        const Index nr = l.queries.chunk_size(g);
        KeyRows& keys = s.cur;
        keys.cols.assign(l.key_chunk(rho, g), l.key_chunk(rho, g) + l.key_count(g));
        if (l.chunks > 1) {
          const Index p = l.previous(g);
          keys.cols.insert(keys.cols.end(), l.key_chunk(rho, p),
                           l.key_chunk(rho, p) + l.key_count(p));
        }
        const Index nc = Index(keys.cols.size());
        if (nc == 0 || nr == 0) return;
        keys.load(kf, v);
        auto fq = shaped(s.fq_rows, nr, m);
        auto weights = shaped(s.weight_rows, nr, nc);
        auto correction = shaped(s.correction_rows, nr, dv + 1);
        gather_query_features<Scalar>(qf, signs, rows, nr, fq);
        weights.noalias() = fq * keys.features().transpose();
        s.pairs.set_columns(keys.cols);
        for (Index u = 0; u < nr; ++u) {
          const Index i = rows[u];
          s.pairs.of_row(i);
          const auto masked = [&](std::size_t t) { return Index(keys.cols[t]) > i; };
          for (Index t = 0; t < nc; ++t)  // negated: the product below is the correction
            weights(u, t) = masked(std::size_t(t))
                                ? Scalar(0)
                                : -weights(u, t) / Scalar(s.pairs.count[std::size_t(t)]);
          add_distinct(i, s.pairs.count, masked);
        }
        correction.noalias() = weights * keys.values();
        merge_rows(rows, nr, correction, keys.top);
      });
    }
    return;
  }

  // Factored: tasks of consecutive chunks, so that key chunk g's G serves query chunks g and g + 1.
  const Index per_task = std::max<Index>(1, kChunkTokensPerTask / std::max<Index>(1, l.c));
  const Index tasks = (l.chunks + per_task - 1) / per_task;
  const auto load_chunk = [&](Index rho, Index h, KeyRows& keys) {
    keys.cols.assign(l.key_chunk(rho, h), l.key_chunk(rho, h) + l.key_count(h));
    keys.load(kf, v);
    if (keys.cols.empty())
      keys.g.setZero();
    else
      row_panel_product(keys.g, keys.features().transpose(), keys.values(), false);
  };
  for (Index rho = 0; rho < l.rounds; ++rho) {
    parallel_for_with(tasks, make, [&](Index task, Work& s) {
      const Index g0 = task * per_task, g1 = std::min(l.chunks, g0 + per_task);
      const bool two = l.chunks > 1;
      if (two) load_chunk(rho, l.previous(g0), s.prev);
      for (Index g = g0; g < g1; std::swap(s.prev, s.cur), ++g) {
        load_chunk(rho, g, s.cur);
        const std::int32_t* rows = l.queries.chunk(rho, g);
        const Index nr = l.queries.chunk_size(g);
        const Scalar top = two ? std::max(s.cur.top, s.prev.top) : s.cur.top;
        if (nr == 0 || top == kNegInf) continue;  // no queries, or no keys in either chunk
        s.gsum.noalias() = std::exp(s.cur.top - top) * s.cur.g;
        if (two) s.gsum.noalias() += std::exp(s.prev.top - top) * s.prev.g;
        auto fq = shaped(s.fq_rows, nr, m);
        auto correction = shaped(s.correction_rows, nr, dv + 1);
        gather_query_features<Scalar>(qf, signs, rows, nr, fq);
        row_panel_product(correction, fq, s.gsum, false);
        // The columns as the causal form orders them: chunk g's keys, then chunk g - 1's.
        const Index ncur = Index(s.cur.cols.size());
        s.cols.assign(s.cur.cols.begin(), s.cur.cols.end());
        if (two) s.cols.insert(s.cols.end(), s.prev.cols.begin(), s.prev.cols.end());
        s.pairs.set_columns(s.cols);
        const auto cur_features = s.cur.features(), prev_features = s.prev.features();
        const auto cur_values = s.cur.values(), prev_values = s.prev.values();
        const Scalar cur_scale = std::exp(s.cur.top - top), prev_scale = std::exp(s.prev.top - top);
        for (Index u = 0; u < nr; ++u) {
          s.pairs.of_row(rows[u]);
          for (std::size_t t = 0; t < s.cols.size(); ++t) {
            const std::int32_t n = s.pairs.count[t];
            if (n <= 1) continue;
            const bool in_cur = Index(t) < ncur;
            const auto& features = in_cur ? cur_features : prev_features;
            const auto& values = in_cur ? cur_values : prev_values;
            const Index row = in_cur ? Index(t) : Index(t) - ncur;
            const Scalar w = fq.row(u).dot(features.row(row)) *
                             (in_cur ? cur_scale : prev_scale) * (Scalar(1) - Scalar(1) / Scalar(n));
            correction.row(u) -= w * values.row(row);
          }
          add_distinct(rows[u], s.pairs.count, [](std::size_t) { return false; });
        }
        correction = -correction;
        merge_rows(rows, nr, correction, top);
      }
    });
  }
}

// Feature rows whose storage is taken from the thread's pool and given back with them.
template <typename Scalar>
struct PooledFeatures : ScaledFeatures<Scalar> {
  PooledFeatures(Index rows, Index dim)
      : ScaledFeatures<Scalar>{MatrixPool<RowMatrix<Scalar>>::take(rows, dim),
                               MatrixPool<Vector<Scalar>>::take(rows)} {}
  PooledFeatures(const PooledFeatures&) = delete;
  PooledFeatures& operator=(const PooledFeatures&) = delete;
  ~PooledFeatures() {
    MatrixPool<RowMatrix<Scalar>>::give(std::move(this->values));
    MatrixPool<Vector<Scalar>>::give(std::move(this->log_scale));
  }
};

// The remainder from the mapped features: the linear core over all valid keys, minus the
// correction `subtract` on the support, then the denominator rule; size(i) = |S_i|.
template <typename Map, typename Size, typename Subtract>
SoftmaxAccumulator<typename Map::Scalar> feature_remainder(
    const char* where, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v, const RandomFeatureOptions& opt,
    Index* clamped_rows, Size&& size, Subtract&& subtract) {
  using Scalar = typename Map::Scalar;
  const auto settings = feature_attention_settings(where, map, opt);
  check_feature_slice(where, map, q, k, v, settings, opt.check_finite);
  if (q.rows() == 0) return SoftmaxAccumulator<Scalar>(0, v.cols());
  // q and k mapped once: the same features serve the linear core and the correction.
  PooledFeatures<Scalar> qf(q.rows(), map.feature_dim()), kf(k.rows(), map.feature_dim());
  map_features(map, q, k, settings, qf, kf);
  const auto& signs = map.signs();  // a reference where the map holds them: no copy
  const GivenFeatureRows<Scalar> qrows(qf.values, qf.log_scale), krows(kf.values, kf.log_scale);
  const LinearOperands<GivenFeatureRows<Scalar>, GivenFeatureRows<Scalar>> in{
      qrows, krows, v, signs, linear_chunk(settings.linear)};
  auto [nd, log_scale] =
      linear_accumulate(where, in, settings.linear.causal, settings.linear.check_finite)
          .release();
  subtract(qf, kf, signs, nd, log_scale);
  const Index n_q = q.rows(), n_k = k.rows(), dv = v.cols();
  Index clamped = 0;
  for (Index i = 0; i < n_q; ++i) {
    const bool full = size(i) == valid_keys(i, n_k, opt.causal);  // nothing outside
    if (full || !(nd(i, dv) > Scalar(0))) {  // the denominator rule (NaN included)
      nd.row(i).setZero();
      log_scale(i) = -std::numeric_limits<Scalar>::infinity();
      clamped += !full;
    }
  }
  if (clamped_rows) *clamped_rows += clamped;
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

}  // namespace detail

// The remainder estimate as an accumulator: q n_q x d, k n_k x d, v n_k x dv; opt.causal and
// opt.scale as for random_feature_attention. *clamped_rows (if given) counts the rows dropped by
// the denominator rule. `chunks` (optional): the LSH sort-and-chunk layout whose target sets
// `sets` are, so that the correction runs as matrix products per chunk.
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> feature_remainder_accumulate(
    const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v, const TargetSets& sets,
    const RandomFeatureOptions& opt, Index* clamped_rows = nullptr,
    const LshChunks* chunks = nullptr) {
  using Scalar = typename Map::Scalar;
  const char* where = "feature_remainder";
  detail::require(sets.rows() == q.rows(), where, "target sets of ", sets.rows(),
                  " queries for ", q.rows(), " queries");
  return detail::feature_remainder(
      where, map, q, k, v, opt, clamped_rows, [&](Index i) { return sets.size(i); },
      [&](const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
          const Vector<Scalar>& signs, RowMatrix<Scalar>& nd, Vector<Scalar>& log_scale) {
        if (chunks)
          detail::subtract_on_chunks(qf, kf, signs, v, *chunks, opt.causal, nd, log_scale);
        else
          detail::subtract_on_targets(qf, kf, signs, v, sets, nd, log_scale);
      });
}

// The same on the target sets of sort-and-chunk LSH with the chunks `chunks`, which are never
// built: the correction counts each row's keys as it weighs them, and `sizes` (if given)
// receives |S_i|, lsh_target_sizes(chunks, opt.causal) without its pass over the keys.
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> feature_remainder_accumulate(
    const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v, const LshChunks& chunks,
    const RandomFeatureOptions& opt, Index* clamped_rows = nullptr,
    std::vector<Index>* sizes = nullptr) {
  using Scalar = typename Map::Scalar;
  const char* where = "feature_remainder";
  detail::require(chunks.n_q == q.rows() && chunks.n_k == k.rows(), where,
                  "the chunks were not cut from these q and k");
  // The sizes are counted into `sizes` when given (a caller's storage, e.g. from the pool).
  detail::PooledVector<Index> own(sizes ? 0 : std::size_t(q.rows()));
  std::vector<Index>& counted = sizes ? *sizes : own;
  counted.assign(std::size_t(q.rows()), 0);
  return detail::feature_remainder(
      where, map, q, k, v, opt, clamped_rows, [&](Index i) { return counted[std::size_t(i)]; },
      [&](const ScaledFeatures<Scalar>& qf, const ScaledFeatures<Scalar>& kf,
          const Vector<Scalar>& signs, RowMatrix<Scalar>& nd, Vector<Scalar>& log_scale) {
        detail::Scratch<Eigen::VectorXd> distinct(q.rows());
        distinct.setZero();
        detail::subtract_on_chunks(qf, kf, signs, v, chunks, opt.causal, nd, log_scale,
                                   distinct.data());
        for (Index i = 0; i < q.rows(); ++i) {  // Σ 1/N_ij sums to an integer; the fallback
          const Index keys = Index(std::llround(distinct(i)));
          counted[std::size_t(i)] = keys > 0 ? keys : valid_keys(i, k.rows(), opt.causal);
        }
      });
}

}  // namespace randattn
