#pragma once
// Large matrices written once per call (feature matrices, outputs) are first touched in 2 MiB
// pages where the system allows it. On Linux every fresh 4 KiB page of anonymous memory costs a
// fault at its first write: 13 µs measured on the virtual machines this library is benchmarked
// on, where a fresh 16 MiB feature matrix then costs 54 ms in faults against 1.5 ms in 2 MiB
// pages. MADV_HUGEPAGE is advice: the kernel may ignore it (transparent huge
// pages disabled), and the contents and results are the same either way.

#include <randattn/detail/intrinsics.hpp>

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <Eigen/Core>

#include "../core/types.hpp"

namespace randattn::detail {

constexpr std::size_t kHugePageBytes = std::size_t(2) << 20;

// Advises 2 MiB pages for the whole 2 MiB pages inside [data, data + bytes), a buffer not yet
// written. Buffers under two such pages are left alone (at most one whole page fits).
inline void advise_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes < 2 * kHugePageBytes) return;
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (first + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const std::uintptr_t end = (first + bytes) & ~(kHugePageBytes - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// An uninitialised rows x cols matrix, advised into huge pages when large.
template <typename Matrix>
Matrix fresh_matrix(Index rows, Index cols) {
  Matrix m(rows, cols);
  advise_huge_pages(m.data(), sizeof(typename Matrix::Scalar) * std::size_t(m.size()));
  return m;
}

// A copy of `e` in a fresh matrix advised as above (inputs scaled or reordered per call).
template <typename Matrix, typename Derived>
Matrix fresh_copy(const Eigen::MatrixBase<Derived>& e) {
  Matrix m = fresh_matrix<Matrix>(e.rows(), e.cols());
  m = e;
  return m;
}

}  // namespace randattn::detail
