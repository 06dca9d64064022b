#pragma once
// Locality-sensitive-filter (LSF) attention: softmax attention restricted, for each query, to the
// keys stored in the filters it opens (filters.hpp). Asymmetric by design: keys are stored in one
// filter per table, queries probe several, so queries and keys need not be shared (unlike
// Reformer's shared-QK LSH); a drop-in for models whose queries and keys live on the unit sphere
// (nGPT-style), where the filter scores are the cosines the softmax cares about.
//
// Target set of query i (q̂, k̂ the normalised rows; only the filters see them):
//  - update side: key j sits in filter argmax_f <a_{t,f}, k̂_j> of table t (zero key: filter 0);
//  - query side: in each table, query i opens every filter with <a_{t,f}, q̂_i> >= η, and at least
//    its min_probes best filters (default 1) whatever η (η = −inf opens every filter);
//  - fallback: if no opened filter holds a valid key (causal: j <= i), filters of all tables are
//    opened in descending score order (ties: lower table, then lower filter) until one does, so no
//    query is ever empty;
//  - P_i = union over tables of the keys in its opened filters. A key found in N_ij tables counts
//    once: its logit is lowered by log N_ij in each of the N_ij tiles that score it (the score
//    tile's dedupe count), so the softmax is over the set, exactly as in LSH attention.
// o_i = softmax_{j ∈ P_i}(scale · q_i·k_j) v_j with the raw q and k, scale 1/sqrt(d) by default.
//
// Execution, never n_q x n_k: keys are counting-sorted by filter per table (CSR, increasing
// position inside a filter); the opened filters of every query are listed (CSR by query and by
// filter). Table by table, the table's keys and values are permuted into filter order, and for
// every filter the dense tile (its queries) x (its keys) goes through the shared score tile
// (core/detail/score_tile.hpp) with gathered global row/column positions (causal masking, dedupe).
// Tasks own fixed blocks of queries, so each output row is merged by one thread, in the order
// table, filter, key tile: results do not depend on the thread count.
// Memory O(n (d + dv) + n L + probes) per slice, probes = Σ_i (filters opened by i), plus the
// opened-filter bits of a task's queries (at most 4 MB per thread).
//
// Self-exclusion (exclude_self, n_q == n_k, queries and keys at the same positions): key i is not
// a valid key of query i, so it is never scored for it (the score tile's self mask) and the fallback
// looks for another key; a query with no other valid key (position 0 under causal, or n = 1)
// attends to its own key alone (core/detail/self_rule.hpp), as exact and LSH attention do.
//
// Causal: the filters opened by query i depend on q_i and on keys 0..i only (the fallback looks at
// valid keys), and each query is scored against the past keys of its filters as a tile of its
// own, so output i depends on tokens 0..i only, bit for bit (a shared tile would let a later
// token change the tile's shape, and Eigen's products round differently for different shapes).
// The price: causal tiles are single rows (matrix-vector products), slower than the bidirectional
// (query tile) x (key tile) products.
//
// The backward (lsf_gradient.hpp) walks the same filters, masks and duplicate counts
// (LsfSlice::backward).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../core/detail/output_check.hpp"
#include "../core/detail/score_tile.hpp"
#include "../core/detail/self_rule.hpp"
#include "../core/input_checks.hpp"
#include "../core/options.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../core/value_headroom.hpp"
#include "../detail/batch.hpp"
#include "../detail/bits.hpp"
#include "../detail/column_argmax.hpp"
#include "../detail/fresh_matrix.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/pooled_vector.hpp"
#include "../detail/threshold_mask.hpp"
#include "../detail/transpose.hpp"
#include "../detail/validation.hpp"
#include "../hashing/detail/bucket_sort.hpp"
#include "../hashing/detail/tiles.hpp"
#include "../hashing/hash_codes.hpp"
#include "../hashing/unit_rows.hpp"
#include "../lsh/detail/tile_gradient.hpp"
#include "filters.hpp"

