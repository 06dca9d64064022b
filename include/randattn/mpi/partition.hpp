#pragma once
// Which rows of a sequence (or entries of a flat tensor) each rank holds.
//
//   contiguous  rank p holds rows [p n / P, (p + 1) n / P): sizes differ by at most one row, n
//               need not be divisible by P, a rank may hold no row (n < P).
//   zigzag      the rows are cut into 2P chunks the same way and rank p holds chunks p and
//               2P − 1 − p (in that order). With causal ring attention each rank then scores about
//               the same number of query-key pairs (an early chunk pairs with a late one), where
//               the contiguous layout leaves rank P − 1 with about 2P − 1 times the work of rank 0.
// A rank's local rows are its segments concatenated in order.

#include <algorithm>
#include <vector>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "communicator.hpp"

namespace randattn::mpi {

enum class RowLayout { contiguous, zigzag };

struct Segment {
  Index first = 0;  // global position of the segment's first row
  Index count = 0;
};

class RowPartition {
 public:
  RowPartition(Index rows, int ranks, RowLayout layout = RowLayout::contiguous)
      : rows_(rows), ranks_(ranks), layout_(layout) {
    randattn::detail::require(rows >= 0 && ranks >= 1, "RowPartition",
                              "need rows >= 0 and ranks >= 1, got ", rows, " and ", ranks);
  }

  Index rows() const { return rows_; }
  int ranks() const { return ranks_; }
  RowLayout layout() const { return layout_; }

  std::vector<Segment> segments(int rank) const {
    if (layout_ == RowLayout::contiguous) return {piece(rank, ranks_)};
    const Segment a = piece(rank, 2 * ranks_), b = piece(2 * ranks_ - 1 - rank, 2 * ranks_);
    return {a, b};
  }

  // Number of rows held by `rank`.
  Index local_rows(int rank) const {
    Index n = 0;
    for (const Segment& s : segments(rank)) n += s.count;
    return n;
  }

  // The rank holding global row i (contiguous layout only).
  int owner(Index i) const {
    int lo = 0, hi = ranks_ - 1;
    while (lo < hi) {  // the last rank whose range starts at or before i
      const int mid = (lo + hi + 1) / 2;
      if (range(mid).first <= i)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }

  // The contiguous range of `rank` (contiguous layout only).
  Segment range(int rank) const {
    randattn::detail::require(layout_ == RowLayout::contiguous, "RowPartition::range",
                              "the zig-zag layout has two segments per rank");
    return piece(rank, ranks_);
  }

 private:
  // Piece i of `pieces` near-equal pieces of [0, rows).
  Segment piece(Index i, Index pieces) const {
    const Index first = i * rows_ / pieces, last = (i + 1) * rows_ / pieces;
    return {first, last - first};
  }

  Index rows_;
  int ranks_;
  RowLayout layout_;
};

namespace detail {

// The partition of a sharded operand from every rank's local row count: the global count is
// their sum, and every rank's count must be the one `layout` gives it. Collective; throws the
// same message on every rank when a count is wrong.
inline RowPartition gather_partition(Communicator& comm, Index local_rows, RowLayout layout,
                                     const char* where, const char* name) {
  const std::vector<Index> counts = comm.allgatherv(std::vector<Index>{local_rows});
  Index total = 0;
  for (Index c : counts) total += c;
  const RowPartition part(total, comm.size(), layout);
  comm.agree([&] {
    for (int r = 0; r < comm.size(); ++r) {
      randattn::detail::require(counts[std::size_t(r)] == part.local_rows(r), where, "rank ", r,
                                " holds ", counts[std::size_t(r)], " rows of ", name, " but the ",
                                layout == RowLayout::contiguous ? "contiguous" : "zig-zag",
                                " layout of ", total, " rows over ", comm.size(),
                                " ranks gives it ", part.local_rows(r));
    }
  });
  return part;
}

// Every rank passes its own value; throws on every rank unless all are equal.
template <typename T>
void require_same_everywhere(Communicator& comm, T value, const char* where, const char* what) {
  const std::vector<T> all = comm.allgatherv(std::vector<T>{value});
  comm.agree([&] {
    for (int r = 1; r < comm.size(); ++r)
      randattn::detail::require(all[std::size_t(r)] == all[0], where, what,
                                " differs between ranks: ", all[0], " on rank 0, ",
                                all[std::size_t(r)], " on rank ", r);
  });
}

}  // namespace detail

}  // namespace randattn::mpi
