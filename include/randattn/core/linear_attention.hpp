#pragma once
// Linear attention over given feature matrices: [num | den] = Q' (K'^T [V | 1]), optionally
// with a sign vector (phi(q)^T diag(sigma) phi(k)) and per-row log-scales (ScaledFeatures).
// Causal attention is computed by chunked prefix sums made of matrix products: inside a chunk
// the masked product (Q'_c K'_c^T ⊙ L)[V_c | 1], across chunks a carried state
// S = sum_j K'_j^T [V_j | 1]. The stabiliser never looks at future keys: row i is relative to
// the larger of the state's log-scale (the maximum over past chunks) and the running maximum of
// the chunk's key log-scales up to i, so output i depends on keys 0..i only (bit for bit).
// The products are row-panel tiles that read their operands in place (detail/chunk_products.hpp).
// The core reads features through row sources one block at a time (GivenFeatureRows below, or a
// feature map applied on the fly), so its own memory is O(n·dv) plus one block per thread.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../detail/batch.hpp"
#include "../detail/fresh_matrix.hpp"
#include "../detail/gemm.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"
#include "../detail/chunk_products.hpp"
#include "../detail/validation.hpp"
#include "detail/output_check.hpp"
#include "options.hpp"
#include "scaled_features.hpp"
#include "softmax_accumulator.hpp"
#include "types.hpp"

namespace randattn {

// causal and check_finite: see core/options.hpp.
struct LinearOptions : CoreOptions {
  Index block_size = 0;               // rows per chunk (causal) or key panel; 0 = automatic
  double denominator_epsilon = 1e-6;  // finalize guard, see SoftmaxAccumulator::finalize
};

// A summary S = K'ᵀ [V | 1] of keys (K' their features, signs applied), relative to
// exp(log_scale): what every later query needs of those keys. No keys: zeros and log_scale = −inf.
template <typename Scalar>
struct KeySummary {
  RowMatrix<Scalar> state;
  Scalar log_scale = -std::numeric_limits<Scalar>::infinity();
};

namespace detail {

// Causal chunks trade the O(n*C*M) masked products against per-chunk overhead; bidirectional
// panels only bound the depth of the key products.
constexpr Index kDefaultCausalChunk = 32;
// Chunks per group of causal attention (see linear_causal); a shape constant, not a thread count.
constexpr Index kCausalGroup = 16;
constexpr Index kDefaultKeyPanel = kMaxGemmDepth;
// Key panels summarised per group of bidirectional attention; a shape constant, not a thread count.
constexpr Index kKeyGroup = 16;
constexpr Index kMergeRows = 64;  // rows of the key state per merge task

// The rows the forward maps to features in one call of a row source (its view): a group of
// kCausalGroup chunks when causal, one panel otherwise. Features mapped in these pieces are the
// forward's, bit for bit.
inline Index feature_mapping_rows(Index chunk, bool causal) {
  return causal ? kCausalGroup * chunk : chunk;
}

template <typename Scalar>
void check_linear_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& qf,
                         const Eigen::Ref<const Vector<Scalar>>& q_log,
                         const Eigen::Ref<const RowMatrix<Scalar>>& kf,
                         const Eigen::Ref<const Vector<Scalar>>& k_log,
                         const Eigen::Ref<const RowMatrix<Scalar>>& v,
                         const Eigen::Ref<const Vector<Scalar>>& signs, const LinearOptions& opt) {
  require(qf.cols() == kf.cols(), where, "q_features (", shape_of(qf), ") and k_features (",
          shape_of(kf), ") must have the same feature dimension");
  require(kf.rows() == v.rows(), where, "k_features (", shape_of(kf), ") and v (", shape_of(v),
          ") must have the same number of rows");
  require(q_log.size() == 0 || q_log.size() == qf.rows(), where, "q_log_scale has ", q_log.size(),
          " entries, expected 0 or ", qf.rows());
  require(k_log.size() == 0 || k_log.size() == kf.rows(), where, "k_log_scale has ", k_log.size(),
          " entries, expected 0 or ", kf.rows());
  require(signs.size() == 0 || signs.size() == qf.cols(), where, "signs has ", signs.size(),
          " entries, expected 0 or the feature dimension ", qf.cols());
  for (Index i = 0; i < signs.size(); ++i) {
    require(signs(i) == Scalar(1) || signs(i) == Scalar(-1), where, "signs(", i, ") = ", signs(i),
            " is not +1 or -1");
  }
  require(!opt.causal || qf.rows() == kf.rows(), where, "causal attention needs as many queries (",
          qf.rows(), ") as keys (", kf.rows(), ")");
  require(opt.block_size >= 0, where, "block_size must be >= 0, got ", opt.block_size);
  require(opt.denominator_epsilon >= 0 && std::isfinite(opt.denominator_epsilon), where,
          "denominator_epsilon must be finite and >= 0, got ", opt.denominator_epsilon);
  if (qf.rows() > 0) {
    require(kf.rows() > 0, where, "attention over zero keys is undefined (q_features ",
            shape_of(qf), ", k_features ", shape_of(kf), ")");
    require(qf.cols() > 0, where, "feature dimension must be >= 1 (q_features ", shape_of(qf), ")");
  }
  // The feature matrices are checked through the result (check_result_finite); the log-scales
  // feed maxima and exponentials, so they are checked now.
  // Log-scales are logarithms: realistic ones are far below 1e4. The bound keeps every sum and
  // difference of two of them finite, so no row is mistaken for "no weight" (log-scale -inf).
  const Scalar log_bound = std::numeric_limits<Scalar>::max() / 4;
  for (const auto* log_scale : {&q_log, &k_log}) {
    const char* name = log_scale == &q_log ? "q_log_scale" : "k_log_scale";
    require_finite(*log_scale, where, name, opt.check_finite);
    require(log_scale->size() == 0 || log_scale->cwiseAbs().maxCoeff() <= log_bound, where, name,
            " has an entry of magnitude above ", log_bound);
  }
}

// Work buffers below come from the thread's pool (detail/matrix_pool.hpp): a call with the
// shapes of an earlier one on the same thread allocates none of them.

// A block of feature rows with their log-scales (the rows a source filled).
template <typename Scalar>
struct FeatureBlock {
  Scratch<RowMatrix<Scalar>> values;
  Scratch<Vector<Scalar>> log_scale;
  FeatureBlock(Index rows, Index dim) : values(rows, dim), log_scale(rows) {}
};

// Feature rows of one side, read block by block. A source has Scalar, rows(), dim(),
// fill(i0, len, values, log_scale), which writes rows [i0, i0 + len) (values len x dim, log-scales
// len; zeros when the side has none), view(i0, len, block), which returns those rows read-only
// (in place when the source holds them, else filled into `block`) with their log-scales in
// block.log_scale, and scan(where, name), which names its first non-finite entry for the result
// check. GivenFeatureRows serves features the caller computed; MappedFeatureRows
// (attention/random_feature_attention.hpp) computes them from q or k block by block, so
// random-feature attention never holds an n x M feature matrix.
template <typename Scalar_>
class GivenFeatureRows {
 public:
  using Scalar = Scalar_;

