#pragma once
// Random-feature attention: a feature map (features/feature_maps.hpp, features/hybrid.hpp)
// followed by the shared linear core, softmax(scale · Q Kᵀ) V ≈ D⁻¹ φ(Q) diag(σ) (φ(K)ᵀ [V | 1]).
// Bidirectional, causal (chunked prefix sums; output i depends on rows 0..i only, bit for
// bit), batched multi-head, and one token at a time (RandomFeatureDecoder).
//
// A feature map type Map provides: Scalar; input_dim(); feature_dim();
// features_into(x, normaliser, values, log_scale, FeatureSide); signs() (empty = all +1);
// and `static constexpr bool nonnegative`. The data normaliser scale^{1/2} is applied to q
// and k inside the map, so the estimated kernel is exp(scale · qᵀk).
//
// Denominator guard. Nonnegative maps (positive, hyperbolic) give positive denominators and
// use denominator_epsilon = 0 by default: no bias at all; a row is returned as zeros only if
// its denominator underflows to 0 or into the subnormal range (possible only at extreme norms,
// e.g. scale·‖q‖² in the hundreds in float). Signed maps (trig, hybrid) can produce
// denominators near zero or negative and use 1e-6 by default: den ← den + 2ε·[|den| ≤ ε] (den
// relative to the row's log-scale), so every output is finite; an explicit 0 is rejected for
// them.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../core/detail/output_check.hpp"
#include "../core/detail/score_tile.hpp"
#include "../core/input_checks.hpp"
#include "../detail/fresh_matrix.hpp"
#include "../detail/matrix_pool.hpp"
#include "../core/linear_attention.hpp"
#include "../core/linear_decoder.hpp"
#include "../core/options.hpp"
#include "../core/scaled_features.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../detail/batch.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "../features/feature_maps.hpp"

