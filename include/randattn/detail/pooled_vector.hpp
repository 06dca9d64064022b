#pragma once
// A std::vector whose storage is taken from the calling thread's VectorPool when it is made and
// given back when it is destroyed: index lists, permutations and bucket bounds of one call, which
// the next call on the same thread then reuses with their capacity (detail/vector_pool.hpp).

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "vector_pool.hpp"

namespace randattn::detail {

template <typename T>
class PooledVector : public std::vector<T> {
 public:
  // `size` entries (value-initialised) and room for at least `capacity`, in a held vector when
  // one is large enough. Ask for the capacity a vector will grow to: a smaller held one would be
  // reallocated as it grows. With neither, an empty vector that takes nothing from the pool.
  explicit PooledVector(std::size_t size = 0, std::size_t capacity = 0)
      : std::vector<T>(size == 0 && capacity == 0 ? std::vector<T>()
                                                  : VectorPool<T>::take(std::max(size, capacity))) {
    this->resize(size);
  }
  PooledVector(PooledVector&& other) noexcept : std::vector<T>(std::move(other)) {}
  PooledVector(const PooledVector&) = delete;
  PooledVector& operator=(const PooledVector&) = delete;
  // Swaps storage: other gives back what this one held.
  PooledVector& operator=(PooledVector&& other) noexcept {
    this->swap(other);
    return *this;
  }
  ~PooledVector() { VectorPool<T>::give(std::move(*this)); }
  using std::vector<T>::operator=;
};

}  // namespace randattn::detail
