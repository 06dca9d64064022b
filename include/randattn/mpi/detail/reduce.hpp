#pragma once
// Reductions of log-scaled summaries across ranks: a value S relative to exp(c), stored as one
// buffer [c | S], merged with the one online-softmax rule (detail::merge_scaled). The MPI
// operation is declared non-commutative, so MPI combines the ranks' buffers in rank order:
// the result depends on the number of ranks only, never on timing.

#include <randattn/detail/intrinsics.hpp>

#include <mpi.h>

#include <cstddef>
#include <limits>

#include <Eigen/Core>

#include "../../core/softmax_accumulator.hpp"
#include "../../core/types.hpp"
#include "../communicator.hpp"

namespace randattn::mpi::detail {

// MPI user function: inout ← in ∘ inout for each of `len` buffers [c | S] of the datatype's size.
template <typename Scalar>
void merge_scaled_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  int bytes = 0;
  MPI_Type_size(*type, &bytes);
  const Index n = Index(bytes) / Index(sizeof(Scalar));
  auto* src = static_cast<Scalar*>(in);
  auto* dst = static_cast<Scalar*>(inout);
  for (int e = 0; e < *len; ++e, src += n, dst += n) {
    Eigen::Map<Vector<Scalar>> d(dst + 1, n - 1);
    const Eigen::Map<const Vector<Scalar>> s(src + 1, n - 1);
    randattn::detail::merge_scaled(d, dst[0], s, src[0]);
  }
}

// A log-scaled summary as one buffer [c | S].
template <typename Scalar>
struct ScaledSummary {
  Vector<Scalar> buffer;

  ScaledSummary(const RowMatrix<Scalar>& state, Scalar c) : buffer(state.size() + 1) {
    buffer(0) = c;
    buffer.tail(state.size()) = Eigen::Map<const Vector<Scalar>>(state.data(), state.size());
  }
  Scalar log_scale() const { return buffer(0); }
  RowMatrix<Scalar> state(Index rows, Index cols) const {
    return Eigen::Map<const RowMatrix<Scalar>>(buffer.data() + 1, rows, cols);
  }
  void clear() {
    buffer.setZero();
    buffer(0) = -std::numeric_limits<Scalar>::infinity();
  }
};

enum class Reduction { all, exclusive_scan };

// Merges the ranks' summaries: `all` leaves the merge of every rank's summary on every rank;
// `exclusive_scan` leaves on rank r the merge of ranks 0..r−1 (empty, c = −inf, on rank 0).
template <typename Scalar>
void merge_across_ranks(Communicator& comm, ScaledSummary<Scalar>& s, Reduction how) {
  MPI_Datatype type;
  MPI_Op op;
  check(MPI_Type_contiguous(to_count(std::size_t(s.buffer.size()), "merge_across_ranks"),
                            datatype<Scalar>(), &type),
        "MPI_Type_contiguous");
  check(MPI_Type_commit(&type), "MPI_Type_commit");
  check(MPI_Op_create(&merge_scaled_op<Scalar>, /*commute=*/0, &op), "MPI_Op_create");
  comm.count_bytes(std::uint64_t(s.buffer.size()) * sizeof(Scalar));
  int rc;
  if (how == Reduction::all) {
    rc = MPI_Allreduce(MPI_IN_PLACE, s.buffer.data(), 1, type, op, comm.get());
  } else {
    Vector<Scalar> mine = s.buffer;
    rc = MPI_Exscan(mine.data(), s.buffer.data(), 1, type, op, comm.get());
    if (comm.rank() == 0) s.clear();
  }
  MPI_Op_free(&op);
  MPI_Type_free(&type);
  check(rc, how == Reduction::all ? "MPI_Allreduce" : "MPI_Exscan");
}

}  // namespace randattn::mpi::detail