namespace randattn {

// causal, scale (> 0, default 1/sqrt(d)) and check_finite: see core/options.hpp.
struct RandomFeatureOptions : AttentionOptions {
  std::optional<double> denominator_epsilon;  // default 0 (nonnegative maps) or 1e-6 (signed)
  Index block_size = 0;                       // causal chunk length; 0 = automatic
  // Queries and keys are the same positions (n_q == n_k): the estimate of key i's term is
  // removed from query i's sums unless key i is its only key (the rule of shared-QK LSH).
  bool exclude_self = false;
};

namespace detail {

// Resolved settings: the data normaliser scale^{1/2} and the options of the linear core.
template <typename Scalar>
struct FeatureAttentionSettings {
  Scalar normaliser;
  LinearOptions linear;
  bool exclude_self = false;
};

template <typename Map>
FeatureAttentionSettings<typename Map::Scalar> feature_attention_settings(
    const char* where, const Map& map, const RandomFeatureOptions& opt) {
  using Scalar = typename Map::Scalar;
  const double scale = resolve_scale<double>(where, opt, inverse_sqrt_dim(map.input_dim()));
  require(scale > 0, where,
          "scale must be positive and finite (the data normaliser is scale^(1/2)), got ", scale);
  const double eps = opt.denominator_epsilon ? *opt.denominator_epsilon
                     : Map::nonnegative      ? 0.0
                                             : LinearOptions{}.denominator_epsilon;
  require(eps >= 0 && std::isfinite(eps), where,
          "denominator_epsilon must be finite and >= 0, got ", eps);
  require(Map::nonnegative || eps > 0, where,
          "this feature map is not positive: denominator_epsilon must be > 0 so that ",
          "denominators near zero are guarded");
  require(opt.block_size >= 0, where, "block_size must be >= 0, got ", opt.block_size);
  LinearOptions lin;
  lin.causal = opt.causal;
  lin.block_size = opt.block_size;
  lin.denominator_epsilon = eps;
  // Inputs are checked before mapping; the core's check of its small result then catches
  // features that overflowed (e.g. an extreme bandwidth or scale) at almost no cost.
  lin.check_finite = opt.check_finite;
  return {static_cast<Scalar>(std::sqrt(scale)), lin, opt.exclude_self};
}

// Validates one (q, k, v) slice: shapes, and finiteness when check_finite.
template <typename Map>
void check_feature_slice(const char* where, const Map& map,
                         const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
                         const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
                         const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
                         const FeatureAttentionSettings<typename Map::Scalar>& s,
                         bool check_finite) {
  using Scalar = typename Map::Scalar;
  require(q.cols() == map.input_dim() && k.cols() == map.input_dim(), where, "q (", shape_of(q),
          ") and k (", shape_of(k), ") must have the feature map's input dimension ",
          map.input_dim());
  check_attention_shapes<Scalar>(where, q, k, v);
  check_attention_counts(where, q.rows(), k.rows(), s.linear.causal);
  require(!s.exclude_self || q.rows() == k.rows(), where, "exclude_self needs as many queries (",
          q.rows(), ") as keys (", k.rows(), ")");
  if (check_finite) check_attention_finite<Scalar>(where, q, k, v);
}

// q and k as features, into qf and kf (q.rows() and k.rows() rows of map.feature_dim()).
template <typename Map>
void map_features(const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
                  const FeatureAttentionSettings<typename Map::Scalar>& s,
                  ScaledFeatures<typename Map::Scalar>& qf,
                  ScaledFeatures<typename Map::Scalar>& kf) {
  if (q.rows() == 0) return;
  map.features_into(q, s.normaliser, qf.values, qf.log_scale, FeatureSide::query);
  map.features_into(k, s.normaliser, kf.values, kf.log_scale, FeatureSide::key);
}

// Validates one (q, k, v) slice and maps q and k to features.
template <typename Map>
std::pair<ScaledFeatures<typename Map::Scalar>, ScaledFeatures<typename Map::Scalar>> map_slice(
    const char* where, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const FeatureAttentionSettings<typename Map::Scalar>& s, bool check_finite) {
  using Scalar = typename Map::Scalar;
  check_feature_slice(where, map, q, k, v, s, check_finite);
  const Index dim = map.feature_dim();
  ScaledFeatures<Scalar> qf{fresh_matrix<RowMatrix<Scalar>>(q.rows(), dim),
                            Vector<Scalar>(q.rows())};
  ScaledFeatures<Scalar> kf{fresh_matrix<RowMatrix<Scalar>>(k.rows(), dim),
                            Vector<Scalar>(k.rows())};
  map_features(map, q, k, s, qf, kf);
  return {std::move(qf), std::move(kf)};
}

// Features of q or k computed block by block as the linear core reads them (a row source of
// core/linear_attention.hpp): no n x M feature matrix is ever held.
template <typename Map>
class MappedFeatureRows {
 public:
  using Scalar = typename Map::Scalar;

  MappedFeatureRows(const Map& map, const Eigen::Ref<const RowMatrix<Scalar>>& x, Scalar normaliser,
                    FeatureSide side)
      : map_(map), x_(x), normaliser_(normaliser), side_(side) {}

  Index rows() const { return x_.rows(); }
  Index dim() const { return map_.feature_dim(); }
  void fill(Index i0, Index len, Eigen::Ref<RowMatrix<Scalar>> values,
            Eigen::Ref<Vector<Scalar>> log_scale) const {
    map_.features_into(x_.middleRows(i0, len), normaliser_, values, log_scale, side_);
  }
  Eigen::Ref<const RowMatrix<Scalar>> view(Index i0, Index len, FeatureBlock<Scalar>& block) const {
    fill(i0, len, block.values.topRows(len), block.log_scale.head(len));
    return block.values.topRows(len);
  }
  // q and k were checked before mapping, so a non-finite result means the features overflowed.
  void scan(const char*, const char*) const {}

