#pragma once
// Read-only views of dense tensors of any order k >= 2.
//
// A TensorView is (data pointer, dims, strides in elements). Whatever the storage, the sketching
// code addresses an entry by its flat row-major index
//     omega = ((i_0 * d_1 + i_1) * d_2 + ...) * d_{k-1} + i_{k-1},
// so a tensor gives the same sketch whether it is stored row-major, column-major or strided.
//
// tensor_view(...) builds a view from
//   - a plain row-major buffer:            tensor_view(ptr, {d0, d1, d2})
//   - an Eigen::Tensor / TensorMap / TensorFixedSize of either layout (any order >= 2);
//     the unsupported Tensor module is not included here: include it yourself to use it;
//   - an Eigen matrix, Map, Ref or block with direct access (order 2: rows x cols);
//   - a TensorView (returned unchanged).
// The view does not own the data, which must outlive it.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "../detail/validation.hpp"

namespace randattn {

namespace detail {

// A shape or multi-index as "(d_0, ..., d_{k-1})" ("(d_0,)" for order 1), formatted only when
// streamed into a message: the checks that pass it to require() build no string unless they fail.
// Refers to `dims`, so it must not outlive them.
struct DimsText {
  const std::vector<Index>* dims;
};

inline std::ostream& operator<<(std::ostream& s, DimsText t) {
  s << "(";
  for (std::size_t j = 0; j < t.dims->size(); ++j) s << (j ? ", " : "") << (*t.dims)[j];
  if (t.dims->size() == 1) s << ",";
  return s << ")";
}

inline DimsText dims_str(const std::vector<Index>& dims) { return {&dims}; }

// "(i_0, ..., i_{k-1})", the multi-index of flat row-major index `flat`.
inline std::string index_str(const std::vector<Index>& dims, Index flat) {
  std::vector<Index> idx(dims.size());
  for (std::size_t j = dims.size(); j-- > 0;) {
    idx[j] = flat % dims[j];
    flat /= dims[j];
  }
  std::ostringstream s;
  s << dims_str(idx);
  return s.str();
}

// Number of entries of a tensor with these dimensions; throws on negative dims or overflow.
inline Index checked_size(const std::vector<Index>& dims, const char* where) {
  Index size = 1;
  for (Index d : dims) {
    require(d >= 0, where, "negative dimension in shape ", dims_str(dims));
    require(d == 0 || size <= std::numeric_limits<Index>::max() / d, where, "shape ",
            dims_str(dims), " overflows the index type");
    size *= d;
  }
  return size;
}

inline std::vector<Index> row_major_strides(const std::vector<Index>& dims) {
  std::vector<Index> strides(dims.size(), 1);
  for (std::size_t j = dims.size(); j-- > 1;) strides[j - 1] = strides[j] * dims[j];
  return strides;
}

}  // namespace detail

template <typename Scalar_>
class TensorView {
 public:
  using Scalar = Scalar_;
  static_assert(std::is_floating_point<Scalar>::value, "TensorView holds float or double data");

  // Contiguous row-major data (the last index varies fastest).
  TensorView(const Scalar* data, std::vector<Index> dims)
      : TensorView(data, dims, detail::row_major_strides(dims)) {}

  // Arbitrary strides in elements: entry (i_0, ..., i_{k-1}) is data[sum_j i_j * strides[j]].
  TensorView(const Scalar* data, std::vector<Index> dims, std::vector<Index> strides)
      : data_(data), dims_(std::move(dims)), strides_(std::move(strides)) {
    const char* where = "TensorView";
    detail::require(dims_.size() >= 2, where, "a tensor of order k >= 2 is needed, got shape ",
                    detail::dims_str(dims_), " (order ", dims_.size(), ")");
    detail::require(strides_.size() == dims_.size(), where, dims_.size(), " dimensions but ",
                    strides_.size(), " strides");
    size_ = detail::checked_size(dims_, where);
    detail::require(size_ == 0 || data_ != nullptr, where, "null data pointer for shape ",
                    detail::dims_str(dims_));
    contiguous_ = strides_ == detail::row_major_strides(dims_);
  }

  Index order() const { return Index(dims_.size()); }
  const std::vector<Index>& dims() const { return dims_; }
  Index dim(Index mode) const { return dims_[std::size_t(mode)]; }
  const std::vector<Index>& strides() const { return strides_; }
  Index size() const { return size_; }
  const Scalar* data() const { return data_; }
  // True when the flat row-major index of an entry is its offset in data().
  bool is_contiguous() const { return contiguous_; }

  // Storage offset of the entry with flat row-major index `flat`.
  Index offset(Index flat) const {
    if (contiguous_) return flat;
    Index off = 0;
    for (std::size_t j = dims_.size(); j-- > 0;) {
      off += (flat % dims_[j]) * strides_[j];
      flat /= dims_[j];
    }
    return off;
  }
  Scalar operator[](Index flat) const { return data_[offset(flat)]; }

