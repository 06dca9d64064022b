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
//               With page_axes, a rank's axes are those of its own first page_axes tokens.
// Centring: a given key_centre, or the mean of the first centre_tokens tokens of the whole
// sequence: every rank sees every appended block, so each sums the first tokens' keys itself
// (in double, in token order, as the single process does) and fixes its local cache's centre
// when the sequence reaches centre_tokens, wherever those tokens are stored.
// lsh_sample hashes keys in blocks of lsh_hash_block local tokens; shard_tokens must be a
// multiple of it, so a rank's blocks are blocks of global positions and the keys still
// attended exactly (the open block) are the single process's.
//
// Files. save(path) is collective and writes one file per rank, "<path>.<rank>" (a shared
// file system, or the same path on every node, for load): a header (magic "RAKVSHRD", format
// version, number of ranks, rank, a stamp shared by the ranks of one save, shard_tokens, the
// global size, the centring state), then the rank's KvCache as KvCache::save writes it, and an
// FNV-1a checksum. load(comm, path) is collective, on as many ranks as saved: a missing,
// corrupt, truncated file, a rank count other than the saved one, or files of different saves
// throw the same std::invalid_argument on every rank; results after load are bit-identical.
//
// Calls. append(k, v), attend(q), save and load are collective: every rank passes the same global arguments
// (k, v as KvCache::append, q as KvCache::attend); append keeps this rank's tokens, attend
// returns the whole result on every rank. Errors on any rank are thrown on every rank
// (Communicator::agree) before anything changes. Not for concurrent use from several threads
// (MPI collectives). Communication per attend: q_heads·(dv + 2) values per rank.

