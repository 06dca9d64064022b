// What a method's Gradient keeps of its forward for the backward: the addresses of q, k and v
// (the caller keeps them alive and unchanged) and a copy of the output, which the caller may
// overwrite before the backward.
#pragma once

#include <randattn/core/types.hpp>
#include <randattn/detail/batch.hpp>

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace randattn::registry::detail {

template <typename Scalar>
class KeptForward {
 public:
  void keep(const Scalar* q, const Scalar* k, const Scalar* v, const Scalar* out,
            const BatchShape& shape) {
    q_ = q, k_ = k, v_ = v;
    shape_ = shape;
    out_.assign(out, out + shape.slices() * shape.n_q * shape.dv);
    kept_ = true;
  }

  // Throws std::logic_error when no forward was kept.
  void require_forward() const {
    if (!kept_) throw std::logic_error("randattn::registry: Gradient::backward() before forward()");
  }

  const Scalar* q() const { return q_; }
  const Scalar* k() const { return k_; }
  const Scalar* v() const { return v_; }
  const Scalar* out() const { return out_.data(); }

  // Slice i of the (batch, heads, n, ·) buffers.
  auto q(Index i) const { return randattn::detail::slice_of(q_, i, shape_.n_q, shape_.d); }
  auto k(Index i) const { return randattn::detail::slice_of(k_, i, shape_.n_k, shape_.d); }
  auto v(Index i) const { return randattn::detail::slice_of(v_, i, shape_.n_k, shape_.dv); }
  auto out(Index i) const {
    return randattn::detail::slice_of(out_.data(), i, shape_.n_q, shape_.dv);
  }

 private:
  const Scalar *q_ = nullptr, *k_ = nullptr, *v_ = nullptr;
  BatchShape shape_;
  std::vector<Scalar> out_;
  bool kept_ = false;
};

// Without queries there is no output and nothing flows back: dk (unless null) and dv are zero.
template <typename Scalar>
void clear_key_gradients_without_queries(const BatchShape& s, Scalar* dk, Scalar* dv) {
  if (s.n_q != 0) return;
  if (dk) std::fill(dk, dk + s.slices() * s.n_k * s.d, Scalar(0));
  std::fill(dv, dv + s.slices() * s.n_k * s.dv, Scalar(0));
}

}  // namespace randattn::registry::detail
