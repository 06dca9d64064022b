#pragma once
// A key/value cache for decoding sharded by position over the ranks of a communicator: every
// rank holds the tokens of its chunks in a local KvCache (decode/kv_cache.hpp), and one collective
// attend merges the ranks' unnormalised per-query-head states [num | den] with their log-scales
// by the online-softmax rule, in rank order (MPI_Allreduce with a non-commutative operation, so
// the result depends on the number of ranks only, never on timing).
//
// Placement. Token j (global position) lives on rank (j / shard_tokens) mod P: chunks of
// `shard_tokens` consecutive tokens dealt round-robin, so memory and attend work stay balanced
// as the cache grows, and each rank's tokens keep their global order.
//
// Modes. The exact part is global: the first `sinks` and last `window` tokens of the whole cache
// are attended exactly by the ranks that hold them, and each rank's retrieval candidates are its
// tokens in [sinks, n − window), so no key is counted twice.
//   exact       every key on every rank: the single-process result up to rounding.
//   lsh_sample  hyperplanes depend on (seed, kv head) only, so every rank hashes like the single
//               process, a key is sampled iff it is sampled there and weighted by the same
//               inclusion probability: the single-process estimate up to rounding.
//   lsf         likewise: every key sits in the same filters, the query opens the same ones.
//   blocks      pages are pages of a rank's own tokens (global pages when page_size divides
//               shard_tokens) and each rank attends to its own top_pages pages: up to
//               P·top_pages pages in all. With every page attended it is exact decoding.
// Centring by the mean of the first tokens (centre_tokens) would differ between ranks and is
// refused; a given key_centre is fine.
//
// Calls. append(k, v) and attend(q) are collective: every rank passes the same global arguments
// (k, v as KvCache::append, q as KvCache::attend); append keeps this rank's tokens, attend
// returns the whole result on every rank. Errors on any rank are thrown on every rank
// (Communicator::agree) before anything changes. Not for concurrent use from several threads
// (MPI collectives). Communication per attend: q_heads·(dv + 2) values per rank.

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../decode/kv_cache.hpp"
#include "../detail/validation.hpp"
#include "communicator.hpp"
#include "reduce.hpp"

namespace randattn::mpi {

template <typename Scalar_>
class ShardedKvCache {
 public:
  using Scalar = Scalar_;
  using Matrix = RowMatrix<Scalar>;

  // `comm` must outlive the cache. Collective (checks the arguments on every rank).
  ShardedKvCache(Communicator& comm, Index head_dim, Index value_dim, Index kv_heads,
                 KvCacheOptions options = {}, Index shard_tokens = 256)
      : comm_(&comm), shard_tokens_(shard_tokens), local_(make_local(comm, head_dim, value_dim,
                                                                    kv_heads, std::move(options),
                                                                    shard_tokens)) {}

  Index size() const { return n_; }
  Index shard_tokens() const { return shard_tokens_; }
  // This rank's tokens, in global order.
  const KvCache<Scalar>& local() const { return local_; }
  int owner(Index position) const { return int((position / shard_tokens_) % comm_->size()); }
  // Global position of this rank's token j (0 <= j < local().size()).
  Index position(Index j) const {
    return ((j / shard_tokens_) * comm_->size() + comm_->rank()) * shard_tokens_ + j % shard_tokens_;
  }

  // Collective: every rank passes the same k ((kv_heads·t) x d) and v ((kv_heads·t) x dv).
  void append(const Eigen::Ref<const Matrix>& k, const Eigen::Ref<const Matrix>& v) {
    comm_->agree([&] {
      const char* where = "ShardedKvCache::append";
      const Index kvh = local_.kv_heads();
      detail_check_rows(k, v, where);
      const Index t = k.rows() / kvh;
      std::vector<Index> mine;  // positions among the t new tokens held here
      for (Index i = 0; i < t; ++i)
        if (owner(n_ + i) == comm_->rank()) mine.push_back(i);
      Matrix lk(kvh * Index(mine.size()), k.cols()), lv(kvh * Index(mine.size()), v.cols());
      for (Index h = 0; h < kvh; ++h)
        for (std::size_t u = 0; u < mine.size(); ++u) {
          lk.row(h * Index(mine.size()) + Index(u)) = k.row(h * t + mine[u]);
          lv.row(h * Index(mine.size()) + Index(u)) = v.row(h * t + mine[u]);
        }
      // Every rank checks the whole block (finite values), so all keep or all refuse it.
      randattn::detail::require_finite(k, where, "k", local_.options().check_finite);
      randattn::detail::require_finite(v, where, "v", local_.options().check_finite);
      local_.append(lk, lv);
      n_ += t;
    });
  }

