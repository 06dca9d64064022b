#pragma once
// Backward of random-feature attention (random_feature_attention.hpp): the gradients of
// <grad_out, out> with respect to q, k, v and, on request, the projection ω, for the maps with a
// vector–Jacobian product (has_features_vjp: positive, hyperbolic, trig). The projection is the
// map's (fixed by its seed), so this is the gradient of the same estimate the forward computed.
//
// The features of q and k (n × M each) feed the linear core's backward (core/linear_backward.hpp),
// which hands each side the cotangent of its features relative to each row's log-scale; the map's
// features_vjp then turns that into dq or dk (and dω). A forward that keeps its features
// (SavedFeatures, random_feature_attention_into with a SavedFeatures) spares the backward mapping
// q and k again; otherwise it maps them itself, in the forward's pieces of rows. The
// stabilisers (a map's per-row maximum, the causal core's running maximum of key log-scales) are
// never differentiated through except where the denominator guard makes the output depend on
// them, and there only through the rows' own keys (j ≤ i under causal): dq_i and dk_j receive
// nothing from grad_out rows before j under causal. Memory: the two feature matrices and their
// cotangents (4·n·M) plus O(n·(dv + C)); never n·M·dv.

#include <randattn/detail/intrinsics.hpp>

#include <atomic>
#include <memory>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../core/detail/output_check.hpp"
#include "../core/linear_backward.hpp"
#include "../core/scaled_features.hpp"
#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/validation.hpp"
#include "../features/projected_feature_map.hpp"
#include "random_feature_attention.hpp"

namespace randattn {

// The features of one call's queries and keys as its forward computed them, kept for the
// backward: filled by random_feature_attention_into(map, q, k, v, out, saved, opt) and read by
// random_feature_attention_backward(..., saved, opt). They belong to that call's map, q, k and
// options: the backward checks their shapes and data normaliser, not their values.
// (n_q + n_k) × (feature_dim + 1) entries; refilling for the same shapes reuses the storage.
template <typename Scalar>
struct SavedFeatures {
  ScaledFeatures<Scalar> q, k;
  Scalar normaliser = 0;  // the data normaliser they were computed with
};

namespace detail {

// x's features as the linear core's forward maps them, in the same pieces of rows
// (feature_mapping_rows), so the same bits.
template <typename Map>
void forward_features(const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& x,
                      typename Map::Scalar normaliser, FeatureSide side, const LinearOptions& opt,
                      Eigen::Ref<RowMatrix<typename Map::Scalar>> values,
                      Eigen::Ref<Vector<typename Map::Scalar>> log_scale) {
  const Index n = x.rows(), piece = feature_mapping_rows(linear_chunk(opt), opt.causal);
  parallel_for((n + piece - 1) / piece, [&](Index t) {
    const Index i0 = t * piece, len = std::min(piece, n - i0);
    map.features_into(x.middleRows(i0, len), normaliser, values.middleRows(i0, len),
                      log_scale.segment(i0, len), side);
  });
}

// The linear core's accumulator on given features: what feature_attention_slice accumulates
// when these are the features it maps.
template <typename Scalar>
SoftmaxAccumulator<Scalar> given_features_accumulate(
    const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& qf,
    const Eigen::Ref<const Vector<Scalar>>& q_log, const Eigen::Ref<const RowMatrix<Scalar>>& kf,
    const Eigen::Ref<const Vector<Scalar>>& k_log, const Eigen::Ref<const RowMatrix<Scalar>>& v,
    const Eigen::Ref<const Vector<Scalar>>& signs, const LinearOptions& opt) {
  const GivenFeatureRows<Scalar> q_rows(qf, q_log), k_rows(kf, k_log);
  const LinearOperands<GivenFeatureRows<Scalar>, GivenFeatureRows<Scalar>> in{
      q_rows, k_rows, v, signs, linear_chunk(opt)};
  return linear_accumulate(where, in, opt.causal, opt.check_finite);
}

// Features of q or k mapped piece by piece as the linear core reads them (MappedFeatureRows),
// each piece also kept in `kept`: the first read of a piece maps it straight into its kept rows
// and the core reads them there, still in cache; a later read of the same piece (a thread
// replaying the keys before its chunks) maps into its own buffer. Pieces are the forward's
// (feature_mapping_rows), so the kept features are the forward's, bit for bit. Every piece is
// read at least once by a forward, so all rows are kept when it returns.
template <typename Map>
class KeepingFeatureRows {
 public:
  using Scalar = typename Map::Scalar;

  KeepingFeatureRows(const Map& map, const Eigen::Ref<const RowMatrix<Scalar>>& x,
                     Scalar normaliser, FeatureSide side, Index piece, ScaledFeatures<Scalar>& kept)
      : rows_(map, x, normaliser, side),
        piece_(piece),
        kept_(kept),
        claimed_(new std::atomic<bool>[std::size_t((x.rows() + piece - 1) / piece)]()) {}