#include <randattn/detail/intrinsics.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../core/softmax_accumulator.hpp"
#include "../core/types.hpp"
#include "../decode/detail/binary_io.hpp"
#include "../decode/kv_cache.hpp"
#include "../detail/validation.hpp"
#include "communicator.hpp"
#include "detail/reduce.hpp"

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
                                                                    shard_tokens)) {
    if (local_.options().centre_tokens > 0) key_sum_ = Eigen::MatrixXd::Zero(kv_heads, head_dim);
  }

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
      check_block(k, v, where);
      const Index t = k.rows() / kvh;
      // Every rank checks the whole block (finite values), so all keep or all refuse it.
      randattn::detail::require_finite(k, where, "k", local_.options().check_finite);
      randattn::detail::require_finite(v, where, "v", local_.options().check_finite);
      // With centring by the first tokens, the block is cut where the sequence reaches them.
      const Index ct = local_.options().centre_tokens;
      const Index cut = centre_pending() && n_ + t >= ct ? ct - n_ : t;
      append_tokens(k, v, t, 0, cut);
      if (centre_pending() && n_ == ct) fix_centre();
      append_tokens(k, v, t, cut, t);
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
    detail::check(MPI_Type_contiguous(int(dv + 2), datatype<Scalar>(), &type),
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

  // Collective: every rank writes "<path>.<rank>" (see the top of the file).
  void save(const std::string& path) const {
    std::uint64_t stamp = 0;
    if (comm_->rank() == 0) stamp = std::random_device{}() * 0x100000001ull + std::random_device{}() + 1;
    comm_->allreduce(&stamp, 1, MPI_MAX);  // rank 0's stamp on every rank
    comm_->agree([&] {
      const std::string file = rank_path(path, comm_->rank());
      randattn::detail::LittleEndianWriter w(file, "ShardedKvCache::save");
      w.raw(kMagic, 8);
      w.u32(kFileVersion);
      w.u32(std::uint32_t(comm_->size()));
      w.u32(std::uint32_t(comm_->rank()));
      w.u64(stamp);
      w.u64(std::uint64_t(shard_tokens_));
      w.u64(std::uint64_t(n_));
      w.u8(centre_fixed_);
      const auto matrix = [&](const auto& m) {
        w.u64(std::uint64_t(m.rows()));
        w.u64(std::uint64_t(m.cols()));
        w.reals(m.data(), std::size_t(m.size()));
      };
      matrix(key_sum_);
      matrix(centre_);
      local_.write_to(w);
      w.finish();
    });
  }

  // Collective, on as many ranks as saved the files: the cache save(path) wrote.
  static ShardedKvCache load(Communicator& comm, const std::string& path) {
    const char* where = "ShardedKvCache::load";
    std::optional<ShardedKvCache> made;
    std::uint64_t stamp = 0;
    comm.agree([&] {
      // The rank count first, from rank 0's file, so a mismatch gives the same message everywhere.
      const std::uint32_t saved = saved_ranks(rank_path(path, 0), where);
      randattn::detail::require(saved == std::uint32_t(comm.size()), where, "'", path,
                                "' was saved by ", saved, " ranks; load it on ", saved,
                                " ranks, not ", comm.size());
      const std::string file = rank_path(path, comm.rank());
      randattn::detail::LittleEndianReader r(file, where);
      randattn::detail::require(r.checksum_ok(), where, "'", file,
                                "' is corrupt or truncated (checksum mismatch)");
      read_header(r, file, where);
      r.u32("ranks");
      const std::uint32_t rank = r.u32("rank");
      randattn::detail::require(rank == std::uint32_t(comm.rank()), where, "'", file,
                                "' holds rank ", rank, "'s part, not rank ", comm.rank(), "'s");
      stamp = r.u64("stamp");
      const std::uint64_t shard = r.u64("shard_tokens"), n = r.u64("size");
      randattn::detail::require(shard >= 1 && shard <= std::uint64_t(KvCache<Scalar>::kMaxTokens) &&
                                    n <= std::uint64_t(KvCache<Scalar>::kMaxTokens),
                                where, "'", file, "' has implausible shard_tokens ", shard,
                                " or size ", n);
      const bool fixed = r.u8("centre state") != 0;
      const auto matrix = [&](auto& m, const char* what) {
        const std::uint64_t rows = r.u64(what), cols = r.u64(what);
        randattn::detail::require(rows <= kLimit && cols <= kLimit, where, "'", file,
                                  "' has implausible ", what, " shape ", rows, "x", cols);
        m.resize(Index(rows), Index(cols));
        r.reals(m.data(), std::size_t(m.size()), what);
      };
      Eigen::MatrixXd key_sum;
      Matrix centre;
      matrix(key_sum, "key sums");
      matrix(centre, "key centre");
      const int P = comm.size(), me = comm.rank();
      KvCache<Scalar> local =
          KvCache<Scalar>::read_from(r, file, where, [&](KvCache<Scalar>& c, Index i) {
            // Where the sequence reached centre_tokens, as append did.
            if (fixed && !c.key_centre_fixed() &&
                i == local_before(c.options().centre_tokens, P, me, Index(shard)))
              c.fix_key_centre(centre);
          });
      const Index held = local_before(Index(n), P, me, Index(shard));
      randattn::detail::require(local.size() == held, where, "'", file, "' holds ", local.size(),
                                " tokens, but rank ", me, " of a cache of ", n, " tokens holds ",
                                held);
      const Index ct = local.options().centre_tokens;
      randattn::detail::require(
          (ct == 0 && key_sum.size() == 0 && centre.size() == 0 && !fixed) ||
              (ct > 0 && fixed == (Index(n) >= ct) && key_sum.rows() == local.kv_heads() &&
               key_sum.cols() == local.head_dim() &&
               centre.rows() == (fixed ? local.kv_heads() : 0) &&
               centre.cols() == (fixed ? local.head_dim() : 0)),
          where, "'", file, "' has an inconsistent centring state");
      randattn::detail::require(local.options().mode != DecodeMode::lsh_sample ||
                                    Index(shard) % local.options().lsh_hash_block == 0,
                                where, "'", file, "' has shard_tokens ", shard,
                                " not a multiple of lsh_hash_block");
      made.emplace(ShardedKvCache(comm, Index(shard), Index(n), std::move(local), fixed,
                                  std::move(key_sum), std::move(centre)));
    });
    // Every rank's file must come from the same save.
    std::uint64_t low = stamp, high = stamp;
    comm.allreduce(&low, 1, MPI_MIN);
    comm.allreduce(&high, 1, MPI_MAX);
    comm.require_all(low == high, std::string("randattn::") + where + ": the files '" + path +
                                      ".<rank>' come from different saves");
    return std::move(*made);
  }

 private:
  static KvCache<Scalar> make_local(Communicator& comm, Index d, Index dv, Index kvh,
                                    KvCacheOptions o, Index shard_tokens) {
    std::optional<KvCache<Scalar>> made;
    comm.agree([&] {
      const char* where = "ShardedKvCache";
      randattn::detail::require(shard_tokens >= 1, where, "shard_tokens must be >= 1, got ",
                                shard_tokens);
      randattn::detail::require(
          o.mode != DecodeMode::lsh_sample || shard_tokens % o.lsh_hash_block == 0, where,
          "shard_tokens (", shard_tokens, ") must be a multiple of options.lsh_hash_block (",
          o.lsh_hash_block, "), so that ranks hash whole blocks of positions");
      made.emplace(d, dv, kvh, std::move(o));
    });
    return std::move(*made);
  }

  // Shapes and the token limit of an appended block (every rank checks the same block).
  template <typename K, typename V>
  void check_block(const K& k, const V& v, const char* where) const {
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
    return local_before(x, comm_->size(), comm_->rank(), shard_tokens_);
  }
  // Rank r's tokens among [0, x) with P ranks and chunks of C tokens.
  static Index local_before(Index x, Index P, Index r, Index C) {
    const Index full = x / C;
    return C * (full / P + (full % P > r ? 1 : 0)) + (full % P == r ? x % C : 0);
  }

  // A loaded cache (load() has checked the parts).
  ShardedKvCache(Communicator& comm, Index shard_tokens, Index n, KvCache<Scalar> local,
                 bool centre_fixed, Eigen::MatrixXd key_sum, Matrix centre)
      : comm_(&comm), shard_tokens_(shard_tokens), n_(n), local_(std::move(local)),
        centre_fixed_(centre_fixed), key_sum_(std::move(key_sum)), centre_(std::move(centre)) {}

  bool centre_pending() const { return local_.options().centre_tokens > 0 && !centre_fixed_; }

  // Tokens [i0, i1) of a block of t: this rank keeps its own; while the centre is pending,
  // every rank adds every key to the sums (double, token order, as KvCache does).
  template <typename K, typename V>
  void append_tokens(const K& k, const V& v, Index t, Index i0, Index i1) {
    const Index kvh = local_.kv_heads();
    if (centre_pending()) {
      for (Index i = i0; i < i1; ++i)
        for (Index h = 0; h < kvh; ++h)
          for (Index c = 0; c < k.cols(); ++c) key_sum_(h, c) += double(k(h * t + i, c));
    }
    std::vector<Index> mine;  // positions among the new tokens held here
    for (Index i = i0; i < i1; ++i)
      if (owner(n_ + i - i0) == comm_->rank()) mine.push_back(i);
    const Index m = Index(mine.size());
    Matrix lk(kvh * m, k.cols()), lv(kvh * m, v.cols());
    for (Index h = 0; h < kvh; ++h)
      for (Index u = 0; u < m; ++u) {
        lk.row(h * m + u) = k.row(h * t + mine[std::size_t(u)]);
        lv.row(h * m + u) = v.row(h * t + mine[std::size_t(u)]);
      }
    local_.append(lk, lv);
    n_ += i1 - i0;
  }

  // The sequence holds centre_tokens tokens: fix the mean of their keys on every rank (a rank
  // that holds all of them has fixed the same centre itself).
  void fix_centre() {
    centre_ = (key_sum_ / double(n_)).template cast<Scalar>();
    centre_fixed_ = true;
    if (!local_.key_centre_fixed()) local_.fix_key_centre(centre_);
  }

  static std::string rank_path(const std::string& path, int rank) {
    return path + "." + std::to_string(rank);
  }

  static void read_header(randattn::detail::LittleEndianReader& r, const std::string& file,
                          const char* where) {
    const unsigned char* magic = r.take(8, "magic");
    randattn::detail::require(
        std::equal(magic, magic + 8, reinterpret_cast<const unsigned char*>(kMagic)), where, "'",
        file, "' is not a ShardedKvCache file (bad magic)");
    const std::uint32_t version = r.u32("version");
    randattn::detail::require(version == kFileVersion, where, "'", file, "' has format version ",
                              version, ", this build reads version ", kFileVersion);
  }

  // The number of ranks recorded in a rank's file (its header only).
  static std::uint32_t saved_ranks(const std::string& file, const char* where) {
    std::ifstream in(file, std::ios::binary);
    randattn::detail::require(bool(in), where, "cannot open '", file, "'");
    unsigned char head[16];
    in.read(reinterpret_cast<char*>(head), 16);
    randattn::detail::require(in.gcount() == 16, where, "'", file, "' is truncated");
    randattn::detail::require(
        std::equal(head, head + 8, reinterpret_cast<const unsigned char*>(kMagic)), where, "'",
        file, "' is not a ShardedKvCache file (bad magic)");
    return randattn::detail::load_le<std::uint32_t>(head + 12);
  }

  static constexpr char kMagic[9] = "RAKVSHRD";
  static constexpr std::uint32_t kFileVersion = 1;
  static constexpr std::uint64_t kLimit = std::uint64_t(1) << 31;

  Communicator* comm_;
  Index shard_tokens_;
  Index n_ = 0;
  KvCache<Scalar> local_;
  // centre_tokens > 0: the sums of the sequence's first keys (kv_heads x d) until the centre is
  // fixed, then the centre itself.
  bool centre_fixed_ = false;
  Eigen::MatrixXd key_sum_;
  Matrix centre_;
};

}  // namespace randattn::mpi
