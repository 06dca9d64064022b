#pragma once
// Linear attention over given feature matrices: [num | den] = Q' (K'^T [V | 1]), optionally
// with a sign vector (phi(q)^T diag(sigma) phi(k)) and per-row log-scales (ScaledFeatures).
// Causal attention is computed by chunked prefix sums made of matrix products: inside a chunk
// the masked product (Q'_c K'_c^T ⊙ L)[V_c | 1], across chunks a carried state
// S = sum_j K'_j^T [V_j | 1]. The stabiliser never looks at future keys: inside a chunk row i
// is scaled by the running maximum of the key log-scales up to i, and the carried state by the
// maximum over past chunks, so output i depends on keys 0..i only (bit for bit).

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include <Eigen/Core>

#include "../detail/batch.hpp"
#include "../detail/gemm.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
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

namespace detail {

// Causal chunks trade the O(n*C*M) masked products against per-chunk overhead; bidirectional
// panels only bound the depth of the key products.
constexpr Index kDefaultCausalChunk = 32;
// Chunks per group of causal attention (see linear_causal); a shape constant, not a thread count.
constexpr Index kCausalGroup = 16;
constexpr Index kDefaultKeyPanel = kMaxGemmDepth;

template <typename Scalar>
RowMatrix<Scalar> append_ones(const Eigen::Ref<const RowMatrix<Scalar>>& v) {
  RowMatrix<Scalar> ve(v.rows(), v.cols() + 1);
  ve.leftCols(v.cols()) = v;
  ve.col(v.cols()).setOnes();
  return ve;
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
  require(q_log.size() == 0 || q_log.size() == qf.rows(), where, "q_log_scale has ",
          q_log.size(), " entries, expected 0 or ", qf.rows());
  require(k_log.size() == 0 || k_log.size() == kf.rows(), where, "k_log_scale has ",
          k_log.size(), " entries, expected 0 or ", kf.rows());
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
    require(qf.cols() > 0, where, "feature dimension must be >= 1 (q_features ", shape_of(qf),
            ")");
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

// Names the first non-finite entry of the feature and value inputs (see check_result_finite).
template <typename Scalar>
auto linear_input_scan(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& qf,
                       const Eigen::Ref<const RowMatrix<Scalar>>& kf,
                       const Eigen::Ref<const RowMatrix<Scalar>>& v) {
  return [=, &qf, &kf, &v] {
    require_finite(qf, where, "q_features");
    require_finite(kf, where, "k_features");
    require_finite(v, where, "v");
  };
}

// The operands of one call as both paths read them; ve = [v | 1].
template <typename Scalar>
struct LinearOperands {
  Eigen::Ref<const RowMatrix<Scalar>> qf;
  Eigen::Ref<const Vector<Scalar>> q_log;
  Eigen::Ref<const RowMatrix<Scalar>> kf;
  Eigen::Ref<const Vector<Scalar>> k_log;
  const RowMatrix<Scalar>& ve;
  Eigen::Ref<const Vector<Scalar>> signs;
  Index chunk;
};

// Per-chunk key summaries T_t = K'_t^T [V_t | 1] (signs applied), each relative to
// exp(log_scale(t)) with log_scale(t) the largest key log-scale of chunk t. They depend on
// chunk t's keys alone and are computed in parallel.
template <typename Scalar>
struct KeySummaries {
  RowMatrix<Scalar> blocks;  // (chunks * M) x (dv + 1); chunk t is rows [t*M, (t+1)*M)
  Vector<Scalar> log_scale;  // chunks
  Index m = 0;

  auto block(Index t) { return blocks.middleRows(t * m, m); }
  auto block(Index t) const { return blocks.middleRows(t * m, m); }
};

// Calls use(keys) with key rows [j0, j0 + len) carrying the signs and the weights
// exp(k_log - g); the rows are used in place when there is nothing to apply.
template <typename Scalar, typename Use>
void with_weighted_keys(const Eigen::Ref<const RowMatrix<Scalar>>& kf,
                        const Eigen::Ref<const Vector<Scalar>>& k_log,
                        const Eigen::Ref<const Vector<Scalar>>& signs, Index j0, Index len,
                        Scalar g, Use&& use) {
  const auto keys = kf.middleRows(j0, len);
  if (k_log.size() == 0 && signs.size() == 0) {
    use(keys);
    return;
  }
  RowMatrix<Scalar> out(len, kf.cols());
  if (k_log.size() > 0) {
    const Vector<Scalar> w = (k_log.segment(j0, len).array() - g).exp().matrix();
    if (signs.size() > 0) {
      out.noalias() = w.asDiagonal() * keys * signs.asDiagonal();
    } else {
      out.noalias() = w.asDiagonal() * keys;
    }
  } else {
    out.noalias() = keys * signs.asDiagonal();
  }
  use(out);
}

// T = K'_cᵀ [V_c | 1] for key rows [j0, j0 + len) (signs applied), written to `out` relative to
// exp(g), g the largest key log-scale of those rows; returns g.
template <typename Scalar, typename Out>
Scalar summarise_chunk(const LinearOperands<Scalar>& in, Index j0, Index len, Out&& out) {
  const Scalar g = in.k_log.size() > 0 ? in.k_log.segment(j0, len).maxCoeff() : Scalar(0);
  with_weighted_keys<Scalar>(in.kf, in.k_log, in.signs, j0, len, g, [&](const auto& keys) {
    gemm_fixed_depth(out, keys.transpose(), in.ve.middleRows(j0, len), false);
  });
  return g;
}

// Per-chunk key summaries, computed in parallel.
template <typename Scalar>
KeySummaries<Scalar> summarise_keys(const LinearOperands<Scalar>& in) {
  const Index n_k = in.kf.rows(), m = in.kf.cols(), chunk = in.chunk;
  const Index chunks = (n_k + chunk - 1) / chunk;
  KeySummaries<Scalar> sums{RowMatrix<Scalar>(chunks * m, in.ve.cols()), Vector<Scalar>(chunks), m};
  parallel_for(chunks, [&](Index t) {
    const Index j0 = t * chunk;
    sums.log_scale(t) = summarise_chunk(in, j0, std::min(chunk, n_k - j0), sums.block(t));
  });
  return sums;
}

// Rows [i0, i0 + len) of causal attention, merged into acc: the masked product with the chunk's
// own keys, and Q_c `state` for the keys before it (`state` relative to exp(state_log); −inf:
// none). Row i is stabilised by the largest key log-scale up to i, never a later one.
template <typename Scalar, typename State>
void causal_chunk_rows(const LinearOperands<Scalar>& in, Index i0, Index len, const State& state,
                       Scalar state_log, SoftmaxAccumulator<Scalar>& acc) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const auto queries = in.qf.middleRows(i0, len);
  RowMatrix<Scalar> weights(len, len), nd(len, in.ve.cols());
  Vector<Scalar> log_rows(len);
  with_weighted_keys<Scalar>(in.kf, Vector<Scalar>(), in.signs, i0, len, Scalar(0),
                             [&](const auto& keys) {
                               gemm_fixed_depth(weights, queries, keys.transpose(), false);
                             });
  Scalar prefix_max = kNegInf;
  for (Index i = 0; i < len; ++i) {
    if (in.k_log.size() > 0) {
      prefix_max = std::max(prefix_max, in.k_log(i0 + i));
      weights.row(i).head(i + 1).array() *=
          (in.k_log.segment(i0, i + 1).array() - prefix_max).exp().transpose();
      log_rows(i) = prefix_max;
    } else {
      log_rows(i) = 0;
    }
    weights.row(i).tail(len - i - 1).setZero();
  }
  if (in.q_log.size() > 0) log_rows += in.q_log.segment(i0, len);
  gemm_fixed_depth(nd, weights, in.ve.middleRows(i0, len), false);
  acc.merge_rows(i0, nd, log_rows);
  if (state_log != kNegInf) {
    gemm_fixed_depth(nd, queries, state, false);
    log_rows.setConstant(state_log);
    if (in.q_log.size() > 0) log_rows += in.q_log.segment(i0, len);
    acc.merge_rows(i0, nd, log_rows);
  }
}

// The summary S = K'^T [V | 1] of all keys (at least one), relative to exp(c).
template <typename Scalar>
RowMatrix<Scalar> key_state(const LinearOperands<Scalar>& in, Scalar& c) {
  const KeySummaries<Scalar> sums = summarise_keys(in);
  // Summing the chunks in a fixed order keeps the result independent of the thread count.
  RowMatrix<Scalar> state = sums.block(0);
  c = sums.log_scale(0);
  for (Index t = 1; t < sums.log_scale.size(); ++t)
    merge_scaled(state, c, sums.block(t), sums.log_scale(t));
  return state;
}

// Every query against the key summary `state` (relative to exp(c)): [num | den] = Q' S.
template <typename Scalar>
SoftmaxAccumulator<Scalar> query_key_state(const LinearOperands<Scalar>& in, const RowMatrix<Scalar>& state,
                                           Scalar c) {
  const Index n_q = in.qf.rows();
  RowMatrix<Scalar> nd(n_q, in.ve.cols());
  parallel_for((n_q + in.chunk - 1) / in.chunk, [&](Index b) {
    const Index i0 = b * in.chunk, len = std::min(in.chunk, n_q - i0);
    gemm_fixed_depth(nd.middleRows(i0, len), in.qf.middleRows(i0, len), state, false);
  });
  Vector<Scalar> log_scale = Vector<Scalar>::Constant(n_q, c);
  if (in.q_log.size() > 0) log_scale += in.q_log;
  return SoftmaxAccumulator<Scalar>(std::move(nd), std::move(log_scale));
}

// Causal linear attention. The sequence is cut into chunks of in.chunk rows, and the chunks into
// groups of kCausalGroup; groups run in order, carrying the state S of every key before the
// group. Inside a group the chunk summaries are computed in parallel, turned into exclusive
// prefixes in order (S absorbs them one by one), and every chunk's rows are then finished in
// parallel: Q_c S_c for the keys before the chunk, the masked product inside it. The merge order
// is fixed by the shapes, so results do not depend on the thread count, and memory holds one
// group's states, not one per chunk.
template <typename Scalar>
SoftmaxAccumulator<Scalar> linear_bidirectional(const LinearOperands<Scalar>& in) {
  Scalar c;
  const RowMatrix<Scalar> state = key_state(in, c);
  return query_key_state(in, state, c);
}

template <typename Scalar>
SoftmaxAccumulator<Scalar> linear_causal(const LinearOperands<Scalar>& in) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index n = in.qf.rows(), m = in.kf.cols(), w = in.ve.cols(), chunk = in.chunk;
  const Index chunks = (n + chunk - 1) / chunk;
  SoftmaxAccumulator<Scalar> acc(n, w - 1);
  RowMatrix<Scalar> carried = RowMatrix<Scalar>::Zero(m, w), incoming(m, w);
  Scalar carried_log = kNegInf;
  KeySummaries<Scalar> prefix{RowMatrix<Scalar>(std::min(chunks, kCausalGroup) * m, w),
                              Vector<Scalar>(std::min(chunks, kCausalGroup)), m};
  for (Index first = 0; first < chunks; first += kCausalGroup) {
    const Index group = std::min(kCausalGroup, chunks - first);
    parallel_for(group, [&](Index t) {
      const Index j0 = (first + t) * chunk, len = std::min(chunk, n - j0);
      prefix.log_scale(t) = summarise_chunk(in, j0, len, prefix.block(t));
    });
    // Exclusive prefix: block t becomes the state of every key before chunk first + t.
    for (Index t = 0; t < group; ++t) {
      incoming = prefix.block(t);
      const Scalar c_in = prefix.log_scale(t);
      prefix.block(t) = carried;
      prefix.log_scale(t) = carried_log;
      merge_scaled(carried, carried_log, incoming, c_in);
    }
    parallel_for(group, [&](Index t) {
      const Index i0 = (first + t) * chunk, len = std::min(chunk, n - i0);
      causal_chunk_rows(in, i0, len, prefix.block(t), prefix.log_scale(t), acc);
    });
  }
  return acc;
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
  const Index chunk = opt.block_size > 0 ? opt.block_size
                      : opt.causal         ? detail::kDefaultCausalChunk
                                           : detail::kDefaultKeyPanel;
  if (q_features.rows() == 0) return SoftmaxAccumulator<Scalar>(0, v.cols());
  const RowMatrix<Scalar> ve = detail::append_ones<Scalar>(v);
  const detail::LinearOperands<Scalar> in{q_features, q_log_scale, k_features, k_log_scale, ve,
                                         signs, chunk};
  SoftmaxAccumulator<Scalar> acc =
      opt.causal ? detail::linear_causal<Scalar>(in) : detail::linear_bidirectional<Scalar>(in);
  detail::check_result_finite(where, acc.numden(), opt.check_finite,
                              detail::linear_input_scan<Scalar>(where, q_features, k_features, v));
  return acc;
}

