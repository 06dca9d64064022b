#pragma once
// Shared-QK LSH attention (Reformer sort-and-chunk) over sequence-parallel shards. Hash codes
// are small (n r integers), so every rank gathers all of them (MPI_Allgatherv) and knows the
// global sorted order of every round. Rank p owns chunks [p C / P, (p + 1) C / P) of the C
// chunks of every round; it fetches the rows (q and v) of the tokens of its chunks and of their
// look-back chunks from the rows' owners (MPI_Alltoallv of requests, then of rows), runs the
// library's LSH kernel (lsh/detail/target_blocks.hpp) on them with global positions (so masks and
// the duplicate correction are those of the single-process call), and sends each token's partial
// [num | den] and log-scale of each round back to the token's owner (MPI_Alltoallv). Owners
// merge the partials in round order, then apply the self rule.
//
// Per rank and call: n r / P codes out; about r (n/P + n/C) rows of d + dv values in; r n / P
// partials of dv + 2 values out. Beyond kCountTableRounds rounds (with dedupe) each rank tables
// the duplicate counts of the tokens it scores once (lsh/detail/target_blocks.hpp,
// chunk_target_counts, shared with the single-process call), so the work is linear in rounds. For chunk lengths c <= 128 (one kernel tile per chunk and look-
// back pair) the result is the single-process result bit for bit; otherwise up to rounding.
// Exact buckets (exact_buckets = true) and separate keys are not distributed: they throw.

#include <randattn/detail/intrinsics.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validation.hpp"
#include "../hashing/unit_rows.hpp"
#include "../lsh/chunk_plan.hpp"
#include "../lsh/cross_polytope.hpp"
#include "../lsh/detail/target_blocks.hpp"
#include "../lsh/lsh_attention.hpp"
#include "communicator.hpp"
#include "partition.hpp"

