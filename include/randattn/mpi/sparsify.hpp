#pragma once
// Sharded tensor sparsification (Algorithm 1, scheme spa) and sketched HOSVD (Algorithm 2).
//
// Each rank owns a contiguous range of the flat row-major index: the whole aligned chunks of
// sparsify_chunk_size entries given by sketch_range() (the last rank also takes the partial last
// chunk). ||A||_F^2 is summed exactly as the single-process call sums it: each rank sums its
// chunks (squared_chunk_sums), every rank gathers all chunk sums and adds them in chunk order.
// The keep probabilities are therefore the same bits, and the counter-based draws (entry omega
// uses Philox draw omega, detail::Sampler at the global flat offset) keep the same entries: the
// union of the ranks' sketches IS randattn::sparsify(A, opt), bit for bit, for any rank count.
// Communication: one gather of D / 2^15 chunk sums (twice: ||A||_F^2 and the expected nnz).
//
// Sketched HOSVD: both sketches are drawn as above; for each mode j the sketch entries are
// sent to the owner of their mode-j unfolding column (columns in near-equal blocks), each rank
// forms its columns' contribution to N_j = M_j(A1) M_j(A2)^T, and the d_j x d_j contributions are
// summed across ranks. The factors equal sketched_hosvd's up to the rounding of that sum.
// Errors (as for sparsify(), plus a wrong local entry count) are thrown on every rank.

#include <cstdint>
#include <limits>
#include <vector>

#include "../core/types.hpp"
#include "../detail/validation.hpp"
#include "../random/philox.hpp"
#include "../sketch/detail/mode_gram.hpp"
#include "../sketch/hosvd.hpp"
#include "../sketch/sparse_tensor.hpp"
#include "../sketch/sparsify.hpp"
#include "../sketch/tensor_view.hpp"
#include "communicator.hpp"
#include "partition.hpp"

