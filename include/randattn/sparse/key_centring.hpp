#pragma once
// Key centring for hashing, filter and block supports: logits q·k and q·(k - μ) differ by q·μ,
// the same for every key of a query, so the softmax over any support is unchanged while the
// centred keys spread around the origin, where angular hashes and filters separate them better.
// Bidirectional calls use the mean of all keys; causal calls the mean of a fixed prefix of keys
// (the first `prefix` rows) or of given calibration keys, never a mean that moves with later keys.

#include <algorithm>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/validation.hpp"

namespace randattn {

// The mean of the first min(prefix, n_k) keys (prefix <= 0: of all keys), in double; zeros for
// no keys.
template <typename Scalar>
Eigen::RowVectorXd key_mean(const Eigen::Ref<const RowMatrix<Scalar>>& k, Index prefix = 0) {
  const Index rows = prefix > 0 ? std::min(prefix, k.rows()) : k.rows();
  Eigen::RowVectorXd mean = Eigen::RowVectorXd::Zero(k.cols());
  for (Index j = 0; j < rows; ++j) mean += k.row(j).template cast<double>();
  return rows > 0 ? Eigen::RowVectorXd(mean / double(rows)) : mean;
}

// k - mean, row by row.
template <typename Scalar>
RowMatrix<Scalar> centred(const Eigen::Ref<const RowMatrix<Scalar>>& k,
                          const Eigen::RowVectorXd& mean) {
  detail::require(mean.size() == k.cols(), "centred", "mean of dimension ", mean.size(),
                  " for keys of dimension ", k.cols());
  RowMatrix<Scalar> out = k;
  out.rowwise() -= mean.template cast<Scalar>();
  return out;
}

}  // namespace randattn
