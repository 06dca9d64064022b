// A key/value cache sharded by position equals the single-process cache on the same tokens, at
// any number of ranks (ctest runs this binary at 1, 2 and 3 ranks). shard_tokens = 7 and n = 103
// make the chunks uneven, and every rank holds sinks, window or retrieval candidates depending
// on P.
//
// Tolerance: the sharded state is the single-process one with its sums split by rank and merged
// by the online-softmax rule, a handful of extra roundings per entry of a convex combination of
// values (|v| <= ~4 here): at most a few ulps of double, checked at 1e-6 relative to max|out|,
// and in double at 1e-12; a lost or doubled key, or a wrong exact range, is O(0.01) or more.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

#include <randattn/mpi/kv_cache.hpp>

#include "support.hpp"

using namespace mpitest;
using randattn::DecodeMode;
using randattn::DecodeReport;
using randattn::KvCache;
using randattn::KvCacheOptions;
using randattn::mpi::ShardedKvCache;

namespace {

constexpr Index kD = 12, kDv = 6, kKvHeads = 2, kQHeads = 4, kTokens = 103;

double rel_diff(const RowMatrix<double>& a, const RowMatrix<double>& b) {
  return (a - b).cwiseAbs().maxCoeff() / std::max(1.0, b.cwiseAbs().maxCoeff());
}

// Fills both caches with the same tokens: a prompt block, then single tokens, then a block.
template <typename Cache>
void fill(Cache& cache, const RowMatrix<double>& k, const RowMatrix<double>& v) {
  const Index n = k.rows() / kKvHeads;
  using S = typename Cache::Scalar;
  const auto part = [&](Index first, Index count) {
    RowMatrix<S> kb(kKvHeads * count, kD), vb(kKvHeads * count, kDv);
    for (Index h = 0; h < kKvHeads; ++h) {
      kb.middleRows(h * count, count) = k.middleRows(h * n + first, count).template cast<S>();
      vb.middleRows(h * count, count) = v.middleRows(h * n + first, count).template cast<S>();
    }
    cache.append(kb, vb);
  };
  part(0, 40);
  for (Index i = 40; i < 50; ++i) part(i, 1);
  part(50, n - 50);
}

struct Data {
  RowMatrix<double> k = gaussian<double>(11, kKvHeads * kTokens, kD);
  RowMatrix<double> v = gaussian<double>(12, kKvHeads * kTokens, kDv);
  RowMatrix<double> q = gaussian<double>(13, kQHeads, kD, 2.0);
};

void check_equal(Communicator& comm, KvCacheOptions opt, double tol, bool same_keys) {
  const Data data;
  KvCache<double> single(kD, kDv, kKvHeads, opt);
  ShardedKvCache<double> sharded(comm, kD, kDv, kKvHeads, opt, /*shard_tokens=*/7);
  fill(single, data.k, data.v);
  fill(sharded, data.k, data.v);
  REQUIRE(sharded.size() == kTokens);
  Index held = sharded.local().size();
  comm.allreduce(&held, 1, MPI_SUM);
  CHECK(held == kTokens);

  DecodeReport one, mine;
  const RowMatrix<double> expected = single.attend(data.q, &one);
  const RowMatrix<double> got = sharded.attend(data.q, &mine);
  CHECK(all_ranks(comm, rel_diff(got, expected) <= tol));
  if (same_keys) {  // the ranks together score exactly the single-process keys
    Index scored[2] = {mine.exact_keys, mine.retrieved_keys};
    comm.allreduce(scored, 2, MPI_SUM);
    CHECK(scored[0] == one.exact_keys);
    CHECK(scored[1] == one.retrieved_keys);
  }
}

}  // namespace

TEST_CASE("Sharded KvCache: exact mode equals the single-process cache", "[mpi][kv_cache]") {
  Communicator comm;
  KvCacheOptions opt;
  check_equal(comm, opt, 1e-12, true);
  // Compressed storage: each rank holds its tokens' rows as the single cache holds them.
  for (const randattn::KvStorage storage : {randattn::KvStorage::bfloat16, randattn::KvStorage::int8}) {
    KvCacheOptions stored = opt;
    stored.storage = storage;
    check_equal(comm, stored, 1e-12, true);
  }

  // float, against the double reference: within 1e-6.
  const Data data;
  ShardedKvCache<float> sharded(comm, kD, kDv, kKvHeads, opt, 7);
  fill(sharded, data.k, data.v);
  // The float cache rounds the inputs, so compare with a double cache of the rounded data.
  KvCache<double> rounded(kD, kDv, kKvHeads, opt);
  fill(rounded, RowMatrix<double>(data.k.cast<float>().cast<double>()),
       RowMatrix<double>(data.v.cast<float>().cast<double>()));
  const RowMatrix<float> qf = data.q.cast<float>();
  const RowMatrix<double> got = sharded.attend(qf).cast<double>();
  CHECK(all_ranks(comm, rel_diff(got, rounded.attend(qf.cast<double>())) <= 1e-6));
}

