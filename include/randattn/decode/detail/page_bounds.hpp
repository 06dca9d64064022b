#pragma once
// Per-page key summaries of Quest (Tang et al., "Quest: Query-Aware Sparsity for Efficient
// Long-Context LLM Inference", arXiv 2406.10774): for each page of P consecutive tokens, the
// per-coordinate minimum and maximum of its keys. For any key k in the page and any query q,
//     q·k ≤ Σ_c max(q_c·min_c, q_c·max_c) = q⁺·max + q⁻·min,
// with q⁺ = max(q, 0) and q⁻ = min(q, 0), so the bounds of g queries against many pages are two
// matrix products. Appending a token updates the last page only: O(d).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>

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

  void append(const Scalar* key) {
    const Index d = min_.cols();
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

  // out(r, p) = bound of query row r over page first + p, for `count` pages. Pages are read
  // in tiles that stay in cache while every query row is scored against them by matrix-vector
  // products (no packing of the summaries). `signs` is scratch.
  template <typename Q>
  void bounds(const Q& q, Index first, Index count, RowMatrix<Scalar>& out,
              RowMatrix<Scalar>& signs) const {
    const Index g = q.rows();
    signs.resize(2 * g, q.cols());
    signs.topRows(g) = q.cwiseMax(Scalar(0));
    signs.bottomRows(g) = q.cwiseMin(Scalar(0));
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
  std::size_t bytes() const { return min_.bytes() + max_.bytes(); }

 private:
  Index page_size_ = 1;
  Index tokens_ = 0;
  GrowableRows<Scalar> min_, max_;
};

}  // namespace randattn::detail
