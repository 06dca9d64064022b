#pragma once
// Backward of random-feature attention (random_feature_attention.hpp): the gradients of
// <grad_out, out> with respect to q, k, v and, on request, the projection ω, for the maps with a
// vector–Jacobian product (has_features_vjp: positive, hyperbolic, trig). The projection is the
// map's (fixed by its seed), so this is the gradient of the same estimate the forward computed.
//
// The features of q and k are computed once (n × M each) and kept for the linear core's backward
// (core/linear_backward.hpp), which hands each side the cotangent of its features relative to
// each row's log-scale; the map's features_vjp then turns that into dq or dk (and dω). The
// stabilisers (a map's per-row maximum, the causal core's running maximum of key log-scales) are
// never differentiated through except where the denominator guard makes the output depend on
// them, and there only through the rows' own keys (j ≤ i under causal): dq_i and dk_j receive
// nothing from grad_out rows before j under causal. Memory: the two feature matrices and their
// cotangents (4·n·M) plus O(n·(dv + C)); never n·M·dv.

#include <type_traits>

#include <Eigen/Core>

#include "../core/linear_backward.hpp"
#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/validation.hpp"
#include "../features/projected_feature_map.hpp"
#include "random_feature_attention.hpp"

namespace randattn {

namespace detail {

// Checks one slice of a backward call (the forward's checks, grad_out and out) before anything is
// written. out may be empty (0 × 0): recomputed.
template <typename Map>
void check_feature_backward_slice(const char* where, const Map& map,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& out,
                                  const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& grad_out,
                                  const FeatureAttentionSettings<typename Map::Scalar>& s,
                                  bool check_finite) {
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
}

// The backward of one checked slice: dq, dk, dv overwritten, *d_omega (unless null) added to.
template <typename Map>
void feature_attention_backward_slice(
    const char* where, const Map& map, const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& q,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& k,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& v,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& out,
    const Eigen::Ref<const RowMatrix<typename Map::Scalar>>& grad_out,
    const FeatureAttentionSettings<typename Map::Scalar>& s,
    Eigen::Ref<RowMatrix<typename Map::Scalar>> dq, Eigen::Ref<RowMatrix<typename Map::Scalar>> dk,
    Eigen::Ref<RowMatrix<typename Map::Scalar>> dv, RowMatrix<typename Map::Scalar>* d_omega) {
  using Scalar = typename Map::Scalar;
  static_assert(has_features_vjp<Map>::value, "this feature map has no backward (features_vjp)");
  const Index n_q = q.rows(), n_k = k.rows(), dim = map.feature_dim();
  dq.setZero();
  dk.setZero();
  if (n_q == 0) {
    dv.setZero();
    return;
  }
  Scratch<RowMatrix<Scalar>> qf(n_q, dim), kf(n_k, dim), dqf(n_q, dim), dkf(n_k, dim);
  Scratch<Vector<Scalar>> q_log(n_q), k_log(n_k), dq_log(n_q), dk_log(n_k);
  map.features_into(q, s.normaliser, qf, q_log, FeatureSide::query);
  map.features_into(k, s.normaliser, kf, k_log, FeatureSide::key);
  const Scratch<Vector<Scalar>> signs = pooled_copy(map.signs());
  const auto core = [&](const Eigen::Ref<const RowMatrix<Scalar>>& o) {
    linear_backward_impl<Scalar>(qf, q_log, kf, k_log, v, signs, o, grad_out, s.linear,
                                 {dqf, dkf, dv, dq_log, dk_log});
  };
  if (out.size() == 0) {
    // The forward on the same features: the output random_feature_attention returns.
    Scratch<RowMatrix<Scalar>> forward_out(n_q, v.cols());
    const GivenFeatureRows<Scalar> q_rows(qf, q_log), k_rows(kf, k_log);
    const LinearOperands<GivenFeatureRows<Scalar>, GivenFeatureRows<Scalar>> in{
        q_rows, k_rows, v, signs, linear_chunk(s.linear)};
    linear_accumulate(where, in, s.linear.causal, false)
        .finalize_into(forward_out, static_cast<Scalar>(s.linear.denominator_epsilon));
    core(forward_out);
  } else {
    core(out);
  }
  map.features_vjp(q, s.normaliser, qf, q_log, dqf, dq_log, dq, d_omega, FeatureSide::query);
  map.features_vjp(k, s.normaliser, kf, k_log, dkf, dk_log, dk, d_omega, FeatureSide::key);
}

}  // namespace detail

// Gradients of <grad_out, out> for out = random_feature_attention(map, q, k, v, opt): written
// into dq (n_q × d), dk (n_k × d) and dv (n_k × dv); with d_omega (m × d, the map's projections ×
// input dimension) the gradient with respect to the dense ω the map's projection stands for is
// ADDED to *d_omega. out is that forward's result, or an empty (0 × 0) matrix to have it
// recomputed. Every argument is checked before anything is written; a non-finite grad_out is
// rejected. exclude_self has no backward.
template <typename Map, typename DQ, typename DK, typename DV, typename DO, typename DG,
          typename GQ, typename GK, typename GV>
void random_feature_attention_backward(const Map& map, const Eigen::MatrixBase<DQ>& q,
                                       const Eigen::MatrixBase<DK>& k,
                                       const Eigen::MatrixBase<DV>& v,
                                       const Eigen::MatrixBase<DO>& out,
                                       const Eigen::MatrixBase<DG>& grad_out,
                                       const Eigen::MatrixBase<GQ>& dq,
                                       const Eigen::MatrixBase<GK>& dk,
                                       const Eigen::MatrixBase<GV>& dv,
                                       const RandomFeatureOptions& opt = {},
                                       RowMatrix<typename Map::Scalar>* d_omega = nullptr) {
  using Scalar = typename Map::Scalar;
  static_assert(std::is_same<Scalar, typename DQ::Scalar>::value &&
                    std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value &&
                    std::is_same<Scalar, typename DO::Scalar>::value &&
                    std::is_same<Scalar, typename DG::Scalar>::value,
                "the feature map, q, k, v, out and grad_out must share the scalar type");
  const char* where = "random_feature_attention_backward";
  const Eigen::Ref<const RowMatrix<Scalar>> qr(q), kr(k), vr(v), outr(out), gr(grad_out);
  auto &gq = detail::writable(dq), &gk = detail::writable(dk);
  auto& gv = detail::writable(dv);
  detail::require(gq.rows() == qr.rows() && gq.cols() == qr.cols() && gk.rows() == kr.rows() &&
                      gk.cols() == kr.cols() && gv.rows() == vr.rows() && gv.cols() == vr.cols(),
                  where, "dq (", detail::shape_of(gq), "), dk (", detail::shape_of(gk),
                  ") and dv (", detail::shape_of(gv), ") must have the shapes of q, k and v");
  detail::require(!d_omega || (d_omega->rows() == map.projection().features() &&
                               d_omega->cols() == map.input_dim()),
                  where, "d_omega must be ", map.projection().features(), "x", map.input_dim());
  const auto s = detail::feature_attention_settings(where, map, opt);
  detail::check_feature_backward_slice(where, map, qr, kr, vr, outr, gr, s, opt.check_finite);
  RowMatrix<Scalar> dqr(qr.rows(), qr.cols()), dkr(kr.rows(), kr.cols()), dvr(vr.rows(), vr.cols());
  detail::feature_attention_backward_slice(where, map, qr, kr, vr, outr, gr, s, dqr, dkr, dvr,
                                           d_omega);
  gq = dqr;
  gk = dkr;
  gv = dvr;
}

}  // namespace randattn
