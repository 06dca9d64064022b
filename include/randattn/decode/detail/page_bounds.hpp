#pragma once
// Per-page key summaries of Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient
// Long-Context LLM Inference", arXiv 2406.10774): for each page of P consecutive tokens, the
// per-coordinate minimum and maximum of its keys. For any key k in the page and any query q,
//     q·k ≤ Σ_c max(q_c·min_c, q_c·max_c) = q⁺·max + q⁻·min,
// with q⁺ = max(q, 0) and q⁻ = min(q, 0), so the bounds of g queries against many pages are two
// matrix products. Appending a token updates the last page only: O(d).
// The box may be taken in an orthonormal basis A instead (rotate(): the principal axes of the
// first keys, linalg/principal_axes.hpp): the summaries are then of Aᵀk, the queries are turned
// into Aᵀq, and the bound is the same expression; appending costs O(d²).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <utility>

#include <Eigen/Core>

#include "../../core/types.hpp"
#include "growable_rows.hpp"

namespace randattn::detail {

template <typename Scalar>
class PageBounds {
 public:
  PageBounds(Index dim = 0, Index page_size = 1) : page_size_(page_size), min_(dim), max_(dim) {}

  Index page_size() const { return page_size_; }
  Index pages() const { return min_.rows(); }
  Index tokens() const { return tokens_; }

  void reserve_tokens(Index tokens) {
    min_.reserve_rows((tokens + page_size_ - 1) / page_size_);
    max_.reserve_rows((tokens + page_size_ - 1) / page_size_);
  }

  void append(const Scalar* raw) {
    const Index d = min_.cols();
    const Scalar* key = raw;
    if (axes_.size() > 0) {
      rotated_.noalias() = Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(raw, d) * axes_;
      key = rotated_.data();
    }
    if (tokens_ % page_size_ == 0) {
      min_.push_row(key);
      max_.push_row(key);
    } else {
      Scalar* lo = min_.row_ptr(min_.rows() - 1);
      Scalar* hi = max_.row_ptr(max_.rows() - 1);
      for (Index c = 0; c < d; ++c) {
        lo[c] = std::min(lo[c], key[c]);
        hi[c] = std::max(hi[c], key[c]);
      }
    }
    ++tokens_;
  }

  // Takes the boxes in the basis `axes` (d x d, orthonormal columns) from now on, summarising the
  // pages of the tokens so far again from key_at(j) (a pointer to key j's d entries).
  template <typename KeyAt>
  void rotate(RowMatrix<Scalar> axes, KeyAt key_at) {
    axes_ = std::move(axes);
    rotated_.resize(1, axes_.cols());
    const Index tokens = tokens_;
    min_.clear();
    max_.clear();
    tokens_ = 0;
    for (Index j = 0; j < tokens; ++j) append(key_at(j));
  }
  // The basis of the boxes (empty: the keys' own coordinates).
  const RowMatrix<Scalar>& axes() const { return axes_; }

  // out(r, p) = bound of query row r over page first + p, for `count` pages. Pages are read
  // in tiles that stay in cache while every query row is scored against them by matrix-vector
  // products (no packing of the summaries). `signs` is scratch.
  template <typename Q>
  void bounds(const Q& q, Index first, Index count, RowMatrix<Scalar>& out,
              RowMatrix<Scalar>& signs) const {
    const Index g = q.rows();
    signs.resize(2 * g, q.cols());
    if (axes_.size() > 0) {
      signs.topRows(g).noalias() = q * axes_;
      signs.bottomRows(g) = signs.topRows(g).cwiseMin(Scalar(0));
      signs.topRows(g) = signs.topRows(g).cwiseMax(Scalar(0));
    } else {
      signs.topRows(g) = q.cwiseMax(Scalar(0));
      signs.bottomRows(g) = q.cwiseMin(Scalar(0));
    }
    out.resize(g, count);
    constexpr Index kTile = 256;
    for (Index p0 = 0; p0 < count; p0 += kTile) {
      const Index bp = std::min(kTile, count - p0);
      const auto hi = max_.block(first + p0, bp), lo = min_.block(first + p0, bp);
      for (Index r = 0; r < g; ++r) {
        auto o = out.row(r).segment(p0, bp);
        o.noalias() = signs.row(r) * hi.transpose();
        o.noalias() += signs.row(g + r) * lo.transpose();
      }
    }
  }

  ConstRowMatrixMap<Scalar> page_min() const { return min_.view(); }
  ConstRowMatrixMap<Scalar> page_max() const { return max_.view(); }
  std::size_t bytes() const {
    return min_.bytes() + max_.bytes() + sizeof(Scalar) * std::size_t(axes_.size());
  }

 private:
  Index page_size_ = 1;
  Index tokens_ = 0;
  GrowableRows<Scalar> min_, max_;
  RowMatrix<Scalar> axes_;
  Eigen::Matrix<Scalar, 1, Eigen::Dynamic> rotated_;
};

}  // namespace randattn::detail
