#pragma once
// Higher-order SVD subspaces: exact, and sketched from two independent sparsifications
// (Algorithm 2 of "Effective Tensor Sketching via Sparsification"), with the sin-Theta distance
// between subspaces.
//
// exact_hosvd: U_j = top r_j eigenvectors of M_j M_j^T (the top left singular vectors of the
//   mode-j unfolding M_j). O(D * sum_j d_j) flops; the Gram products run over panels of fixed
//   depth, so the result does not depend on the thread count.
// sketched_hosvd: two independent sketches A1, A2 of A (streams opt.stream and opt.stream + 1),
//   N_j = M_j(A1) M_j(A2)^T, which is unbiased for M_j M_j^T, and U_j = top r_j eigenvectors of
//   (N_j + N_j^T) / 2. Cost O(nnz) to sketch plus sum_c nnz_1(c) nnz_2(c) over unfolding columns.
// Factors are d_j x r_j with orthonormal columns, in decreasing order of eigenvalue, each signed so
// that its largest-magnitude entry is positive. Modes are numbered from 0.
// Errors (std::invalid_argument): ranks.size() != order, a rank outside [1, d_j], an all-zero
// tensor, a non-finite entry, and (sketched) every error of sparsify().

#include <randattn/detail/intrinsics.hpp>

#include <array>
#include <cmath>
#include <vector>

#include <Eigen/Core>
#include <Eigen/SVD>

#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "detail/mode_gram.hpp"
#include "sparse_tensor.hpp"
#include "sparsify.hpp"
#include "tensor_view.hpp"

