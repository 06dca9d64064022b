// Distributed attention equals single-process attention on the same global inputs, for any
// number of ranks (the ctest cases run this binary at 1, 2 and 3 ranks; n is never divisible by
// 2 or 3, so the splits are uneven).
//
// Tolerances: the distributed results differ from the single-process ones only in the order in
// which partial sums are merged (tiles aligned to the shards, summaries summed by rank, then by
// chunk). Each merge rounds once, a handful of merges per row, and each sum over at most n terms
// of magnitude <= max|v|: the relative error is a few tens of ulps at most, far below 1e-5 in
// float (eps 6e-8) and 1e-12 in double (eps 1.1e-16); a wrong mask or a lost block is O(1).

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include <randattn/mpi/lsh_attention.hpp>
#include <randattn/mpi/random_feature_attention.hpp>
#include <randattn/mpi/ring_attention.hpp>

#include "support.hpp"

using namespace mpitest;

namespace {

template <typename Scalar>
double tolerance() {
  return std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
}

// The message every rank threw, or "" when no rank threw; requires that all ranks agree.
template <typename Fn>
std::string collective_error(Communicator& comm, Fn&& fn) {
  std::string message;
  try {
    fn();
  } catch (const randattn::invalid_argument& e) {  // the collective error type
    message = e.what();
  }
  const std::vector<char> mine(message.begin(), message.end());
  const std::vector<char> all = comm.allgatherv(std::vector<char>{char(message.empty() ? 0 : 1)});
  for (char c : all) REQUIRE(c == all[0]);  // every rank threw, or none did
  const std::vector<Index> lengths = comm.allgatherv(std::vector<Index>{Index(message.size())});
  for (Index l : lengths) REQUIRE(l == lengths[0]);
  return message;
}

}  // namespace

TEMPLATE_TEST_CASE("Ring attention equals exact attention, contiguous and zig-zag, causal or not",
                   "[mpi][ring]", float, double) {
  using Scalar = TestType;
  Communicator comm;
  const Index n = 37, d = 8, dv = 5;
  const RowMatrix<Scalar> q = gaussian<Scalar>(1, n, d), k = gaussian<Scalar>(2, n, d),
                          v = gaussian<Scalar>(3, n, dv);
  for (const RowLayout layout : {RowLayout::contiguous, RowLayout::zigzag}) {
    for (const bool causal : {false, true}) {
      CAPTURE(int(layout), causal);
      randattn::mpi::RingOptions opt;
      opt.causal = causal;
      opt.layout = layout;
      opt.block_size = 4;  // several tiles per block
      randattn::ExactOptions ref_opt;
      ref_opt.causal = causal;
      const RowMatrix<Scalar> ref = randattn::exact_attention(q, k, v, ref_opt);
      const RowMatrix<Scalar> mine = randattn::mpi::ring_attention<Scalar>(
          comm, local_rows(q, comm, layout), local_rows(k, comm, layout),
          local_rows(v, comm, layout), opt);
      REQUIRE(relative_error(comm, gather_rows(comm, mine, n, layout), ref) <= tolerance<Scalar>());
    }
  }
}

TEMPLATE_TEST_CASE("Ring attention with more keys than queries (bidirectional)", "[mpi][ring]",
                   float, double) {
  using Scalar = TestType;
  Communicator comm;
  const Index n_q = 11, n_k = 29, d = 6, dv = 3;
  const RowMatrix<Scalar> q = gaussian<Scalar>(4, n_q, d), k = gaussian<Scalar>(5, n_k, d),
                          v = gaussian<Scalar>(6, n_k, dv);
  const RowMatrix<Scalar> ref = randattn::exact_attention(q, k, v);
  const RowMatrix<Scalar> mine = randattn::mpi::ring_attention<Scalar>(
      comm, local_rows(q, comm), local_rows(k, comm), local_rows(v, comm));
  REQUIRE(relative_error(comm, gather_rows(comm, mine, n_q), ref) <= tolerance<Scalar>());
}

