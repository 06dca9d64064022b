#pragma once
// Storage that outlives a call: vectors a thread gives back are handed out again by its next
// take(), with their capacity. A vector of a few MB that is freed and allocated again per call
// goes back to the kernel and returns as fresh pages, and every fresh page costs a fault at its
// first write (13 µs here: more than the work on the entries it holds); a reused vector's pages
// are already mapped.
//
// Each thread holds at most kHeld vectors per element type, the largest it was given; they are
// freed with the thread (OpenMP's workers live as long as the process), or at once by
// randattn::release_sketch_storage() (sketch/sparsify.hpp).

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace randattn::detail {

template <typename T>
class VectorPool {
 public:
  static constexpr std::size_t kHeld = 8;

  // An empty vector, with the capacity of one given back earlier when the thread holds one (the
  // smallest that has at least `capacity`, else the largest).
  static std::vector<T> take(std::size_t capacity = 0) {
    std::vector<std::vector<T>>& held = pool();
    if (held.empty()) {
      std::vector<T> v;
      v.reserve(capacity);
      return v;
    }
    auto pick = held.end() - 1;  // held is sorted by capacity
    for (auto it = held.begin(); it != held.end(); ++it) {
      if (it->capacity() >= capacity) {
        pick = it;
        break;
      }
    }
    std::vector<T> v = std::move(*pick);
    held.erase(pick);
    v.clear();
    v.reserve(capacity);
    return v;
  }

  // Keeps v's storage for a later take() (the smallest held one is freed when the pool is full).
  static void give(std::vector<T>&& v) {
    if (v.capacity() == 0) return;
    std::vector<std::vector<T>>& held = pool();
    if (held.size() == kHeld) {
      if (held.front().capacity() >= v.capacity()) return;
      held.erase(held.begin());
    }
    auto at = std::lower_bound(
        held.begin(), held.end(), v.capacity(),
        [](const std::vector<T>& h, std::size_t c) { return h.capacity() < c; });
    held.insert(at, std::move(v));
  }

  static void release_held() { pool().clear(); }
  // Vectors the calling thread holds, in increasing order of capacity.
  static std::size_t held_count() { return pool().size(); }

 private:
  static std::vector<std::vector<T>>& pool() {
    thread_local std::vector<std::vector<T>> held;
    return held;
  }
};

}  // namespace randattn::detail