namespace randattn::mpi {

// The flat range [first, first + count) of a D-entry tensor owned by `rank` of `ranks`.
inline Segment sketch_range(Index size, int rank, int ranks) {
  const Index chunk = sparsify_chunk_size, chunks = (size + chunk - 1) / chunk;
  const Segment blocks = RowPartition(chunks, ranks).range(rank);
  const Index first = std::min(size, blocks.first * chunk);
  return {first, std::min(size, (blocks.first + blocks.count) * chunk) - first};
}

namespace detail {

// The ordered total of per-chunk sums gathered from every rank (chunk order = rank order).
// (OrderedSum::value() adds the closed chunk sums in order from 0, the open chunk's last.)
inline double ordered_total(Communicator& comm, const std::vector<double>& chunk_sums) {
  double total = 0;
  for (double s : comm.allgatherv(chunk_sums)) total += s;
  return total;
}

// Sketches of this rank's entries, one per stream, with the global statistics.
template <typename Scalar>
std::vector<SparseSketch<Scalar>> sample_shard(Communicator& comm, const std::vector<Index>& dims,
                                               const Scalar* local, Index count,
                                               const SparsifyOptions& opt,
                                               const std::vector<std::uint32_t>& streams,
                                               const char* where) {
  Index size = 0;
  Segment range;
  comm.agree([&] {
    size = check_spa_arguments(where, dims, opt, "distributed sparsification");
    range = sketch_range(size, comm.rank(), comm.size());
    randattn::detail::require(count == range.count && (count == 0 || local), where, "rank ",
                              comm.rank(), " holds ", count, " entries but owns [", range.first,
                              ", ", range.first + range.count, ") of the tensor of shape ",
                              randattn::detail::dims_str(dims));
  });
  SketchStats stats;
  stats.scheme = opt.scheme;
  stats.budget = opt.budget;
  const Index chunk = sparsify_chunk_size, chunks = (count + chunk - 1) / chunk;
  std::vector<double> sums = squared_chunk_sums(range.first, local, count);
  Index bad = std::numeric_limits<Index>::max();
  for (Index t = 0; t < count; ++t) {
    if (!std::isfinite(local[t])) {
      bad = range.first + t;
      break;
    }
  }
  const double fro2 = ordered_total(comm, sums);
  comm.allreduce(&bad, 1, MPI_MIN);
  std::vector<SparseSketch<Scalar>> out;
  if (size == 0) {
    for (std::size_t i = 0; i < streams.size(); ++i)
      out.emplace_back(SparseTensor<Scalar>(dims, {}, {}), stats);
    return out;
  }
  comm.agree([&] {
    randattn::detail::check_squared_norm(fro2, dims, where, [&] {
      return bad == std::numeric_limits<Index>::max() ? Index(-1) : bad;
    });
  });
  stats.frobenius_norm = std::sqrt(fro2);
  stats.rule = randattn::detail::spa_rule(fro2, opt.budget, size);

  const Philox rng(opt.seed);
  std::vector<randattn::detail::Sampler<Scalar>> parts(
      std::size_t(chunks), randattn::detail::Sampler<Scalar>(stats.rule, rng, streams, false));
  comm.agree([&] {  // a kept value can overflow the scalar type on one rank
    randattn::detail::parallel_for(chunks, [&](Index c) {
      const Index t0 = c * chunk;
      parts[std::size_t(c)].run(range.first + t0, local + t0, 1, std::min(chunk, count - t0));
    });
  });
  for (std::size_t c = 0; c < parts.size(); ++c) sums[c] = parts[c].expected_nnz();
  stats.expected_nnz = ordered_total(comm, sums);
  for (std::size_t i = 0; i < streams.size(); ++i) {
    std::vector<Index> indices;
    std::vector<Scalar> values;
    for (auto& part : parts) {
      auto& o = part.outputs()[i];
      indices.insert(indices.end(), o.indices.begin(), o.indices.end());
      values.insert(values.end(), o.values.begin(), o.values.end());
    }
    out.emplace_back(SparseTensor<Scalar>(dims, std::move(indices), std::move(values)), stats);
  }
  return out;
}

// The entries of `s` whose mode-j unfolding column this rank owns, gathered from every rank.
template <typename Scalar>
SparseTensor<Scalar> entries_by_column(Communicator& comm, const SparseTensor<Scalar>& s,
                                       Index mode) {
  const randattn::detail::ModeSplit split(s.dims(), mode);
  const RowPartition columns(split.cols(), comm.size());
  const auto p = std::size_t(comm.size());
  std::vector<std::vector<Index>> indices(p);
  std::vector<std::vector<Scalar>> values(p);
  for (Index e = 0; e < s.nnz(); ++e) {
    const Index flat = s.indices()[std::size_t(e)];
    const auto to = std::size_t(columns.owner(split.col(flat)));
    indices[to].push_back(flat);
    values[to].push_back(s.values()[std::size_t(e)]);
  }
  std::vector<Index> all_indices;
  std::vector<Scalar> all_values;
  for (const auto& v : comm.alltoallv(indices))
    all_indices.insert(all_indices.end(), v.begin(), v.end());
  for (const auto& v : comm.alltoallv(values))
    all_values.insert(all_values.end(), v.begin(), v.end());
  // Ranks own increasing flat ranges, so rank order keeps the indices increasing.
  return SparseTensor<Scalar>(s.dims(), std::move(all_indices), std::move(all_values));
}

}  // namespace detail

// This rank's part of randattn::sparsify(A, opt) (scheme spa): `local` holds the `count`
// entries of A at flat indices sketch_range(D, rank, size) (row-major). The returned sketch has
// A's shape, the global statistics and only this rank's entries (global flat indices).
template <typename Scalar>
SparseSketch<Scalar> sparsify(Communicator& comm, const std::vector<Index>& dims,
                              const Scalar* local, Index count, const SparsifyOptions& opt) {
  return std::move(
      detail::sample_shard(comm, dims, local, count, opt, {opt.stream}, "sparsify (MPI)").front());
}

// Sketched HOSVD (Algorithm 2) of the sharded tensor; every rank receives all factors.
template <typename Scalar>
SketchedHosvd<Scalar> sketched_hosvd(Communicator& comm, const std::vector<Index>& dims,
                                     const Scalar* local, Index count,
                                     const std::vector<Index>& ranks, const SparsifyOptions& opt) {
  const char* where = "sketched_hosvd (MPI)";
  comm.agree([&] { randattn::detail::check_ranks(dims, ranks, where); });
  const auto sketches =
      detail::sample_shard(comm, dims, local, count, opt, {opt.stream, opt.stream + 1}, where);
  SketchedHosvd<Scalar> out;
  out.nnz = {{sketches[0].nnz(), sketches[1].nnz()}};
  comm.allreduce(out.nnz.data(), 2, MPI_SUM);
  out.stats = sketches[0].stats;
  std::vector<RowMatrix<Scalar>> mode_matrix(dims.size());
  for (std::size_t j = 0; j < dims.size(); ++j) {
    RowMatrix<Scalar> n = randattn::detail::sketch_mode_product(
        detail::entries_by_column(comm, sketches[0], Index(j)),
        detail::entries_by_column(comm, sketches[1], Index(j)), Index(j));
    comm.allreduce(n.data(), std::size_t(n.size()), MPI_SUM);
    mode_matrix[j] = (n + n.transpose()) / Scalar(2);
  }
  comm.agree([&] {
    randattn::detail::hosvd_factors<Scalar>(
        out, ranks, [&](Index j) { return mode_matrix[std::size_t(j)]; }, "mpi::sketched_hosvd");
  });
  return out;
}

}  // namespace randattn::mpi