TEST_CASE("Sharded KvCache: lsh_sample and lsf retrieve what the single process retrieves",
          "[mpi][kv_cache]") {
  Communicator comm;
  KvCacheOptions lsh;
  lsh.mode = DecodeMode::lsh_sample;
  lsh.sinks = 3;
  lsh.window = 9;
  lsh.lsh_bits = 3;
  lsh.lsh_tables = 12;
  lsh.seed = 5;
  lsh.lsh_hash_block = 7;  // a divisor of shard_tokens: blocks of global positions
  check_equal(comm, lsh, 1e-12, true);
  lsh.key_centre = RowMatrix<double>::Constant(1, kD, 0.25);
  check_equal(comm, lsh, 1e-12, true);

  KvCacheOptions lsf;
  lsf.mode = DecodeMode::lsf;
  lsf.sinks = 2;
  lsf.window = 10;
  lsf.lsf_filters = 8;
  lsf.lsf_tables = 3;
  lsf.lsf_alpha = 0.7;
  lsf.seed = 9;
  check_equal(comm, lsf, 1e-12, true);
  lsf.storage = randattn::KvStorage::int8;
  check_equal(comm, lsf, 1e-12, true);
}

TEST_CASE("Sharded KvCache: retrieving everything is exact decoding", "[mpi][kv_cache]") {
  Communicator comm;
  const Data data;
  KvCache<double> exact(kD, kDv, kKvHeads);
  fill(exact, data.k, data.v);
  const RowMatrix<double> expected = exact.attend(data.q);

  KvCacheOptions blocks;
  blocks.mode = DecodeMode::blocks;
  blocks.sinks = 4;
  blocks.window = 8;
  blocks.page_size = 7;
  blocks.top_pages = kTokens;  // every page of every rank
  KvCacheOptions lsh;
  lsh.mode = DecodeMode::lsh_sample;
  lsh.sinks = 1;
  lsh.window = 5;
  lsh.lsh_bits = 0;  // every key collides in every table: p = 1
  lsh.lsh_hash_block = 7;
  KvCacheOptions lsf;
  lsf.mode = DecodeMode::lsf;
  lsf.sinks = 0;
  lsf.window = 3;
  lsf.lsf_threshold = -std::numeric_limits<double>::infinity();
  for (const KvCacheOptions& opt : {blocks, lsh, lsf}) {
    ShardedKvCache<double> sharded(comm, kD, kDv, kKvHeads, opt, 7);
    fill(sharded, data.k, data.v);
    DecodeReport rep;
    CHECK(all_ranks(comm, rel_diff(sharded.attend(data.q, &rep), expected) <= 1e-12));
    Index scored = rep.keys_scored();
    comm.allreduce(&scored, 1, MPI_SUM);
    CHECK(scored == kQHeads * kTokens);
  }
}

