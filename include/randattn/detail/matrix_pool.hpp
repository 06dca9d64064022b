#pragma once
// Per-thread working storage of the attention paths (accumulators, scaled copies of the inputs,
// feature blocks, tiles, hash codes): a call takes its buffers here and gives them back when it
// is done, so the next call with the same shapes on the same thread reuses them and allocates
// nothing. Eigen matrices have no capacity beyond their size (a resize to another size
// reallocates), so a buffer is reused only for a request of the same number of entries.
//
// Each thread holds at most kHeld buffers per matrix type, the ones given back last; they are
// freed with the thread (OpenMP's workers live as long as the process), or at once by
// randattn::release_attention_scratch() (core/scratch.hpp). Contents of a taken buffer are
// unspecified: callers overwrite what they read.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../core/types.hpp"
#include "fresh_matrix.hpp"

namespace randattn::detail {

// The release functions of every pool the calling thread has used.
inline std::vector<void (*)()>& thread_pools() {
  thread_local std::vector<void (*)()> pools;
  return pools;
}

template <typename M>
class MatrixPool {
 public:
  // More than the buffers of one type that any call holds at once on one thread.
  static constexpr std::size_t kHeld = 32;

  // A rows x cols buffer: one given back earlier with as many entries, else a new one (advised
  // into huge pages when large, see fresh_matrix.hpp).
  static M take(Index rows, Index cols) {
    std::vector<M>& h = held();
    const Index size = rows * cols;
    for (auto it = h.rbegin(); size > 0 && it != h.rend(); ++it) {
      if (it->size() != size) continue;
      M m = std::move(*it);
      h.erase(std::next(it).base());
      m.resize(rows, cols);  // same number of entries: no reallocation
      return m;
    }
    return fresh_matrix<M>(rows, cols);
  }
  static M take(Index size) { return take(size, 1); }

  // Keeps m's storage for a later take(); when full, the buffer given back first is freed.
  static void give(M&& m) {
    if (m.size() == 0 || closed()) return;  // closed: m frees its storage itself
    std::vector<M>& h = held();
    if (h.size() == kHeld) h.erase(h.begin());
    h.push_back(std::move(m));
  }

  static void release_held() {
    held().clear();
  }
  static std::size_t held_count() { return held().size(); }

 private:
  // Whether the thread's pool is gone (thread exit): a buffer destroyed later, e.g. in an object
  // of static storage, is freed instead of given back.
  static bool& closed() {
    thread_local bool gone = false;  // trivially destructible: readable until the thread ends
    return gone;
  }

  struct Held {
    std::vector<M> buffers;
    Held() {
      thread_pools().push_back(&MatrixPool::release_held);
      buffers.reserve(kHeld);
    }
    ~Held() { closed() = true; }
  };

  static std::vector<M>& held() {
    thread_local Held h;
    return h.buffers;
  }
};

// A matrix whose storage is taken from the calling thread's pool when it is made and given back
// when it is destroyed (to the pool of the thread that destroys it): a drop-in for M as a local
// variable or a member of a work buffer. Its entries start unspecified.
template <typename M>
class Scratch : public M {
 public:
  Scratch() = default;
  Scratch(Index rows, Index cols) : M(MatrixPool<M>::take(rows, cols)) {}
  explicit Scratch(Index size) : M(MatrixPool<M>::take(size)) {}
  Scratch(Scratch&& other) noexcept : M(std::move(static_cast<M&>(other))) {}  // other: empty
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // Swaps storage (Eigen's move assignment): other gives back what this one held.
  Scratch& operator=(Scratch&& other) noexcept {
    M::operator=(std::move(static_cast<M&>(other)));
    return *this;
  }
  ~Scratch() { MatrixPool<M>::give(std::move(static_cast<M&>(*this))); }
  using M::operator=;
};

// A copy of x in storage taken from the calling thread's pool.
template <typename M>
Scratch<M> pooled_copy(const M& x) {
  Scratch<M> copy(x.rows(), x.cols());
  copy = x;
  return copy;
}

}  // namespace randattn::detail