 private:
  const Map& map_;
  Eigen::Ref<const RowMatrix<Scalar>> x_;
  Scalar normaliser_;
  FeatureSide side_;
};

// The operands of the linear core for one (q, k, v) slice: features of q and k mapped block by
// block, the map's signs and the chunk length. Holds references to map, q, k and v.
template <typename Map>
struct FeatureOperands {
  using Scalar = typename Map::Scalar;
  using Rows = MappedFeatureRows<Map>;
  Rows q, k;
  detail::Scratch<Vector<Scalar>> signs;  // a pooled copy: a map may return its signs by value
  LinearOperands<Rows, Rows> in;

  FeatureOperands(const Map& map, const Eigen::Ref<const RowMatrix<Scalar>>& q_rows,
                  const Eigen::Ref<const RowMatrix<Scalar>>& k_rows,
                  const Eigen::Ref<const RowMatrix<Scalar>>& v,
                  const FeatureAttentionSettings<Scalar>& s)
      : q(map, q_rows, s.normaliser, FeatureSide::query),
        k(map, k_rows, s.normaliser, FeatureSide::key),
        signs(detail::pooled_copy(map.signs())),
        in{q, k, v, signs, linear_chunk(s.linear)} {}
  FeatureOperands(const FeatureOperands&) = delete;
  FeatureOperands& operator=(const FeatureOperands&) = delete;
};

template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> feature_attention_slice(
    const char* where, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const FeatureAttentionSettings<typename Map::Scalar>& s, bool check_finite) {
  using Scalar = typename Map::Scalar;
  check_feature_slice(where, map, q, k, v, s, check_finite);
  if (q.rows() == 0) return SoftmaxAccumulator<Scalar>(0, v.cols());
  const FeatureOperands<Map> op(map, q, k, v, s);
  SoftmaxAccumulator<Scalar> acc =
      linear_accumulate(where, op.in, s.linear.causal, s.linear.check_finite);
  if (s.exclude_self) remove_self_terms(op.in, s.linear.causal, acc);
  return acc;
}

}  // namespace detail

// Random-feature attention in parts, for callers that hold the keys in parts (e.g. one part per
// process of a sharded sequence): the summary of this part's keys, this part's queries against a
// summary of any keys, and causal attention within the part together with its keys' summary.
// Summaries of several parts merge with the online-softmax rule in key order. The constructor
// checks the options, the map's input dimension, the shapes and (when opt.check_finite) the
// finiteness of q, k and v; the row counts of the whole call are the caller's to check
// (check_attention_counts). Holds references to map, q, k and v.
template <typename Map>
class FeatureAttentionParts {
 public:
  using Scalar = typename Map::Scalar;

  FeatureAttentionParts(const char* where, const Map& map,
                        const Eigen::Ref<const RowMatrix<Scalar>>& q,
                        const Eigen::Ref<const RowMatrix<Scalar>>& k,
                        const Eigen::Ref<const RowMatrix<Scalar>>& v,
                        const RandomFeatureOptions& opt)
      : settings_(checked_settings(where, map, q, k, v, opt)), op_(map, q, k, v, settings_) {}

  // φ(K)ᵀ diag(σ) [V | 1] of this part's keys (zeros and −inf without keys).
  KeySummary<Scalar> key_summary() const {
    KeySummary<Scalar> s{RowMatrix<Scalar>::Zero(op_.in.features(), op_.in.width())};
    if (op_.k.rows() > 0) s.state = detail::key_state(op_.in, s.log_scale);
    return s;
  }

  // This part's queries against the summary of some keys (a summary with log_scale −inf adds
  // nothing: every row stays empty).
  SoftmaxAccumulator<Scalar> queries_against(const KeySummary<Scalar>& keys) const {
    return detail::query_key_state(op_.in, keys.state, keys.log_scale);
  }

  // Causal attention of this part's queries to its own keys (query i sees keys j <= i of the
  // part; needs as many queries as keys), and the summary of all its keys.
  std::pair<SoftmaxAccumulator<Scalar>, KeySummary<Scalar>> causal_with_key_summary() const {
    return detail::linear_causal_with_summary(op_.in);
  }