TEST_CASE("Sharded KvCache: blocks attends to each rank's top pages", "[mpi][kv_cache]") {
  // No sinks or window and one page per rank: the result is exact softmax over the union of
  // the ranks' chosen pages (recorded per rank in local indices, mapped to global positions).
  Communicator comm;
  const Data data;
  KvCacheOptions opt;
  opt.mode = DecodeMode::blocks;
  opt.sinks = 0;
  opt.window = 0;
  opt.page_size = 7;
  opt.top_pages = 1;
  ShardedKvCache<double> sharded(comm, kD, kDv, kKvHeads, opt, 7);
  fill(sharded, data.k, data.v);
  DecodeReport rep;
  rep.record_keys = true;
  const RowMatrix<double> out = sharded.attend(data.q, &rep);
  CHECK(all_ranks(comm, rep.pages_opened == (sharded.local().size() > 0 ? kQHeads : 0)));
  const Index group = kQHeads / kKvHeads;
  for (Index i = 0; i < kQHeads; ++i) {
    std::vector<Index> mine;
    for (const std::int32_t j : rep.scored_keys[std::size_t(i)]) mine.push_back(sharded.position(j));
    const std::vector<Index> keys = comm.allgatherv(mine);
    CHECK(keys.size() >= std::size_t(comm.size()));  // one page (1..7 tokens) per rank
    CHECK(keys.size() <= std::size_t(7 * comm.size()));
    const Index h = i / group;
    const double scale = 1 / std::sqrt(double(kD));
    double c = -1e300;
    for (const Index j : keys) c = std::max(c, scale * data.q.row(i).dot(data.k.row(h * kTokens + j)));
    RowMatrix<double> num = RowMatrix<double>::Zero(1, kDv);
    double den = 0;
    for (const Index j : keys) {
      const double w = std::exp(scale * data.q.row(i).dot(data.k.row(h * kTokens + j)) - c);
      num += w * data.v.row(h * kTokens + j);
      den += w;
    }
    CHECK(all_ranks(comm, rel_diff(out.row(i), num / den) <= 1e-12));
  }
}

TEST_CASE("Sharded KvCache: errors are collective and leave the cache unchanged",
          "[mpi][kv_cache]") {
  Communicator comm;
  const Data data;
  ShardedKvCache<double> sharded(comm, kD, kDv, kKvHeads, {}, 7);
  CHECK_THROWS_WITH(sharded.attend(data.q), Catch::Contains("empty"));
  fill(sharded, data.k, data.v);
  const RowMatrix<double> before = sharded.attend(data.q);
  CHECK_THROWS_WITH(sharded.append(RowMatrix<double>::Zero(3, kD), RowMatrix<double>::Zero(3, kDv)),
                    Catch::Contains("multiple of kv_heads"));
  CHECK_THROWS_WITH(sharded.append(RowMatrix<double>::Zero(2, kD + 1), RowMatrix<double>::Zero(2, kDv)),
                    Catch::Contains("head_dim"));
  RowMatrix<double> nan = RowMatrix<double>::Zero(2 * kKvHeads, kD);
  nan(3, 1) = std::numeric_limits<double>::quiet_NaN();  // a token held by one rank only
  CHECK_THROWS(sharded.append(nan, RowMatrix<double>::Zero(2 * kKvHeads, kDv)));
  CHECK_THROWS_WITH(sharded.attend(data.q.topRows(3)), Catch::Contains("multiple of kv_heads"));
  CHECK(sharded.size() == kTokens);
  CHECK(all_ranks(comm, (sharded.attend(data.q) - before).cwiseAbs().maxCoeff() == 0));

  KvCacheOptions lsh;
  lsh.mode = DecodeMode::lsh_sample;
  lsh.lsh_hash_block = 4;
  CHECK_THROWS_WITH(ShardedKvCache<double>(comm, kD, kDv, kKvHeads, lsh, 7),
                    Catch::Contains("lsh_hash_block"));
  CHECK_THROWS_WITH(ShardedKvCache<double>(comm, kD, kDv, kKvHeads, {}, 0),
                    Catch::Contains("shard_tokens"));
}

namespace {

// One path for every rank (rank 0's pid), different between concurrent runs.
std::string shared_path(Communicator& comm, const std::string& name) {
  std::int64_t pid = comm.rank() == 0 ? std::int64_t(::getpid()) : 0;
  comm.allreduce(&pid, 1, MPI_MAX);
  return "/tmp/randattn_mpi_kv_cache_" + std::to_string(pid) + "_" + name;
}

template <typename S>
bool same_bits(const RowMatrix<S>& a, const RowMatrix<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(S) * std::size_t(a.size())) == 0;
}

void remove_files(Communicator& comm, const std::string& path) {
  MPI_Barrier(comm.get());
  std::remove((path + "." + std::to_string(comm.rank())).c_str());
  MPI_Barrier(comm.get());
}

}  // namespace