  GivenFeatureRows(const Eigen::Ref<const RowMatrix<Scalar>>& values,
                   const Eigen::Ref<const Vector<Scalar>>& log_scale)
      : values_(values), log_scale_(log_scale) {}

  Index rows() const { return values_.rows(); }
  Index dim() const { return values_.cols(); }
  void fill(Index i0, Index len, Eigen::Ref<RowMatrix<Scalar>> values,
            Eigen::Ref<Vector<Scalar>> log_scale) const {
    values = values_.middleRows(i0, len);
    log_scales(i0, len, log_scale);
  }
  Eigen::Ref<const RowMatrix<Scalar>> view(Index i0, Index len, FeatureBlock<Scalar>& block) const {
    log_scales(i0, len, block.log_scale.head(len));
    return values_.middleRows(i0, len);
  }
  void scan(const char* where, const char* name) const { require_finite(values_, where, name); }

 private:
  void log_scales(Index i0, Index len, Eigen::Ref<Vector<Scalar>> out) const {
    if (log_scale_.size() > 0) {
      out = log_scale_.segment(i0, len);
    } else {
      out.setZero();
    }
  }

  Eigen::Ref<const RowMatrix<Scalar>> values_;
  Eigen::Ref<const Vector<Scalar>> log_scale_;
};

// The operands of one call as every path reads them: the two sources, v, the sign vector of
// φ(q)ᵀ diag(σ) φ(k) (empty: all +1) and the chunk length (rows per causal chunk, or per key
// panel and query block).
template <typename QRows, typename KRows>
struct LinearOperands {
  using Scalar = typename KRows::Scalar;
  const QRows& q;
  const KRows& k;
  Eigen::Ref<const RowMatrix<Scalar>> v;
  Eigen::Ref<const Vector<Scalar>> signs;
  Index chunk;

