#pragma once
// The check of a caller's output buffer for the `_into` forms of attention: it must have the
// result's shape and must not share storage with an input (the kernels read the inputs while
// they write the output, block by block). It runs before any work, so a rejected buffer is
// never written.

#include <randattn/detail/intrinsics.hpp>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <Eigen/Core>

#include "../../detail/batch.hpp"
#include "../../detail/validation.hpp"
#include "../types.hpp"

namespace randattn::detail {

// The bytes [first, last) spanned by a direct-access matrix's mapped data; first == last when it
// has no entries. For a block with an outer stride the span includes the gaps between its rows.
struct AddressSpan {
  std::uintptr_t first = 0, last = 0;

  bool empty() const { return first == last; }
  bool overlaps(const AddressSpan& o) const {
    return !empty() && !o.empty() && first < o.last && o.first < last;
  }
};

template <typename Derived>
AddressSpan address_span(const Eigen::DenseBase<Derived>& m) {
  static_assert(bool(Derived::Flags & Eigen::DirectAccessBit),
                "out must map memory directly (a matrix, a block of one, a Map or a Ref)");
  const Derived& x = m.derived();
  if (x.size() == 0) return {};
  using Scalar = typename Derived::Scalar;
  const Scalar* last_entry =
      x.data() + (x.outerSize() - 1) * x.outerStride() + (x.innerSize() - 1) * x.innerStride();
  return {reinterpret_cast<std::uintptr_t>(x.data()),
          reinterpret_cast<std::uintptr_t>(last_entry + 1)};
}

// The bytes spanned by `count` contiguous entries from `data` (none for a null pointer).
template <typename Scalar>
AddressSpan address_span(const Scalar* data, Index count) {
  if (!data || count <= 0) return {};
  return {reinterpret_cast<std::uintptr_t>(data), reinterpret_cast<std::uintptr_t>(data + count)};
}

// An input of an attention call as the output check sees it: its name and its storage.
struct NamedInput {
  const char* name;
  AddressSpan span;
};

template <typename Derived>
NamedInput named_input(const char* name, const Eigen::DenseBase<Derived>& m) {
  return {name, address_span(m)};
}

// Throws randattn::invalid_argument naming `where` and the first input whose span `out` overlaps.
inline void check_no_overlap(const char* where, const AddressSpan& out,
                             std::initializer_list<NamedInput> inputs) {
  for (const NamedInput& in : inputs) {
    require(!out.overlaps(in.span), where, "out shares memory with the input ", in.name,
            "; write the result into storage of its own");
  }
}

// Throws unless no buffer of `written` shares storage with an input or with another of `written`
// (the kernels read the inputs while they write the gradients, block by block): the
// output check of the backward passes.
inline void check_written_apart(const char* where, std::initializer_list<NamedInput> written,
                                std::initializer_list<NamedInput> inputs) {
  for (const NamedInput* w = written.begin(); w != written.end(); ++w) {
    for (const NamedInput& in : inputs)
      require(!w->span.overlaps(in.span), where, w->name, " shares memory with the input ", in.name,
              "; write the gradients into storage of their own");
    for (const NamedInput* o = w + 1; o != written.end(); ++o)
      require(!w->span.overlaps(o->span), where, w->name, " and ", o->name,
              " share memory; write each gradient into storage of its own");
  }
}

// Throws randattn::invalid_argument naming `where` unless `out` is rows x cols and its span
// overlaps none of the inputs' spans. Overlap is judged on spans, so two interleaved blocks of
// one matrix (e.g. column blocks of a row-major matrix) count as overlapping even when they share
// no entry: keep outputs in storage of their own.
template <typename DO>
void check_output(const char* where, const Eigen::MatrixBase<DO>& out, Index rows, Index cols,
                  std::initializer_list<NamedInput> inputs) {
  require(out.rows() == rows && out.cols() == cols, where, "out is ", shape_of(out),
          ", expected ", rows, "x", cols, " (queries x value dimension)");
  check_no_overlap(where, address_span(out), inputs);
}

// check_output for attention on q, k and v: out is n_q x dv and shares storage with none of them.
template <typename Scalar, typename DO>
void check_attention_output(const char* where, const Eigen::MatrixBase<DO>& out,
                            const Eigen::Ref<const RowMatrix<Scalar>>& q,
                            const Eigen::Ref<const RowMatrix<Scalar>>& k,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v) {
  static_assert(std::is_same<Scalar, typename DO::Scalar>::value,
                "q, k, v and out must share the scalar type");
  check_output(where, out, q.rows(), v.cols(),
               {named_input("q", q), named_input("k", k), named_input("v", v)});
}

// An input buffer of a `_batched` form: `count` contiguous entries from `data` (null: none).
template <typename Scalar>
NamedInput named_buffer(const char* name, const Scalar* data, Index count) {
  return {name, address_span(data, count)};
}

// The output check of a `_batched` form: the shape has no negative dimension and `out`, its
// slices × n_q × dv entries, overlaps none of the input buffers. Runs before any slice is written.
template <typename Scalar>
void check_batch_output(const char* where, const BatchShape& shape, const Scalar* out,
                        std::initializer_list<NamedInput> inputs) {
  check_batch_shape(where, shape);
  check_no_overlap(where, address_span(out, shape.slices() * shape.n_q * shape.dv), inputs);
}

// check_batch_output for the q (n_q x d), k (n_k x d) and v (n_k x dv) buffers of a `_batched`
// attention form; `q_name` names q ("qk" under shared QK, where k is null).
template <typename Scalar>
void check_batch_qkv_output(const char* where, const BatchShape& shape, const Scalar* q,
                            const Scalar* k, const Scalar* v, const Scalar* out,
                            const char* q_name = "q") {
  check_batch_output(where, shape, out,
                     {named_buffer(q_name, q, shape.slices() * shape.n_q * shape.d),
                      named_buffer("k", k, shape.slices() * shape.n_k * shape.d),
                      named_buffer("v", v, shape.slices() * shape.n_k * shape.dv)});
}

}  // namespace randattn::detail