namespace {

template <typename Map>
void check_feature_map(const Map& map, Index n_q, Index n_k) {
  using Scalar = typename Map::Scalar;
  Communicator comm;
  const Index d = map.input_dim(), dv = 4;
  const RowMatrix<Scalar> q = gaussian<Scalar>(7, n_q, d, 0.5),
                          k = gaussian<Scalar>(8, n_k, d, 0.5), v = gaussian<Scalar>(9, n_k, dv);
  for (const bool causal : {false, true}) {
    if (causal && n_q != n_k) continue;
    CAPTURE(causal);
    randattn::RandomFeatureOptions opt;
    opt.causal = causal;
    opt.block_size = 5;  // several causal chunks per rank
    const RowMatrix<Scalar> ref = randattn::random_feature_attention(map, q, k, v, opt);
    const RowMatrix<Scalar> mine = randattn::mpi::random_feature_attention(
        comm, map, local_rows(q, comm), local_rows(k, comm), local_rows(v, comm), opt);
    REQUIRE(relative_error(comm, gather_rows(comm, mine, n_q), ref) <= tolerance<Scalar>());
  }
}

}  // namespace

TEMPLATE_TEST_CASE("Random-feature attention equals the single-process result for every map",
                   "[mpi][features]", float, double) {
  using Scalar = TestType;
  const Index d = 8, m = 16;
  SECTION("positive") {
    check_feature_map(randattn::PositiveFeatures(randattn::OrthogonalProjection<Scalar>(m, d, 3)),
                      31, 31);
  }
  SECTION("hyperbolic") {
    check_feature_map(randattn::HyperbolicFeatures(randattn::GaussianProjection<Scalar>(m, d, 4)),
                      31, 31);
  }
  SECTION("trig") {
    check_feature_map(randattn::TrigFeatures(randattn::HadamardProjection<Scalar>(m, d, 5)), 31,
                      31);
  }
  SECTION("angular hybrid") {
    check_feature_map(randattn::angular_hybrid<Scalar>(m, 4, d, 6), 31, 31);
  }
  SECTION("gaussian hybrid") {
    check_feature_map(randattn::gaussian_hybrid<Scalar>(m, 4, d, 1.0, 7), 31, 31);
  }
  SECTION("more keys than queries") {
    check_feature_map(randattn::PositiveFeatures(randattn::OrthogonalProjection<Scalar>(m, d, 8)),
                      7, 23);
  }
}

TEST_CASE("Ranks holding different feature maps fail together", "[mpi][features]") {
  Communicator comm;
  const Index n = 13, d = 4;
  const RowMatrix<float> x = gaussian<float>(10, n, d);
  // A seed that depends on the rank: the maps differ as soon as there are two ranks.
  const randattn::PositiveFeatures map(
      randattn::OrthogonalProjection<float>(8, d, 100 + comm.rank()));
  const std::string error = collective_error(comm, [&] {
    randattn::mpi::random_feature_attention(comm, map, local_rows(x, comm), local_rows(x, comm),
                                            local_rows(x, comm));
  });
  if (comm.size() == 1) {
    REQUIRE(error.empty());
  } else {
    REQUIRE(error.find("feature map") != std::string::npos);
  }
}

TEST_CASE("A non-finite entry on the last rank's slice fails every rank with one message",
          "[mpi][errors]") {
  Communicator comm;
  const Index n = 17, d = 4;
  RowMatrix<double> q = gaussian<double>(11, n, d);
  q(n - 1, 2) = std::numeric_limits<double>::quiet_NaN();  // held by the last rank
  const RowMatrix<double> ql = local_rows(q, comm), kl = local_rows(q, comm),
                          vl = local_rows(q, comm);
  const std::string ring =
      collective_error(comm, [&] { randattn::mpi::ring_attention<double>(comm, ql, kl, vl); });
  REQUIRE(ring.find("non-finite") != std::string::npos);
  const randattn::PositiveFeatures map(randattn::OrthogonalProjection<double>(8, d, 1));
  const std::string features = collective_error(
      comm, [&] { randattn::mpi::random_feature_attention(comm, map, ql, kl, vl); });
  REQUIRE(features.find("non-finite") != std::string::npos);
  const randattn::CrossPolytopeHash<double> hash(randattn::RotationKind::dense, d, 4, 2, 1);
  randattn::LshOptions lopt;
  lopt.chunk = 4;
  const std::string lsh = collective_error(
      comm, [&] { randattn::mpi::lsh_attention<double>(comm, hash, ql, vl, lopt); });
  REQUIRE(lsh.find("non-finite") != std::string::npos);
}

