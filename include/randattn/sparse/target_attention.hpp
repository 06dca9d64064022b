#pragma once
// Softmax partials over explicit target sets: for every query i, [num | den] =
// Σ_{j ∈ S_i} w_j exp(scale q_i·k_j − c_i) [v_j | 1] relative to c_i = max_j scale q_i·k_j, merged
// into a SoftmaxAccumulator. Weights w_j = 1 give the exact part of sparse attention; w_j = 1/p_j
// the importance-weighted sampled part. Each row is computed by one thread in key order, so
// results do not depend on the thread count.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../core/softmax_accumulator.hpp"
#include "../core/target_sets.hpp"
#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/parallel.hpp"

namespace randattn {

namespace detail {

constexpr Index kTargetRowsPerTask = 64;

// Row i's partial over keys cols[0..count) with weights `weight` (null: all 1), merged into acc.
template <typename Scalar>
class TargetRowKernel {
 public:
  TargetRowKernel(Index max_keys, Index dv) : logits_(max_keys), nd_(1, dv + 1) {}

  void attend(const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
              const Eigen::Ref<const RowMatrix<Scalar>>& v, Scalar scale, Index i,
              const std::int32_t* cols, const Scalar* weight, Index count,
              SoftmaxAccumulator<Scalar>& acc) {
    if (count == 0) return;
    // Grown in powers of two, so that the next call's kernels find the same sizes in the pool.
    if (logits_.size() < count) {
      Index size = 1;
      while (size < count) size *= 2;
      logits_ = Scratch<Vector<Scalar>>(size);
    }
    const Index dv = v.cols();
    Scalar c = -std::numeric_limits<Scalar>::infinity();
    for (Index u = 0; u < count; ++u) {
      logits_(u) = scale * q.row(i).dot(k.row(cols[u]));
      c = std::max(c, logits_(u));
    }
    nd_.setZero();
    for (Index u = 0; u < count; ++u) {
      const Scalar w = std::exp(logits_(u) - c) * (weight ? weight[u] : Scalar(1));
      nd_.leftCols(dv).noalias() += w * v.row(cols[u]);
      nd_(0, dv) += w;
    }
    acc.merge_rows(i, nd_, Vector<Scalar>::Constant(1, c));
  }

 private:
  // From the thread's pool (detail/matrix_pool.hpp).
  Scratch<Vector<Scalar>> logits_;
  Scratch<RowMatrix<Scalar>> nd_;
};

}  // namespace detail

// Exact softmax partials of every query over its target set: q n_q x d, k n_k x d, v n_k x dv.
// A query with an empty set gets no weight (log-scale −inf).
template <typename Scalar>
SoftmaxAccumulator<Scalar> target_attention_accumulate(
    const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
    const Eigen::Ref<const RowMatrix<Scalar>>& v, const TargetSets& sets, Scalar scale) {
  detail::require(sets.rows() == q.rows(), "target_attention_accumulate", "target sets of ",
                  sets.rows(), " queries for ", q.rows(), " queries");
  SoftmaxAccumulator<Scalar> acc(q.rows(), v.cols());
  const Index tasks = (q.rows() + detail::kTargetRowsPerTask - 1) / detail::kTargetRowsPerTask;
  detail::parallel_for(tasks, [&](Index t) {
    detail::TargetRowKernel<Scalar> kernel(0, v.cols());
    const Index end = std::min(q.rows(), (t + 1) * detail::kTargetRowsPerTask);
    for (Index i = t * detail::kTargetRowsPerTask; i < end; ++i)
      kernel.attend(q, k, v, scale, i, sets.begin(i), nullptr, sets.size(i), acc);
  });
  return acc;
}

}  // namespace randattn