  Index features() const { return k.dim(); }
  Index width() const { return v.cols() + 1; }  // columns of [v | 1]
};

// Key rows [i0, i0 + len) with the signs applied: read in place when there are no signs (a view
// of the source, or its rows mapped into `block`), else filled into `block` and signed there.
template <typename In>
Eigen::Ref<const RowMatrix<typename In::Scalar>> signed_keys(
    const In& in, Index i0, Index len, FeatureBlock<typename In::Scalar>& block) {
  if (in.signs.size() == 0) return in.k.view(i0, len, block);
  auto rows = block.values.topRows(len);
  in.k.fill(i0, len, rows, block.log_scale.head(len));
  rows.array().rowwise() *= in.signs.transpose().array();
  return rows;
}

// Work buffers of one thread: a block of feature rows, [w ∘ V | w] or [V | 1] of a chunk, and,
// for causal chunks, the masked weights, the rows' log-scales and the factors that rescale the
// carried state's part.
template <typename Scalar>
struct ChunkScratch {
  FeatureBlock<Scalar> features;
  Scratch<RowMatrix<Scalar>> values, weights;
  Scratch<Vector<Scalar>> log_rows, rescale;
  ChunkScratch(Index chunk, Index dim, Index width, bool causal)
      : features(causal ? 0 : chunk, dim),
        values(chunk, line_padded<Scalar>(width)),
        weights(causal ? chunk : 0, causal ? chunk : 0),
        log_rows(causal ? chunk : 0),
        rescale(causal ? chunk : 0) {}
};

// weighted = [w ∘ V | w] for key rows [j0, j0 + len) with log-scales k_log, w = exp(k_log − c)
// where c, returned, is the larger of c_prev and the largest of k_log.
template <typename In, typename Weighted>
typename In::Scalar weigh_values(const In& in, Index j0,
                                 const Eigen::Ref<const Vector<typename In::Scalar>>& k_log,
                                 typename In::Scalar c_prev, Weighted&& weighted) {
  const Index dv = in.v.cols();
  const typename In::Scalar c = std::max(c_prev, k_log.maxCoeff());
  weighted.col(dv) = (k_log.array() - c).exp().matrix();
  weighted.leftCols(dv) = weighted.col(dv).asDiagonal() * in.v.middleRows(j0, k_log.size());
  return c;
}

// T = K'ᵀ [w ∘ V | w] for key rows [j0, j0 + len) given as `keys` with log-scales
// `k_log`, where w = exp(k_log − g) and g is the largest of them: T is relative to exp(g).
// Returns g.
template <typename In, typename Keys, typename Out>
typename In::Scalar summarise_keys(const In& in, const Keys& keys,
                                   const Eigen::Ref<const Vector<typename In::Scalar>>& k_log,
                                   Index j0, RowMatrix<typename In::Scalar>& scratch, Out&& out) {
  auto weighted = scratch.topLeftCorner(keys.rows(), in.width());
  const typename In::Scalar g = weigh_values(
      in, j0, k_log, -std::numeric_limits<typename In::Scalar>::infinity(), weighted);
  row_panel_product(out, keys.transpose(), weighted, false);
  return g;
}

// Per-chunk key summaries T_t, chunk t of a group being rows [t*M, (t+1)*M) of `blocks`,
// relative to exp(log_scale(t)).
template <typename Scalar>
struct KeySummaries {
  Scratch<RowMatrix<Scalar>> blocks;
  Scratch<Vector<Scalar>> log_scale;
  Index m = 0;
  KeySummaries(Index chunks, Index m, Index width)
      : blocks(chunks * m, width), log_scale(chunks), m(m) {}