TEST_CASE("Local row counts that do not match the layout fail every rank", "[mpi][errors]") {
  Communicator comm;
  // Rank 0 holds one row too many for the contiguous layout (when there are two ranks or more).
  const Index rows = comm.rank() == 0 && comm.size() > 1 ? 6 : 5;
  const RowMatrix<float> x = gaussian<float>(12 + comm.rank(), rows, 3);
  const std::string error =
      collective_error(comm, [&] { randattn::mpi::ring_attention<float>(comm, x, x, x); });
  if (comm.size() == 1) {
    REQUIRE(error.empty());
  } else {
    REQUIRE(error.find("rank 0 holds 6 rows of q") != std::string::npos);
  }
}

TEMPLATE_TEST_CASE("LSH attention with many rounds (tabled pair counts) equals the single process",
                   "[mpi][lsh]", float, double) {
  // Beyond kCountTableRounds rounds both calls look the duplicate counts up in a table built once
  // (each rank only for the tokens it scores): a row missing from a rank's table would count its
  // pairs once per round instead of once, an O(1) change of the output.
  using Scalar = TestType;
  Communicator comm;
  const Index n = 53, d = 8, dv = 4, rounds = randattn::detail::kCountTableRounds + 6;
  const RowMatrix<Scalar> qk = gaussian<Scalar>(15, n, d), v = gaussian<Scalar>(16, n, dv);
  const randattn::CrossPolytopeHash<Scalar> hash(randattn::RotationKind::dense, d, 8, rounds, 23);
  for (const Index chunk : {Index(4), Index(11)}) {
    for (const bool causal : {false, true}) {
      CAPTURE(chunk, causal);
      randattn::LshOptions opt;
      opt.chunk = chunk;
      opt.causal = causal;
      const RowMatrix<Scalar> ref = randattn::lsh_attention(hash, qk, v, opt);
      const RowMatrix<Scalar> mine = randattn::mpi::lsh_attention<Scalar>(
          comm, hash, local_rows(qk, comm), local_rows(v, comm), opt);
      REQUIRE(relative_error(comm, gather_rows(comm, mine, n), ref) <= tolerance<Scalar>());
      // Without the correction the multiset differs: the comparison can tell the two apart.
      opt.dedupe = false;
      REQUIRE(relative_error(comm, gather_rows(comm, mine, n),
                             randattn::lsh_attention(hash, qk, v, opt)) > 1e-3);
    }
  }
}

TEMPLATE_TEST_CASE("LSH attention equals the single-process result for the same seed", "[mpi][lsh]",
                   float, double) {
  using Scalar = TestType;
  Communicator comm;
  const Index n = 53, d = 8, dv = 4;
  const RowMatrix<Scalar> qk = gaussian<Scalar>(13, n, d), v = gaussian<Scalar>(14, n, dv);
  for (const Index chunk : {Index(4), Index(7), Index(64)}) {
    for (const bool causal : {false, true}) {
      for (const bool dedupe : {true, false}) {
        CAPTURE(chunk, causal, dedupe);
        const randattn::CrossPolytopeHash<Scalar> hash(randattn::RotationKind::dense, d,
                                                       randattn::reformer_buckets(n, chunk), 3, 21);
        randattn::LshOptions opt;
        opt.chunk = chunk;
        opt.causal = causal;
        opt.dedupe = dedupe;
        const RowMatrix<Scalar> ref = randattn::lsh_attention(hash, qk, v, opt);
        const RowMatrix<Scalar> mine = randattn::mpi::lsh_attention<Scalar>(
            comm, hash, local_rows(qk, comm), local_rows(v, comm), opt);
        REQUIRE(relative_error(comm, gather_rows(comm, mine, n), ref) <= tolerance<Scalar>());
      }
    }
  }
}
