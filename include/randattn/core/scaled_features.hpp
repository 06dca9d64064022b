#pragma once
// Feature rows with a per-row log-scale: row i stands for exp(log_scale(i)) * values.row(i).
// Feature maps return their features in this form so that large norms never overflow: the
// magnitude lives in the log-scale and the core combines rows exactly like online softmax.

#include "types.hpp"

namespace randattn {

template <typename Scalar>
struct ScaledFeatures {
  RowMatrix<Scalar> values;  // n x M
  Vector<Scalar> log_scale;  // n, or empty meaning all zeros

  Index rows() const { return values.rows(); }
  Index dim() const { return values.cols(); }
};

}  // namespace randattn