  auto block(Index t) { return blocks.middleRows(t * m, m); }
  auto block(Index t) const { return blocks.middleRows(t * m, m); }
};

// The summary S = K'ᵀ [V | 1] of all keys (at least one), relative to exp(c). Key panels of
// in.chunk rows are mapped and summarised in parallel, kKeyGroup at a time, and merged into S
// in order: the result does not depend on the thread count, and memory holds one group's
// summaries and one panel of features per thread.
template <typename In>
Scratch<RowMatrix<typename In::Scalar>> key_state(const In& in, typename In::Scalar& c) {
  using Scalar = typename In::Scalar;
  const Index n_k = in.k.rows(), m = in.features(), w = in.width(), chunk = in.chunk;
  const Index chunks = (n_k + chunk - 1) / chunk;
  KeySummaries<Scalar> sums(std::min(chunks, kKeyGroup), m, w);
  Scratch<RowMatrix<Scalar>> state(m, w);
  state.setZero();
  c = -std::numeric_limits<Scalar>::infinity();
  for (Index first = 0; first < chunks; first += kKeyGroup) {
    const Index group = std::min(kKeyGroup, chunks - first);
    parallel_for_with(
        group, [&] { return ChunkScratch<Scalar>(chunk, m, w, false); },
        [&](Index t, ChunkScratch<Scalar>& s) {
          const Index j0 = (first + t) * chunk, len = std::min(chunk, n_k - j0);
          const auto keys = signed_keys(in, j0, len, s.features);
          sums.log_scale(t) =
              summarise_keys(in, keys, s.features.log_scale.head(len), j0, s.values, sums.block(t));
        });
    // The group's summaries join S in order, each thread taking its own rows of S through the
    // same sequence of merges (so the same bits whatever the split).
    const Scalar c0 = c;
    parallel_for((m + kMergeRows - 1) / kMergeRows, [&](Index b) {
      const Index r0 = b * kMergeRows, rows = std::min(kMergeRows, m - r0);
      Scalar cb = c0;
      for (Index t = 0; t < group; ++t)
        merge_scaled(state.middleRows(r0, rows), cb, sums.block(t).middleRows(r0, rows),
                     sums.log_scale(t));
    });
    for (Index t = 0; t < group; ++t) c = merged_log_scale(c, sums.log_scale(t));
  }
  return state;
}

// Every query against the key summary `state` (relative to exp(c)): [num | den] = Q' S.
template <typename In>
SoftmaxAccumulator<typename In::Scalar> query_key_state(const In& in,
                                                        const RowMatrix<typename In::Scalar>& state,
                                                        typename In::Scalar c) {
  using Scalar = typename In::Scalar;
  const Index n_q = in.q.rows(), m = in.features(), chunk = in.chunk;
  RowMatrix<Scalar> nd = MatrixPool<RowMatrix<Scalar>>::take(n_q, in.width());
  Vector<Scalar> log_scale = MatrixPool<Vector<Scalar>>::take(n_q);
  parallel_for_with((n_q + chunk - 1) / chunk, [&] { return FeatureBlock<Scalar>(chunk, m); },
                    [&](Index b, FeatureBlock<Scalar>& f) {
                      const Index i0 = b * chunk, len = std::min(chunk, n_q - i0);
                      row_panel_product(nd.middleRows(i0, len), in.q.view(i0, len, f), state, false);
                      log_scale.segment(i0, len) = f.log_scale.head(len);
                    });
  log_scale.array() += c;
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

template <typename In>
SoftmaxAccumulator<typename In::Scalar> linear_bidirectional(const In& in) {
  typename In::Scalar c;
  const auto state = key_state(in, c);
  return query_key_state(in, state, c);
}

// Causal rows [i0, i0 + len), `queries` and `keys` (signed) being their features, written to
// rows [i0, i0 + len) of `nd` and `log_scale`: Q_c `state` for the keys before the chunk
// (`state` relative to exp(state_log); −inf: none) plus the masked product with the chunk's own
// keys, both relative to r_i = max(state_log, largest key log-scale up to i), so row i is
// stabilised by keys 0..i only and is written once.
template <typename In, typename Rows, typename State>
void causal_chunk_rows(const In& in, Index i0, const Rows& queries,
                       const Eigen::Ref<const Vector<typename In::Scalar>>& q_log, const Rows& keys,
                       const Eigen::Ref<const Vector<typename In::Scalar>>& k_log,
                       const State& state, typename In::Scalar state_log,
                       ChunkScratch<typename In::Scalar>& s, RowMatrix<typename In::Scalar>& nd,
                       Vector<typename In::Scalar>& log_scale) {
  using Scalar = typename In::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index len = queries.rows(), dv = in.v.cols();
  auto weights = s.weights.topLeftCorner(len, len);
  auto row_log = s.log_rows.head(len);
  auto values = s.values.topLeftCorner(len, dv + 1);
  auto out = nd.middleRows(i0, len);
  row_dots(weights, queries, keys, true);
  Scalar prefix_max = kNegInf;
  for (Index i = 0; i < len; ++i) {
    prefix_max = std::max(prefix_max, k_log(i));
    row_log(i) = std::max(prefix_max, state_log);
    weights.row(i).head(i + 1).array() *=
        (k_log.head(i + 1).array() - row_log(i)).exp().transpose();
    weights.row(i).tail(len - i - 1).setZero();
  }
  values.leftCols(dv) = in.v.middleRows(i0, len);
  values.col(dv).setOnes();
  const bool has_state = state_log != kNegInf;
  if (has_state) {
    row_panel_product(out, queries, state, false);
    // Evaluated into scratch first (Eigen would evaluate it into a temporary).
    auto rescale = s.rescale.head(len);
    rescale = (state_log - row_log.array()).exp().matrix();
    out.array().colwise() *= rescale.array();
  }
  row_panel_product(out, weights, values, has_state, Triangle::lower);
  log_scale.segment(i0, len) = row_log + q_log;
}

// A state joined by one chunk's keys: next = exp(c_prev − c_next) prev + a w, where a holds the
// chunk's (signed) key features transposed and w = [w ∘ V | w] from weigh_values. prev is
// relative to exp(c_prev) (−inf: no keys yet, prev unread) and next to exp(c_next); next may be
// prev itself.
template <typename Scalar, typename Prev, typename A, typename W, typename Next>
void advance_state(const Prev& prev, Scalar c_prev, const A& a, const W& w, Scalar c_next,
                   Next&& next) {
  if (c_prev == -std::numeric_limits<Scalar>::infinity()) {
    row_panel_product(next, a, w, false);
  } else {
    row_panel_product_onto(next, prev, std::exp(c_prev - c_next), a, w);
  }
}

// Cost of a chunk's state update relative to the whole chunk (its rows and the update), on given
// features at n = 8192, 256 features, dv = 64, one thread: 1.8 of 5.5 ms (Zen 5). It only sets
// where the runs of several threads are cut, never a result.
constexpr double kCausalUpdateShare = 1.0 / 3;

// The first chunk of run s of `segments` consecutive runs of the `chunks` chunks (s = segments:
// chunks). A run that starts at chunk x first replays the x state updates before it, so later
// runs are shorter: equal times t = r x_s + L_s (r = kCausalUpdateShare) give
// x_s = t (1 − (1 − r)^s) / r.
inline Index causal_segment_start(Index chunks, Index segments, Index s) {
  if (s >= segments) return chunks;
  const double r = kCausalUpdateShare;
  const double t = double(chunks) * r / (1 - std::pow(1 - r, double(segments)));
  return std::min(chunks, Index(std::llround(t * (1 - std::pow(1 - r, double(s))) / r)));
}

// Causal linear attention. The sequence is cut into chunks of in.chunk rows. The chunks run in
// order, each finishing its rows against the state S of every key before it (Q_c S plus the
// masked product inside the chunk, written once into the result) and then joining S in place:
// S ← exp(c − c') S + K_cᵀ [w ∘ V_c | w]. Features are computed for groups of kCausalGroup
// chunks. On several threads the chunks are cut into consecutive runs, one per thread; a run
// that starts at chunk x first replays the state updates of chunks 0 … x − 1 (no rows), the same
// products in the same order as one thread, so the result does not depend on the thread count.
// The runs are cut so that the replays even out (causal_segment_start). Also returns the summary of
// all keys, the state after the last chunk (what attention of a later part of the sequence
// reads).
template <typename In>
std::pair<SoftmaxAccumulator<typename In::Scalar>, KeySummary<typename In::Scalar>>
linear_causal_with_summary(const In& in) {
  using Scalar = typename In::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index n = in.q.rows(), m = in.features(), w = in.width(), chunk = in.chunk;
  const Index chunks = (n + chunk - 1) / chunk;
  const Index group_rows = std::min(n, feature_mapping_rows(chunk, true));
  RowMatrix<Scalar> nd = MatrixPool<RowMatrix<Scalar>>::take(n, w);
  Vector<Scalar> log_scale = MatrixPool<Vector<Scalar>>::take(n);
  const Index segments = std::max<Index>(1, std::min(available_threads(), chunks));
  RowMatrix<Scalar> carried = MatrixPool<RowMatrix<Scalar>>::take(m, w);
  carried.setZero();  // the summary of no keys
  Scalar carried_log = kNegInf;
  const auto run = [&](Index segment) {
    const Index begin = causal_segment_start(chunks, segments, segment),
                end = causal_segment_start(chunks, segments, segment + 1);
    const bool last = segment + 1 == segments;
    if (begin == end && !last) return;
    Scratch<RowMatrix<Scalar>> own_state;  // the last run's state is the summary itself
    if (!last) own_state = Scratch<RowMatrix<Scalar>>(m, w);
    RowMatrix<Scalar>& state = last ? carried : own_state;
    Scalar state_log = kNegInf;
    FeatureBlock<Scalar> q_rows(group_rows, m), k_rows(group_rows, m);
    Scratch<RowMatrix<Scalar>> weighted(group_rows, line_padded<Scalar>(w));
    ChunkScratch<Scalar> own(chunk, m, w, true);
    for (Index group0 = 0; group0 < end; group0 += kCausalGroup) {
      const Index group = std::min(kCausalGroup, chunks - group0), g0 = group0 * chunk;
      const Index g_len = std::min(group_rows, n - g0);
      const Eigen::Ref<const RowMatrix<Scalar>> keys = signed_keys(in, g0, g_len, k_rows);
      // Queries only where the group has rows of this run; the features of a group are always
      // those of all its rows, as on one thread.
      const auto query_rows = [&]() -> Eigen::Ref<const RowMatrix<Scalar>> {
        if (group0 + group > begin) return in.q.view(g0, g_len, q_rows);
        return keys;
      };
      const Eigen::Ref<const RowMatrix<Scalar>> queries = query_rows();
      for (Index t = 0; t < group && group0 + t < end; ++t) {
        const Index r0 = t * chunk, len = std::min(chunk, n - g0 - r0);
        if (group0 + t >= begin)
          causal_chunk_rows(in, g0 + r0, queries.middleRows(r0, len),
                            q_rows.log_scale.segment(r0, len), keys.middleRows(r0, len),
                            k_rows.log_scale.segment(r0, len), state, state_log, own, nd,
                            log_scale);
        if (!last && group0 + t + 1 == end) break;  // no later chunk reads this run's state
        auto weights = weighted.block(r0, 0, len, w);
        const Scalar c =
            weigh_values(in, g0 + r0, k_rows.log_scale.segment(r0, len), state_log, weights);
        advance_state(state, state_log, keys.middleRows(r0, len).transpose(), weights, c, state);
        state_log = c;
      }
    }
    if (last) carried_log = state_log;
  };
  parallel_for(segments, run);
  return {SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale)),
          KeySummary<Scalar>{std::move(carried), carried_log}};
}

