#pragma once
// A sparse tensor in coordinate (COO) form: flat row-major indices in strictly increasing
// order with their values, plus the dimensions. Mode-j matricisation to Eigen::SparseMatrix
// and conversion to a dense row-major buffer.

#include <randattn/detail/intrinsics.hpp>

#include <utility>
#include <vector>

#include <Eigen/Core>
#include <Eigen/SparseCore>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "tensor_view.hpp"

namespace randattn {

template <typename Scalar_>
class SparseTensor {
 public:
  using Scalar = Scalar_;
  // Entry e sits at multi-index unravel(indices()[e]) in row-major order.
  using Coordinates = Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  SparseTensor() = default;

  // Checks order >= 2, matching lengths and strictly increasing indices inside [0, size()).
  SparseTensor(std::vector<Index> dims, std::vector<Index> indices, std::vector<Scalar> values)
      : dims_(std::move(dims)), indices_(std::move(indices)), values_(std::move(values)) {
    const char* where = "SparseTensor";
    detail::require(dims_.size() >= 2, where, "a tensor of order k >= 2 is needed, got shape ",
                    detail::dims_str(dims_));
    size_ = detail::checked_size(dims_, where);
    detail::require(indices_.size() == values_.size(), where, indices_.size(), " indices but ",
                    values_.size(), " values");
    for (std::size_t e = 0; e < indices_.size(); ++e) {
      detail::require(
          indices_[e] >= 0 && indices_[e] < size_ && (e == 0 || indices_[e - 1] < indices_[e]),
          where, "indices must be strictly increasing flat indices in [0, ", size_, "); entry ", e,
          " is ", indices_[e]);
    }
  }

  Index order() const { return Index(dims_.size()); }
  const std::vector<Index>& dims() const { return dims_; }
  Index dim(Index mode) const { return dims_[std::size_t(mode)]; }
  Index size() const { return size_; }  // number of entries of the dense tensor
  Index nnz() const { return Index(indices_.size()); }
  const std::vector<Index>& indices() const { return indices_; }
  const std::vector<Scalar>& values() const { return values_; }

  // The index and value vectors, moved out so that their storage can be reused (by
  // sparsify_into, for one); the tensor is left with the same shape and no entries.
  std::pair<std::vector<Index>, std::vector<Scalar>> take_storage() && {
    std::pair<std::vector<Index>, std::vector<Scalar>> storage{std::move(indices_),
                                                              std::move(values_)};
    indices_.clear();
    values_.clear();
    return storage;
  }

  // Index along `mode` of entry e.
  Index coordinate(Index e, Index mode) const {
    return detail::ModeSplit(dims_, mode).row(indices_[std::size_t(e)]);
  }

  // nnz x order matrix of multi-indices.
  Coordinates coordinates() const {
    Coordinates c(nnz(), order());
    for (Index mode = 0; mode < order(); ++mode) {
      const detail::ModeSplit split(dims_, mode);
      for (Index e = 0; e < nnz(); ++e) c(e, mode) = split.row(indices_[std::size_t(e)]);
    }
    return c;
  }

 private:
  std::vector<Index> dims_{0, 0};
  std::vector<Index> indices_;
  std::vector<Scalar> values_;
  Index size_ = 0;
};

// Dense row-major copy (size() entries, zeros where nothing is stored).
template <typename Scalar>
Vector<Scalar> densify(const SparseTensor<Scalar>& s) {
  Vector<Scalar> dense = Vector<Scalar>::Zero(s.size());
  for (Index e = 0; e < s.nnz(); ++e)
    dense(s.indices()[std::size_t(e)]) = s.values()[std::size_t(e)];
  return dense;
}

// Mode-j matricisation M_j: a d_j x (size / d_j) sparse matrix whose column index runs over the
// remaining indices in row-major order (see detail::ModeSplit). Column-major (default) or
// row-major storage; the inner indices of every outer vector come out sorted. Built in O(nnz +
// outer size) by counting, since the flat order already sorts each outer vector.
template <int Options = Eigen::ColMajor, typename Scalar>
Eigen::SparseMatrix<Scalar, Options, Index> unfold(const SparseTensor<Scalar>& s, Index mode) {
  detail::require(mode >= 0 && mode < s.order(), "unfold", "mode ", mode,
                  " is out of range for a tensor of order ", s.order());
  const detail::ModeSplit split(s.dims(), mode);
  constexpr bool row_major = (Options & Eigen::RowMajorBit) != 0;
  const Index nnz = s.nnz();
  std::vector<Index> outer(std::size_t(nnz), 0), inner(std::size_t(nnz), 0);
  for (Index e = 0; e < nnz; ++e) {
    Index row = 0, col = 0;
    split.locate(s.indices()[std::size_t(e)], row, col);
    outer[std::size_t(e)] = row_major ? row : col;
    inner[std::size_t(e)] = row_major ? col : row;
  }

  Eigen::SparseMatrix<Scalar, Options, Index> m(split.dim, split.cols());
  m.resizeNonZeros(nnz);
  Index* starts = m.outerIndexPtr();
  const Index outer_size = m.outerSize();
  std::fill(starts, starts + outer_size + 1, Index(0));
  for (Index o : outer) ++starts[o + 1];
  for (Index o = 0; o < outer_size; ++o) starts[o + 1] += starts[o];
  std::vector<Index> next(starts, starts + outer_size);
  for (Index e = 0; e < nnz; ++e) {
    const Index slot = next[std::size_t(outer[std::size_t(e)])]++;
    m.innerIndexPtr()[slot] = inner[std::size_t(e)];
    m.valuePtr()[slot] = s.values()[std::size_t(e)];
  }
  return m;
}

}  // namespace randattn
