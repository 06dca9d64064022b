#pragma once
// The score-tile step that every softmax path shares: a tile of logits S = Q_t K_tᵀ for a set of
// query rows and key columns, its mask, the row maxima c_r and the weights exp(S − c_r), and the
// partial [num | den] = [P V | P 1] merged into the SoftmaxAccumulator (online softmax).
// Exact attention (contiguous blocks), LSH and filter attention (gathered rows and columns),
// sparse-score attention (weights only) and clipped random-feature attention (clipped weights
// instead of exponentials) are sequences of the steps below.
//
// Masks (TileMask), applied in this order:
//   dedupe        the logit of pair (i, j) is lowered by log N_ij, N_ij >= 1 the number of times
//                 the pair was scored (hash rounds, filter tables): a softmax over the union counts
//                 every key once;
//   causal        j > i is removed;
//   exclude_self  j == i is removed (shared-QK LSH).
// A removed entry has logit −inf and weight exactly 0. A tile row whose entries are all removed
// has row maximum −inf and contributes nothing when merged (log-scale −inf).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "../../detail/chunk_products.hpp"
#include "../../detail/gemm.hpp"
#include "../../detail/matrix_pool.hpp"
#include "../softmax_accumulator.hpp"
#include "../types.hpp"

namespace randattn::detail {

// Rows and columns of a tile when the caller does not choose (exact and clipped attention).
constexpr Index kDefaultTileSize = 128;

// Global positions of a tile's rows or columns: a contiguous range [first, first + size), or a
// gathered list of positions.
struct TileIndex {
  const std::int32_t* list = nullptr;  // null: the range
  Index first = 0;
  Index size = 0;

  static TileIndex range(Index first, Index size) { return {nullptr, first, size}; }
  static TileIndex gathered(const std::int32_t* list, Index size) { return {list, 0, size}; }
  Index operator[](Index t) const { return list ? Index(list[t]) : first + t; }
  Index max() const {
    return list ? Index(*std::max_element(list, list + size)) : first + size - 1;
  }
  Index min() const { return list ? Index(*std::min_element(list, list + size)) : first; }
};

// Pair counts for the dedupe mask: count(i, cols, n) writes into n[u] the number of times the
// pair (i, cols[u]) was scored, for the columns of the current tile.
struct NoDedupe {
  void operator()(Index, const TileIndex&, std::int32_t*) const {}
};

template <typename Count = NoDedupe>
struct TileMask {
  bool causal = false;
  bool exclude_self = false;
  const Count* dedupe = nullptr;  // null: every pair counts once
};

// One tile's buffers, sized once for tiles of at most max_rows x max_cols; every step works on
// the top-left br x bc corner, so a kernel allocates nothing per tile. The buffers come from the
// thread's pool (detail/matrix_pool.hpp), so a tile made per call allocates nothing either once
// the thread has made one of that size.
template <typename Scalar>
class ScoreTile {
 public:
  static constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();

  ScoreTile(Index max_rows, Index max_cols, Index value_dim)
      : s_(max_rows, max_cols), nd_(max_rows, value_dim + 1), row_max_(max_rows), count_(max_cols) {}

  // S = q kᵀ for q (br x d) and k (bc x d); the logits of the rows and columns now in the tile.
  template <typename Q, typename K>
  void logits(const Q& q, const K& k) {
    br_ = q.rows();
    bc_ = k.rows();
    gemm_fixed_depth(scores(), q, k.transpose(), false);
  }

  // The same for keys given transposed, kt (d x bc) with unit column stride, through the
  // register-tile product (detail/chunk_products.hpp), which packs neither operand: for narrow
  // tiles (a few dozen keys, as in filter attention) packing costs about as much as the multiply.
  template <typename Q, typename KT>
  void logits_transposed(const Q& q, const KT& kt) {
    br_ = q.rows();
    bc_ = kt.cols();
    row_panel_product(scores(), q, kt, false);
  }