template <typename In>
SoftmaxAccumulator<typename In::Scalar> linear_causal(const In& in) {
  auto [acc, summary] = linear_causal_with_summary(in);
  MatrixPool<RowMatrix<typename In::Scalar>>::give(std::move(summary.state));
  return std::move(acc);
}

// Self-exclusion for queries and keys at the same positions (n_q == n_k): removes from row i of
// acc the term of key i, φ(q_i)ᵀ diag(σ) φ(k_i) [v_i | 1] at log-scale (q_i's + k_i's), unless
// key i is the row's only key (n = 1, or row 0 under causal). The remaining sum is that of the
// other keys up to the rounding of the full sum.
template <typename In>
void remove_self_terms(const In& in, bool causal, SoftmaxAccumulator<typename In::Scalar>& acc) {
  using Scalar = typename In::Scalar;
  const Index n = in.q.rows(), first = causal ? 1 : 0;
  if (n <= 1) return;
  const Index block = std::min<Index>(n, 256), dv = in.v.cols();
  FeatureBlock<Scalar> qb(block, in.features()), kb(block, in.features());
  Scratch<RowMatrix<Scalar>> nd(block, dv + 1);
  for (Index i0 = first; i0 < n; i0 += block) {
    const Index len = std::min(block, n - i0);
    const auto qf = in.q.view(i0, len, qb);
    const auto kf = in.k.view(i0, len, kb);
    for (Index r = 0; r < len; ++r) {
      const Scalar w = in.signs.size() > 0
                           ? (qf.row(r).array() * in.signs.transpose().array() * kf.row(r).array()).sum()
                           : qf.row(r).dot(kf.row(r));
      nd.row(r).head(dv) = -w * in.v.row(i0 + r);
      nd(r, dv) = -w;
    }
    acc.merge_rows(i0, nd.topRows(len), qb.log_scale.head(len) + kb.log_scale.head(len));
  }
}