  Index rows() const { return rows_.rows(); }
  Index dim() const { return rows_.dim(); }
  void fill(Index i0, Index len, Eigen::Ref<RowMatrix<Scalar>> values,
            Eigen::Ref<Vector<Scalar>> log_scale) const {
    if (!claim(i0, len)) return rows_.fill(i0, len, values, log_scale);
    map_kept(i0, len);
    values = kept_.values.middleRows(i0, len);
    log_scale = kept_.log_scale.segment(i0, len);
  }
  Eigen::Ref<const RowMatrix<Scalar>> view(Index i0, Index len, FeatureBlock<Scalar>& block) const {
    if (!claim(i0, len)) return rows_.view(i0, len, block);
    map_kept(i0, len);
    block.log_scale.head(len) = kept_.log_scale.segment(i0, len);
    return kept_.values.middleRows(i0, len);
  }
  void scan(const char* where, const char* name) const { rows_.scan(where, name); }

 private:
  // Whether this read is the first of its piece (which then maps into the kept rows). Relaxed:
  // the kept rows are read by other threads only after the forward's parallel region ends.
  bool claim(Index i0, Index len) const {
    eigen_assert(i0 % piece_ == 0 && len == std::min(piece_, rows() - i0));
    (void)len;
    return !claimed_[std::size_t(i0 / piece_)].exchange(true, std::memory_order_relaxed);
  }
  void map_kept(Index i0, Index len) const {
    rows_.fill(i0, len, kept_.values.middleRows(i0, len), kept_.log_scale.segment(i0, len));
  }

