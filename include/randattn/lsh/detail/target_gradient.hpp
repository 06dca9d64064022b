#pragma once
// The backward of the LSH kernel (target_blocks.hpp): the same gathered tiles, masks and
// duplicate counts as TargetBlockKernel::attend, each turned into its gradients by the shared
// tile backward (tile_gradient.hpp) and added to the rows it read. Query gradients go to the
// query rows; key and value gradients to one of two destinations by column, so that a caller
// can give every column of a parallel task a destination no other task writes (the keys of a
// chunk's own chunk and of its predecessor, say), and sum them afterwards in a fixed order.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstdint>

#include <Eigen/Core>

#include "../../core/types.hpp"
#include "../../detail/matrix_pool.hpp"
#include "target_blocks.hpp"
#include "tile_gradient.hpp"

namespace randattn::detail {

// The backward's per-query inputs and the queries' gradient, by stored row; owned by the caller.
template <typename Scalar>
struct TargetRowGradients {
  const RowMatrix<Scalar>* grad_out = nullptr;  // n_q x dv: dO
  const Vector<Scalar>* lse = nullptr;          // n_q: row log-sum-exp (+inf: no weight)
  const Vector<Scalar>* dot = nullptr;          // n_q: D_i = dO_i · o_i
  RowMatrix<Scalar>* dq = nullptr;  // n_q x d: gradient of the scaled queries, added to
};

// Where the key and value gradients of a set of columns are added, by stored key row.
template <typename Scalar>
struct KeyGradients {
  RowMatrix<Scalar>* dk = nullptr;  // n_k x d
  RowMatrix<Scalar>* dv = nullptr;  // n_k x dv
};

template <typename Scalar>
class TargetBlockGradient {
 public:
  TargetBlockGradient(const TargetProblem<Scalar>& problem, const TargetRowGradients<Scalar>& rows)
      : rows_(rows),
        kernel_(problem),
        grad_(kTargetRowTile, kTargetColTile, problem.keys->cols(), problem.values->cols()),
        go_(kTargetRowTile, problem.values->cols()),
        lse_(kTargetRowTile),
        dot_(kTargetRowTile) {}

  // The gradients of attend(rows, nr, cols, nc, ·): the queries' added to rows.dq, those of key
  // cols[u] to `first` for u < split and to `rest` from split on.
  void backward(const std::int32_t* rows, Index nr, const std::int32_t* cols, Index nc,
                Index split, const KeyGradients<Scalar>& first, const KeyGradients<Scalar>& rest) {
    kernel_.for_each_tile(
        rows, nr, cols, nc,
        [&](const TileIndex& r) {
          for (Index t = 0; t < r.size; ++t) {
            go_.row(t) = rows_.grad_out->row(r[t]);
            lse_(t) = (*rows_.lse)(r[t]);
            dot_(t) = (*rows_.dot)(r[t]);
          }
        },
        [&](const TileIndex& r, const TileIndex& c) {
          const Index br = r.size, bc = c.size;
          grad_.step(kernel_.tile(), lse_.head(br), dot_.head(br), kernel_.queries(br),
                     kernel_.keys(bc), kernel_.values(bc), go_.topRows(br), true, true);
          const auto dq = grad_.dq();
          for (Index t = 0; t < br; ++t) rows_.dq->row(r[t]) += dq.row(t);
          const auto dk = grad_.dk();
          const auto dv = grad_.dv();
          const Index offset = Index(c.list - cols);  // tile column u is cols[offset + u]
          for (Index u = 0; u < bc; ++u) {
            const KeyGradients<Scalar>& to = offset + u < split ? first : rest;
            to.dk->row(c[u]) += dk.row(u);
            to.dv->row(c[u]) += dv.row(u);
          }
        });
  }

  void backward(const std::int32_t* rows, Index nr, const std::int32_t* cols, Index nc,
                const KeyGradients<Scalar>& keys) {
    backward(rows, nr, cols, nc, nc, keys, keys);
  }

 private:
  const TargetRowGradients<Scalar>& rows_;
  TargetBlockKernel<Scalar> kernel_;
  ScoreTileGradient<Scalar> grad_;
  Scratch<RowMatrix<Scalar>> go_;
  Scratch<Vector<Scalar>> lse_, dot_;
};

}  // namespace randattn::detail