// Normalised linear attention D^{-1} Q'(K'^T [V | 1]) for scaled features.
template <typename Scalar, typename DV>
RowMatrix<Scalar> linear_attention(const ScaledFeatures<Scalar>& q, const ScaledFeatures<Scalar>& k,
                                   const Eigen::MatrixBase<DV>& v, const LinearOptions& opt = {},
                                   const Vector<Scalar>& signs = Vector<Scalar>()) {
  static_assert(std::is_same<Scalar, typename DV::Scalar>::value,
                "features and values must share the scalar type");
  RowMatrix<Scalar> out = linear_attention_accumulate<Scalar>(q.values, q.log_scale, k.values,
                                                             k.log_scale, v, signs, opt)
                              .finalize(static_cast<Scalar>(opt.denominator_epsilon));
  detail::check_result_finite("linear_attention", out, opt.check_finite, [] {});
  return out;
}

// Normalised linear attention for plain feature matrices (no log-scales, no signs).
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& q_features,
                                                const Eigen::MatrixBase<DK>& k_features,
                                                const Eigen::MatrixBase<DV>& v,
                                                const LinearOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value,
                "q_features, k_features and v must share the scalar type");
  const Vector<Scalar> none;
  RowMatrix<Scalar> out =
      linear_attention_accumulate<Scalar>(q_features, none, k_features, none, v, none, opt)
          .finalize(static_cast<Scalar>(opt.denominator_epsilon));
  detail::check_result_finite("linear_attention", out, opt.check_finite, [] {});
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
        if (opt.check_finite) detail::linear_input_scan<Scalar>(where, qf, kf, vs)();
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
