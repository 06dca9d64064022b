#pragma once
// Lloyd's algorithm for k-means on rows, shared by the key clusters of sparse attention's
// `clusters` support (sparse/cluster_support.hpp) and the splits of the decoding cache's clusters
// (decode/detail/key_clusters.hpp). A step assigns every row to its nearest centroid, argmin
// ‖c‖² − 2 c·x (ties to the lower index) from dot products of rows read in place (row_dots), then
// moves each centroid to the mean of its rows, summed in double in row order; a cluster left
// empty keeps its centroid. Rows are assigned in parallel blocks, each row on its own, so results
// are a function of the rows and the starting centroids alone, never of the thread count.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "chunk_products.hpp"
#include "matrix_pool.hpp"
#include "parallel.hpp"

namespace randattn::detail {

// A cluster whose bound on its members' logits is this far below a logit scored holds keys whose
// weights are each below 2^-24 (float's rounding unit) of that key's: negligible, so it may stay
// closed (the clusters of decoding and of the sparse + low-rank support).
constexpr double kClusterMargin = 16.635532333438686;  // 24·ln 2

constexpr Index kAssignRows = 256;  // rows per block of the assignment: their dots stay in cache

// labels[u] = the nearest row of c (K x d) to row u of x (n x d); c_norm2 the squared norms of
// c's rows.
template <typename Scalar>
void nearest_centroids(const Eigen::Ref<const RowMatrix<Scalar>>& x,
                       const Eigen::Ref<const RowMatrix<Scalar>>& c,
                       const Eigen::Ref<const Vector<Scalar>>& c_norm2, std::int32_t* labels) {
  const Index n = x.rows(), K = c.rows();
  if (n == 0 || K == 0) return;
  parallel_for((n + kAssignRows - 1) / kAssignRows, [&](Index t) {
    const Index u0 = t * kAssignRows, rows = std::min(kAssignRows, n - u0);
    Scratch<RowMatrix<Scalar>> dots(rows, K);
    row_dots(dots, x.middleRows(u0, rows), c);
    for (Index u = 0; u < rows; ++u) {
      std::int32_t best = 0;
      Scalar low = std::numeric_limits<Scalar>::infinity();
      for (Index k = 0; k < K; ++k) {
        const Scalar s = c_norm2(k) - 2 * dots(u, k);
        if (s < low) low = s, best = std::int32_t(k);
      }
      labels[u0 + u] = best;
    }
  });
}

// `steps` >= 1 Lloyd steps on the rows of x from the centroids c (K x d, updated in place).
// labels (n) receives the last assignment and counts (K) its cluster sizes: each centroid with
// members is then the mean of the rows labelled with it.
template <typename Scalar>
void lloyd_steps(const Eigen::Ref<const RowMatrix<Scalar>>& x, Eigen::Ref<RowMatrix<Scalar>> c,
                 int steps, std::int32_t* labels, Index* counts) {
  const Index n = x.rows(), K = c.rows(), d = c.cols();
  Scratch<Vector<Scalar>> norm2(K);
  Scratch<RowMatrix<double>> sum(K, d);
  for (int step = 0; step < steps; ++step) {
    norm2 = c.rowwise().squaredNorm();
    nearest_centroids<Scalar>(x, c, norm2, labels);
    sum.setZero();
    std::fill(counts, counts + K, Index(0));
    for (Index u = 0; u < n; ++u) {
      sum.row(labels[u]) += x.row(u).template cast<double>();
      ++counts[labels[u]];
    }
    for (Index k = 0; k < K; ++k)
      if (counts[k] > 0) c.row(k) = (sum.row(k) / double(counts[k])).template cast<Scalar>();
  }
}

}  // namespace randattn::detail
