#pragma once
// The working storage that attention calls keep per thread for their next call
// (detail/matrix_pool.hpp): after the first call, a call with the same shapes on the same threads
// allocates nothing for it.

#include "../detail/matrix_pool.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace randattn {

// Frees the storage kept for reuse by the calling thread and, when OpenMP is on, by every thread
// of a team of the current maximum size. Later calls allocate afresh; results do not change.
inline void release_attention_scratch() {
  auto release = [] {
    for (void (*release_pool)() : detail::thread_pools()) release_pool();
  };
  release();
#if defined(_OPENMP)
#pragma omp parallel if (!omp_in_parallel())
  release();
#endif
}

}  // namespace randattn