// Causal or bidirectional attention of the operands, its result checked when check_finite: a
// non-finite result names the first non-finite input, or reports an overflow.
template <typename In>
SoftmaxAccumulator<typename In::Scalar> linear_accumulate(const char* where, const In& in,
                                                          bool causal, bool check_finite) {
  SoftmaxAccumulator<typename In::Scalar> acc =
      causal ? linear_causal(in) : linear_bidirectional(in);
  check_result_finite(where, acc.numden(), check_finite, [&] {
    in.q.scan(where, "q_features");
    in.k.scan(where, "k_features");
    require_finite(in.v, where, "v");
  });
  return acc;
}

// The chunk length of the options: block_size, or the default of the mode.
inline Index linear_chunk(const LinearOptions& opt) {
  return opt.block_size > 0 ? opt.block_size : opt.causal ? kDefaultCausalChunk : kDefaultKeyPanel;
}

}  // namespace detail

// The unnormalised result as an accumulator (for merging with other partial results).
// Empty q_log_scale / k_log_scale mean zeros; empty signs mean all +1.
template <typename Scalar>
SoftmaxAccumulator<Scalar> linear_attention_accumulate(
    const Eigen::Ref<const RowMatrix<Scalar>>& q_features,
    const Eigen::Ref<const Vector<Scalar>>& q_log_scale,
    const Eigen::Ref<const RowMatrix<Scalar>>& k_features,
    const Eigen::Ref<const Vector<Scalar>>& k_log_scale,
    const Eigen::Ref<const RowMatrix<Scalar>>& v, const Eigen::Ref<const Vector<Scalar>>& signs,
    const LinearOptions& opt = {}) {
  const char* where = "linear_attention";
  detail::check_linear_inputs<Scalar>(where, q_features, q_log_scale, k_features, k_log_scale, v,
                                      signs, opt);
  if (q_features.rows() == 0) return SoftmaxAccumulator<Scalar>(0, v.cols());
  const detail::GivenFeatureRows<Scalar> q(q_features, q_log_scale), k(k_features, k_log_scale);
  const detail::LinearOperands<detail::GivenFeatureRows<Scalar>, detail::GivenFeatureRows<Scalar>>
      in{q, k, v, signs, detail::linear_chunk(opt)};
  return detail::linear_accumulate(where, in, opt.causal, opt.check_finite);
}