  auto scores() { return s_.topLeftCorner(br_, bc_); }
  auto scores() const { return s_.topLeftCorner(br_, bc_); }
  auto row_max() const { return row_max_.head(br_); }

  // Applies `mask` to the tile whose rows and columns sit at global positions rows and cols.
  template <typename Count>
  void mask(const TileIndex& rows, const TileIndex& cols, const TileMask<Count>& mask) {
    if (mask.dedupe) subtract_log_counts(rows, cols, *mask.dedupe);
    if (!mask.causal && !mask.exclude_self) return;
    // Both masks as one comparison per key: j removed iff j > limit, or j == self.
    constexpr Index kNone = std::numeric_limits<Index>::max();
    for (Index t = 0; t < br_; ++t) {
      const Index i = rows[t];
      const Index limit = mask.causal ? i : kNone;
      const Index self = mask.exclude_self ? i : -1;
      Scalar* srow = &s_(t, 0);
      if (cols.list) {
        mask_listed(cols.list, limit, self, srow);
      } else if (mask.causal) {
        // Contiguous keys: the removed ones are a suffix of the row (and i itself, if asked).
        const Index keep = std::clamp<Index>(limit - cols.first + 1, 0, bc_);
        std::fill(srow + keep, srow + bc_, kNegInf);
        if (self >= cols.first && self < cols.first + keep) srow[self - cols.first] = kNegInf;
      } else if (self >= cols.first && self < cols.first + bc_) {
        srow[self - cols.first] = kNegInf;
      }
    }
  }

  // Row maxima c_r of the (masked) logits, then S ← exp(S − c_r). A row with every entry
  // removed keeps c_r = −inf and is shifted by 0, so its weights are exactly 0, never NaN.
  void exponentiate() {
    row_max_.head(br_) = scores().rowwise().maxCoeff();
    for (Index t = 0; t < br_; ++t) {
      const Scalar c = row_max_(t);
      shift_and_exponentiate(t, c == kNegInf ? Scalar(0) : c);
    }
  }

  // The weights of a finished softmax: S ← exp(S − L_r) for the rows' log-sum-exps L (a backward
  // pass recomputing probabilities). A row with L_r = −inf had no weight: its weights are 0.
  template <typename L>
  void exponentiate_from(const L& log_sum_exp) {
    for (Index t = 0; t < br_; ++t) {
      const Scalar c = log_sum_exp(t);
      if (c == kNegInf) {
        scores().row(t).setZero();
      } else {
        shift_and_exponentiate(t, c);
      }
    }
  }

  // Weights instead of exponentials: S ← max(S, 0) ⊙ column_weight, with the row log-scales
  // given (clipped kernel estimates of random-feature attention).
  template <typename W, typename C>
  void clip(const W& column_weight, const C& log_scale) {
    auto s = scores();
    s = s.cwiseMax(Scalar(0)) * column_weight.asDiagonal();
    row_max_.head(br_) = log_scale;
  }

  // [num | den] = [P V | P 1] for the tile's weights P and value rows v (bc x dv), merged into
  // acc at the tile's rows with the row log-scales.
  // With `panels`, P V goes through the register-tile product (v with unit column stride), as
  // after logits_transposed.
  template <typename V>
  void merge_into(SoftmaxAccumulator<Scalar>& acc, const TileIndex& rows, const V& v,
                  bool panels = false) {
    const Index dv = nd_.cols() - 1;
    auto nd = nd_.topRows(br_);
    if (panels) {
      row_panel_product(nd.leftCols(dv), scores(), v, false);
    } else {
      gemm_fixed_depth(nd.leftCols(dv), scores(), v, false);
    }
    nd.col(dv) = scores().rowwise().sum();
    if (rows.list) {
      acc.merge_gathered(rows.list, nd, row_max_.head(br_));
    } else {
      acc.merge_rows(rows.first, nd, row_max_.head(br_));
    }
  }

