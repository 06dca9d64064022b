#pragma once
// The input contract every attention family shares, for q (n_q x d), k (n_k x d) and v (n_k x dv):
//   shapes   q and k have the same number of columns d; k and v the same number of rows;
//   counts   causal attention needs n_q == n_k; queries need at least one key (n_q > 0 needs
//            n_k > 0); at most 2^31 - 1 rows each (kernels index rows with 32-bit integers);
//   finite   no NaN or Inf in q, k or v, unless check_finite = false.
// Each failure throws randattn::invalid_argument naming the function, the argument and the
// shapes. A family adds its own checks (the dimension its map, hash or filters were built for,
// its options). Counts are checked apart from shapes so that a caller holding one part of the
// rows (e.g. one process of a sharded call) checks the shapes of its part and the counts of the
// whole.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>
#include <limits>

#include <Eigen/Core>

#include "../detail/validation.hpp"
#include "options.hpp"
#include "types.hpp"

namespace randattn {

// q and k share d, k and v share their rows.
template <typename Scalar>
void check_attention_shapes(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                            const Eigen::Ref<const RowMatrix<Scalar>>& k,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v) {
  detail::require(q.cols() == k.cols(), where, "q (", detail::shape_of(q), ") and k (",
                  detail::shape_of(k), ") must have the same number of columns d");
  detail::require(k.rows() == v.rows(), where, "k (", detail::shape_of(k), ") and v (",
                  detail::shape_of(v), ") must have the same number of rows");
}

// The row counts of all queries and all keys.
inline void check_attention_counts(const char* where, Index n_q, Index n_k, bool causal) {
  detail::require(!causal || n_q == n_k, where, "causal attention needs as many queries (", n_q,
                  ") as keys (", n_k, ")");
  detail::require(n_q == 0 || n_k > 0, where, "attention over zero keys is undefined (", n_q,
                  " queries, ", n_k, " keys)");
  detail::require(n_q <= Index(std::numeric_limits<std::int32_t>::max()) &&
                      n_k <= Index(std::numeric_limits<std::int32_t>::max()),
                  where, "at most 2^31 - 1 queries and keys, got ", n_q, " and ", n_k);
}

// No NaN or Inf in q, k or v; the message names the first one.
template <typename Scalar>
void check_attention_finite(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                            const Eigen::Ref<const RowMatrix<Scalar>>& k,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v) {
  detail::require_finite(q, where, "q");
  detail::require_finite(k, where, "k");
  detail::require_finite(v, where, "v");
}

// The whole contract for a call that holds all rows: shapes, counts, and finiteness when
// opt.check_finite.
template <typename Scalar>
void check_attention_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                            const Eigen::Ref<const RowMatrix<Scalar>>& k,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v, const CoreOptions& opt) {
  check_attention_shapes<Scalar>(where, q, k, v);
  check_attention_counts(where, q.rows(), k.rows(), opt.causal);
  if (opt.check_finite) check_attention_finite<Scalar>(where, q, k, v);
}

// No NaN or Inf in one input x (any dense expression); the message names `name` and the first.
template <typename Derived>
void check_finite_input(const char* where, const char* name, const Eigen::DenseBase<Derived>& x) {
  detail::require_finite(x, where, name);
}

// The result of finite inputs is finite: overflow is reported, never returned.
template <typename Derived>
void check_finite_result(const char* where, const Eigen::DenseBase<Derived>& result) {
  detail::check_result_finite(where, result, true, [] {});
}

}  // namespace randattn
