#pragma once
// The backward of LSF attention (lsf_attention.hpp): dq, dk and dv of <dO, o> for an incoming
// gradient dO.
//
// What is held constant: every key's filter in every table and the filters every query opened
// (threshold, min_probes and fallback), from the forward (LsfResiduals). They are piecewise
// constant in the inputs, so away from ties of the filter scores (and of a score with η) the
// result is the gradient of the forward, equal to central finite differences of the same seeded
// call. The logits use the raw q and k (only the filters see normalised rows), so there is no
// path through the normalisation. The softmax over each query's union of keys is recomputed on
// the forward's filter tiles, masks and duplicate counts from the row log-sum-exp the forward
// kept (lsh/detail/tile_gradient.hpp). With η = −∞ every filter is opened and the gradient is
// exact attention's.
//
// Determinism and memory: see LsfSlice::backward; results do not depend on the thread count.
// Memory O(n (d + dv) + probes) per slice, as the forward's.

#include <randattn/detail/intrinsics.hpp>

#include <memory>
#include <type_traits>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../lsh/lsh_gradient.hpp"  // row_log_sum_exp, check_separate_key_backward
#include "lsf_attention.hpp"

namespace randattn {

// What lsf_attention_forward keeps for lsf_attention_backward (one slice): the filters' choices
// (the keys' filters and the queries' opened filters), the options and scale, and the row
// log-sum-exp. It refers to the LocalitySensitiveFilters of the forward, which must outlive it.
template <typename Scalar>
struct LsfResiduals {
  Scalar scale = 0;
  Index n_q = 0, n_k = 0, dim = 0, value_dim = 0;
  std::unique_ptr<detail::LsfSlice<Scalar>> choices;
  Vector<Scalar> row_lse;
};

// LSF attention written into `out` as lsf_attention_into (the same bits), keeping what
// lsf_attention_backward needs: q n_q x d, k n_k x d, v n_k x dv, out n_q x dv.
template <typename Scalar, typename DO>
LsfResiduals<Scalar> lsf_attention_forward(const LocalitySensitiveFilters<Scalar>& filters,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                           const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                           const Eigen::MatrixBase<DO>& out,
                                           const LsfOptions& opt = {}) {
  static_assert(std::is_same<Scalar, typename DO::Scalar>::value,
                "q, k, v and out must share the scalar type");
  const char* where = "lsf_attention";
  detail::check_output(where, out, q.rows(), v.cols(),
                       {detail::named_input("q", q), detail::named_input("k", k),
                        detail::named_input("v", v)});
  LsfResiduals<Scalar> saved;
  saved.scale = detail::check_lsf_inputs<Scalar>(where, q, k, v, filters, opt);
  saved.n_q = q.rows();
  saved.n_k = k.rows();
  saved.dim = q.cols();
  saved.value_dim = v.cols();
  int e = 0;
  const SoftmaxAccumulator<Scalar> acc =
      detail::lsf_slice<Scalar>(q, k, v, filters, opt, saved.scale, &e, &saved.choices);
  detail::check_accumulator_finite(where, acc, opt.check_finite);
  acc.finalize_into(out);
  detail::unscale_output(out, e);
  saved.row_lse = detail::row_log_sum_exp(acc);
  return saved;
}

// The gradients of <grad_out, out>: dq (n_q x d), dk (n_k x d), dv (n_k x dv), overwritten. q, k,
// v and out as given to and written by lsf_attention_forward, unchanged since. Throws
// std::invalid_argument (nothing written) on shapes that disagree with the forward's or a
// non-finite grad_out.
template <typename Scalar>
void lsf_attention_backward(const LsfResiduals<Scalar>& saved,
                            const Eigen::Ref<const RowMatrix<Scalar>>& q,
                            const Eigen::Ref<const RowMatrix<Scalar>>& k,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v,
                            const Eigen::Ref<const RowMatrix<Scalar>>& out,
                            const Eigen::Ref<const RowMatrix<Scalar>>& grad_out,
                            Eigen::Ref<RowMatrix<Scalar>> dq, Eigen::Ref<RowMatrix<Scalar>> dk,
                            Eigen::Ref<RowMatrix<Scalar>> dv) {
  const char* where = "lsf_attention_backward";
  detail::require(saved.choices != nullptr, where, "the residuals hold no forward");
  detail::check_separate_key_backward<Scalar>(where, saved.n_q, saved.n_k, saved.dim,
                                              saved.value_dim, q, k, v, out, grad_out, dq, dk, dv);
  const Index n_q = q.rows(), n_k = k.rows();
  detail::Scratch<RowMatrix<Scalar>> go(n_q, v.cols()), dqs(n_q, q.cols()), dks(n_k, k.cols()),
      dvs(n_k, v.cols());
  detail::Scratch<Vector<Scalar>> dot(n_q);
  go = grad_out;
  dot = (go.array() * out.array()).rowwise().sum();
  dqs.setZero();
  dks.setZero();
  dvs.setZero();
  saved.choices->backward(q, k, v, go, saved.row_lse, dot, saved.scale, dqs, dks, dvs);
  dq = saved.scale * dqs;
  dk = dks;
  dv = dvs;
}

}  // namespace randattn