namespace randattn {

template <typename Scalar>
struct Hosvd {
  std::vector<RowMatrix<Scalar>> factors;   // U_j: d_j x r_j, orthonormal columns
  std::vector<Vector<Scalar>> eigenvalues;  // the r_j leading eigenvalues of the mode-j matrix
};

template <typename Scalar>
struct SketchedHosvd : Hosvd<Scalar> {
  std::array<Index, 2> nnz{{0, 0}};  // realised nnz of the two sketches
  SketchStats stats;                 // parameters of the sketches (expected nnz of each)
};

namespace detail {

inline void check_ranks(const std::vector<Index>& dims, const std::vector<Index>& ranks,
                        const char* where) {
  require(ranks.size() == dims.size(), where, ranks.size(), " ranks given for a tensor of order ",
          dims.size(), " (shape ", dims_str(dims), ")");
  for (std::size_t j = 0; j < dims.size(); ++j) {
    require(ranks[j] >= 1 && ranks[j] <= dims[j], where, "rank ", ranks[j], " of mode ", j,
            " must be in [1, d_", j, "] = [1, ", dims[j], "] (shape ", dims_str(dims), ")");
  }
}

// Fills the factors from mode_matrix(j), a symmetric d_j x d_j matrix; modes in parallel.
template <typename Scalar, typename ModeMatrix>
void hosvd_factors(Hosvd<Scalar>& out, const std::vector<Index>& ranks, ModeMatrix&& mode_matrix,
                   const char* where) {
  const Index k = Index(ranks.size());
  out.factors.resize(std::size_t(k));
  out.eigenvalues.resize(std::size_t(k));
  parallel_for(k, [&](Index j) {
    const RowMatrix<Scalar> gram = mode_matrix(j);
    // The inputs are finite here: entries beyond sqrt(max) overflow their squares, which is the
    // documented overflow error, not an eigensolver failure.
    check_result_finite(where, gram, true, [] {});
    top_eigenvectors<Scalar>(gram, ranks[std::size_t(j)], out.factors[std::size_t(j)],
                             out.eigenvalues[std::size_t(j)]);
  });
}

}  // namespace detail

// Exact HOSVD subspaces of a tensor (anything tensor_view() accepts).
template <typename T>
auto exact_hosvd(const T& tensor, const std::vector<Index>& ranks) {
  const auto a = tensor_view(tensor);
  using Scalar = typename std::decay_t<decltype(a)>::Scalar;
  const char* where = "exact_hosvd";
  detail::check_ranks(a.dims(), ranks, where);
  Vector<Scalar> storage;
  const Scalar* data = detail::row_major_data(a, storage);
  detail::require_finite(data, a.size(), where, "the tensor");
  const Eigen::Map<const Vector<Scalar>> entries(data, a.size());
  detail::require((entries.array() != Scalar(0)).any(), where, "the tensor of shape ",
                  detail::dims_str(a.dims()), " is all zero: its subspaces are undefined");
  Hosvd<Scalar> out;
  detail::hosvd_factors(
      out, ranks, [&](Index j) { return detail::dense_mode_gram(data, a.dims(), j); }, where);
  return out;
}

// Algorithm 2 on two given sketches of the same tensor (e.g. from StreamingSparsifier with two
// streams). They must be independent for N_j to be unbiased.
template <typename Scalar>
SketchedHosvd<Scalar> sketched_hosvd(const SparseSketch<Scalar>& s1, const SparseSketch<Scalar>& s2,
                                     const std::vector<Index>& ranks) {
  const char* where = "sketched_hosvd";
  detail::require(s1.dims() == s2.dims(), where, "the sketches have different shapes ",
                  detail::dims_str(s1.dims()), " and ", detail::dims_str(s2.dims()));
  detail::check_ranks(s1.dims(), ranks, where);
  SketchedHosvd<Scalar> out;
  out.nnz = {{s1.nnz(), s2.nnz()}};
  out.stats = s1.stats;
  std::vector<Index> modes(s1.dims().size());
  for (std::size_t j = 0; j < modes.size(); ++j) modes[j] = Index(j);
  const std::vector<RowMatrix<Scalar>> n = detail::sketch_mode_products(s1, s2, modes);
  detail::hosvd_factors<Scalar>(
      out, ranks,
      [&](Index j) {
        return RowMatrix<Scalar>((n[std::size_t(j)] + n[std::size_t(j)].transpose()) / Scalar(2));
      },
      where);
  return out;
}

// Algorithm 2: sketches the tensor twice (one pass for ||A||_F, shared) and runs the above.
template <typename T>
auto sketched_hosvd(const T& tensor, const std::vector<Index>& ranks, const SparsifyOptions& opt) {
  const auto a = tensor_view(tensor);
  using Scalar = typename std::decay_t<decltype(a)>::Scalar;
  detail::check_ranks(a.dims(), ranks, "sketched_hosvd");
  auto sketches = detail::InMemorySparsifier<Scalar>(a, opt, "sketched_hosvd")
                      .sample({opt.stream, opt.stream + 1});
  auto out = sketched_hosvd(sketches[0], sketches[1], ranks);
  for (SparseSketch<Scalar>& s : sketches) detail::recycle(std::move(s));
  return out;
}

// ||sin Theta(U, V)||_2 = ||(I - U U^T) V||_2 for U (d x r) and V (d x r') with orthonormal
// columns (not checked): 0 when span V lies in span U, 1 when some direction of V is orthogonal
// to span U. Computed in double.
template <typename DU, typename DV>
double sin_theta_distance(const Eigen::MatrixBase<DU>& u, const Eigen::MatrixBase<DV>& v) {
  detail::require(u.rows() == v.rows(), "sin_theta_distance", "U (", detail::shape_of(u),
                  ") and V (", detail::shape_of(v), ") must have the same number of rows");
  if (v.cols() == 0) return 0;
  const Eigen::MatrixXd ud = u.template cast<double>(), vd = v.template cast<double>();
  const Eigen::MatrixXd residual = vd - ud * (ud.transpose() * vd);
  return Eigen::JacobiSVD<Eigen::MatrixXd>(residual).singularValues()(0);
}

}  // namespace randattn