  // The denominator guard finalize() needs for this map and these options.
  Scalar denominator_epsilon() const {
    return static_cast<Scalar>(settings_.linear.denominator_epsilon);
  }

 private:
  static detail::FeatureAttentionSettings<Scalar> checked_settings(
      const char* where, const Map& map, const Eigen::Ref<const RowMatrix<Scalar>>& q,
      const Eigen::Ref<const RowMatrix<Scalar>>& k, const Eigen::Ref<const RowMatrix<Scalar>>& v,
      const RandomFeatureOptions& opt) {
    const auto s = detail::feature_attention_settings(where, map, opt);
    detail::require(q.cols() == map.input_dim() && k.cols() == map.input_dim(), where, "q (",
                    detail::shape_of(q), ") and k (", detail::shape_of(k),
                    ") must have the feature map's input dimension ", map.input_dim());
    check_attention_shapes<Scalar>(where, q, k, v);
    if (opt.check_finite) check_attention_finite<Scalar>(where, q, k, v);
    return s;
  }

  detail::FeatureAttentionSettings<Scalar> settings_;
  detail::FeatureOperands<Map> op_;
};

// Unnormalised result as an accumulator (to merge with other partial results).
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> random_feature_attention_accumulate(
    const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const RandomFeatureOptions& opt = {}) {
  const char* where = "random_feature_attention";
  const auto s = detail::feature_attention_settings(where, map, opt);
  return detail::feature_attention_slice(where, map, q, k, v, s, opt.check_finite);
}

namespace detail {

template <typename Scalar, typename... Matrices>
constexpr bool shares_scalar = (std::is_same<Scalar, typename Matrices::Scalar>::value && ...);

// The 2-D _into forms: checks `out`, then finalises into it the accumulator
// accumulate(where, q, k, v, settings) returns (which checks the slice itself).
template <typename Map, typename DQ, typename DK, typename DV, typename DO, typename Accumulate>
void feature_attention_into(const Map& map, const Eigen::MatrixBase<DQ>& q,
                            const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                            const Eigen::MatrixBase<DO>& out, const RandomFeatureOptions& opt,
                            Accumulate&& accumulate) {
  using Scalar = typename Map::Scalar;
  static_assert(shares_scalar<Scalar, DQ, DK, DV, DO>,
                "the feature map, q, k, v and out must share the scalar type");
  const char* where = "random_feature_attention";
  const Eigen::Ref<const RowMatrix<Scalar>> qr(q), kr(k), vr(v);
  check_output(where, out, qr.rows(), vr.cols(),
               {named_input("q", qr), named_input("k", kr), named_input("v", vr)});
  const auto s = feature_attention_settings(where, map, opt);
  accumulate(where, qr, kr, vr, s)
      .finalize_into(out, static_cast<Scalar>(s.linear.denominator_epsilon));
}

}  // namespace detail

// softmax(scale · Q Kᵀ [masked]) V estimated with the map, written into `out` (n_q×dv, sharing
// no memory with q, k or v). A rejected `out` is not written.
template <typename Map, typename DQ, typename DK, typename DV, typename DO>
void random_feature_attention_into(const Map& map, const Eigen::MatrixBase<DQ>& q,
                                   const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                                   const Eigen::MatrixBase<DO>& out,
                                   const RandomFeatureOptions& opt = {}) {
  detail::feature_attention_into(
      map, q, k, v, out, opt, [&](const char* where, const auto& qr, const auto& kr,
                                  const auto& vr, const auto& s) {
        return detail::feature_attention_slice(where, map, qr, kr, vr, s, opt.check_finite);
      });
}

// softmax(scale · Q Kᵀ [masked]) V estimated with the map: q n_q×d, k n_k×d, v n_k×dv.
template <typename Map, typename DQ, typename DK, typename DV>
RowMatrix<typename Map::Scalar> random_feature_attention(const Map& map,
                                                         const Eigen::MatrixBase<DQ>& q,
                                                         const Eigen::MatrixBase<DK>& k,
                                                         const Eigen::MatrixBase<DV>& v,
                                                         const RandomFeatureOptions& opt = {}) {
  auto out = detail::fresh_matrix<RowMatrix<typename Map::Scalar>>(q.rows(), v.cols());
  random_feature_attention_into(map, q, k, v, out, opt);
  return out;
}

// Batched multi-head form over contiguous row-major buffers: q (batch, heads, n_q, d),
// k (batch, heads, n_k, d), v (batch, heads, n_k, dv), out (batch, heads, n_q, dv). One map
// (one ω) serves every slice. Slices run in parallel, each on one thread: results do not
// depend on the thread count.
template <typename Map>
void random_feature_attention_batched(const Map& map, const typename Map::Scalar* q,
                                      const typename Map::Scalar* k, const typename Map::Scalar* v,
                                      typename Map::Scalar* out, const BatchShape& shape,
                                      const RandomFeatureOptions& opt = {}) {
  using Scalar = typename Map::Scalar;
  const char* where = "random_feature_attention_batched";
  detail::check_batch_qkv_output(where, shape, q, k, v, out);
  detail::require(shape.d == map.input_dim(), where, "shape.d = ", shape.d,
                  " must equal the map's input dimension ", map.input_dim());
  const auto s = detail::feature_attention_settings(where, map, opt);
  using detail::slice_of;
  const auto slice = [&](Index i) {
    return std::make_tuple(slice_of(q, i, shape.n_q, shape.d), slice_of(k, i, shape.n_k, shape.d),
                           slice_of(v, i, shape.n_k, shape.dv));
  };
  detail::for_each_slice(
      where, shape, q && k && v && out,
      [&](Index i) {
        const auto [qs, ks, vs] = slice(i);
        detail::check_feature_slice(where, map, qs, ks, vs, s, opt.check_finite);
      },
      [&](Index i) {
        const auto [qs, ks, vs] = slice(i);
        auto o = slice_of(out, i, shape.n_q, shape.dv);
        // Inputs were scanned by the validation pass.
        detail::feature_attention_slice(where, map, qs, ks, vs, s, false)
            .finalize_into(o, static_cast<Scalar>(s.linear.denominator_epsilon));
      });
}

// Attention with every kernel estimate clipped at zero: weights max(0, φ(q_i)ᵀ diag(σ) φ(k_j))
// (masked when causal). For signed maps (trig, hybrid) this removes negative weights but is
// BIASED (E[max(0, X)] >= E[X]); it costs O(n_q · n_k · M) — the weights are formed block by
// block, never as an n_q × n_k matrix — so it is meant for moderate n and for study. A row
// whose clipped weights all vanish gets the denominator guard, i.e. zeros.
template <typename Map, typename DQ, typename DK, typename DV>
RowMatrix<typename Map::Scalar> random_feature_attention_clipped(
    const Map& map, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
    const Eigen::MatrixBase<DV>& v, const RandomFeatureOptions& opt = {}) {
  using Scalar = typename Map::Scalar;
  static_assert(detail::shares_scalar<Scalar, DQ, DK, DV>,
                "the feature map, q, k and v must share the scalar type");
  const char* where = "random_feature_attention_clipped";
  const auto s = detail::feature_attention_settings(where, map, opt);
  // Named members, not a structured binding: lambdas may not capture those in C++17.
  const auto mapped = detail::map_slice(where, map, q, k, v, s, opt.check_finite);
  const auto& qf = mapped.first;
  const auto& kf = mapped.second;
  const Index n_q = qf.rows(), n_k = kf.rows();
  const Index block = opt.block_size > 0 ? opt.block_size : detail::kDefaultTileSize;
  SoftmaxAccumulator<Scalar> acc(n_q, v.cols());
  Vector<Scalar> sigma = map.signs();
  if (sigma.size() == 0) sigma = Vector<Scalar>::Ones(map.feature_dim());
  detail::TileMask<> mask;
  mask.causal = opt.causal;
  detail::parallel_for((n_q + block - 1) / block, [&](Index b) {
    const Index i0 = b * block, bq = std::min(block, n_q - i0);
    const RowMatrix<Scalar> signed_q = qf.values.middleRows(i0, bq) * sigma.asDiagonal();
    const auto rows = detail::TileIndex::range(i0, bq);
    detail::ScoreTile<Scalar> tile(bq, block, v.cols());
    Vector<Scalar> key_weight(block);
    const Index k_end = opt.causal ? i0 + bq : n_k;
    for (Index j0 = 0; j0 < k_end; j0 += block) {
      const Index bk = std::min(block, k_end - j0);
      // Key weights relative to the block's largest key log-scale g; rows carry q_log + g.
      const Scalar g = kf.log_scale.segment(j0, bk).maxCoeff();
      key_weight.head(bk) = (kf.log_scale.segment(j0, bk).array() - g).exp().matrix();
      tile.logits(signed_q, kf.values.middleRows(j0, bk));
      tile.mask(rows, detail::TileIndex::range(j0, bk), mask);
      tile.clip(key_weight.head(bk), (qf.log_scale.segment(i0, bq).array() + g).matrix());
      tile.merge_into(acc, rows, v.middleRows(j0, bk));
    }
  });
  return acc.finalize(static_cast<Scalar>(s.linear.denominator_epsilon));
}

// Causal attention one token at a time (decoding): append(k_t, v_t), then query(q_t) returns
// the output of position t. O(M · dv) per token; append and query_into allocate nothing for
// maps on dense projections. Computes what random_feature_attention computes with
// causal = true, up to rounding.
template <typename Map>
class RandomFeatureDecoder {
 public:
  using Scalar = typename Map::Scalar;
  using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

