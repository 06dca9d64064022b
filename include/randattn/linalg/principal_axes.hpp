#pragma once
// The principal axes of a set of rows: the eigenvectors of their covariance, by decreasing
// variance, as the columns of an orthogonal d x d matrix A. For any orthogonal A,
//     q·k = (Aᵀq)·(Aᵀk),
// so a bound on q·k from per-coordinate minima and maxima (a page's box, decode/detail/
// page_bounds.hpp) holds in the rotated coordinates as in the raw ones. Keys of trained models
// vary mostly along a few directions; a box aligned with them is usually the tighter one
// (docs/decode.md measures the slack on two trained models).

#include <randattn/detail/intrinsics.hpp>

#include <cmath>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "../core/types.hpp"

namespace randattn::detail {

// Axes (columns) of rows row_at(0), ..., row_at(rows - 1) of d entries each (row_at(j) -> a
// pointer to them, read before the next call). The covariance is accumulated in double. Each axis
// is signed so that its entry of largest magnitude (the first of equals) is positive, since an
// eigensolver's signs are arbitrary; the same rows give the same axes. Fewer than two rows, or a
// covariance that is not finite (NaN/Inf rows), give the identity: the raw coordinates.
template <typename Scalar, typename RowAt>
RowMatrix<Scalar> principal_axes(Index rows, Index d, RowAt row_at) {
  RowMatrix<Scalar> identity = RowMatrix<Scalar>::Identity(d, d);
  if (rows < 2) return identity;
  Eigen::VectorXd sum = Eigen::VectorXd::Zero(d);
  Eigen::MatrixXd gram = Eigen::MatrixXd::Zero(d, d);
  Eigen::VectorXd x(d);
  for (Index j = 0; j < rows; ++j) {
    const Scalar* r = row_at(j);
    for (Index c = 0; c < d; ++c) x(c) = double(r[c]);
    sum += x;
    gram.selfadjointView<Eigen::Lower>().rankUpdate(x);
  }
  const Eigen::VectorXd mean = sum / double(rows);
  Eigen::MatrixXd cov = gram.selfadjointView<Eigen::Lower>();
  cov -= double(rows) * mean * mean.transpose();
  if (!cov.allFinite()) return identity;
  const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> eig(cov);
  if (eig.info() != Eigen::Success) return identity;
  RowMatrix<Scalar> axes(d, d);
  for (Index a = 0; a < d; ++a) {
    // Eigen orders the eigenvalues increasingly: axis a is eigenvector d - 1 - a.
    auto v = eig.eigenvectors().col(d - 1 - a);
    Index top = 0;
    for (Index c = 1; c < d; ++c)
      if (std::abs(v(c)) > std::abs(v(top))) top = c;
    axes.col(a) = (v * (v(top) < 0 ? -1.0 : 1.0)).template cast<Scalar>();
  }
  return axes;
}

}  // namespace randattn::detail
