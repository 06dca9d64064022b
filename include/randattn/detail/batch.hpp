#pragma once
// The one driver of every `_batched` entry point: contiguous row-major (batch, heads, rows, cols)
// buffers seen one (batch, head) slice at a time.

#include <randattn/detail/intrinsics.hpp>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "parallel.hpp"
#include "validation.hpp"

namespace randattn::detail {

// Slice s of a (slices, rows, cols) row-major buffer.
template <typename Scalar>
Eigen::Map<const RowMatrix<Scalar>> slice_of(const Scalar* base, Index s, Index rows, Index cols) {
  return Eigen::Map<const RowMatrix<Scalar>>(base + s * rows * cols, rows, cols);
}
template <typename Scalar>
Eigen::Map<RowMatrix<Scalar>> slice_of(Scalar* base, Index s, Index rows, Index cols) {
  return Eigen::Map<RowMatrix<Scalar>>(base + s * rows * cols, rows, cols);
}

// Every dimension of a batch shape is >= 0.
inline void check_batch_shape(const char* where, const BatchShape& shape) {
  require(shape.batch >= 0 && shape.heads >= 0 && shape.n_q >= 0 && shape.n_k >= 0 &&
              shape.d >= 0 && shape.dv >= 0,
          where, "negative dimension in shape (batch ", shape.batch, ", heads ", shape.heads,
          ", n_q ", shape.n_q, ", n_k ", shape.n_k, ", d ", shape.d, ", dv ", shape.dv, ")");
}

// Checks the shape (`dims` names the dimensions in messages) and that the data pointers are set
// (`pointers_set`) whenever there is work; then runs validate(s) on every slice before
// compute(s) runs on any, so bad input in any slice throws before the output is written.
// Slices are computed in parallel, each on one thread: results do not depend on the thread count.
// Only an overflow found while computing (every input finite) can throw after some slices were
// written; the exception says so and the output is then unspecified.
template <typename Validate, typename Compute>
void for_each_slice(const char* where, const BatchShape& shape, bool pointers_set,
                    Validate&& validate, Compute&& compute) {
  check_batch_shape(where, shape);
  require(shape.slices() == 0 || shape.n_q == 0 || pointers_set, where, "null data pointer");
  if (shape.n_q == 0) return;
  for (Index s = 0; s < shape.slices(); ++s) validate(s);
  parallel_for(shape.slices(), compute);
}

}  // namespace randattn::detail