  RandomFeatureDecoder(Map map, Index value_dim, const RandomFeatureOptions& opt = {})
      : map_(std::move(map)),
        settings_(detail::feature_attention_settings("RandomFeatureDecoder", map_, opt)),
        state_(map_.feature_dim(), value_dim, map_.signs(), settings_.linear.denominator_epsilon),
        x_(1, map_.input_dim()),
        features_(1, map_.feature_dim()),
        log_scale_(1),
        check_finite_(opt.check_finite) {}

  const Map& map() const { return map_; }
  Index length() const { return state_.length(); }
  void reset() { state_.reset(); }

  template <typename DK, typename DV>
  void append(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v) {
    map_row(k, "k", FeatureSide::key);
    state_.append(features_, v, log_scale_(0));
  }

  template <typename DQ>
  RowVector query(const Eigen::MatrixBase<DQ>& q) {
    map_row(q, "q", FeatureSide::query);
    return state_.query(features_, log_scale_(0));
  }

  // As query, written into a caller-provided row (1 x value_dim).
  template <typename DQ, typename DO>
  void query_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DO>& out) {
    map_row(q, "q", FeatureSide::query);
    state_.query_into(features_, log_scale_(0), out);
  }

 private:
  template <typename DX>
  void map_row(const Eigen::MatrixBase<DX>& x, const char* name, FeatureSide side) {
    detail::require(x.size() == map_.input_dim(), "RandomFeatureDecoder", name, " has ", x.size(),
                    " entries, expected ", map_.input_dim());
    x_ = x.derived().reshaped().transpose();
    detail::require_finite(x_, "RandomFeatureDecoder", name, check_finite_);
    map_.features_into(x_, settings_.normaliser, features_, log_scale_, side);
  }

  Map map_;
  detail::FeatureAttentionSettings<Scalar> settings_;
  LinearDecoderState<Scalar> state_;
  RowMatrix<Scalar> x_, features_;
  Vector<Scalar> log_scale_;
  bool check_finite_;
};

}  // namespace randattn
