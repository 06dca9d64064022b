#pragma once
// Streaming (decoding) form of causal linear attention: the carried state
// S = sum_j phi(k_j)^T [v_j | 1] held relative to a running log-scale, updated one token at a
// time in O(M * dv) and queried in O(M * dv). It computes the same quantity as the causal
// chunked path, one token at a time.

#include <randattn/detail/intrinsics.hpp>

#include <cmath>
#include <limits>

#include <Eigen/Core>

#include "../detail/validation.hpp"
#include "linear_attention.hpp"
#include "softmax_accumulator.hpp"
#include "types.hpp"

namespace randattn {

template <typename Scalar_>
class LinearDecoderState {
 public:
  using Scalar = Scalar_;
  using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

  // feature_dim M, value dimension dv, optional sign vector (M entries of +1/-1, empty = all +1).
  LinearDecoderState(Index feature_dim, Index value_dim, Vector<Scalar> signs = Vector<Scalar>(),
                     double denominator_epsilon = LinearOptions{}.denominator_epsilon)
      : signs_(std::move(signs)),
        state_(RowMatrix<Scalar>::Zero(feature_dim, value_dim + 1)),
        key_(feature_dim),
        value_(RowVector::Ones(value_dim + 1)),
        epsilon_(static_cast<Scalar>(denominator_epsilon)) {
    const char* where = "LinearDecoderState";
    detail::require(feature_dim >= 1 && value_dim >= 0, where, "feature_dim must be >= 1 and ",
                    "value_dim >= 0, got ", feature_dim, " and ", value_dim);
    detail::require(signs_.size() == 0 || signs_.size() == feature_dim, where, "signs has ",
                    signs_.size(), " entries, expected 0 or ", feature_dim);
    for (Index i = 0; i < signs_.size(); ++i) {
      detail::require(signs_(i) == Scalar(1) || signs_(i) == Scalar(-1), where, "signs(", i,
                      ") = ", signs_(i), " is not +1 or -1");
    }
    detail::require(denominator_epsilon >= 0 && std::isfinite(denominator_epsilon), where,
                    "denominator_epsilon must be finite and >= 0");
  }

  Index feature_dim() const { return state_.rows(); }
  Index value_dim() const { return state_.cols() - 1; }
  Index length() const { return length_; }

  // Appends one token: its key feature row exp(k_log_scale) * k_features and its value row.
  template <typename DK, typename DV>
  void append(const Eigen::MatrixBase<DK>& k_features, const Eigen::MatrixBase<DV>& v,
              Scalar k_log_scale = 0) {
    const char* where = "LinearDecoderState::append";
    detail::require(k_features.size() == feature_dim() && v.size() == value_dim(), where,
                    "k_features has ", k_features.size(), " entries and v ", v.size(),
                    ", expected ", feature_dim(), " and ", value_dim());
    detail::require(std::isfinite(k_log_scale) && k_features.allFinite() && v.allFinite(), where,
                    "non-finite key feature, value or log-scale");
    key_ = k_features.derived().reshaped();
    if (signs_.size() > 0) key_.array() *= signs_.array();
    value_.head(value_dim()) = v.derived().reshaped().transpose();
    // The rank-1 update key^T [v | 1] joins the state by the online-softmax merge rule; the
    // coefficient-wise product needs no temporary.
    detail::merge_scaled(state_, log_scale_, key_.lazyProduct(value_), k_log_scale);
    ++length_;
  }

  // Unnormalised [num | den] of one query against the tokens appended so far, relative to
  // exp(log_scale_out).
  template <typename DQ>
  RowVector query_unnormalised(const Eigen::MatrixBase<DQ>& q_features, Scalar q_log_scale,
                               Scalar& log_scale_out) const {
    check_query(q_features, q_log_scale);
    log_scale_out = q_log_scale + log_scale_;
    return q_features.derived().reshaped().transpose() * state_;
  }

  // Normalised output for one query, with the same denominator guard as linear_attention.
  template <typename DQ>
  RowVector query(const Eigen::MatrixBase<DQ>& q_features, Scalar q_log_scale = 0) const {
    RowVector out(value_dim());
    query_into(q_features, q_log_scale, out);
    return out;
  }

  // As query, written into a caller-provided row (1 x value_dim()): no allocation.
  template <typename DQ, typename DO>
  void query_into(const Eigen::MatrixBase<DQ>& q_features, Scalar q_log_scale,
                  const Eigen::MatrixBase<DO>& out_) const {
    const char* where = "LinearDecoderState::query";
    auto& out = const_cast<Eigen::MatrixBase<DO>&>(out_);
    check_query(q_features, q_log_scale);
    detail::require(out.size() == value_dim(), where, "out has ", out.size(), " entries, expected ",
                    value_dim());
    const auto qt = q_features.derived().reshaped().transpose();
    const Scalar den = SoftmaxAccumulator<Scalar>::guarded_denominator(
        qt.dot(state_.col(value_dim()).transpose()), epsilon_);
    if (den == Scalar(0)) {
      out.setZero();
      return;
    }
    // Coefficient-based: reads q_features in place, so no temporary is made.
    out.noalias() = qt.lazyProduct(state_.leftCols(value_dim()));
    out /= den;
    detail::check_result_finite(where, out, true, [] {});
  }

  void reset() {
    state_.setZero();
    log_scale_ = -std::numeric_limits<Scalar>::infinity();
    length_ = 0;
  }

 private:
  template <typename DQ>
  void check_query(const Eigen::MatrixBase<DQ>& q_features, Scalar q_log_scale) const {
    const char* where = "LinearDecoderState::query";
    detail::require(q_features.size() == feature_dim(), where, "q_features has ", q_features.size(),
                    " entries, expected ", feature_dim());
    detail::require(length_ > 0, where, "no token has been appended yet");
    detail::require(std::isfinite(q_log_scale) && q_features.allFinite(), where,
                    "non-finite query feature or log-scale");
  }

  Vector<Scalar> signs_;
  RowMatrix<Scalar> state_;  // M x (dv + 1), relative to exp(log_scale_)
  Vector<Scalar> key_;       // M, signs applied
  RowVector value_;          // [v | 1]
  Scalar epsilon_;
  Scalar log_scale_ = -std::numeric_limits<Scalar>::infinity();
  Index length_ = 0;
};

}  // namespace randattn
