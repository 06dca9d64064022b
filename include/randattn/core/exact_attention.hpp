#pragma once
// Exact softmax attention: a naive reference that forms the n_q x n_k score matrix, and a
// tiled online-softmax version (flash-attention style) that never does: each query block
// sweeps the key blocks and merges every block's partial [num | den] into the shared
// SoftmaxAccumulator. Memory O((n_q + n_k) * (d + dv)) plus one block of scores per thread.

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include <Eigen/Core>

#include "../detail/gemm.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "linear_attention.hpp"
#include "softmax_accumulator.hpp"
#include "types.hpp"

namespace randattn {

struct ExactOptions {
  bool causal = false;          // query i sees keys j <= i (requires n_q == n_k)
  std::optional<double> scale;  // logits are scale * q.k; default 1/sqrt(d)
  bool check_finite = true;     // throw std::invalid_argument on NaN/Inf input
  Index block_size = 0;         // query and key block length; 0 = automatic (128)
};

namespace detail {

constexpr Index kDefaultExactBlock = 128;

template <typename Scalar>
Scalar check_exact_inputs(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                          const Eigen::Ref<const RowMatrix<Scalar>>& k,
                          const Eigen::Ref<const RowMatrix<Scalar>>& v, const ExactOptions& opt) {
  require(q.cols() == k.cols(), where, "q (", shape_of(q), ") and k (", shape_of(k),
          ") must have the same number of columns d");
  require(k.rows() == v.rows(), where, "k (", shape_of(k), ") and v (", shape_of(v),
          ") must have the same number of rows");
  require(!opt.causal || q.rows() == k.rows(), where, "causal attention needs as many queries (",
          q.rows(), ") as keys (", k.rows(), ")");
  require(opt.block_size >= 0 && opt.block_size <= kMaxGemmDepth, where,
          "block_size must be in [0, ", kMaxGemmDepth, "], got ", opt.block_size);
  if (q.rows() > 0) {
    require(k.rows() > 0, where, "attention over zero keys is undefined (q ", shape_of(q),
            ", k ", shape_of(k), ")");
    require(q.cols() > 0, where, "d must be >= 1 (q ", shape_of(q), ")");
  }
  require(!opt.scale || std::isfinite(*opt.scale), where, "scale must be finite, got ",
          opt.scale ? *opt.scale : 0.0);
  const double scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(double(std::max<Index>(q.cols(), 1)));
  require(std::isfinite(static_cast<Scalar>(scale)), where, "scale ", scale,
          " is not representable in the input's floating-point type");
  return static_cast<Scalar>(scale);
}

// Names the first non-finite entry of q, k or v (see check_result_finite).
template <typename Scalar>
auto exact_input_scan(const char* where, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                      const Eigen::Ref<const RowMatrix<Scalar>>& k,
                      const Eigen::Ref<const RowMatrix<Scalar>>& v) {
  return [=, &q, &k, &v] {
    require_finite(q, where, "q");
    require_finite(k, where, "k");
    require_finite(v, where, "v");
  };
}

template <typename Scalar>
SoftmaxAccumulator<Scalar> exact_tiled(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                       const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                       const Eigen::Ref<const RowMatrix<Scalar>>& v, Scalar scale,
                                       bool causal, Index block) {
  const Index n_q = q.rows(), n_k = k.rows(), dv = v.cols();
  SoftmaxAccumulator<Scalar> acc(n_q, dv);
  if (n_q == 0) return acc;
  const RowMatrix<Scalar> qs = scale * q;
  const RowMatrix<Scalar> ve = append_ones<Scalar>(v);
  const Index q_blocks = (n_q + block - 1) / block;
  // Query blocks are independent and each runs on one thread: results do not depend on the
  // thread count.
  parallel_for(q_blocks, [&](Index qb) {
    const Index i0 = qb * block, bq = std::min(block, n_q - i0);
    RowMatrix<Scalar> scores(bq, block), numden(bq, dv + 1);
    Vector<Scalar> row_max(bq);
    const Index k_end = causal ? i0 + bq : n_k;
    for (Index j0 = 0; j0 < k_end; j0 += block) {
      const Index bk = std::min(block, k_end - j0);
      auto s = scores.leftCols(bk);
      gemm_fixed_depth(s, qs.middleRows(i0, bq), k.middleRows(j0, bk).transpose(), false);
      if (causal && j0 + bk > i0) {
        // Diagonal block: key j0 + c is masked for query i0 + r when j0 + c > i0 + r.
        for (Index r = 0; r < bq; ++r) {
          const Index first_masked = std::max<Index>(0, i0 + r + 1 - j0);
          if (first_masked < bk)
            s.row(r).tail(bk - first_masked).setConstant(-std::numeric_limits<Scalar>::infinity());
        }
      }
      row_max = s.rowwise().maxCoeff();
      s = (s.colwise() - row_max).array().exp().matrix();
      numden.noalias() = s * ve.middleRows(j0, bk);
      acc.merge_rows(i0, numden, row_max);
    }
  });
  return acc;
}

}  // namespace detail

// Unnormalised exact attention as an accumulator (for merging with other partial results).
template <typename Scalar>
SoftmaxAccumulator<Scalar> exact_attention_accumulate(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                                      const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                                      const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                      const ExactOptions& opt = {}) {
  const Scalar scale = detail::check_exact_inputs<Scalar>("exact_attention", q, k, v, opt);
  const Index block = opt.block_size > 0 ? opt.block_size : detail::kDefaultExactBlock;
  SoftmaxAccumulator<Scalar> acc = detail::exact_tiled<Scalar>(q, k, v, scale, opt.causal, block);
  const auto scan = detail::exact_input_scan<Scalar>("exact_attention", q, k, v);
  detail::check_result_finite("exact_attention", acc.numden(), opt.check_finite, scan);
  // Every row has a valid key, so a log-scale of -inf means all its logits overflowed to -inf.
  detail::check_result_finite("exact_attention", acc.log_scale(), opt.check_finite, scan);
  return acc;
}

// softmax(scale * Q K^T [masked]) V, tiled: q n_q x d, k n_k x d, v n_k x dv -> n_q x dv.
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> exact_attention(const Eigen::MatrixBase<DQ>& q,
                                               const Eigen::MatrixBase<DK>& k,
                                               const Eigen::MatrixBase<DV>& v,
                                               const ExactOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  static_assert(std::is_same<Scalar, typename DK::Scalar>::value &&
                    std::is_same<Scalar, typename DV::Scalar>::value,
                "q, k and v must share the scalar type");
  // Every row of an exact accumulator has den >= 1 (its maximal term is exp(0)).
  return exact_attention_accumulate<Scalar>(q, k, v, opt).finalize();
}

// Reference implementation: forms the full score matrix (O(n_q * n_k) memory). For tests and
// benchmarks; use exact_attention otherwise.
template <typename DQ, typename DK, typename DV>
RowMatrix<typename DQ::Scalar> naive_attention(const Eigen::MatrixBase<DQ>& q,
                                               const Eigen::MatrixBase<DK>& k,
                                               const Eigen::MatrixBase<DV>& v,
                                               const ExactOptions& opt = {}) {
  using Scalar = typename DQ::Scalar;
  const RowMatrix<Scalar> qm = q, km = k, vm = v;
  const Scalar scale = detail::check_exact_inputs<Scalar>("naive_attention", qm, km, vm, opt);

  RowMatrix<Scalar> p = (scale * qm) * km.transpose();
  if (opt.causal) {
    for (Index i = 0; i < p.rows(); ++i)
      p.row(i).tail(p.cols() - i - 1).setConstant(-std::numeric_limits<Scalar>::infinity());
  }
  for (Index i = 0; i < p.rows(); ++i) {
    p.row(i).array() = (p.row(i).array() - p.row(i).maxCoeff()).exp();
    p.row(i) /= p.row(i).sum();
  }
  RowMatrix<Scalar> out = p * vm;
  detail::check_result_finite("naive_attention", out, opt.check_finite,
                              detail::exact_input_scan<Scalar>("naive_attention", qm, km, vm));
  return out;
}

// Batched multi-head exact attention over contiguous row-major buffers:
// q (batch, heads, n_q, d), k (batch, heads, n_k, d), v (batch, heads, n_k, dv) ->
// out (batch, heads, n_q, dv). Slices run in parallel, each on one thread, so results do not
// depend on the thread count.
template <typename Scalar>
void exact_attention_batched(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out,
                             const BatchShape& shape, const ExactOptions& opt = {}) {
  const char* where = "exact_attention_batched";
  detail::require(shape.batch >= 0 && shape.heads >= 0 && shape.n_q >= 0 && shape.n_k >= 0 &&
                      shape.d >= 0 && shape.dv >= 0,
                  where, "negative dimension in shape (batch ", shape.batch, ", heads ",
                  shape.heads, ", n_q ", shape.n_q, ", n_k ", shape.n_k, ", d ", shape.d, ", dv ",
                  shape.dv, ")");
  detail::require(shape.slices() == 0 || shape.n_q == 0 || (q && k && v && out), where,
                  "null data pointer");
  using CMap = Eigen::Map<const RowMatrix<Scalar>>;
  detail::parallel_for(shape.slices(), [&](Index s) {
    const CMap qs(q + s * shape.n_q * shape.d, shape.n_q, shape.d);
    const CMap ks(k + s * shape.n_k * shape.d, shape.n_k, shape.d);
    const CMap vs(v + s * shape.n_k * shape.dv, shape.n_k, shape.dv);
    Eigen::Map<RowMatrix<Scalar>> o(out + s * shape.n_q * shape.dv, shape.n_q, shape.dv);
    exact_attention_accumulate<Scalar>(qs, ks, vs, opt).finalize_into(o);
  });
}

}  // namespace randattn