namespace randattn::mpi {

namespace detail {

// A fingerprint of the hash: its shape and the codes of the identity rows in every round.
template <typename Scalar>
std::uint64_t hash_fingerprint(const CrossPolytopeHash<Scalar>& hash) {
  const Index shape[3] = {hash.dim(), hash.buckets(), hash.rounds()};
  const HashCodes codes = hash.hash(RowMatrix<Scalar>::Identity(hash.dim(), hash.dim()), false);
  return fnv1a(codes.data(), std::size_t(codes.size()), fnv1a(shape, 3));
}

// Rows [q | v] of the given global tokens (sorted, unique), fetched from their owners.
template <typename Scalar>
RowMatrix<Scalar> fetch_rows(Communicator& comm, const RowPartition& part,
                             const std::vector<std::int32_t>& tokens,
                             const RowMatrix<Scalar>& local_qv) {
  const auto p = std::size_t(comm.size());
  const Index width = local_qv.cols(), first = part.range(comm.rank()).first;
  std::vector<std::vector<std::int32_t>> requests(p);
  for (std::int32_t t : tokens) requests[std::size_t(part.owner(t))].push_back(t);
  const std::vector<std::vector<std::int32_t>> asked = comm.alltoallv(requests);
  std::vector<std::vector<Scalar>> replies(p);
  for (std::size_t r = 0; r < p; ++r) {
    for (std::int32_t t : asked[r]) {
      const auto row = local_qv.row(t - first);
      replies[r].insert(replies[r].end(), row.data(), row.data() + width);
    }
  }
  const std::vector<std::vector<Scalar>> rows = comm.alltoallv(replies);
  // Tokens are sorted and owners hold increasing ranges: rank order is token order.
  RowMatrix<Scalar> out(Index(tokens.size()), width);
  Index at = 0;
  for (std::size_t r = 0; r < p; ++r)
    for (std::size_t e = 0; e < rows[r].size(); e += std::size_t(width), ++at)
      out.row(at) = Eigen::Map<const Vector<Scalar>>(rows[r].data() + e, width).transpose();
  return out;
}

}  // namespace detail

// Shared-QK LSH attention as an accumulator of the local rows: qk and v are this rank's rows
// (contiguous layout) of the global n × d and n × dv operands. Every rank passes the same hash.
template <typename Scalar>
SoftmaxAccumulator<Scalar> lsh_attention_accumulate(Communicator& comm,
                                                    const CrossPolytopeHash<Scalar>& hash,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& qk,
                                                    const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                                    const LshOptions& opt = {}) {
  const char* where = "lsh_attention (MPI)";
  const RowPartition part =
      detail::gather_partition(comm, qk.rows(), RowLayout::contiguous, where, "qk");
  detail::require_same_everywhere<Index>(comm, v.cols(), where, "the number of columns dv of v");
  const Index n = part.rows(), d = qk.cols(), dv = v.cols(), r = hash.rounds(), c = opt.chunk;
  Scalar scale = 0;
  HashCodes codes;
  comm.agree([&] {
    randattn::detail::require(
        !opt.exact_buckets, where,
        "exact buckets are not distributed; use sort-and-chunk (exact_buckets = false)");
    scale = check_lsh_inputs<Scalar>(where, qk, v, hash, opt);
    codes = hash.hash(qk, false);
  });
  detail::require_same_everywhere<std::uint64_t>(
      comm, detail::hash_fingerprint(hash), where,
      "the hash (fingerprint of its rotations; draw it from the same seed "
      "and shape on every rank)");

  // Global codes, sorted order and chunk signatures, on every rank.
  std::vector<std::int32_t> mine(codes.data(), codes.data() + codes.size());
  const std::vector<std::int32_t> all = comm.allgatherv(mine);
  SoftmaxAccumulator<Scalar> acc(qk.rows(), dv);
  if (n == 0) return acc;
  const HashCodes global_codes = Eigen::Map<const HashCodes>(all.data(), n, r);
  const LshChunkPlan plan(global_codes, hash.buckets(), c);
  const Index chunks = plan.chunks();
  const Index g0 = comm.rank() * chunks / comm.size(),
              g1 = (comm.rank() + 1) * chunks / comm.size();

  // The tokens this rank's chunks read: their own and their look-back chunk's, every round.
  const auto chunk_tokens = [&](Index rho, Index g) {
    return std::make_pair(plan.chunk(rho, g), plan.chunk_size(g));
  };
  std::vector<std::int32_t> tokens;
  for (Index rho = 0; rho < r; ++rho) {
    for (Index g = g0; g < g1; ++g) {
      for (Index h : {g, (g + chunks - 1) % chunks}) {
        const auto [first, count] = chunk_tokens(rho, h);
        tokens.insert(tokens.end(), first, first + count);
      }
    }
  }
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  RowMatrix<Scalar> local_qv(qk.rows(), d + dv);
  local_qv.leftCols(d) = qk;
  local_qv.rightCols(dv) = v;
  const RowMatrix<Scalar> fetched = detail::fetch_rows(comm, part, tokens, local_qv);
  const RowMatrix<Scalar> queries = scale * fetched.leftCols(d);
  const RowMatrix<Scalar> keys = randattn::unit_rows<Scalar>(fetched.leftCols(d));
  const RowMatrix<Scalar> values = fetched.rightCols(dv);
  const auto stored = [&](std::int32_t token) {  // row of a global token in the fetched rows
    return std::int32_t(std::lower_bound(tokens.begin(), tokens.end(), token) - tokens.begin());
  };

  randattn::detail::RoundSignatures sig{plan.chunk_of().data(), plan.chunk_of().data(), r,
                                        chunks > 1, static_cast<std::int32_t>(1 - chunks)};
  // Many rounds: N_ij of the tokens this rank scores as queries tabled once, as the
  // single-process call does, so the work stays linear in rounds.
  randattn::detail::TargetCounts counts;
  if (opt.dedupe && r > randattn::detail::kCountTableRounds) {
    std::vector<std::int32_t> rows;
    for (Index rho = 0; rho < r; ++rho)
      for (Index g = g0; g < g1; ++g) {
        const auto [first, count] = chunk_tokens(rho, g);
        rows.insert(rows.end(), first, first + count);
      }
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    counts = randattn::detail::chunk_target_counts(plan, plan, &rows);
    sig.counts = &counts;
  }
  randattn::detail::TargetProblem<Scalar> problem;
  problem.queries = &queries;
  problem.keys = &keys;
  problem.values = &values;
  problem.exclude_self = true;
  problem.causal = opt.causal;
  problem.dedupe = opt.dedupe ? &sig : nullptr;
  problem.position = tokens.data();

  // Per round: the partials of the tokens of the owned chunks, sent back to their owners as
  // [round, token] ids and [num | den | log-scale] rows.
  const auto p = std::size_t(comm.size());
  std::vector<std::vector<Index>> ids(p);
  std::vector<std::vector<Scalar>> partials(p);
  SoftmaxAccumulator<Scalar> round_acc;
  for (Index rho = 0; rho < r; ++rho) {
    round_acc = SoftmaxAccumulator<Scalar>(Index(tokens.size()), dv);
    randattn::detail::parallel_for(g1 - g0, [&](Index t) {
      randattn::detail::TargetBlockKernel<Scalar> kernel(problem);
      std::vector<std::int32_t> rows, cols;
      const Index g = g0 + t;
      const auto [first, count] = chunk_tokens(rho, g);
      for (Index u = 0; u < count; ++u) rows.push_back(stored(first[u]));
      cols = rows;
      if (chunks > 1) {
        const auto [back, back_count] = chunk_tokens(rho, (g + chunks - 1) % chunks);
        for (Index u = 0; u < back_count; ++u) cols.push_back(stored(back[u]));
      }
      kernel.attend(rows.data(), Index(rows.size()), cols.data(), Index(cols.size()), round_acc);
    });
    for (Index g = g0; g < g1; ++g) {
      const auto [first, count] = chunk_tokens(rho, g);
      for (Index u = 0; u < count; ++u) {
        const std::int32_t s = stored(first[u]);
        const auto to = std::size_t(part.owner(first[u]));
        ids[to].push_back(rho * n + first[u]);
        const auto nd = round_acc.numden().row(s);
        partials[to].insert(partials[to].end(), nd.data(), nd.data() + dv + 1);
        partials[to].push_back(round_acc.log_scale()(s));
      }
    }
  }
  const std::vector<std::vector<Index>> got_ids = comm.alltoallv(ids);
  const std::vector<std::vector<Scalar>> got = comm.alltoallv(partials);

  // Merge in round order (ids are round * n + token), as the single-process call does.
  struct Entry {
    Index id;
    const Scalar* row;
  };
  std::vector<Entry> entries;
  for (std::size_t q = 0; q < p; ++q)
    for (std::size_t e = 0; e < got_ids[q].size(); ++e)
      entries.push_back({got_ids[q][e], got[q].data() + e * (dv + 2)});
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.id < b.id; });
  const Index first_row = part.range(comm.rank()).first;
  for (const Entry& e : entries) {
    const Eigen::Map<const RowMatrix<Scalar>> nd(e.row, 1, dv + 1);
    acc.merge_rows(e.id % n - first_row, nd, Vector<Scalar>::Constant(1, e.row[dv + 1]));
  }

  // Self rule for the rows with no other valid target, on their owner.
  std::vector<std::int32_t> empty;
  for (Index i = 0; i < acc.rows(); ++i)
    if (acc.log_scale()(i) == -std::numeric_limits<Scalar>::infinity())
      empty.push_back(std::int32_t(i));
  if (!empty.empty()) {
    const RowMatrix<Scalar> own_queries = scale * qk, own_keys = randattn::unit_rows<Scalar>(qk),
                            own_values = v;
    randattn::detail::attend_to_self(acc, empty, own_queries, own_keys, own_values);
  }
  comm.agree([&] {
    randattn::detail::check_accumulator_finite(where, acc, opt.check_finite);
  });
  return acc;
}

// Shared-QK LSH attention of the local rows (n_local × dv).
template <typename Scalar>
RowMatrix<Scalar> lsh_attention(Communicator& comm, const CrossPolytopeHash<Scalar>& hash,
                                const Eigen::Ref<const RowMatrix<Scalar>>& qk,
                                const Eigen::Ref<const RowMatrix<Scalar>>& v,
                                const LshOptions& opt = {}) {
  return lsh_attention_accumulate<Scalar>(comm, hash, qk, v, opt).finalize();
}

}  // namespace randattn::mpi