  // Collective: every rank passes the same q (q_heads x d); returns q_heads x dv on every rank.
  // `report`, if given, receives this rank's part (keys it scored, pages, probes).
  Matrix attend(const Eigen::Ref<const Matrix>& q, DecodeReport* report = nullptr) const {
    const Index dv = local_.value_dim();
    // One buffer [c | num | den] per query head, merged by mpi::detail::merge_scaled_op.
    Matrix state;
    comm_->agree([&] {
      randattn::detail::require(n_ > 0, "ShardedKvCache::attend",
                                "the cache is empty: attention over no keys is undefined");
      const Index s = local_before(std::min(local_.options().sinks, n_));
      const Index w =
          local_.size() - local_before(n_ - std::min(local_.options().window, n_));
      const SoftmaxAccumulator<Scalar> acc = local_.attend_partial(q, s, w, report);
      state.resize(q.rows(), dv + 2);
      state.col(0) = acc.log_scale();
      state.rightCols(dv + 1) = acc.numden();
    });
    MPI_Datatype type;
    MPI_Op op;
    detail::check(MPI_Type_contiguous(int(dv + 2), detail::datatype<Scalar>(), &type),
                  "MPI_Type_contiguous");
    detail::check(MPI_Type_commit(&type), "MPI_Type_commit");
    detail::check(MPI_Op_create(&detail::merge_scaled_op<Scalar>, /*commute=*/0, &op),
                  "MPI_Op_create");
    comm_->count_bytes(std::uint64_t(state.size()) * sizeof(Scalar));
    const int rc = MPI_Allreduce(MPI_IN_PLACE, state.data(),
                                 detail::to_count(std::size_t(state.rows()), "attend"), type, op,
                                 comm_->get());
    MPI_Op_free(&op);
    MPI_Type_free(&type);
    detail::check(rc, "MPI_Allreduce");
    const SoftmaxAccumulator<Scalar> all(state.rightCols(dv + 1), state.col(0));
    Matrix out(q.rows(), dv);
    all.finalize_into(out);
    return out;
  }

 private:
  static KvCache<Scalar> make_local(Communicator& comm, Index d, Index dv, Index kvh,
                                    KvCacheOptions o, Index shard_tokens) {
    std::optional<KvCache<Scalar>> made;
    comm.agree([&] {
      const char* where = "ShardedKvCache";
      randattn::detail::require(shard_tokens >= 1, where, "shard_tokens must be >= 1, got ",
                                shard_tokens);
      randattn::detail::require(o.centre_tokens == 0, where,
                                "centring by the first tokens (centre_tokens) is not sharded: "
                                "give key_centre instead");
      made.emplace(d, dv, kvh, std::move(o));
    });
    return std::move(*made);
  }

  template <typename K, typename V>
  void detail_check_rows(const K& k, const V& v, const char* where) const {
    const Index kvh = local_.kv_heads();
    randattn::detail::require(k.cols() == local_.head_dim(), where, "k is ",
                              randattn::detail::shape_of(k), " but head_dim is ", local_.head_dim());
    randattn::detail::require(v.cols() == local_.value_dim(), where, "v is ",
                              randattn::detail::shape_of(v), " but value_dim is ",
                              local_.value_dim());
    randattn::detail::require(k.rows() % kvh == 0 && v.rows() == k.rows(), where, "k (",
                              randattn::detail::shape_of(k), ") and v (",
                              randattn::detail::shape_of(v),
                              ") must have the same rows, a multiple of kv_heads = ", kvh);
    randattn::detail::require(k.rows() / kvh <= KvCache<Scalar>::kMaxTokens - n_, where,
                              "the cache would exceed ", KvCache<Scalar>::kMaxTokens, " tokens");
  }

  // This rank's tokens among global positions [0, x).
  Index local_before(Index x) const {
    const Index P = comm_->size(), r = comm_->rank(), C = shard_tokens_;
    const Index full = x / C;
    return C * (full / P + (full % P > r ? 1 : 0)) + (full % P == r ? x % C : 0);
  }

  Communicator* comm_;
  Index shard_tokens_;
  Index n_ = 0;
  KvCache<Scalar> local_;
};

}  // namespace randattn::mpi