 private:
  const Scalar* data_;
  std::vector<Index> dims_;
  std::vector<Index> strides_;
  Index size_ = 0;
  bool contiguous_ = true;
};

namespace detail {

template <typename T, typename = void>
struct is_eigen_tensor : std::false_type {};
template <typename T>
struct is_eigen_tensor<T, std::void_t<decltype(T::NumIndices), decltype(T::Layout),
                                      decltype(std::declval<const T&>().data()),
                                      decltype(std::declval<const T&>().dimension(0))>>
    : std::true_type {};

// Calls fn(flat0, pointer, stride, length) for consecutive runs covering the flat row-major
// range [begin, end): entries flat0 + t (t < length) are at pointer[t * stride]. A contiguous
// view is one run; otherwise runs follow the last mode.
template <typename Scalar, typename Fn>
void for_each_run(const TensorView<Scalar>& a, Index begin, Index end, Fn&& fn) {
  if (begin >= end) return;
  if (a.is_contiguous()) {
    fn(begin, a.data() + begin, Index(1), end - begin);
    return;
  }
  const Index last = a.dim(a.order() - 1), stride = a.strides().back();
  for (Index flat = begin; flat < end;) {
    const Index len = std::min(last - flat % last, end - flat);
    fn(flat, a.data() + a.offset(flat), stride, len);
    flat += len;
  }
}

// A tensor seen as outer x dim x inner around one mode: outer = product of the dimensions
// before `mode`, inner = product of those after it. The mode-j unfolding M_j is dim x
// (outer * inner) with column index outer_index * inner + inner_index, i.e. the remaining
// indices in row-major order.
struct ModeSplit {
  Index outer = 1, dim = 1, inner = 1;

  ModeSplit(const std::vector<Index>& dims, Index mode) : dim(dims[std::size_t(mode)]) {
    for (Index j = 0; j < mode; ++j) outer *= dims[std::size_t(j)];
    for (std::size_t j = std::size_t(mode) + 1; j < dims.size(); ++j) inner *= dims[j];
    inv_inner_ = 1.0 / double(std::max<Index>(inner, 1));
    inv_dim_ = 1.0 / double(std::max<Index>(dim, 1));
  }
  Index cols() const { return outer * inner; }
  Index row(Index flat) const { return (flat / inner) % dim; }
  Index col(Index flat) const { return flat / (dim * inner) * inner + flat % inner; }

  // flat / inner: the index of the run of `inner` entries (one outer index and one mode-j index)
  // that holds the entry.
  Index run(Index flat) const { return divide(flat, inner, inv_inner_); }
  // flat / dim, for inner = 1: the unfolding column.
  Index run_of_dim(Index flat) const { return divide(flat, dim, inv_dim_); }

  // row() and col() at once, for the hot loops of the unfoldings.
  void locate(Index flat, Index& row_index, Index& col_index) const {
    const Index q = divide(flat, inner, inv_inner_), r = flat - q * inner;
    const Index o = divide(q, dim, inv_dim_);
    row_index = q - o * dim;
    col_index = o * inner + r;
  }

 private:
  // x / d for 0 <= x, 1 <= d by a floating-point reciprocal: far cheaper than an integer
  // division. Below 2^52 the rounded quotient is off by at most one, which is corrected.
  static Index divide(Index x, Index d, double inv) {
    if (x >= (Index(1) << 52)) return x / d;
    Index q = Index(double(x) * inv);
    if (q * d > x) {
      --q;
    } else if ((q + 1) * d <= x) {
      ++q;
    }
    return q;
  }

  double inv_inner_ = 1, inv_dim_ = 1;
};

}  // namespace detail

// Identity, so every entry point can take a TensorView or anything tensor_view accepts.
template <typename Scalar>
const TensorView<Scalar>& tensor_view(const TensorView<Scalar>& a) {
  return a;
}

// A row-major buffer with the given dimensions.
template <typename Scalar>
TensorView<Scalar> tensor_view(const Scalar* data, std::vector<Index> dims) {
  return TensorView<Scalar>(data, std::move(dims));
}

// Eigen::Tensor, TensorMap or TensorFixedSize (either layout).
template <typename T, std::enable_if_t<detail::is_eigen_tensor<T>::value, int> = 0>
TensorView<std::remove_const_t<typename T::Scalar>> tensor_view(const T& t) {
  constexpr int k = T::NumIndices;
  std::vector<Index> dims(k), strides(k);
  for (int j = 0; j < k; ++j) dims[std::size_t(j)] = Index(t.dimension(j));
  const bool row_major = int(T::Layout) == int(Eigen::RowMajor);
  Index s = 1;
  for (int t = 0; t < k; ++t) {
    const std::size_t j = std::size_t(row_major ? k - 1 - t : t);  // fastest mode first
    strides[j] = s;
    s *= dims[j];
  }
  return TensorView<std::remove_const_t<typename T::Scalar>>(t.data(), std::move(dims),
                                                             std::move(strides));
}

// A dense Eigen matrix expression with direct access: an order-2 tensor rows x cols.
template <typename Derived>
TensorView<typename Derived::Scalar> tensor_view(const Eigen::DenseBase<Derived>& m) {
  static_assert(bool(Derived::Flags & Eigen::DirectAccessBit),
                "tensor_view needs a matrix with direct access (evaluate the expression first)");
  return TensorView<typename Derived::Scalar>(m.derived().data(), {m.rows(), m.cols()},
                                              {m.derived().rowStride(), m.derived().colStride()});
}

}  // namespace randattn