  MappedFeatureRows<Map> rows_;
  Index piece_;
  ScaledFeatures<Scalar>& kept_;
  std::unique_ptr<std::atomic<bool>[]> claimed_;
};

// The forward of one checked slice (feature_attention_slice's result, bit for bit), keeping its
// features in `saved`.
template <typename Map>
SoftmaxAccumulator<typename Map::Scalar> feature_attention_saving_slice(
    const char* where, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const FeatureAttentionSettings<typename Map::Scalar>& s,
    SavedFeatures<typename Map::Scalar>& saved) {
  using Scalar = typename Map::Scalar;
  require(!s.exclude_self, where, "exclude_self has no backward pass: its features are not kept");
  const Index dim = map.feature_dim();
  saved.normaliser = s.normaliser;
  saved.q.values.resize(q.rows(), dim);
  saved.q.log_scale.resize(q.rows());
  saved.k.values.resize(q.rows() > 0 ? k.rows() : 0, dim);
  saved.k.log_scale.resize(saved.k.values.rows());
  if (q.rows() == 0) return SoftmaxAccumulator<Scalar>(0, v.cols());
  const Index chunk = linear_chunk(s.linear), piece = feature_mapping_rows(chunk, s.linear.causal);
  const KeepingFeatureRows<Map> q_rows(map, q, s.normaliser, FeatureSide::query, piece, saved.q),
      k_rows(map, k, s.normaliser, FeatureSide::key, piece, saved.k);
  const Scratch<Vector<Scalar>> signs = pooled_copy(map.signs());
  const LinearOperands<KeepingFeatureRows<Map>, KeepingFeatureRows<Map>> in{q_rows, k_rows, v,
                                                                           signs, chunk};
  return linear_accumulate(where, in, s.linear.causal, s.linear.check_finite);
}

// Checks one slice of a backward call (the forward's checks, grad_out, out and the saved
// features when given) before anything is written. out may be empty (0 × 0): recomputed.
template <typename Map>
void check_feature_backward_slice(const char* where, const Map& map,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& out,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& grad_out,
                                  const FeatureAttentionSettings<typename Map::Scalar>& s,
                                  bool check_finite,
                                  const SavedFeatures<typename Map::Scalar>* saved = nullptr) {
  check_feature_slice(where, map, q, k, v, s, check_finite);
  require(!s.exclude_self, where, "exclude_self has no backward pass");
  if (out.size() == 0 && q.rows() > 0) {
    require(grad_out.rows() == q.rows() && grad_out.cols() == v.cols(), where, "grad_out is ",
            shape_of(grad_out), ", expected the output's shape ", q.rows(), "x", v.cols());
    require_finite(grad_out, where, "grad_out");
  } else {
    check_linear_grad_out<typename Map::Scalar>(where, out, grad_out, q.rows(), v.cols(),
                                                check_finite);
  }
  if (!saved || q.rows() == 0) return;
  const Index dim = map.feature_dim();
  require(saved->q.values.rows() == q.rows() && saved->q.values.cols() == dim &&
              saved->q.log_scale.size() == q.rows() && saved->k.values.rows() == k.rows() &&
              saved->k.values.cols() == dim && saved->k.log_scale.size() == k.rows() &&
              saved->normaliser == s.normaliser,
          where, "the saved features (queries ", shape_of(saved->q.values), ", keys ",
          shape_of(saved->k.values), ", normaliser ", saved->normaliser,
          ") are not this call's (", q.rows(), "x", dim, ", ", k.rows(), "x", dim, ", ",
          s.normaliser, "): keep them from the forward on the same map, q, k and options");
}

// The backward of one checked slice: dq, dk, dv overwritten, *d_omega (unless null) added to.
// saved: the forward's features, or null to map q and k here.
template <typename Map>
void feature_attention_backward_slice(
    const char* where, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& out,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& grad_out,
    const FeatureAttentionSettings<typename Map::Scalar>& s,
    Eigen::Ref<RowMatrix<typename Map::Scalar>> dq, Eigen::Ref<RowMatrix<typename Map::Scalar>> dk,
    Eigen::Ref<RowMatrix<typename Map::Scalar>> dv, RowMatrix<typename Map::Scalar>* d_omega,
    const SavedFeatures<typename Map::Scalar>* saved = nullptr) {
  using Scalar = typename Map::Scalar;
  using Features = Eigen::Ref<const RowMatrix<Scalar>>;
  using LogScales = Eigen::Ref<const Vector<Scalar>>;
  static_assert(has_features_vjp<Map>::value, "this feature map has no backward (features_vjp)");
  const Index n_q = q.rows(), n_k = k.rows(), dim = map.feature_dim();
  dq.setZero();
  dk.setZero();
  if (n_q == 0) {
    dv.setZero();
    return;
  }
  // Without saved features: mapped here as the forward mapped them.
  const Index own_q = saved ? 0 : n_q, own_k = saved ? 0 : n_k;
  Scratch<RowMatrix<Scalar>> qf_own(own_q, dim), kf_own(own_k, dim);
  Scratch<Vector<Scalar>> q_log_own(own_q), k_log_own(own_k);
  if (!saved) {
    forward_features(map, q, s.normaliser, FeatureSide::query, s.linear, qf_own, q_log_own);
    forward_features(map, k, s.normaliser, FeatureSide::key, s.linear, kf_own, k_log_own);
  }
  const Features qf = saved ? Features(saved->q.values) : Features(qf_own);
  const Features kf = saved ? Features(saved->k.values) : Features(kf_own);
  const LogScales q_log = saved ? LogScales(saved->q.log_scale) : LogScales(q_log_own);
  const LogScales k_log = saved ? LogScales(saved->k.log_scale) : LogScales(k_log_own);

  Scratch<RowMatrix<Scalar>> dqf(n_q, dim), dkf(n_k, dim);
  Scratch<Vector<Scalar>> dq_log(n_q), dk_log(n_k);
  const Scratch<Vector<Scalar>> signs = pooled_copy(map.signs());
  const auto core = [&](const Eigen::Ref<const RowMatrix<Scalar>>& o) {
    linear_backward_impl<Scalar>(qf, q_log, kf, k_log, v, signs, o, grad_out, s.linear,
                                 {dqf, dkf, dv, dq_log, dk_log});
  };
  if (out.size() == 0) {
    // The forward on the same features: the output random_feature_attention returns.
    Scratch<RowMatrix<Scalar>> forward_out(n_q, v.cols());
    given_features_accumulate<Scalar>(where, qf, q_log, kf, k_log, v, signs, s.linear)
        .finalize_into(forward_out, static_cast<Scalar>(s.linear.denominator_epsilon));
    core(forward_out);
  } else {
    core(out);
  }
  map.features_vjp(q, s.normaliser, qf, q_log, dqf, dq_log, dq, d_omega, FeatureSide::query);
  map.features_vjp(k, s.normaliser, kf, k_log, dkf, dk_log, dk, d_omega, FeatureSide::key);
}

// The checks and the backward of one 2-D call (both overloads of the public backward).
template <typename Map, typename DQ, typename DK, typename DV, typename DO, typename DG>
void feature_attention_backward_2d(const Map& map, const Eigen::MatrixBase<DQ>& q_in,
                                   const Eigen::MatrixBase<DK>& k_in,
                                   const Eigen::MatrixBase<DV>& v_in,
                                   const Eigen::MatrixBase<DO>& out_in,
                                   const Eigen::MatrixBase<DG>& grad_out_in,
                                   Eigen::Ref<RowMatrix<typename Map::Scalar>> dq,
                                   Eigen::Ref<RowMatrix<typename Map::Scalar>> dk,
                                   Eigen::Ref<RowMatrix<typename Map::Scalar>> dv,
                                   const RandomFeatureOptions& opt,
                                   RowMatrix<typename Map::Scalar>* d_omega,
                                   const SavedFeatures<typename Map::Scalar>* saved) {
  using Scalar = typename Map::Scalar;
  static_assert(shares_scalar<Scalar, DQ, DK, DV, DO, DG>,
                "the feature map, q, k, v, out and grad_out must share the scalar type");
  const char* where = "random_feature_attention_backward";
  const Eigen::Ref<const RowMatrix<Scalar>> q(q_in), k(k_in), v(v_in), out(out_in),
      grad_out(grad_out_in);
  require(!saved || out.size() > 0 || q.rows() == 0, where,
          "with saved features, out must be the forward's result (it is empty)");
  require(dq.rows() == q.rows() && dq.cols() == q.cols() && dk.rows() == k.rows() &&
              dk.cols() == k.cols() && dv.rows() == v.rows() && dv.cols() == v.cols(),
          where, "dq (", shape_of(dq), "), dk (", shape_of(dk), ") and dv (", shape_of(dv),
          ") must have the shapes of q, k and v");
  check_written_apart(
      where, {named_input("dq", dq), named_input("dk", dk), named_input("dv", dv)},
      {named_input("q", q), named_input("k", k), named_input("v", v), named_input("out", out),
       named_input("grad_out", grad_out)});
  require(!d_omega || (d_omega->rows() == map.projections() && d_omega->cols() == map.input_dim()),
          where, "d_omega must be ", map.projections(), "x", map.input_dim());
  const auto s = feature_attention_settings(where, map, opt);
  check_feature_backward_slice(where, map, q, k, v, out, grad_out, s, opt.check_finite, saved);
  feature_attention_backward_slice(where, map, q, k, v, out, grad_out, s, dq, dk, dv, d_omega,
                                   saved);
}

}  // namespace detail

// random_feature_attention_into that also keeps the features of q and k in `saved`, for
// random_feature_attention_backward: `out` is the same, bit for bit. exclude_self is refused
// (it has no backward).
template <typename Map, typename DQ, typename DK, typename DV, typename DO>
void random_feature_attention_into(const Map& map, const Eigen::MatrixBase<DQ>& q,
                                   const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                                   const Eigen::MatrixBase<DO>& out,
                                   SavedFeatures<typename Map::Scalar>& saved,
                                   const RandomFeatureOptions& opt = {}) {
  detail::feature_attention_into(
      map, q, k, v, out, opt, [&](const char* where, const auto& qr, const auto& kr,
                                  const auto& vr, const auto& s) {
        detail::check_feature_slice(where, map, qr, kr, vr, s, opt.check_finite);
        return detail::feature_attention_saving_slice(where, map, qr, kr, vr, s, saved);
      });
}

// Gradients of <grad_out, out> for out = random_feature_attention(map, q, k, v, opt): written
// into dq (n_q × d), dk (n_k × d) and dv (n_k × dv), which share no memory with the inputs or
// each other; with d_omega (map.projections() × d) the gradient with respect to the dense ω the
// map's projection stands for (a hybrid's: every part's, stacked) is ADDED to *d_omega. out is
// that forward's result, or an empty (0 × 0) matrix to have it recomputed. Every argument is
// checked before anything is written; a non-finite grad_out is rejected. exclude_self has no
// backward.
template <typename Map, typename DQ, typename DK, typename DV, typename DO, typename DG>
void random_feature_attention_backward(
    const Map& map, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
    const Eigen::MatrixBase<DG>& grad_out, Eigen::Ref<RowMatrix<typename Map::Scalar>> dq,
    Eigen::Ref<RowMatrix<typename Map::Scalar>> dk, Eigen::Ref<RowMatrix<typename Map::Scalar>> dv,
    const RandomFeatureOptions& opt = {}, RowMatrix<typename Map::Scalar>* d_omega = nullptr) {
  detail::feature_attention_backward_2d(map, q, k, v, out, grad_out, dq, dk, dv, opt, d_omega,
                                        nullptr);
}

// The same from the features the forward kept (random_feature_attention_into with `saved`):
// q and k are not mapped again. out must be that forward's result.
template <typename Map, typename DQ, typename DK, typename DV, typename DO, typename DG>
void random_feature_attention_backward(
    const Map& map, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& out,
    const Eigen::MatrixBase<DG>& grad_out, Eigen::Ref<RowMatrix<typename Map::Scalar>> dq,
    Eigen::Ref<RowMatrix<typename Map::Scalar>> dk, Eigen::Ref<RowMatrix<typename Map::Scalar>> dv,
    const SavedFeatures<typename Map::Scalar>& saved, const RandomFeatureOptions& opt = {},
    RowMatrix<typename Map::Scalar>* d_omega = nullptr) {
  detail::feature_attention_backward_2d(map, q, k, v, out, grad_out, dq, dk, dv, opt, d_omega,
                                        &saved);
}

}  // namespace randattn