namespace randattn {

// causal, scale (default 1/sqrt(d)) and check_finite: see core/options.hpp. Give exactly one of
// eta and alpha.
struct LsfOptions : AttentionOptions {
  std::optional<double> eta;    // threshold on normalised scores; −inf opens every filter
  std::optional<double> alpha;  // target cosine in (0, 1): eta = filter_threshold(alpha, m)
  Index min_probes = 1;         // best filters opened per table whatever eta, in [1, m]
  // Queries and keys at the same positions (n_q == n_k): key i is not a target of query i unless
  // it has no other valid key.
  bool exclude_self = false;
};

// What the filters selected, for reports and benchmarks.
struct LsfProbeStats {
  double eta = 0;              // the threshold used
  Index opened = 0;            // Σ_i filters opened by query i (all tables)
  Index fallback_queries = 0;  // queries that needed the fallback
  Index target_pairs = 0;      // Σ_i |P_i|: distinct valid (query, key) pairs scored; / (n_q n_k)
                               // is the fraction of pairs scored
  Index logits = 0;            // logits computed: a key found in N tables is scored N times
};

namespace detail {

// Queries per attention task: 4096, fewer when their opened-filter bits (L m each) would pass 4 MB.
// A function of L m alone, so results never depend on the thread count.
inline Index query_block(Index filters_in_all_tables) {
  const Index fit = (Index(1) << 25) / std::max<Index>(filters_in_all_tables, 1);
  return std::clamp<Index>(fit / 64 * 64, 256, 4096);
}

// Keys bucketed by filter, one CSR per table. Storage from the thread's pools (reused by the next
// call with the same shapes).
struct FilterBuckets {
  Scratch<HashCodes> codes;             // n_k x L
  PooledVector<std::int32_t> perm;  // L x n_k: table t's keys filter by filter, increasing position
  PooledVector<Index> start;  // L x (m + 1): filter f of table t is perm[t n_k + start[f]], ...
};

// The filters opened by every query: by query (ids g = t m + f, increasing) and by filter (queries
// in increasing position). Storage from the thread's pools.
struct FilterProbes {
  PooledVector<Index> query_start;  // n_q + 1
  PooledVector<std::int32_t> query_filters;
  PooledVector<Index> filter_start;  // L m + 1
  PooledVector<std::int32_t> filter_queries;
  Index fallback_queries = 0;
};

inline double resolve_threshold(const char* where, const LsfOptions& opt, Index filters) {
  require(opt.eta.has_value() != opt.alpha.has_value(), where,
          "give exactly one of eta and alpha (eta ", opt.eta ? "set" : "unset", ", alpha ",
          opt.alpha ? "set" : "unset", ")");
  require(opt.min_probes >= 1 && opt.min_probes <= filters, where,
          "min_probes must be in [1, m = ", filters, "], got ", opt.min_probes);
  if (opt.alpha) {
    require(std::isfinite(*opt.alpha) && *opt.alpha > 0 && *opt.alpha < 1, where,
            "alpha must be in (0, 1), got ", *opt.alpha);
    return filter_threshold(*opt.alpha, filters);
  }
  require(!std::isnan(*opt.eta) && *opt.eta != std::numeric_limits<double>::infinity(), where,
          "eta must be finite or -inf, got ", *opt.eta);
  return *opt.eta;
}

template <typename Scalar>
Scalar check_lsf_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                        const Eigen::Ref<const RowMatrix<Scalar>>& k,
                        const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const LocalitySensitiveFilters<Scalar>& filters, const LsfOptions& opt) {
  resolve_threshold(where, opt, filters.filters());
  const Scalar scale = resolve_scale<Scalar>(where, opt, inverse_sqrt_dim(filters.dim()));
  require(q.rows() == 0 || q.cols() == filters.dim(), where, "q is ", shape_of(q),
          " but the filters were built for dimension ", filters.dim());
  require(k.rows() == 0 || k.cols() == filters.dim(), where, "k is ", shape_of(k),
          " but the filters were built for dimension ", filters.dim());
  check_attention_shapes<Scalar>(where, q, k, v);
  check_attention_counts(where, q.rows(), k.rows(), opt.causal);
  require(!opt.exclude_self || q.rows() == k.rows(), where, "exclude_self needs as many queries (",
          q.rows(), ") as keys (", k.rows(), ")");
  if (opt.check_finite) check_attention_finite<Scalar>(where, q, k, v);
  return scale;
}

template <typename Scalar>
FilterBuckets bucket_keys(const LocalitySensitiveFilters<Scalar>& filters,
                          const RowMatrix<Scalar>& unit_k) {
  const Index n = unit_k.rows(), m = filters.filters(), L = filters.tables();
  FilterBuckets b{Scratch<HashCodes>(n, L), PooledVector<std::int32_t>(std::size_t(L * n)),
                  PooledVector<Index>(std::size_t(L * (m + 1)))};
  filters.assign_unit_into(unit_k, b.codes);
  PooledVector<Index> start(std::size_t(m) + 1);
  for (Index t = 0; t < L; ++t) {
    sort_by_bucket(b.codes.data() + t, L, n, m, b.perm.data() + t * n, start);
    std::copy(start.begin(), start.end(), b.start.begin() + t * (m + 1));
  }
  return b;
}

// order[0..count) = indices of the `count` largest of s[0..size), by descending score, ties to
// the lower index.
template <typename Scalar>
void best_first(const Scalar* s, Index size, Index count, std::vector<std::int32_t>& order) {
  order.resize(static_cast<std::size_t>(size));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(
      order.begin(), order.begin() + count, order.end(),
      [s](std::int32_t a, std::int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
}

// The filters each query of a block opens in each table, from the block's filter-major scores
// (L m x B, row t m + f): those with score >= η in increasing order, or the min_probes best (in
// increasing order) when fewer pass. The scores are compared a row, i.e. one filter for every
// query of the block, at a time, and the lists are placed by a counting sort on (query, table).
template <typename Scalar>
class OpenedLists {
 public:
  OpenedLists(const RowMatrix<Scalar>& scores, Index m, Scalar eta, Index min_probes)
      : queries_(scores.cols()), tables_(scores.rows() / m) {
    eigen_assert(queries_ <= 64 && tables_ * m == scores.rows());
    const Index lists = queries_ * tables_, rows = scores.rows();
    PooledVector<std::uint64_t> bits(static_cast<std::size_t>(rows));
    PooledVector<Index> size(static_cast<std::size_t>(lists));
    for (Index t = 0, g = 0; t < tables_; ++t) {
      Index* table_size = size.data() + t;  // list (u, t) at table_size[u L]
      for (Index f = 0; f < m; ++f, ++g) {
        const std::uint64_t b = threshold_mask<false>(&scores(g, 0), queries_, eta);
        bits[std::size_t(g)] = b;
        for (std::uint64_t r = b; r != 0; r &= r - 1)
          ++table_size[Index(count_trailing_zeros(r)) * tables_];
      }
    }
    start_ = PooledVector<Index>(static_cast<std::size_t>(lists) + 1);
    for (Index e = 0; e < lists; ++e)
      start_[std::size_t(e) + 1] =
          start_[std::size_t(e)] + std::max(size[std::size_t(e)], min_probes);
    ids_ = PooledVector<std::int32_t>(static_cast<std::size_t>(start_.back()));
    PooledVector<Index> next(static_cast<std::size_t>(lists));
    std::copy(start_.begin(), start_.end() - 1, next.begin());
    for (Index t = 0, g = 0; t < tables_; ++t) {
      for (Index f = 0; f < m; ++f, ++g) {
        for (std::uint64_t r = bits[std::size_t(g)]; r != 0; r &= r - 1) {
          const std::size_t e = std::size_t(Index(count_trailing_zeros(r)) * tables_ + t);
          if (size[e] >= min_probes) ids_[std::size_t(next[e]++)] = std::int32_t(g);
        }
      }
    }
    // Too few pass: they are among the best, so the min_probes best are the list. One probe (the
    // default) is the best filter: the first maximum down each column of every table, on packets.
    PooledVector<Scalar> column;
    PooledVector<std::int32_t> order, best;
    for (Index e = 0; e < lists; ++e) {
      if (size[std::size_t(e)] >= min_probes) continue;
      const Index u = e / tables_, t = e % tables_;
      if (min_probes == 1) {
        if (best.empty()) {
          best = PooledVector<std::int32_t>(static_cast<std::size_t>(lists));
          for (Index tt = 0; tt < tables_; ++tt)
            column_argmax<false>(&scores(tt * m, 0), scores.outerStride(), m, queries_, Scalar(1),
                                 best.data() + tt, tables_);
        }
        ids_[std::size_t(start_[std::size_t(e)])] = std::int32_t(t * m + best[std::size_t(e)]);
        continue;
      }
      if (column.empty()) {
        column = PooledVector<Scalar>(static_cast<std::size_t>(m));
        order = PooledVector<std::int32_t>(0, static_cast<std::size_t>(m));
      }
      for (Index f = 0; f < m; ++f) column[std::size_t(f)] = scores(t * m + f, u);
      best_first(column.data(), m, min_probes, order);
      std::sort(order.begin(), order.begin() + min_probes);
      for (Index r = 0; r < min_probes; ++r)
        ids_[std::size_t(start_[std::size_t(e)] + r)] = std::int32_t(t * m + order[std::size_t(r)]);
    }
  }

  // Appends the filters of query u, table by table (ids t m + f, increasing).
  void append(Index u, std::vector<std::int32_t>& out) const {
    out.insert(out.end(), ids_.begin() + start_[std::size_t(u * tables_)],
               ids_.begin() + start_[std::size_t((u + 1) * tables_)]);
  }

 private:
  Index queries_, tables_;
  PooledVector<Index> start_;  // list (u, t) is ids_[start_[u L + t] ..)
  PooledVector<std::int32_t> ids_;
};

// The filters each block of 64 queries opened, kept by a thread with their capacity for its next
// call; freed by release_attention_scratch().
inline std::vector<std::vector<std::int32_t>>& opened_filter_lists() {
  thread_local std::vector<std::vector<std::int32_t>> lists = [] {
    thread_pools().push_back([] { opened_filter_lists().clear(); });
    return std::vector<std::vector<std::int32_t>>();
  }();
  return lists;
}

// Chooses the filters each query opens (threshold, min_probes, fallback; see the top of the file).
template <typename Scalar>
class FilterProber {
 public:
  FilterProber(const LocalitySensitiveFilters<Scalar>& filters, const FilterBuckets& keys,
               Index n_k, Scalar eta, Index min_probes, bool causal, bool exclude_self)
      : filters_(filters),
        keys_(keys),
        n_k_(n_k),
        eta_(eta),
        min_probes_(min_probes),
        causal_(causal),
        exclude_self_(exclude_self),
        first_alone_(exclude_self && first_row_alone_with_self(n_k, causal)) {}

  FilterProbes probe(const RowMatrix<Scalar>& unit_q) const {
    const Index n = unit_q.rows(), m = filters_.filters(), L = filters_.tables();
    const Index blocks = (n + kHashTile - 1) / kHashTile;
    // The calling thread's lists (the blocks fill them on any thread; only this call uses them).
    std::vector<std::vector<std::int32_t>>& opened = opened_filter_lists();
    if (Index(opened.size()) < blocks) opened.resize(static_cast<std::size_t>(blocks));
    for (Index b = 0; b < blocks; ++b) opened[std::size_t(b)].clear();
    PooledVector<Index> count(static_cast<std::size_t>(n));
    PooledVector<char> fell_back(static_cast<std::size_t>(n));
    filters_.for_each_block(unit_q, [&](Index i0, const auto& block, RowMatrix<Scalar>&,
                                        RowMatrix<Scalar>& work) {
      const Index B = block.rows();
      // The block's scores in all tables, filter-major: row t m + f, column u = query i0 + u.
      Scratch<RowMatrix<Scalar>> scores(L * m, B);
      for (Index t = 0; t < L; ++t) filters_.score_block(block, t, scores.middleRows(t * m, m), work);
      const OpenedLists<Scalar> lists(scores, m, eta_, min_probes_);
      std::vector<std::int32_t>& out = opened[static_cast<std::size_t>(i0 / kHashTile)];
      PooledVector<Scalar> column;
      PooledVector<std::int32_t> order;
      for (Index u = 0; u < B; ++u) {
        const std::size_t first = out.size();
        lists.append(u, out);
        if (!any_valid(out.data() + first, out.size() - first, i0 + u) && has_valid_key(i0 + u)) {
          if (column.empty()) {  // rare: the storage only when a query needs it
            column = PooledVector<Scalar>(static_cast<std::size_t>(L * m));
            order = PooledVector<std::int32_t>(0, static_cast<std::size_t>(L * m));
          }
          for (Index g = 0; g < L * m; ++g) column[std::size_t(g)] = scores(g, u);
          fallback(column.data(), i0 + u, order, out, first);
          fell_back[static_cast<std::size_t>(i0 + u)] = 1;
        }
        count[static_cast<std::size_t>(i0 + u)] = Index(out.size() - first);
      }
    });
    FilterProbes p;
    p.query_start = PooledVector<Index>(static_cast<std::size_t>(n) + 1);
    for (Index i = 0; i < n; ++i) p.query_start[i + 1] = p.query_start[i] + count[i];
    const std::size_t opened_total = static_cast<std::size_t>(p.query_start[n]);
    p.query_filters = PooledVector<std::int32_t>(0, opened_total);
    for (Index b = 0; b < blocks; ++b)
      p.query_filters.insert(p.query_filters.end(), opened[std::size_t(b)].begin(),
                             opened[std::size_t(b)].end());
    p.fallback_queries = std::count(fell_back.begin(), fell_back.end(), 1);
    // By filter: a stable counting sort of the (query, filter) pairs keeps queries in order.
    p.filter_start = PooledVector<Index>(static_cast<std::size_t>(L * m) + 1);
    for (std::int32_t g : p.query_filters) ++p.filter_start[static_cast<std::size_t>(g) + 1];
    for (Index g = 0; g < L * m; ++g) p.filter_start[g + 1] += p.filter_start[g];
    p.filter_queries = PooledVector<std::int32_t>(opened_total);
    PooledVector<Index> next(p.filter_start.size() - 1);
    std::copy(p.filter_start.begin(), p.filter_start.end() - 1, next.begin());
    for (Index i = 0; i < n; ++i)
      for (Index e = p.query_start[i]; e < p.query_start[i + 1]; ++e)
        p.filter_queries[static_cast<std::size_t>(next[p.query_filters[e]]++)] =
            static_cast<std::int32_t>(i);
    return p;
  }

 private:

  // True when filter g holds a key valid for query i (keys are in increasing position): not
  // after i under causal masking, not i itself under self-exclusion.
  bool holds_valid_key(std::int32_t g, Index i) const {
    const Index m = filters_.filters(), t = g / m, f = g % m;
    const Index* start = keys_.start.data() + t * (m + 1);
    const std::int32_t* first = keys_.perm.data() + t * n_k_ + start[f];
    const std::int32_t* last = keys_.perm.data() + t * n_k_ + start[f + 1];
    if (first != last && exclude_self_ && *first == i) ++first;
    return first != last && (!causal_ || *first <= i);
  }

  // False for a query whose only valid key is its own (the self rule attends to it).
  bool has_valid_key(Index i) const { return !(first_alone_ && i == 0); }

  bool any_valid(const std::int32_t* g, std::size_t count, Index i) const {
    for (std::size_t e = 0; e < count; ++e)
      if (holds_valid_key(g[e], i)) return true;
    return false;
  }

  // Opens filters of all tables in descending score order until one holds a valid key; keeps
  // out[first..) sorted. Terminates: query i has a valid key (has_valid_key), and some filter
  // holds it.
  void fallback(const Scalar* s, Index i, std::vector<std::int32_t>& order,
                std::vector<std::int32_t>& out, std::size_t first) const {
    const Index all = filters_.filters() * filters_.tables();
    best_first(s, all, all, order);
    for (std::int32_t g : order) {
      if (!holds_valid_key(g, i)) continue;  // an opened filter holds no valid key either
      out.insert(std::upper_bound(out.begin() + first, out.end(), g), g);
      return;
    }
  }

  const LocalitySensitiveFilters<Scalar>& filters_;
  const FilterBuckets& keys_;
  Index n_k_;
  Scalar eta_;
  Index min_probes_;
  bool causal_;
  bool exclude_self_;
  bool first_alone_;  // query 0 has no valid key but its own
};

// The dedupe count of the score tile: the number of tables in which key cols[u] lies in a filter
// opened by query i (>= 1 for every key of a tile that scores the pair). The opened filters of the
// task's queries are one bit each (rows lo .. lo + rows, L m bits a row), set once per task; the
// tile's columns are a range of the table's filter-ordered keys, whose codes (in that order) are
// rows of `codes`, so a count is L bit tests.
struct OpenedFilterCounter {
  const std::int32_t* perm =
      nullptr;                       // the table's keys in filter order (cols.list points into it)
  const HashCodes* codes = nullptr;  // n_k x L, rows in the order of perm
  Index filters = 0, lo = 0, words = 0;
  PooledVector<std::uint64_t> bits;  // rows x words

  void open(const FilterProbes& p, Index first, Index rows) {
    lo = first;
    words = (codes->cols() * filters + 63) / 64;
    bits = PooledVector<std::uint64_t>(static_cast<std::size_t>(rows * words));  // zeros
    for (Index i = first; i < first + rows; ++i)
      for (Index e = p.query_start[i]; e < p.query_start[i + 1]; ++e) {
        const std::uint64_t g = std::uint64_t(p.query_filters[e]);
        bits[static_cast<std::size_t>((i - first) * words + Index(g >> 6))] |= std::uint64_t(1)
                                                                               << (g & 63);
      }
  }

  void operator()(Index i, const TileIndex& cols, std::int32_t* n) const {
    const std::uint64_t* row = bits.data() + (i - lo) * words;
    const Index L = codes->cols();
    const std::int32_t* code = codes->data() + (cols.list - perm) * L;
    for (Index u = 0; u < cols.size; ++u, code += L) {
      std::int32_t c = 0;
      for (Index t = 0; t < L; ++t) {
        const std::uint64_t g = std::uint64_t(t * filters + code[t]);
        c += std::int32_t((row[g >> 6] >> (g & 63)) & 1);
      }
      n[u] += c;
    }
  }
};

// One (batch, head) slice.
template <typename Scalar>
class LsfSlice {
 public:
  LsfSlice(const Eigen::Ref<const RowMatrix<Scalar>>& q,
           const Eigen::Ref<const RowMatrix<Scalar>>& k,
           const LocalitySensitiveFilters<Scalar>& filters, const LsfOptions& opt)
      : filters_(filters),
        opt_(opt),
        eta_(resolve_threshold("lsf_attention", opt, filters.filters())) {
    if (q.rows() == 0) return;
    Scratch<RowMatrix<Scalar>> unit_k(k.rows(), k.cols());
    unit_rows_into<Scalar>(k, unit_k);
    keys_ = bucket_keys(filters, unit_k);
    Scratch<RowMatrix<Scalar>> unit_q(q.rows(), q.cols());
    unit_rows_into<Scalar>(q, unit_q);
    probes_ = FilterProber<Scalar>(filters, keys_, k.rows(), static_cast<Scalar>(eta_),
                                   opt.min_probes, opt.causal, opt.exclude_self)
                  .probe(unit_q);
  }

  LsfProbeStats stats() const {
    LsfProbeStats st;
    st.eta = eta_;
    st.opened = Index(probes_.query_filters.size());
    st.fallback_queries = probes_.fallback_queries;
    const Index n_q = Index(probes_.query_start.size()) - 1, n_k = keys_.codes.rows();
    const Index m = filters_.filters(), L = filters_.tables();
    std::vector<std::uint8_t> open(static_cast<std::size_t>(L * m), 0);
    for (Index i = 0; i < n_q; ++i) {
      const std::int32_t* g0 = probes_.query_filters.data() + probes_.query_start[i];
      const std::int32_t* g1 = probes_.query_filters.data() + probes_.query_start[i + 1];
      for (const std::int32_t* g = g0; g < g1; ++g) open[*g] = 1;
      for (const std::int32_t* g = g0; g < g1; ++g) {
        const Index t = *g / m, f = *g % m;
        const std::int32_t* perm = keys_.perm.data() + t * n_k;
        const Index* start = keys_.start.data() + t * (m + 1);
        const Index end =
            opt_.causal ? Index(std::upper_bound(perm + start[f], perm + start[f + 1], i) - perm)
                        : start[f + 1];
        st.logits += end - start[f];
        // A key counts for the first table in which i finds it.
        for (Index e = start[f]; e < end; ++e) {
          const std::int32_t* code = keys_.codes.data() + Index(perm[e]) * L;
          Index before = 0;
          for (Index u = 0; u < t; ++u) before += open[u * m + code[u]];
          st.target_pairs += before == 0 && !(opt_.exclude_self && perm[e] == i);
        }
      }
      for (const std::int32_t* g = g0; g < g1; ++g) open[*g] = 0;
    }
    if (opt_.exclude_self) st.target_pairs += Index(rows_alone_with_self(n_q, opt_.causal).size());
    return st;
  }

  // P_i of every query: the valid keys of its opened filters, each once (under self-exclusion
  // without i, or {i} for a query with no other valid key).
  TargetSets target_sets() const {
    const Index n_q = Index(probes_.query_start.size()) - 1, n_k = keys_.codes.rows();
    const Index m = filters_.filters();
    const bool first_alone = opt_.exclude_self && first_row_alone_with_self(n_q, opt_.causal);
    // The keys of the filter opened at probes_.query_filters[e], in increasing position.
    const auto filter_keys = [&](Index e) {
      const Index g = probes_.query_filters[std::size_t(e)], t = g / m, f = g % m;
      const std::int32_t* perm = keys_.perm.data() + t * n_k;
      const Index* start = keys_.start.data() + t * (m + 1);
      return std::make_pair(perm + start[f], perm + start[f + 1]);
    };
    // Room: per query, the keys of its filters (its valid keys at most), or itself.
    std::size_t room = 0;
    for (Index i = 0; i < n_q; ++i) {
      Index keys = 1;
      for (Index e = probes_.query_start[i]; e < probes_.query_start[i + 1]; ++e) {
        const auto [first, last] = filter_keys(e);
        keys += last - first;
      }
      room += std::size_t(std::min(keys, valid_keys(i, n_k, opt_.causal)));
    }
    return gather_target_sets(
        n_q, n_k,
        [&](Index i, auto&& add) {
          if (first_alone && i == 0) {
            add(std::int32_t(0));
            return;
          }
          for (Index e = probes_.query_start[i]; e < probes_.query_start[i + 1]; ++e) {
            auto [first, last] = filter_keys(e);
            if (opt_.causal) last = std::upper_bound(first, last, std::int32_t(i));
            for (const std::int32_t* j = first; j < last; ++j)
              if (!(opt_.exclude_self && *j == i)) add(*j);
          }
        },
        false, false, room);
  }

  SoftmaxAccumulator<Scalar> attend(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                    const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                    const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                    Scalar scale) const {
    const Index n_q = q.rows(), n_k = k.rows(), m = filters_.filters(), L = filters_.tables();
    SoftmaxAccumulator<Scalar> acc(n_q, v.cols());
    if (n_q == 0) return acc;
    Scratch<RowMatrix<Scalar>> queries(n_q, q.cols());
    queries = scale * q;
    Scratch<RowMatrix<Scalar>> keys_t(k.cols(), n_k), values(n_k, v.cols());
    Scratch<HashCodes> codes(n_k, L);
    const Index block = query_block(L * m), tasks = (n_q + block - 1) / block;
    for (Index t = 0; t < L; ++t) {
      lay_out_table(t, k, v, keys_t, values, codes);
      const std::int32_t* perm = keys_.perm.data() + t * n_k;
      // Each task owns the rows [b Q, (b + 1) Q): one thread merges a row, filter by filter.
      parallel_for(tasks, [&](Index b) {
        const Index lo = b * block, hi = std::min(n_q, (b + 1) * block);
        ScoreTile<Scalar> tile(kTargetRowTile, kTargetColTile, v.cols());
        Scratch<RowMatrix<Scalar>> q_tile(kTargetRowTile, q.cols());
        OpenedFilterCounter counter;
        const TileMask<OpenedFilterCounter> mask = table_mask(t, codes, lo, hi, counter);
        // Causal: one query per tile, against the filter's keys j <= i only (keys are in
        // increasing position), so every tile shape, and with it every rounding, depends on
        // tokens 0..i alone and output i is bit-identical whatever the later tokens.
        const Index rows_per_tile = opt_.causal ? 1 : kTargetRowTile;
        for (Index f = 0; f < m; ++f)
          for_each_filter_tile(t, f, lo, hi, rows_per_tile, [&](const TileIndex& rows, Index c0,
                                                                Index bc) {
            for (Index u = 0; u < rows.size; ++u) q_tile.row(u) = queries.row(rows[u]);
            tile.attend_transposed(q_tile.topRows(rows.size), keys_t.middleCols(c0, bc),
                                   values.middleRows(c0, bc), rows,
                                   TileIndex::gathered(perm + c0, bc), mask, acc);
          });
      });
    }
    // The self rule: a query with no other valid key (row 0 alone can be one) attends to its own.
    if (opt_.exclude_self && first_row_alone_with_self(n_q, opt_.causal)) {
      const std::int32_t first = 0;
      attend_to_self(acc, &first, 1, queries, k, v);
    }
    return acc;
  }

  // The backward of attend() (lsf_gradient.hpp) from the row log-sum-exp lse and D = dO · o of
  // the finished rows: adds the gradients of the scaled queries to dqs, of the keys to dk and of
  // the values to dv. The tiles are attend()'s filters and masks, with query tiles of up to
  // kTargetRowTile rows also under causal masking (the backward need not be bitwise causal).
  // With one query block a task owns every key and one pass gives all three; with several, the
  // blocks give dqs in parallel and a second pass, block by block, gives dk and dv from tasks
  // that own whole filters (a key lies in one filter per table), so no two tasks write one row.
  void backward(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                const Eigen::Ref<const RowMatrix<Scalar>>& k,
                const Eigen::Ref<const RowMatrix<Scalar>>& v, const RowMatrix<Scalar>& go,
                const Vector<Scalar>& lse, const Vector<Scalar>& dot, Scalar scale,
                RowMatrix<Scalar>& dqs, RowMatrix<Scalar>& dk, RowMatrix<Scalar>& dv) const {
    const Index n_q = q.rows(), n_k = k.rows(), m = filters_.filters(), L = filters_.tables();
    const Index d = q.cols(), dvs = v.cols();
    if (n_q == 0) return;
    Scratch<RowMatrix<Scalar>> queries(n_q, d);
    queries = scale * q;
    Scratch<RowMatrix<Scalar>> keys_t(d, n_k), values(n_k, dvs);
    Scratch<HashCodes> codes(n_k, L);
    const Index block = query_block(L * m), tasks = (n_q + block - 1) / block;
    const bool one_pass = tasks == 1;
    // Filters per task of the second pass.
    constexpr Index kFiltersPerTask = 16;
    for (Index t = 0; t < L; ++t) {
      lay_out_table(t, k, v, keys_t, values, codes);
      const std::int32_t* perm = keys_.perm.data() + t * n_k;
      // The tiles of filters [f0, f1) for the queries [lo, hi): dqs when `queries`, dk and dv
      // when `keys`.
      const auto run = [&](Index lo, Index hi, Index f0, Index f1,
                           const TileMask<OpenedFilterCounter>& mask, bool queries_wanted,
                           bool keys_wanted) {
        ScoreTile<Scalar> tile(kTargetRowTile, kTargetColTile, dvs);
        ScoreTileGradient<Scalar> grad(kTargetRowTile, kTargetColTile, d, dvs);
        Scratch<RowMatrix<Scalar>> q_tile(kTargetRowTile, d), go_tile(kTargetRowTile, dvs);
        Scratch<Vector<Scalar>> lse_tile(kTargetRowTile), dot_tile(kTargetRowTile);
        for (Index f = f0; f < f1; ++f)
          for_each_filter_tile(t, f, lo, hi, kTargetRowTile, [&](const TileIndex& rows, Index c0,
                                                                 Index bc) {
            const Index br = rows.size;
            for (Index u = 0; u < br; ++u) {
              q_tile.row(u) = queries.row(rows[u]);
              go_tile.row(u) = go.row(rows[u]);
              lse_tile(u) = lse(rows[u]);
              dot_tile(u) = dot(rows[u]);
            }
            tile.logits_transposed(q_tile.topRows(br), keys_t.middleCols(c0, bc));
            tile.mask(rows, TileIndex::gathered(perm + c0, bc), mask);
            grad.step(tile, lse_tile.head(br), dot_tile.head(br), q_tile.topRows(br),
                      keys_t.middleCols(c0, bc).transpose(), values.middleRows(c0, bc),
                      go_tile.topRows(br), queries_wanted, keys_wanted);
            if (queries_wanted)
              for (Index u = 0; u < br; ++u) dqs.row(rows[u]) += grad.dq().row(u);
            if (keys_wanted)
              for (Index u = 0; u < bc; ++u) {
                dk.row(perm[c0 + u]) += grad.dk().row(u);
                dv.row(perm[c0 + u]) += grad.dv().row(u);
              }
          });
      };
      parallel_for(tasks, [&](Index b) {
        const Index lo = b * block, hi = std::min(n_q, (b + 1) * block);
        OpenedFilterCounter counter;
        run(lo, hi, 0, m, table_mask(t, codes, lo, hi, counter), true, one_pass);
      });
      if (one_pass) continue;
      for (Index b = 0; b < tasks; ++b) {
        const Index lo = b * block, hi = std::min(n_q, (b + 1) * block);
        OpenedFilterCounter counter;
        const TileMask<OpenedFilterCounter> mask = table_mask(t, codes, lo, hi, counter);
        parallel_for((m + kFiltersPerTask - 1) / kFiltersPerTask, [&](Index g) {
          run(lo, hi, g * kFiltersPerTask, std::min(m, (g + 1) * kFiltersPerTask), mask, false,
              true);
        });
      }
    }
    // A query with no other valid key attended to its own: o_0 = v_0.
    if (opt_.exclude_self && first_row_alone_with_self(n_q, opt_.causal)) dv.row(0) += go.row(0);
  }

 private:
  // Table t's keys in filter order: transposed (d x n_k; a filter's keys are a few dozen
  // columns, the right operand of the tiles' register products as they lie), their values, and
  // their filter codes in that order.
  void lay_out_table(Index t, const Eigen::Ref<const RowMatrix<Scalar>>& k,
                     const Eigen::Ref<const RowMatrix<Scalar>>& v, RowMatrix<Scalar>& keys_t,
                     RowMatrix<Scalar>& values, HashCodes& codes) const {
    const Index n_k = k.rows();
    const std::int32_t* perm = keys_.perm.data() + t * n_k;
    Scratch<RowMatrix<Scalar>> gathered(kHashTile, k.cols());
    for (Index s0 = 0; s0 < n_k; s0 += kHashTile) {
      const Index count = std::min(kHashTile, n_k - s0);
      for (Index s = s0; s < s0 + count; ++s) {
        gathered.row(s - s0) = k.row(perm[s]);
        values.row(s) = v.row(perm[s]);
        codes.row(s) = keys_.codes.row(perm[s]);
      }
      transpose_scaled(gathered.data(), gathered.cols(), count, gathered.cols(),
                       static_cast<const Scalar*>(nullptr), keys_t.data() + s0, n_k);
    }
  }

  // The mask of table t's tiles for the queries [lo, hi): causal, self and, with several tables,
  // the duplicate count from `counter` (opened here for those queries).
  TileMask<OpenedFilterCounter> table_mask(Index t, const HashCodes& codes, Index lo, Index hi,
                                           OpenedFilterCounter& counter) const {
    TileMask<OpenedFilterCounter> mask;
    mask.causal = opt_.causal;
    mask.exclude_self = opt_.exclude_self;
    if (filters_.tables() > 1) {
      counter.perm = keys_.perm.data() + t * codes.rows();
      counter.codes = &codes;
      counter.filters = filters_.filters();
      counter.open(probes_, lo, hi - lo);
      mask.dedupe = &counter;
    }
    return mask;
  }

  // Calls fn(rows, c0, bc) for the tiles of filter f of table t: its queries in [lo, hi),
  // rows_per_tile at a time (rows: their positions), against its keys at filter-order positions
  // [c0, c0 + bc), kTargetColTile at a time; under causal masking only the keys up to the tile's
  // last (largest) query.
  template <typename Fn>
  void for_each_filter_tile(Index t, Index f, Index lo, Index hi, Index rows_per_tile,
                            Fn&& fn) const {
    const Index m = filters_.filters(), n_k = keys_.codes.rows(), g = t * m + f;
    const std::int32_t* perm = keys_.perm.data() + t * n_k;
    const Index* start = keys_.start.data() + t * (m + 1);
    const Index k0 = start[f], k1 = start[f + 1];
    if (k0 == k1) return;
    const std::int32_t* fq = probes_.filter_queries.data();
    const std::int32_t* q0 = std::lower_bound(fq + probes_.filter_start[g],
                                              fq + probes_.filter_start[g + 1], std::int32_t(lo));
    const std::int32_t* q1 =
        std::lower_bound(q0, fq + probes_.filter_start[g + 1], std::int32_t(hi));
    for (const std::int32_t* r = q0; r < q1; r += rows_per_tile) {
      const Index br = std::min<Index>(rows_per_tile, q1 - r);
      const Index end =
          opt_.causal ? Index(std::upper_bound(perm + k0, perm + k1, r[br - 1]) - perm) : k1;
      const TileIndex rows = TileIndex::gathered(r, br);
      for (Index c0 = k0; c0 < end; c0 += kTargetColTile)
        fn(rows, c0, std::min(kTargetColTile, end - c0));
    }
  }

  const LocalitySensitiveFilters<Scalar>& filters_;
  LsfOptions opt_;
  double eta_;
  FilterBuckets keys_;
  FilterProbes probes_;
};

template <typename Scalar>
SoftmaxAccumulator<Scalar> lsf_slice(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                     const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                     const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                     const LocalitySensitiveFilters<Scalar>& filters,
                                     const LsfOptions& opt, Scalar scale,
                                     int* value_exponent = nullptr,
                                     std::unique_ptr<LsfSlice<Scalar>>* keep = nullptr) {
  // A key is scored once per table it shares with the query: up to tables terms per key.
  const int e = value_headroom(v, double(v.rows()) * double(filters.tables()));
  // keep: the filters' choices stay with the caller, for a backward; without it the slice lives
  // on the stack (a forward allocates nothing its pools do not give back).
  std::optional<LsfSlice<Scalar>> local;
  if (keep)
    *keep = std::make_unique<LsfSlice<Scalar>>(q, k, filters, opt);
  else
    local.emplace(q, k, filters, opt);
  const LsfSlice<Scalar>& slice = keep ? **keep : *local;
  if (e == 0) {
    if (value_exponent) *value_exponent = 0;
    return slice.attend(q, k, v, scale);
  }
  Scratch<RowMatrix<Scalar>> scaled(v.rows(), v.cols());
  scaled = v;
  scale_by_power_of_two(scaled, -e);
  SoftmaxAccumulator<Scalar> acc = slice.attend(q, k, scaled, scale);
  if (value_exponent) {
    *value_exponent = e;
    return acc;
  }
  return unscaled_accumulator(std::move(acc), e);
}

}  // namespace detail

// LSF attention as an accumulator (for merging with other partial results):
// q n_q x d, k n_k x d, v n_k x dv.
template <typename Scalar>
SoftmaxAccumulator<Scalar> lsf_attention_accumulate(const LocalitySensitiveFilters<Scalar>& filters,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                    const LsfOptions& opt = {}) {
  const char* where = "lsf_attention";
  const Scalar scale = detail::check_lsf_inputs<Scalar>(where, q, k, v, filters, opt);
  SoftmaxAccumulator<Scalar> acc = detail::lsf_slice<Scalar>(q, k, v, filters, opt, scale);
  detail::check_accumulator_finite(where, acc, opt.check_finite);
  return acc;
}

// LSF attention written into `out` (n_q x dv, sharing no memory with q, k or v). A rejected
// `out` is not written.
template <typename DQ, typename DK, typename DV, typename DO>
void lsf_attention_into(const LocalitySensitiveFilters<typename DQ::Scalar>& filters,
                        const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                        const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
                        const LsfOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value &&
                    std::is_same<Scalar, typename DO::Scalar>::value,
                "q, k, v and out must share the scalar type");
  const char* where = "lsf_attention";
  const Eigen::Ref<const RowMatrix<Scalar>> qr(q), kr(k), vr(v);
  detail::check_output(where, out, qr.rows(), vr.cols(),
                       {detail::named_input("q", qr), detail::named_input("k", kr),
                        detail::named_input("v", vr)});
  // Every row holds at least one key, whose largest term is exp(0): den >= 1.
  const Scalar scale = detail::check_lsf_inputs<Scalar>(where, qr, kr, vr, filters, opt);
  int e = 0;
  const SoftmaxAccumulator<Scalar> acc =
      detail::lsf_slice<Scalar>(qr, kr, vr, filters, opt, scale, &e);
  detail::check_accumulator_finite(where, acc, opt.check_finite);
  acc.finalize_into(out);
  detail::unscale_output(out, e);
}

// LSF attention: q n_q x d, k n_k x d, v n_k x dv -> n_q x dv.
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> lsf_attention(
    const LocalitySensitiveFilters<typename DQ::Scalar>& filters, const Eigen::MatrixBase<DQ>& q,
    const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v, const LsfOptions& opt = {}) {
  auto out = detail::fresh_matrix<RowMatrix<typename DQ::Scalar>>(q.rows(), v.cols());
  lsf_attention_into(filters, q, k, v, out, opt);
  return out;
}

// The filters LSF attention would open for q over k, without the attention: the threshold used,
// filters opened, fallback queries, distinct pairs scored (target_pairs / (n_q n_k) is the
// fraction of pairs scored) and logits computed.
template <typename Scalar>
LsfProbeStats lsf_probe_stats(const LocalitySensitiveFilters<Scalar>& filters,
                              const Eigen::Ref<const RowMatrix<Scalar>>& q,
                              const Eigen::Ref<const RowMatrix<Scalar>>& k,
                              const LsfOptions& opt = {}) {
  const RowMatrix<Scalar> no_values(k.rows(), 0);
  detail::check_lsf_inputs<Scalar>("lsf_probe_stats", q, k, no_values, filters, opt);
  return detail::LsfSlice<Scalar>(q, k, filters, opt).stats();
}

// The target set P_i of every query of LSF attention (the keys lsf_attention scores for query i,
// each once, causal mask and fallback applied): q n_q x d, k n_k x d.
template <typename Scalar>
TargetSets lsf_target_sets(const LocalitySensitiveFilters<Scalar>& filters,
                           const Eigen::Ref<const RowMatrix<Scalar>>& q,
                           const Eigen::Ref<const RowMatrix<Scalar>>& k, const LsfOptions& opt = {}) {
  const RowMatrix<Scalar> no_values(k.rows(), 0);
  detail::check_lsf_inputs<Scalar>("lsf_target_sets", q, k, no_values, filters, opt);
  if (q.rows() == 0) return TargetSets{};
  return detail::LsfSlice<Scalar>(q, k, filters, opt).target_sets();
}

// Batched multi-head LSF attention over contiguous row-major buffers: q (batch, heads, n_q, d),
// k (batch, heads, n_k, d), v (batch, heads, n_k, dv) -> out (batch, heads, n_q, dv). Every slice
// uses the same filters. Slices run in parallel, each on one thread.
template <typename Scalar>
void lsf_attention_batched(const LocalitySensitiveFilters<Scalar>& filters, const Scalar* q,
                           const Scalar* k, const Scalar* v, Scalar* out, const BatchShape& shape,
                           const LsfOptions& opt = {}) {
  const char* where = "lsf_attention_batched";
  detail::check_batch_qkv_output(where, shape, q, k, v, out);
  using detail::slice_of;
  const Scalar scale =
      detail::resolve_scale<Scalar>(where, opt, detail::inverse_sqrt_dim(filters.dim()));
  detail::for_each_slice(
      where, shape, q && k && v && out,
      [&](Index s) {
        detail::check_lsf_inputs<Scalar>(where, slice_of(q, s, shape.n_q, shape.d),
                                         slice_of(k, s, shape.n_k, shape.d),
                                         slice_of(v, s, shape.n_k, shape.dv), filters, opt);
      },
      [&](Index s) {
        auto o = slice_of(out, s, shape.n_q, shape.dv);
        int e = 0;
        const SoftmaxAccumulator<Scalar> acc = detail::lsf_slice<Scalar>(
            slice_of(q, s, shape.n_q, shape.d), slice_of(k, s, shape.n_k, shape.d),
            slice_of(v, s, shape.n_k, shape.dv), filters, opt, scale, &e);
        detail::check_accumulator_finite(where, acc, opt.check_finite);
        acc.finalize_into(o);
        detail::unscale_output(o, e);
      });
}

}  // namespace randattn
