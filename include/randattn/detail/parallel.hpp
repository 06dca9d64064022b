#pragma once
// Parallel loops over independent work items. Each item is computed by one thread in a
// fixed way, so results do not depend on the thread count. Exceptions thrown inside the
// parallel region are carried out of it and rethrown (the first one wins).

#include <exception>
#include <mutex>
#include <optional>
#include <utility>

#include "../core/types.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace randattn::detail {

// The first exception thrown by any thread, rethrown once the loop is over.
class FirstError {
 public:
  template <typename Fn>
  void run(Fn&& fn) noexcept {
    try {
      fn();
    } catch (...) {
#if defined(_OPENMP)
      std::lock_guard<std::mutex> lock(mutex_);
#endif
      if (!error_) error_ = std::current_exception();
    }
  }
  bool failed() const { return bool(error_); }
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::exception_ptr error_;
#if defined(_OPENMP)
  std::mutex mutex_;
#endif
};

// Threads a parallel loop started here would run on: 1 inside a parallel region (loops do not
// nest) or without OpenMP.
inline Index available_threads() {
#if defined(_OPENMP)
  return omp_in_parallel() ? 1 : Index(omp_get_max_threads());
#else
  return 1;
#endif
}

// Whether a loop of `count` items gets a parallel region. A region that would run on one thread
// is not started: the OpenMP runtime (libgomp) allocates the team of each such region afresh.
inline bool runs_parallel(Index count) { return count > 1 && available_threads() > 1; }

template <typename Fn>
void parallel_for(Index count, Fn&& fn) {
  FirstError error;
  if (runs_parallel(count)) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1)
#endif
    for (Index i = 0; i < count; ++i) error.run([&] { fn(i); });
  } else {
    for (Index i = 0; i < count; ++i) error.run([&] { fn(i); });
  }
  error.rethrow();
}

// As parallel_for, with one scratch object per thread, made by make(): fn(i, scratch) reuses it
// across the items that thread computes, so large work buffers are allocated (and first
// touched) once per thread rather than once per item. fn must overwrite whatever of the scratch
// it reads, so that no item depends on which items ran before it on the same thread.
template <typename Make, typename Fn>
void parallel_for_with(Index count, Make&& make, Fn&& fn) {
  FirstError error;
  if (!runs_parallel(count)) {
    std::optional<decltype(make())> scratch;
    error.run([&] { scratch.emplace(make()); });
    for (Index i = 0; i < count; ++i) {
      if (scratch) error.run([&] { fn(i, *scratch); });
    }
    error.rethrow();
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel
#endif
  {
    std::optional<decltype(make())> scratch;
    error.run([&] { scratch.emplace(make()); });
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
    for (Index i = 0; i < count; ++i) {
      if (scratch) error.run([&] { fn(i, *scratch); });
    }
  }
  error.rethrow();
}

}  // namespace randattn::detail