namespace detail {

// Normalised linear attention into `out`, after checking `out`: the one body of both overloads
// and their `_into` forms.
template <typename Scalar, typename DO>
void linear_attention_into_impl(const Eigen::Ref<const RowMatrix<Scalar>>& q_features,
                                const Eigen::Ref<const Vector<Scalar>>& q_log_scale,
                                const Eigen::Ref<const RowMatrix<Scalar>>& k_features,
                                const Eigen::Ref<const Vector<Scalar>>& k_log_scale,
                                const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                const Eigen::Ref<const Vector<Scalar>>& signs,
                                const Eigen::MatrixBase<DO>& out, const LinearOptions& opt) {
  static_assert(std::is_same<Scalar, typename DO::Scalar>::value,
                "features, values and out must share the scalar type");
  const char* where = "linear_attention";
  check_output(where, out, q_features.rows(), v.cols(),
               {named_input("q_features", q_features), named_input("q_log_scale", q_log_scale),
                named_input("k_features", k_features), named_input("k_log_scale", k_log_scale),
                named_input("v", v), named_input("signs", signs)});
  linear_attention_accumulate<Scalar>(q_features, q_log_scale, k_features, k_log_scale, v, signs,
                                      opt)
      .finalize_into(out, static_cast<Scalar>(opt.denominator_epsilon));
  check_result_finite(where, out, opt.check_finite, [] {});
}

}  // namespace detail

// Normalised linear attention D^{-1} Q'(K'^T [V | 1]) for scaled features, written into `out`
// (n_q x dv, sharing no memory with the features, log-scales, v or signs). A rejected `out` is
// not written; an overflow error (check_finite) is raised after `out` holds the result.
template <typename Scalar, typename DV, typename DO>
void linear_attention_into(const ScaledFeatures<Scalar>& q, const ScaledFeatures<Scalar>& k,
                           const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
                           const LinearOptions& opt = {},
                           const Vector<Scalar>& signs = Vector<Scalar>()) {
  static_assert(std::is_same<Scalar, typename DV::Scalar>::value,
                "features and values must share the scalar type");
  detail::linear_attention_into_impl<Scalar>(q.values, q.log_scale, k.values, k.log_scale, v,
                                             signs, out, opt);
}

