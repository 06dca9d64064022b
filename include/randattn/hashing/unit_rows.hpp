#pragma once
// The rows of x scaled to unit Euclidean norm: the keys of shared-QK LSH, and what LSF filters
// score. A zero row stays zero (so it hashes like any zero vector, never NaN).

#include <Eigen/Core>

#include "../core/types.hpp"

namespace randattn {

template <typename Scalar>
RowMatrix<Scalar> unit_rows(const Eigen::Ref<const RowMatrix<Scalar>>& x) {
  RowMatrix<Scalar> u(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    // Dividing by the largest entry first keeps the norm finite for any finite row.
    const Scalar m = x.row(i).cwiseAbs().maxCoeff();
    if (m == Scalar(0)) {
      u.row(i).setZero();
    } else {
      u.row(i) = x.row(i) / m;
      u.row(i) /= u.row(i).norm();
    }
  }
  return u;
}

}  // namespace randattn
