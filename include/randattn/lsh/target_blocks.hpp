#pragma once
// The compute kernel of LSH attention: query rows attend to an explicit list of key rows
// (a sorted chunk and its predecessor, or a hash bucket), with the self rule, causal masking
// and the multi-round duplicate correction, and the partial [num | den] of every row is merged
// into the shared SoftmaxAccumulator. Long lists are cut into tiles, so no buffer is larger
// than a tile, whatever the chunk or bucket size.
//
// Duplicate correction. Round rho gives every token a signature s_rho (its chunk index in the
// sorted order, or its bucket). Key j is a target of query i in round rho exactly when
//   s_rho(i) - s_rho(j) = 0, or, for chunks ("adjacent"), = 1 (previous chunk) or = 1 - #chunks
//   (chunk 0 looking back cyclically at the last chunk);
// N_ij counts these rounds in O(r) per pair from the per-token signatures, without any n x n
// table, and the logit of the pair is lowered by log N_ij.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../detail/gemm.hpp"

namespace randattn::detail {

// Stable counting sort of `n` tokens by code (codes[t * stride] in [0, buckets)): perm lists the
// tokens bucket by bucket in increasing position; bucket c is perm[start[c], start[c + 1]).
inline void sort_by_bucket(const std::int32_t* codes, Index stride, Index n, Index buckets,
                           std::int32_t* perm, std::vector<Index>& start) {
  start.assign(static_cast<std::size_t>(buckets) + 1, 0);
  for (Index t = 0; t < n; ++t) ++start[static_cast<std::size_t>(codes[t * stride]) + 1];
  for (Index c = 0; c < buckets; ++c) start[c + 1] += start[c];
  std::vector<Index> next(start.begin(), start.end() - 1);
  for (Index t = 0; t < n; ++t) perm[next[static_cast<std::size_t>(codes[t * stride])]++] = static_cast<std::int32_t>(t);
}

// Per-round signatures of queries and keys (row-major n x rounds) and the target relation.
struct RoundSignatures {
  const std::int32_t* query = nullptr;
  const std::int32_t* key = nullptr;
  Index rounds = 0;
  bool adjacent = false;  // chunks: same or previous chunk; buckets: same bucket
  std::int32_t wrap = 0;  // 1 - #chunks: chunk 0 looking back at the last chunk
};

// Everything a kernel needs; the matrices are owned by the caller.
template <typename Scalar>
struct TargetProblem {
  const RowMatrix<Scalar>* queries = nullptr;  // n_q x d, already multiplied by the scale
  const RowMatrix<Scalar>* keys = nullptr;     // n_k x d
  const RowMatrix<Scalar>* values = nullptr;   // n_k x dv
  bool exclude_self = false;                   // shared QK: key i is masked for query i
  bool causal = false;                         // key j is masked for query i when j > i
  const RoundSignatures* dedupe = nullptr;     // null: every occurrence counts (no correction)
};

// Row and column tiles; a chunk of length c <= 128 and its predecessor fit one tile each.
constexpr Index kTargetRowTile = 128;
constexpr Index kTargetColTile = 256;

template <typename Scalar>
class TargetBlockKernel {
 public:
  explicit TargetBlockKernel(const TargetProblem<Scalar>& problem)
      : p_(problem),
        q_(kTargetRowTile, problem.queries->cols()),
        k_(kTargetColTile, problem.keys->cols()),
        v_(kTargetColTile, problem.values->cols()),
        s_(kTargetRowTile, kTargetColTile),
        nd_(kTargetRowTile, problem.values->cols() + 1),
        row_max_(kTargetRowTile),
        count_(kTargetColTile),
        key_sig_(problem.dedupe ? problem.dedupe->rounds : 0, kTargetColTile) {
    if (p_.dedupe) {
      log_count_.resize(p_.dedupe->rounds + 1);
      for (Index c = 0; c <= p_.dedupe->rounds; ++c) log_count_[c] = std::log(static_cast<Scalar>(std::max<Index>(c, 1)));
    }
  }