TEST_CASE("Sharded KvCache: centring by the first tokens equals the single process",
          "[mpi][kv_cache]") {
  // The first centre_tokens tokens are spread over the ranks (shards of 7); every rank fixes
  // the mean of all of them, when the sequence reaches them: inside the first block (20), among
  // the single tokens (45), inside the last block (60).
  Communicator comm;
  const Data data;
  for (const Index ct : {Index(20), Index(45), Index(60)}) {
    KvCacheOptions lsh;
    lsh.mode = DecodeMode::lsh_sample;
    lsh.sinks = 3;
    lsh.window = 9;
    lsh.lsh_bits = 3;
    lsh.lsh_tables = 12;
    lsh.seed = 5;
    lsh.lsh_hash_block = 7;
    lsh.centre_tokens = ct;
    KvCacheOptions lsf;
    lsf.mode = DecodeMode::lsf;
    lsf.sinks = 2;
    lsf.window = 10;
    lsf.lsf_filters = 8;
    lsf.lsf_tables = 3;
    lsf.lsf_alpha = 0.7;
    lsf.centre_tokens = ct;
    for (const KvCacheOptions& opt : {lsh, lsf}) {
      INFO("mode " << randattn::to_string(opt.mode) << ", centre_tokens " << ct);
      check_equal(comm, opt, 1e-12, true);
      KvCache<double> single(kD, kDv, kKvHeads, opt);
      ShardedKvCache<double> sharded(comm, kD, kDv, kKvHeads, opt, 7);
      fill(single, data.k, data.v);
      fill(sharded, data.k, data.v);
      bool same = sharded.local().key_centre_fixed();
      for (Index h = 0; h < kKvHeads; ++h)
        same = same && (sharded.local().key_centre(h) - single.key_centre(h)).cwiseAbs().maxCoeff() == 0;
      CHECK(all_ranks(comm, same));
    }
  }
  // Before the sequence reaches centre_tokens nothing is indexed: every key exact.
  KvCacheOptions pending;
  pending.mode = DecodeMode::lsh_sample;
  pending.lsh_hash_block = 7;
  pending.centre_tokens = 200;
  ShardedKvCache<double> sharded(comm, kD, kDv, kKvHeads, pending, 7);
  fill(sharded, data.k, data.v);
  DecodeReport rep;
  sharded.attend(data.q, &rep);
  Index retrieved = rep.retrieved_keys;
  comm.allreduce(&retrieved, 1, MPI_SUM);
  CHECK(retrieved == 0);
}

TEST_CASE("Sharded KvCache: save/load round trip is bit-identical", "[mpi][kv_cache]") {
  Communicator comm;
  const Data data;
  const std::string path = shared_path(comm, "roundtrip");
  KvCacheOptions blocks;
  blocks.mode = DecodeMode::blocks;
  blocks.sinks = 2;
  blocks.window = 6;
  blocks.page_size = 7;
  blocks.top_pages = 2;
  KvCacheOptions lsh;
  lsh.mode = DecodeMode::lsh_sample;
  lsh.sinks = 3;
  lsh.window = 9;
  lsh.lsh_bits = 3;
  lsh.lsh_tables = 12;
  lsh.lsh_hash_block = 7;
  lsh.centre_tokens = 45;  // fixed before the save
  KvCacheOptions pending = lsh;
  pending.centre_tokens = 120;  // still pending at the save, fixed after it
  KvCacheOptions lsf;
  lsf.mode = DecodeMode::lsf;
  lsf.lsf_filters = 8;
  lsf.lsf_tables = 3;
  lsf.key_centre = RowMatrix<double>::Constant(1, kD, 0.25);
  const RowMatrix<double> more_k = gaussian<double>(21, kKvHeads * 30, kD);
  const RowMatrix<double> more_v = gaussian<double>(22, kKvHeads * 30, kDv);
  for (const KvCacheOptions& opt : {KvCacheOptions{}, blocks, lsh, pending, lsf}) {
    INFO("mode " << randattn::to_string(opt.mode) << ", centre_tokens " << opt.centre_tokens);
    ShardedKvCache<double> original(comm, kD, kDv, kKvHeads, opt, 7);
    fill(original, data.k, data.v);
    original.save(path);
    ShardedKvCache<double> loaded = ShardedKvCache<double>::load(comm, path);
    remove_files(comm, path);
    CHECK(loaded.size() == original.size());
    CHECK(loaded.shard_tokens() == 7);
    CHECK(all_ranks(comm, loaded.local().size() == original.local().size()));
    CHECK(all_ranks(comm, same_bits(loaded.attend(data.q), original.attend(data.q))));
    // Both grow alike (the pending centre is fixed inside this block).
    original.append(more_k, more_v);
    loaded.append(more_k, more_v);
    CHECK(all_ranks(comm, same_bits(loaded.attend(data.q), original.attend(data.q))));
    CHECK(all_ranks(comm, loaded.local().key_centre_fixed() == original.local().key_centre_fixed()));
  }
  // float too
  ShardedKvCache<float> f(comm, kD, kDv, kKvHeads, lsh, 7);
  fill(f, data.k, data.v);
  f.save(path);
  const auto g = ShardedKvCache<float>::load(comm, path);
  remove_files(comm, path);
  const RowMatrix<float> qf = data.q.cast<float>();
  CHECK(all_ranks(comm, same_bits(g.attend(qf), f.attend(qf))));
}

