#pragma once
// The rows of a key/value cache in their storage type (KvStorage: float32, float64, bfloat16,
// float16 or int8 with one scale per row), appended one row at a time from the compute type
// Scalar. Kernels read the rows where they lie through visit(), which hands them a map of the
// stored type (and the int8 scales); index builders that need a row in Scalar get it from
// row_as(), decoded into their scratch unless the storage is Scalar itself.
//
// int8 rows: s = max|x| / 127 and q = round(x / s) (ties to even), so x ≈ s·q with an error of
// at most s/2 per entry; an all-zero row has s = 0.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <variant>
#include <vector>

#include <Eigen/Core>

#include "../../core/types.hpp"
#include "../../detail/packet_load.hpp"
#include "../../detail/validation.hpp"
#include "../decode_options.hpp"
#include "binary_io.hpp"
#include "growable_rows.hpp"

namespace randattn::detail {

// The element type of each KvStorage, in the order of its values.
using StoredTypes = std::variant<GrowableRows<float>, GrowableRows<double>,
                                 GrowableRows<Eigen::bfloat16>, GrowableRows<Eigen::half>,
                                 GrowableRows<std::int8_t>>;

inline std::size_t storage_bytes_per_entry(KvStorage s) {
  switch (s) {
    case KvStorage::float64: return 8;
    case KvStorage::bfloat16:
    case KvStorage::float16: return 2;
    case KvStorage::int8: return 1;
    default: return 4;
  }
}

template <typename Scalar>
constexpr KvStorage storage_of() {
  return std::is_same<Scalar, double>::value ? KvStorage::float64 : KvStorage::float32;
}

inline bool is_storage(std::uint32_t s) { return s <= std::uint32_t(KvStorage::int8); }

template <typename Scalar>
class StoredRows {
 public:
  StoredRows() = default;
  StoredRows(Index cols, KvStorage storage) : cols_(cols), storage_(storage) {
    switch (storage) {
      case KvStorage::float32: rows_.template emplace<0>(cols); break;
      case KvStorage::float64: rows_.template emplace<1>(cols); break;
      case KvStorage::bfloat16: rows_.template emplace<2>(cols); break;
      case KvStorage::float16: rows_.template emplace<3>(cols); break;
      case KvStorage::int8: rows_.template emplace<4>(cols); break;
    }
  }

  KvStorage storage() const { return storage_; }
  bool scaled() const { return storage_ == KvStorage::int8; }
  Index cols() const { return cols_; }
  Index rows() const {
    return std::visit([](const auto& r) { return r.rows(); }, rows_);
  }

  void reserve_rows(Index rows) {
    std::visit([&](auto& r) { r.reserve_rows(rows); }, rows_);
    if (scaled()) scales_.reserve(static_cast<std::size_t>(rows));
  }

  // f(rows, scales): every row as a row-major map of the stored type, and the int8 scales
  // (nullptr for the floating-point types).
  template <typename F>
  decltype(auto) visit(F&& f) const {
    return std::visit([&](const auto& r) -> decltype(auto) { return f(r.view(), scale_data()); },
                      rows_);
  }

  // Why `rows` (each of cols() entries) cannot be stored, or nullptr: an int8 row with a
  // non-finite entry, or a finite entry whose rounding to the storage type overflows.
  template <typename Rows>
  static const char* unstorable(const Rows& rows, KvStorage storage) {
    if (storage == KvStorage::int8)
      return rows.allFinite() ? nullptr
                              : "has a non-finite entry, which an int8 cache cannot hold (its "
                                "rows are scaled by their largest magnitude), whatever check_finite";
    const char* overflow = "has a finite entry beyond the range of the cache's storage type";
    const auto overflows = [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same<T, Scalar>::value) return false;  // stored as given
      for (Index i = 0; i < rows.rows(); ++i)
        for (Index c = 0; c < rows.cols(); ++c) {
          const Scalar x = rows(i, c);
          if (std::isfinite(x) && !std::isfinite(widen<double>(narrow<T>(x)))) return true;
        }
      return false;
    };
    switch (storage) {
      case KvStorage::float32: return overflows(float()) ? overflow : nullptr;
      case KvStorage::bfloat16: return overflows(Eigen::bfloat16()) ? overflow : nullptr;
      case KvStorage::float16: return overflows(Eigen::half()) ? overflow : nullptr;
      default: return nullptr;
    }
  }

  // Appends x[0, cols), rounded or quantised to the storage type (see unstorable()).
  void push_row(const Scalar* x) {
    std::visit(
        [&](auto& r) {
          using T = std::remove_pointer_t<decltype(r.push_row())>;
          T* dst = r.push_row();
          if constexpr (std::is_same<T, std::int8_t>::value) {
            Scalar top = 0;
            for (Index c = 0; c < cols_; ++c) top = std::max(top, std::abs(x[c]));
            const Scalar s = top / Scalar(127);
            for (Index c = 0; c < cols_; ++c)
              dst[c] = s > 0 ? static_cast<std::int8_t>(std::clamp<Scalar>(
                                   std::nearbyint(x[c] / s), Scalar(-127), Scalar(127)))
                             : std::int8_t(0);
            scales_.push_back(s);
          } else {
            for (Index c = 0; c < cols_; ++c) dst[c] = narrow<T>(x[c]);
          }
        },
        rows_);
  }