  // Merges into `acc` the softmax partials of query rows rows[0..nr) over key rows cols[0..nc).
  void attend(const std::int32_t* rows, Index nr, const std::int32_t* cols, Index nc,
              SoftmaxAccumulator<Scalar>& acc) {
    for (Index r0 = 0; r0 < nr; r0 += kTargetRowTile) {
      const Index br = std::min(kTargetRowTile, nr - r0);
      std::int32_t max_row = 0;
      for (Index t = 0; t < br; ++t) {
        q_.row(t) = p_.queries->row(rows[r0 + t]);
        max_row = std::max(max_row, rows[r0 + t]);
      }
      for (Index c0 = 0; c0 < nc; c0 += kTargetColTile) {
        const Index bc = std::min(kTargetColTile, nc - c0);
        if (p_.causal && *std::min_element(cols + c0, cols + c0 + bc) > max_row) continue;
        tile(rows + r0, br, cols + c0, bc, acc);
      }
    }
  }

 private:
  void tile(const std::int32_t* rows, Index br, const std::int32_t* cols, Index bc, SoftmaxAccumulator<Scalar>& acc) {
    constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
    const RoundSignatures* sig = p_.dedupe;
    for (Index u = 0; u < bc; ++u) {
      k_.row(u) = p_.keys->row(cols[u]);
      v_.row(u) = p_.values->row(cols[u]);
      if (sig)
        for (Index rho = 0; rho < sig->rounds; ++rho) key_sig_(rho, u) = sig->key[cols[u] * sig->rounds + rho];
    }
    auto s = s_.topLeftCorner(br, bc);
    gemm_fixed_depth(s, q_.topRows(br), k_.topRows(bc).transpose(), false);

    for (Index t = 0; t < br; ++t) {
      const std::int32_t i = rows[t];
      Scalar* srow = &s(t, 0);
      if (sig) {
        count_pairs(sig->query + Index(i) * sig->rounds, bc);
        for (Index u = 0; u < bc; ++u) srow[u] -= log_count_[count_[u]];
      }
      // Self and causal masks as one comparison per key: j masked iff j > limit, or j == i.
      const std::int32_t limit = p_.causal ? i : std::numeric_limits<std::int32_t>::max();
      const std::int32_t self = p_.exclude_self ? i : -1;
      for (Index u = 0; u < bc; ++u) srow[u] = (cols[u] > limit || cols[u] == self) ? kNegInf : srow[u];
      const Scalar m = s.row(t).maxCoeff();
      row_max_[t] = m;
      // A row with no valid key in this tile contributes nothing (log-scale -inf); shifting by 0
      // keeps its exponentials at exactly 0 instead of NaN.
      s.row(t).array() = (s.row(t).array() - (m == kNegInf ? Scalar(0) : m)).exp();
    }
    // [num | den] = [P V | P 1]; the row sums keep the product at dv columns.
    auto nd = nd_.topRows(br);
    auto num = nd.leftCols(v_.cols());
    gemm_fixed_depth(num, s, v_.topRows(bc), false);
    nd.col(v_.cols()) = s.rowwise().sum();
    for (Index t = 0; t < br; ++t) acc.merge_rows(rows[t], nd.row(t), row_max_.segment(t, 1));
  }

  // count_[u] = number of rounds in which key cols[u] is a target of the query with signatures qs.
  void count_pairs(const std::int32_t* qs, Index bc) {
    const RoundSignatures& sig = *p_.dedupe;
    std::fill(count_.data(), count_.data() + bc, 0);
    for (Index rho = 0; rho < sig.rounds; ++rho) {
      const std::int32_t a = qs[rho];
      const std::int32_t* ks = &key_sig_(rho, 0);
      std::int32_t* cnt = count_.data();
      if (sig.adjacent) {
        for (Index u = 0; u < bc; ++u) {
          const std::int32_t diff = a - ks[u];
          cnt[u] += (diff == 0) | (diff == 1) | (diff == sig.wrap);
        }
      } else {
        for (Index u = 0; u < bc; ++u) cnt[u] += (a == ks[u]);
      }
    }
  }

  const TargetProblem<Scalar>& p_;
  RowMatrix<Scalar> q_, k_, v_, s_, nd_;
  Vector<Scalar> row_max_;
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, 1> count_;
  Eigen::Matrix<std::int32_t, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> key_sig_;
  Vector<Scalar> log_count_;
};

}  // namespace randattn::detail