TEST_CASE("Sharded KvCache: load refuses corrupt, missing and mismatched files on every rank",
          "[mpi][kv_cache]") {
  Communicator comm;
  const Data data;
  const std::string path = shared_path(comm, "bad");
  const std::string mine = path + "." + std::to_string(comm.rank());
  ShardedKvCache<double> cache(comm, kD, kDv, kKvHeads, {}, 7);
  fill(cache, data.k, data.v);
  const auto refused = [&](const std::string& p, const std::string& text) {
    std::string message;
    try {
      ShardedKvCache<double>::load(comm, p);
    } catch (const std::invalid_argument& e) {
      message = e.what();
    }
    INFO("message: " << message);
    // The same message on every rank.
    std::vector<char> all = comm.allgatherv(std::vector<char>(message.begin(), message.end()));
    const std::string joined(all.begin(), all.end());
    std::string repeated;
    for (int r = 0; r < comm.size(); ++r) repeated += message;
    return all_ranks(comm, message.find(text) != std::string::npos && joined == repeated);
  };
  CHECK(refused(shared_path(comm, "never_saved"), "cannot open"));

  const auto read_all = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const auto write_all = [](const std::string& p, const std::string& bytes) {
    std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  };
  cache.save(path);
  const std::string good = read_all(mine);
  // One rank's file corrupted (a flipped byte in its keys), then truncated.
  const int last = comm.size() - 1;
  if (comm.rank() == last) {
    std::string bad = good;
    bad[bad.size() / 2] ^= 0x10;
    write_all(mine, bad);
  }
  MPI_Barrier(comm.get());
  CHECK(refused(path, "checksum"));
  if (comm.rank() == last) write_all(mine, good.substr(0, good.size() - 100));
  MPI_Barrier(comm.get());
  CHECK(refused(path, "corrupt or truncated"));
  if (comm.rank() == last) write_all(mine, good);
  MPI_Barrier(comm.get());
  // A header claiming another rank count.
  if (comm.rank() == 0) {
    std::string other = good;
    other[12] = char(comm.size() + 1);
    write_all(mine, other);
  }
  MPI_Barrier(comm.get());
  CHECK(refused(path, "was saved by " + std::to_string(comm.size() + 1) + " ranks"));
  if (comm.rank() == 0) write_all(mine, good);
  MPI_Barrier(comm.get());
  CHECK(all_ranks(comm, same_bits(ShardedKvCache<double>::load(comm, path).attend(data.q),
                                  cache.attend(data.q))));
  if (comm.size() > 1) {
    // Loaded on fewer ranks: the first P - 1 ranks in one communicator, the last alone.
    MPI_Comm part;
    MPI_Comm_split(comm.get(), comm.rank() == last ? 1 : 0, comm.rank(), &part);
    {
      Communicator sub(part);
      std::string message;
      try {
        ShardedKvCache<double>::load(sub, path);
      } catch (const std::invalid_argument& e) {
        message = e.what();
      }
      INFO("message: " << message);
      CHECK(all_ranks(comm, message.find("was saved by " + std::to_string(comm.size()) +
                                         " ranks; load it on " + std::to_string(comm.size()) +
                                         " ranks, not " + std::to_string(sub.size())) !=
                                std::string::npos));
    }
    MPI_Comm_free(&part);
    // Files of two saves mixed: rank 1's file from another cache.
    const std::string other = shared_path(comm, "other");
    ShardedKvCache<double> second(comm, kD, kDv, kKvHeads, {}, 7);
    fill(second, data.k, data.v);
    second.save(other);
    if (comm.rank() == 1) write_all(mine, read_all(other + ".1"));
    MPI_Barrier(comm.get());
    CHECK(refused(path, "different saves"));
    remove_files(comm, other);
  }
  remove_files(comm, path);
}