// Normalised linear attention D^{-1} Q'(K'^T [V | 1]) for scaled features.
template <typename Scalar, typename DV>
RowMatrix<Scalar> linear_attention(const ScaledFeatures<Scalar>& q, const ScaledFeatures<Scalar>& k,
                                   const Eigen::MatrixBase<DV>& v, const LinearOptions& opt = {},
                                   const Vector<Scalar>& signs = Vector<Scalar>()) {
  auto out = detail::fresh_matrix<RowMatrix<Scalar>>(q.values.rows(), v.cols());
  linear_attention_into(q, k, v, out, opt, signs);
  return out;
}

// Normalised linear attention for plain feature matrices (no log-scales, no signs), written into
// `out` as the overload above.
template <typename DQ, typename DK, typename DV, typename DO>
void linear_attention_into(const Eigen::MatrixBase<DQ>& q_features,
                           const Eigen::MatrixBase<DK>& k_features, const Eigen::MatrixBase<DV>& v,
                           const Eigen::MatrixBase<DO>& out, const LinearOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value,
                "q_features, k_features and v must share the scalar type");
  const Vector<Scalar> none;
  detail::linear_attention_into_impl<Scalar>(q_features, none, k_features, none, v, none, out,
                                             opt);
}

// Normalised linear attention for plain feature matrices (no log-scales, no signs).
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& q_features,
                                                const Eigen::MatrixBase<DK>& k_features,
                                                const Eigen::MatrixBase<DV>& v,
                                                const LinearOptions& opt = {}) {
  RowMatrix<typename DQ::Scalar> out(q_features.rows(), v.cols());
  linear_attention_into(q_features, k_features, v, out, opt);
  return out;
}

// Batched multi-head linear attention over contiguous row-major buffers:
// q_features (batch, heads, n_q, M), k_features (batch, heads, n_k, M), v (batch, heads, n_k, dv),
// out (batch, heads, n_q, dv); shape.d is the feature dimension M. Log-scale buffers
// (batch, heads, n) may be null (zeros); signs (M) may be null (all +1). Slices run in parallel
// with OpenMP, each on one thread, so results do not depend on the thread count.
template <typename Scalar>
void linear_attention_batched(const Scalar* q_features, const Scalar* q_log_scale,
                              const Scalar* k_features, const Scalar* k_log_scale, const Scalar* v,
                              const Scalar* signs, Scalar* out, const BatchShape& shape,
                              const LinearOptions& opt = {}) {
  const char* where = "linear_attention_batched";
  const Index slices = shape.slices();
  detail::check_batch_output(
      where, shape, out,
      {detail::named_buffer("q_features", q_features, slices * shape.n_q * shape.d),
       detail::named_buffer("q_log_scale", q_log_scale, slices * shape.n_q),
       detail::named_buffer("k_features", k_features, slices * shape.n_k * shape.d),
       detail::named_buffer("k_log_scale", k_log_scale, slices * shape.n_k),
       detail::named_buffer("v", v, slices * shape.n_k * shape.dv),
       detail::named_buffer("signs", signs, shape.d)});
  using detail::slice_of;
  using VMap = Eigen::Map<const Vector<Scalar>>;
  const VMap sign_map(signs, signs ? shape.d : 0);
  const auto log_scales = [&](const Scalar* base, Index s, Index n) {
    return VMap(base ? base + s * n : nullptr, base ? n : 0);
  };
  detail::for_each_slice(
      where, shape, q_features && k_features && v && out,
      [&](Index s) {
        const auto qf = slice_of(q_features, s, shape.n_q, shape.d);
        const auto kf = slice_of(k_features, s, shape.n_k, shape.d);
        const auto vs = slice_of(v, s, shape.n_k, shape.dv);
        detail::check_linear_inputs<Scalar>(where, qf, log_scales(q_log_scale, s, shape.n_q), kf,
                                            log_scales(k_log_scale, s, shape.n_k), vs, sign_map,
                                            opt);
        if (opt.check_finite) {
          detail::require_finite(qf, where, "q_features");
          detail::require_finite(kf, where, "k_features");
          detail::require_finite(vs, where, "v");
        }
      },
      [&](Index s) {
        auto o = slice_of(out, s, shape.n_q, shape.dv);
        linear_attention_accumulate<Scalar>(
            slice_of(q_features, s, shape.n_q, shape.d), log_scales(q_log_scale, s, shape.n_q),
            slice_of(k_features, s, shape.n_k, shape.d), log_scales(k_log_scale, s, shape.n_k),
            slice_of(v, s, shape.n_k, shape.dv), sign_map, opt)
            .finalize_into(o, static_cast<Scalar>(opt.denominator_epsilon));
        detail::check_result_finite(where, o, opt.check_finite, [] {});
      });
}

}  // namespace randattn