  // Row i in Scalar: where it lies when the storage is Scalar, else decoded into scratch
  // (cols() entries), valid until scratch is written again.
  const Scalar* row_as(Index i, Scalar* scratch) const {
    return std::visit(
        [&](const auto& r) -> const Scalar* {
          using T = std::remove_cv_t<std::remove_pointer_t<decltype(r.row_ptr(0))>>;
          if constexpr (std::is_same<T, Scalar>::value) {
            return r.row_ptr(i);
          } else {
            const T* p = r.row_ptr(i);
            const Scalar s = scaled() ? scales_[std::size_t(i)] : Scalar(1);
            for (Index c = 0; c < cols_; ++c) scratch[c] = s * widen<Scalar>(p[c]);
            return scratch;
          }
        },
        rows_);
  }

  // The rows where they lie when the storage is Scalar itself, else nullptr.
  const Scalar* scalar_data() const {
    if constexpr (std::is_same<Scalar, float>::value) {
      if (const auto* r = std::get_if<0>(&rows_)) return r->row_ptr(0);
    } else {
      if (const auto* r = std::get_if<1>(&rows_)) return r->row_ptr(0);
    }
    return nullptr;
  }

  // f(keys, key scales, values, value scales) for two StoredRows of one storage type (a cache's
  // keys and values): one instantiation per type, not one per pair.
  template <typename F>
  static decltype(auto) visit_pair(const StoredRows& a, const StoredRows& b, F&& f) {
    return std::visit(
        [&](const auto& ra) -> decltype(auto) {
          const auto& rb = std::get<std::decay_t<decltype(ra)>>(b.rows_);
          return f(ra.view(), a.scale_data(), rb.view(), b.scale_data());
        },
        a.rows_);
  }

  // Rows [first, first + count) in Scalar.
  RowMatrix<Scalar> decoded(Index first, Index count) const {
    RowMatrix<Scalar> out(count, cols_);
    for (Index i = 0; i < count; ++i) {
      const Scalar* p = row_as(first + i, out.row(i).data());
      if (p != out.row(i).data()) std::copy(p, p + cols_, out.row(i).data());
    }
    return out;
  }

  // Bytes of one row as stored (with its scale), and of the whole allocation.
  std::size_t bytes_per_row() const {
    return storage_bytes_per_entry(storage_) * std::size_t(cols_) + (scaled() ? sizeof(Scalar) : 0);
  }
  std::size_t bytes() const {
    return std::visit([](const auto& r) { return r.bytes(); }, rows_) +
           scales_.capacity() * sizeof(Scalar);
  }

  // Rows [0, count) as stored: entries little-endian in their own width, then the scales.
  void write(LittleEndianWriter& w, Index count) const {
    const auto n = static_cast<std::size_t>(count * cols_);
    std::visit(
        [&](const auto& r) {
          using T = std::remove_cv_t<std::remove_pointer_t<decltype(r.row_ptr(0))>>;
          if constexpr (std::is_same<T, std::int8_t>::value) {
            w.raw(r.row_ptr(0), n);
          } else if constexpr (is_half_precision_v<T>) {
            w.template reals<std::uint16_t>(reinterpret_cast<const std::uint16_t*>(r.row_ptr(0)), n);
          } else {
            w.reals(r.row_ptr(0), n);
          }
        },
        rows_);
    if (scaled()) w.reals(scales_.data(), static_cast<std::size_t>(count));
  }

  // Bytes that write() gives for `count` rows.
  std::size_t file_bytes(Index count) const {
    return std::size_t(count) * (storage_bytes_per_entry(storage_) * std::size_t(cols_) +
                                 (scaled() ? sizeof(Scalar) : 0));
  }

  // Reads what write() wrote for `count` rows into `into`, an empty StoredRows of this storage,
  // one row at a time through push_row's storage: no value is rounded again. Throws
  // std::invalid_argument (through the reader) for a truncated file, and for an int8 scale that
  // is negative or not finite (a corrupt file).
  void read(LittleEndianReader& r, Index count, const char* where, const std::string& path) {
    const auto n = static_cast<std::size_t>(count * cols_);
    reserve_rows(count);
    std::visit(
        [&](auto& rows) {
          using T = std::remove_pointer_t<decltype(rows.push_row())>;
          std::vector<T> all(n);
          if constexpr (std::is_same<T, std::int8_t>::value) {
            std::memcpy(all.data(), r.take(n, "int8 rows"), n);
          } else if constexpr (is_half_precision_v<T>) {
            r.template reals<std::uint16_t>(reinterpret_cast<std::uint16_t*>(all.data()), n, "rows");
          } else {
            r.reals(all.data(), n, "rows");
          }
          for (Index i = 0; i < count; ++i) {
            T* dst = rows.push_row();
            std::copy(all.data() + i * cols_, all.data() + (i + 1) * cols_, dst);
          }
        },
        rows_);
    if (scaled()) {
      scales_.resize(static_cast<std::size_t>(count));
      r.reals(scales_.data(), scales_.size(), "int8 scales");
      for (const Scalar s : scales_)
        require(std::isfinite(s) && s >= 0, where, "'", path, "' holds an int8 scale ", s,
                " (corrupt)");
    }
  }

 private:
  const Scalar* scale_data() const { return scaled() ? scales_.data() : nullptr; }

  Index cols_ = 0;
  KvStorage storage_ = storage_of<Scalar>();
  StoredTypes rows_;
  std::vector<Scalar> scales_;  // int8: one per row
};

}  // namespace randattn::detail
