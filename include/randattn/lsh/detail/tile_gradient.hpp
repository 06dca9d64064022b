#pragma once
// The backward of one score tile (core/detail/score_tile.hpp) of a softmax over gathered targets,
// shared by LSH and LSF attention. The forward merged the tile's weights exp(S − c) into the row
// accumulators; with the row log-sum-exp L_i of the finished rows (over every tile, round and
// table), the tile's share of the softmax is P = exp(S − L) for the same masked logits S, with the
// duplicate correction −log N_ij included, so summing the tiles below over every tile the forward
// scored gives the gradient of the whole softmax (FlashAttention-2's backward, on gathered tiles):
//   dV_t += Pᵀ dO_t,   dP = dO_t V_tᵀ,   dS = P ∘ (dP − D 1ᵀ)  (D_i = dO_i · o_i),
//   dQ_t += dS K_t,    dK_t += dSᵀ Q_t,
// with Q_t the scaled queries whose products are the logits. Five products per tile against the
// forward's two; no buffer beyond the tile.

#include <randattn/detail/intrinsics.hpp>

#include <Eigen/Core>

#include "../../core/detail/score_tile.hpp"
#include "../../core/types.hpp"
#include "../../detail/gemm.hpp"
#include "../../detail/matrix_pool.hpp"

namespace randattn::detail {

template <typename Scalar>
class ScoreTileGradient {
 public:
  ScoreTileGradient(Index max_rows, Index max_cols, Index dim, Index value_dim)
      : dp_(max_rows, max_cols), dq_(max_rows, dim), dk_(max_cols, dim), dv_(max_cols, value_dim) {}

  // The tile's gradients from its masked logits (tile.scores(), overwritten by P), the rows'
  // log-sum-exp lse and D (br each), the gathered scaled queries q (br x d), keys k (bc x d),
  // values v (bc x dv) and output gradients go (br x dv). Leaves dq() when `queries`, dk() and
  // dv() when `keys` is set. A row with lse = +inf (no weight) gets P = 0.
  template <typename L, typename D, typename Q, typename K, typename V, typename GO>
  void step(ScoreTile<Scalar>& tile, const L& lse, const D& dot, const Q& q, const K& k,
            const V& v, const GO& go, bool queries, bool keys) {
    auto p = tile.scores();
    br_ = p.rows();
    bc_ = p.cols();
    p.array() = (p.array().colwise() - lse.array()).exp();
    auto ds = dp_.topLeftCorner(br_, bc_);
    gemm_fixed_depth(ds, go, v.transpose(), false);
    ds.array() = p.array() * (ds.array().colwise() - dot.array());
    if (queries) gemm_fixed_depth(dq_.topRows(br_), ds, k, false);
    if (keys) {
      gemm_fixed_depth(dk_.topRows(bc_), ds.transpose(), q, false);
      gemm_fixed_depth(dv_.topRows(bc_), p.transpose(), go, false);
    }
  }

  auto dq() const { return dq_.topRows(br_); }  // br x d: of the scaled queries
  auto dk() const { return dk_.topRows(bc_); }  // bc x d
  auto dv() const { return dv_.topRows(bc_); }  // bc x dv

 private:
  Scratch<RowMatrix<Scalar>> dp_, dq_, dk_, dv_;
  Index br_ = 0, bc_ = 0;
};

}  // namespace randattn::detail
