#pragma once
// The working storage that attention calls keep per thread for their next call: matrices
// (detail/matrix_pool.hpp) and index lists (detail/pooled_vector.hpp over detail/vector_pool.hpp).
// After the first call, a call with the same shapes on the same thread allocates nothing for it
// (docs/core.md lists the exceptions).

#include <cstdint>

#include "../detail/matrix_pool.hpp"
#include "../detail/vector_pool.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace randattn {

// Frees the storage kept for reuse by the calling thread and, when OpenMP is on, by every thread
// of a team of the current maximum size: every matrix pool and the index lists the attention
// paths keep (which the sketches share). Later calls allocate afresh; results do not change.
inline void release_attention_scratch() {
  auto release = [] {
    for (void (*release_pool)() : detail::thread_pools()) release_pool();
    detail::VectorPool<Index>::release_held();
    detail::VectorPool<std::int32_t>::release_held();
    detail::VectorPool<std::uint64_t>::release_held();
    detail::VectorPool<char>::release_held();
  };
  release();
#if defined(_OPENMP)
#pragma omp parallel if (!omp_in_parallel())
  release();
#endif
}

}  // namespace randattn
