#pragma once
// Exact softmax attention over sequence-parallel shards (ring attention, Liu et al. 2023): each
// rank holds a block of query rows and a block of key/value rows; the key/value blocks travel
// around the ring (rank r sends to r + 1 and receives from r − 1), and every rank merges the
// partial [num | den] of each block it sees into its SoftmaxAccumulator. Sending the next block
// (MPI_Isend/MPI_Irecv) overlaps the score tiles of the block in hand. Tiles are the shared
// score tile with GLOBAL row and column positions, so the causal mask is right on any shard.
//
// Communication: P − 1 steps, each rank sends its current block of n_k/P rows (d + dv values
// each): (P − 1) n_k (d + dv) / P values per rank, whatever the mask.
//
// Causal load. A block of keys wholly after a rank's queries is skipped (still forwarded). In the
// contiguous layout rank p then scores about (2p + 1)/(2P) n²/P of the causal pairs: the last
// rank does 2P − 1 times the work of the first, and the step time is the last rank's. The
// zig-zag layout (RowLayout::zigzag, partition.hpp) gives rank p chunks p and 2P − 1 − p of 2P,
// so every rank scores the same number of pairs up to rounding.
//
// Result: the local rows' accumulator (ring_attention_accumulate) or output (ring_attention).
// It equals exact_attention on the whole sequence up to rounding (tiles and merge order follow
// the shards). Every rank must call with its local rows in the chosen layout (counts are
// checked); errors on any rank are thrown on every rank (communicator.hpp).

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <vector>

#include <Eigen/Core>

#include "../core/exact_attention.hpp"
#include "../core/exact_tile.hpp"
#include "../core/input_checks.hpp"
#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "communicator.hpp"
#include "partition.hpp"

namespace randattn::mpi {

struct RingOptions : ExactOptions {
  RowLayout layout = RowLayout::contiguous;  // of the queries and of the keys/values
};

namespace detail {

// A key/value block in flight: rows of [k | v] and the global segments they come from.
template <typename Scalar>
struct KeyValueBlock {
  RowMatrix<Scalar> kv;
  std::vector<Segment> segments;
};

// Merges into acc the partials of the local queries (their segments, in local row order)
// against one key/value block.
template <typename Scalar>
void attend_block(const RowMatrix<Scalar>& qs, const std::vector<Segment>& q_segments,
                  const KeyValueBlock<Scalar>& block, Index d, Index block_size, bool causal,
                  SoftmaxAccumulator<Scalar>& acc) {
  const Index dv = acc.value_dim();
  // Query tiles: one task each, across the segments.
  struct Task {
    Index local, global, rows;
  };
  std::vector<Task> tasks;
  Index local = 0;
  for (const Segment& s : q_segments) {
    for (Index i = 0; i < s.count; i += block_size)
      tasks.push_back({local + i, s.first + i, std::min(block_size, s.count - i)});
    local += s.count;
  }
  randattn::detail::parallel_for(Index(tasks.size()), [&](Index t) {
    const Task task = tasks[std::size_t(t)];
    ExactTile<Scalar> tile(task.rows, block_size, dv, causal);
    const auto q = qs.middleRows(task.local, task.rows);
    Index key_local = 0;
    for (const Segment& s : block.segments) {
      // Causal: keys after the tile's last query are skipped.
      const Index end = causal ? std::min(s.count, task.global + task.rows - s.first) : s.count;
      for (Index j = 0; j < end; j += block_size) {
        const Index cols = std::min(block_size, end - j);
        const auto rows = block.kv.middleRows(key_local + j, cols);
        tile.attend(q, task.global, rows.leftCols(d), rows.rightCols(dv), s.first + j, acc,
                    task.local);
      }
      key_local += s.count;
    }
  });
}

}  // namespace detail

// Unnormalised ring attention of the local query rows (to merge with other partial results).
template <typename Scalar>
SoftmaxAccumulator<Scalar> ring_attention_accumulate(Communicator& comm,
                                                     const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                                     const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                                     const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                     const RingOptions& opt = {}) {
  const char* where = "ring_attention";
  const RowPartition q_part = detail::gather_partition(comm, q.rows(), opt.layout, where, "q");
  const RowPartition k_part = detail::gather_partition(comm, k.rows(), opt.layout, where, "k");
  detail::require_same_everywhere<Index>(comm, q.cols(), where, "the number of columns d of q");
  detail::require_same_everywhere<Index>(comm, v.cols(), where, "the number of columns dv of v");
  const Index n_q = q_part.rows(), n_k = k_part.rows(), d = q.cols(), dv = v.cols();
  const Index block = exact_block_size(opt);
  Scalar scale = 0;
  comm.agree([&] {
    // This rank's rows have the shapes of the contract; the counts are those of the whole call.
    check_attention_shapes<Scalar>(where, q, k, v);
    check_attention_counts(where, n_q, n_k, opt.causal);
    scale = check_exact_options<Scalar>(where, opt, n_q, d);
    // NaN/Inf on this rank's slice is reported before any block moves.
    if (opt.check_finite) check_attention_finite<Scalar>(where, q, k, v);
  });

  const int p = comm.size(), me = comm.rank();
  const RowMatrix<Scalar> qs = scale * q;
  SoftmaxAccumulator<Scalar> acc(q.rows(), dv);
  detail::KeyValueBlock<Scalar> current{RowMatrix<Scalar>(k.rows(), d + dv), k_part.segments(me)};
  current.kv.leftCols(d) = k;
  current.kv.rightCols(dv) = v;
  detail::KeyValueBlock<Scalar> next;
  std::vector<MPI_Request> requests;
  const int to = (me + 1) % p, from = (me + p - 1) % p;
  for (int step = 0; step < p; ++step) {
    if (step + 1 < p) {
      // At step s this rank holds the block of rank me − s; next comes the block of me − s − 1.
      const int source = (me + p - step - 1) % p;
      next.segments = k_part.segments(source);
      next.kv.resize(k_part.local_rows(source), d + dv);
      requests.push_back(comm.irecv(next.kv.data(), std::size_t(next.kv.size()), from, step));
      requests.push_back(comm.isend(current.kv.data(), std::size_t(current.kv.size()), to, step));
    }
    if (q.rows() > 0 && current.kv.rows() > 0)
      detail::attend_block(qs, q_part.segments(me), current, d, block, opt.causal, acc);
    Communicator::wait_all(requests);
    if (step + 1 < p) std::swap(current, next);
  }
  comm.agree([&] {
    const auto scan = [] {};  // every rank scanned its inputs above
    randattn::detail::check_accumulator_finite(where, acc, opt.check_finite, scan);
  });
  return acc;
}

// softmax(scale · Q Kᵀ [masked]) V for the local query rows: q, k, v are this rank's rows of the
// global n_q × d, n_k × d, n_k × dv operands in the layout opt.layout.
template <typename Scalar>
RowMatrix<Scalar> ring_attention(Communicator& comm, const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& k,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                 const RingOptions& opt = {}) {
  return ring_attention_accumulate<Scalar>(comm, q, k, v, opt).finalize();
}

}  // namespace randattn::mpi
