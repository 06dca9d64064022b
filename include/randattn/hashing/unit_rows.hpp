#pragma once
// The rows of x scaled to unit Euclidean norm: the keys of shared-QK LSH, and what LSF filters
// score. A zero row stays zero (so it hashes like any zero vector, never NaN).

#include <randattn/detail/intrinsics.hpp>

#include <Eigen/Core>

#include "../core/types.hpp"

namespace randattn {

// Into u, of x's shape (the rows of u are written in place).
template <typename Scalar, typename Out>
void unit_rows_into(const Eigen::Ref<const RowMatrix<Scalar>>& x, Out& u) {
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
}

template <typename Scalar>
RowMatrix<Scalar> unit_rows(const Eigen::Ref<const RowMatrix<Scalar>>& x) {
  RowMatrix<Scalar> u(x.rows(), x.cols());
  unit_rows_into<Scalar>(x, u);
  return u;
}

}  // namespace randattn