  // The whole softmax step: logits, mask, exponentials, merge.
  template <typename Q, typename K, typename V, typename Count>
  void attend(const Q& q, const K& k, const V& v, const TileIndex& rows, const TileIndex& cols,
              const TileMask<Count>& mask, SoftmaxAccumulator<Scalar>& acc) {
    logits(q, k);
    finish(v, rows, cols, mask, acc, false);
  }
  // The same with the keys transposed (kt, d x bc) and both products as register tiles.
  template <typename Q, typename KT, typename V, typename Count>
  void attend_transposed(const Q& q, const KT& kt, const V& v, const TileIndex& rows,
                         const TileIndex& cols, const TileMask<Count>& mask,
                         SoftmaxAccumulator<Scalar>& acc) {
    logits_transposed(q, kt);
    finish(v, rows, cols, mask, acc, true);
  }

 private:
  template <typename V, typename Count>
  void finish(const V& v, const TileIndex& rows, const TileIndex& cols,
              const TileMask<Count>& mask, SoftmaxAccumulator<Scalar>& acc, bool panels) {
    this->mask(rows, cols, mask);
    exponentiate();
    merge_into(acc, rows, v, panels);
  }

  // srow[u] = −inf where key cols[u] is past `limit` or is `self` (a listed tile: LSH's gathered
  // keys). Eight keys at a time for float with AVX2: GCC leaves the plain loop scalar at -O2.
  void mask_listed(const std::int32_t* cols, Index limit, Index self, Scalar* srow) const {
    Index u = 0;
#if defined(__AVX2__)
    if constexpr (std::is_same_v<Scalar, float>) {
      // Positions are int32, so the limit is clamped to that range (and self = −1 stays −1).
      const auto lim = std::int32_t(std::min<Index>(limit, std::numeric_limits<std::int32_t>::max()));
      const __m256i vlim = _mm256_set1_epi32(lim), vself = _mm256_set1_epi32(std::int32_t(self));
      const __m256 ninf = _mm256_set1_ps(kNegInf);
      for (; u + 8 <= bc_; u += 8) {
        const __m256i j = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols + u));
        const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(j, vlim), _mm256_cmpeq_epi32(j, vself));
        _mm256_storeu_ps(srow + u, _mm256_blendv_ps(_mm256_loadu_ps(srow + u), ninf, _mm256_castsi256_ps(out)));
      }
    }
#endif
    for (; u < bc_; ++u) {
      const Index j = cols[u];
      srow[u] = (j > limit || j == self) ? kNegInf : srow[u];
    }
  }

  void shift_and_exponentiate(Index t, Scalar c) {
    auto s = scores();
    s.row(t).array() = (s.row(t).array() - c).exp();
  }

  template <typename Count>
  void subtract_log_counts(const TileIndex& rows, const TileIndex& cols, const Count& count) {
    for (Index t = 0; t < br_; ++t) {
      std::int32_t* n = count_.data();
      std::fill(n, n + bc_, 0);
      count(rows[t], cols, n);
      Scalar* srow = &s_(t, 0);
      for (Index u = 0; u < bc_; ++u) srow[u] -= log_of_count(n[u]);
    }
  }

  // log max(n, 1), from a per-thread table grown on demand (counts are small: rounds or tables),
  // kept across calls.
  static Scalar log_of_count(std::int32_t n) {
    thread_local std::vector<Scalar> table;
    if (std::size_t(n) >= table.size()) {
      for (std::size_t c = table.size(); c <= std::size_t(n); ++c)
        table.push_back(std::log(static_cast<Scalar>(std::max<std::size_t>(c, 1))));
    }
    return table[std::size_t(n)];
  }

  Scratch<RowMatrix<Scalar>> s_, nd_;
  Scratch<Vector<Scalar>> row_max_;
  Scratch<Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1>> count_;
  Index br_ = 0, bc_ = 0;
};

}  // namespace randattn::detail
