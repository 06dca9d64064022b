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

#include <string>

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
  const auto part = [&](Index first, Index count) {
    RowMatrix<double> kb(kKvHeads * count, kD), vb(kKvHeads * count, kDv);
    for (Index h = 0; h < kKvHeads; ++h) {
      kb.middleRows(h * count, count) = k.middleRows(h * n + first, count);
      vb.middleRows(h * count, count) = v.middleRows(h * n + first, count);
    }
    cache.append(kb, vb);
  };
  part(0, 40);
  for (Index i = 40; i < 50; ++i) part(i, 1);
  part(50, n - 50);
}

// Every rank passes; the check is reduced so all ranks agree.
bool all_ranks(Communicator& comm, bool ok) {
  int flag = ok ? 1 : 0;
  comm.allreduce(&flag, 1, MPI_MIN);
  return flag == 1;
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

  // float, against the double reference: within 1e-6.
  const Data data;
  KvCache<double> reference(kD, kDv, kKvHeads, opt);
  ShardedKvCache<float> sharded(comm, kD, kDv, kKvHeads, opt, 7);
  fill(reference, data.k, data.v);
  fill(sharded, RowMatrix<double>(data.k.cast<float>().cast<double>()),
       RowMatrix<double>(data.v.cast<float>().cast<double>()));
  // The float cache rounds the same inputs, so compare with a double cache of the rounded data.
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

  KvCacheOptions centred;
  centred.mode = DecodeMode::lsh_sample;
  centred.centre_tokens = 16;
  CHECK_THROWS_WITH(ShardedKvCache<double>(comm, kD, kDv, kKvHeads, centred),
                    Catch::Contains("centre_tokens"));
  CHECK_THROWS_WITH(ShardedKvCache<double>(comm, kD, kDv, kKvHeads, {}, 0),
                    Catch::Contains("shard_tokens"));
}
