#pragma once
// Key centring for hashing, filter and block supports: logits q·k and q·(k - μ) differ by q·μ,
// the same for every key of a query, so the softmax over any support is unchanged while the
// centred keys spread around the origin, where angular hashes and filters separate them better.
// Bidirectional calls use the mean of all keys; causal calls the mean of a fixed prefix of keys
// (the first `prefix` rows) or of given calibration keys, never a mean that moves with later keys.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/validation.hpp"

namespace randattn {

// The mean of the first min(prefix, n_k) keys (prefix <= 0: of all keys), in double, into
// `mean` (k.cols() entries); zeros for no keys.
template <typename Scalar>
void key_mean_into(const Eigen::Ref<const RowMatrix<Scalar>>& k, Index prefix,
                   Eigen::Ref<Eigen::RowVectorXd> mean) {
  const Index rows = prefix > 0 ? std::min(prefix, k.rows()) : k.rows();
  mean.setZero();
  for (Index j = 0; j < rows; ++j) mean += k.row(j).template cast<double>();
  if (rows > 0) mean /= double(rows);
}

// The same as a new vector.
template <typename Scalar>
Eigen::RowVectorXd key_mean(const Eigen::Ref<const RowMatrix<Scalar>>& k, Index prefix = 0) {
  Eigen::RowVectorXd mean(k.cols());
  key_mean_into<Scalar>(k, prefix, mean);
  return mean;
}

// k - mean, row by row, into `out` (k's shape).
template <typename Scalar>
void centred_into(const Eigen::Ref<const RowMatrix<Scalar>>& k,
                  const Eigen::Ref<const Eigen::RowVectorXd>& mean,
                  Eigen::Ref<RowMatrix<Scalar>> out) {
  detail::require(mean.size() == k.cols(), "centred", "mean of dimension ", mean.size(),
                  " for keys of dimension ", k.cols());
  detail::Scratch<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>> mu(1, k.cols());  // from the pool
  mu = mean.template cast<Scalar>();
  out = k;
  out.rowwise() -= mu;
}

// The same as a new matrix.
template <typename Scalar>
RowMatrix<Scalar> centred(const Eigen::Ref<const RowMatrix<Scalar>>& k,
                          const Eigen::RowVectorXd& mean) {
  RowMatrix<Scalar> out(k.rows(), k.cols());
  centred_into<Scalar>(k, mean, out);
  return out;
}

}  // namespace randattn
