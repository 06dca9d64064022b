#pragma once
// The self rule of attention whose queries and keys are the same positions (shared-QK LSH,
// exclude_self): query i never attends to key i unless it has no other valid key. The kernels
// mask key i in their score tiles (TileMask::exclude_self); the rows left without any other key
// attend to their own key alone, with the functions below.

#include <cstdint>
#include <vector>

#include "../../detail/matrix_pool.hpp"
#include "../softmax_accumulator.hpp"
#include "../target_sets.hpp"
#include "../types.hpp"

namespace randattn::detail {

// The rows of an n x n self-excluding call that have no valid key but their own: row 0 under
// causal masking, the single row when n = 1, none otherwise.
inline bool first_row_alone_with_self(Index n, bool causal) { return n > 0 && (causal || n == 1); }

inline std::vector<std::int32_t> rows_alone_with_self(Index n, bool causal) {
  if (!first_row_alone_with_self(n, causal)) return {};
  return {0};
}

// Target sets of an n x n self-excluding call under the self rule: row i's set without key i,
// or key i alone for a row with no other valid key.
inline TargetSets sets_under_self_rule(const TargetSets& sets, bool causal) {
  const Index n = sets.rows();
  return gather_target_sets(
      n, n,
      [&](Index i, auto&& add) {
        if (valid_keys(i, n, causal) == 1) {
          add(std::int32_t(i));
          return;
        }
        for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j)
          if (*j != i) add(*j);
      },
      false, false, sets.keys.size() + std::size_t(n));
}

// Row i's set with key i added (n x n): the keys an estimate of "every other valid key" leaves out
// under the self rule.
inline TargetSets sets_with_self(const TargetSets& sets) {
  const Index n = sets.rows();
  return gather_target_sets(
      n, n,
      [&](Index i, auto&& add) {
        add(std::int32_t(i));
        for (const std::int32_t* j = sets.begin(i); j < sets.end(i); ++j) add(*j);
      },
      false, false, sets.keys.size() + std::size_t(n));
}

// Each row i of `rows` attends to itself alone, with logit queries(i) . keys(i) (queries already
// scaled) and value values(i), merged into acc.
template <typename Scalar, typename Q, typename K, typename V>
void attend_to_self(SoftmaxAccumulator<Scalar>& acc, const std::int32_t* rows, Index count,
                    const Q& queries, const K& keys, const V& values) {
  Scratch<RowMatrix<Scalar>> self(1, values.cols() + 1);
  self(0, values.cols()) = 1;
  for (const std::int32_t* at = rows; at < rows + count; ++at) {
    const std::int32_t i = *at;
    self.leftCols(values.cols()) = values.row(i);
    acc.merge_rows(i, self, Vector<Scalar>::Constant(1, queries.row(i).dot(keys.row(i))));
  }
}

template <typename Scalar, typename Q, typename K, typename V>
void attend_to_self(SoftmaxAccumulator<Scalar>& acc, const std::vector<std::int32_t>& rows,
                    const Q& queries, const K& keys, const V& values) {
  attend_to_self(acc, rows.data(), Index(rows.size()), queries, keys, values);
}

}  // namespace randattn::detail
