#pragma once
// Upper bounds on the logits of a block of keys (Quest, arXiv 2406.10774): key block b keeps the
// per-coordinate minimum m_b and maximum M_b of its keys, and for any query q and any key k of
// the block
//   q·k = Σ_c q_c k_c <= Σ_c max(q_c m_bc, q_c M_bc) = q⁺·M_b + q⁻·m_b,
// q⁺ = max(q, 0), q⁻ = min(q, 0). Computed for many queries at once as two matrix products.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/matrix_pool.hpp"
#include "../detail/validation.hpp"

namespace randattn {

template <typename Scalar>
class KeyBlockBounds {
 public:
  // Keys n_k x d cut into blocks of `block` consecutive rows (the last one shorter).
  KeyBlockBounds(const Eigen::Ref<const RowMatrix<Scalar>>& k, Index block)
      : block_(block), n_k_(k.rows()) {
    detail::require(block >= 1, "KeyBlockBounds", "block size must be >= 1, got ", block);
    const Index nb = blocks();
    lo_ = detail::Scratch<RowMatrix<Scalar>>(nb, k.cols());
    hi_ = detail::Scratch<RowMatrix<Scalar>>(nb, k.cols());
    for (Index b = 0; b < nb; ++b) {
      const auto rows = k.middleRows(b * block, block_size(b));
      lo_.row(b) = rows.colwise().minCoeff();
      hi_.row(b) = rows.colwise().maxCoeff();
    }
  }

  Index block() const { return block_; }
  Index blocks() const { return (n_k_ + block_ - 1) / block_; }
  Index block_size(Index b) const { return std::min(block_, n_k_ - b * block_); }
  Index block_of(Index j) const { return j / block_; }

  // out(i, b) = the bound on q_i·k for every key k of block b: q rows x blocks().
  RowMatrix<Scalar> bounds(const Eigen::Ref<const RowMatrix<Scalar>>& q) const {
    RowMatrix<Scalar> out(q.rows(), blocks());
    bounds_into(q, out);
    return out;
  }

  // The same into `out` (q rows x blocks()), its working storage from the thread's pool.
  void bounds_into(const Eigen::Ref<const RowMatrix<Scalar>>& q, RowMatrix<Scalar>& out) const {
    detail::Scratch<RowMatrix<Scalar>> pos(q.rows(), q.cols()), neg(q.rows(), q.cols());
    pos = q.cwiseMax(Scalar(0));
    neg = q.cwiseMin(Scalar(0));
    out.noalias() = pos * hi_.transpose();
    out.noalias() += neg * lo_.transpose();
  }

 private:
  Index block_, n_k_;
  detail::Scratch<RowMatrix<Scalar>> lo_, hi_;  // from the thread's pool
};

}  // namespace randattn
