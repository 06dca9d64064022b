#pragma once
// Contiguous row-major storage that grows by whole rows with amortised doubling, so appending a
// token costs O(cols) and never rebuilds anything; every view is an Eigen::Map of the rows.
// Capacity is allocated and written (zero-filled) when it grows, not when a row is pushed, so
// reserve_rows() ahead of time moves the first touch of fresh memory out of the per-token path.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstring>
#include <vector>

#include <Eigen/Core>

#include "../../core/types.hpp"

namespace randattn::detail {

template <typename T>
class GrowableRows {
 public:
  explicit GrowableRows(Index cols = 0) : cols_(cols) {}

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }

  // Capacity for at least `rows` rows: doubles, so n appends cost O(n · cols) in total.
  void reserve_rows(Index rows) {
    const std::size_t need = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols_);
    if (need <= data_.size()) return;
    data_.reserve(need);
    data_.resize(need);
  }

  Index capacity_rows() const { return cols_ > 0 ? Index(data_.size()) / cols_ : 0; }

  T* push_row() {
    if (rows_ == capacity_rows()) reserve_rows(std::max<Index>(2 * rows_, 16));
    return row_ptr(rows_++);
  }

  void push_row(const T* values) {
    T* dst = push_row();
    if (cols_ > 0) std::memcpy(dst, values, sizeof(T) * static_cast<std::size_t>(cols_));
  }

  // No rows; the capacity stays.
  void clear() { rows_ = 0; }

  T* row_ptr(Index i) { return data_.data() + i * cols_; }
  const T* row_ptr(Index i) const { return data_.data() + i * cols_; }

  ConstRowMatrixMap<T> block(Index first, Index count) const {
    return ConstRowMatrixMap<T>(data_.data() + first * cols_, count, cols_);
  }
  ConstRowMatrixMap<T> view() const { return block(0, rows_); }

  std::size_t bytes() const { return data_.size() * sizeof(T); }

 private:
  Index cols_ = 0;
  Index rows_ = 0;
  std::vector<T> data_;
};

}  // namespace randattn::detail
