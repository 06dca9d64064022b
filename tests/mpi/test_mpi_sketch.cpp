// Sharded sparsification is the single-process sparsify bit for bit (same norm, same
// probabilities, same counter-based draws); sharded sketched HOSVD matches sketched_hosvd up to
// the rounding of the summed mode products.

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include <randattn/mpi/sparsify.hpp>

#include "support.hpp"

using namespace mpitest;

namespace {

// Three chunks of 2^15 entries and a partial one: at 2 and 3 ranks every rank holds whole chunks
// and the last also the partial chunk.
const std::vector<Index> kDims{40, 53, 50};

template <typename Scalar>
randattn::SyntheticTensor<Scalar> test_tensor() {
  randattn::SyntheticOptions opt;
  opt.noise = 0.3;
  opt.spikes = 20;
  opt.spike_size = 0.5;
  return randattn::low_rank_plus_noise<Scalar>(kDims, {3, 3, 3}, opt, 5);
}

}  // namespace

TEMPLATE_TEST_CASE("Sharded sparsify equals sparsify bit for bit", "[mpi][sketch]", float, double) {
  using Scalar = TestType;
  Communicator comm;
  const auto a = test_tensor<Scalar>();
  randattn::SparsifyOptions opt;
  opt.budget = 4000;
  opt.seed = 9;
  const randattn::SparseSketch<Scalar> ref = randattn::sparsify(a.view(), opt);
  const auto range = randattn::mpi::sketch_range(a.data.size(), comm.rank(), comm.size());
  const randattn::SparseSketch<Scalar> mine =
      randattn::mpi::sparsify(comm, kDims, a.data.data() + range.first, range.count, opt);
  const std::vector<Index> indices = comm.allgatherv(mine.indices());
  const std::vector<Scalar> values = comm.allgatherv(mine.values());
  REQUIRE(indices == ref.indices());
  REQUIRE(values.size() == ref.values().size());
  REQUIRE(std::memcmp(values.data(), ref.values().data(), values.size() * sizeof(Scalar)) == 0);
  REQUIRE(mine.stats.frobenius_norm == ref.stats.frobenius_norm);
  REQUIRE(mine.stats.expected_nnz == ref.stats.expected_nnz);
}

TEMPLATE_TEST_CASE("Sharded sketched HOSVD matches sketched_hosvd", "[mpi][sketch]", float,
                   double) {
  using Scalar = TestType;
  Communicator comm;
  // A clear spectral gap: weak noise and a budget that keeps most entries.
  randattn::SyntheticOptions synth;
  synth.noise = 0.05;
  const auto a = randattn::low_rank_plus_noise<Scalar>(kDims, {3, 3, 3}, synth, 6);
  const std::vector<Index> ranks{3, 3, 3};
  randattn::SparsifyOptions opt;
  opt.budget = 60000;
  opt.seed = 4;
  const randattn::SketchedHosvd<Scalar> ref = randattn::sketched_hosvd(a.view(), ranks, opt);
  const auto range = randattn::mpi::sketch_range(a.data.size(), comm.rank(), comm.size());
  const randattn::SketchedHosvd<Scalar> mine = randattn::mpi::sketched_hosvd(
      comm, kDims, a.data.data() + range.first, range.count, ranks, opt);
  REQUIRE(mine.nnz == ref.nnz);
  for (std::size_t j = 0; j < kDims.size(); ++j) {
    // The mode products differ only by the order of their sums (over ranks, then columns): an
    // error E of a few eps ||N|| (float: ~1e-7 relative). By Davis-Kahan sin-Theta <= ||E|| / gap,
    // and with weak noise the gap after the third eigenvalue is a sizeable fraction of ||N||.
    const double s = randattn::sin_theta_distance(mine.factors[j], ref.factors[j]);
    CAPTURE(j, s);
    REQUIRE(all_ranks(comm, s <= 1e-5));
  }
}

TEST_CASE("A non-finite entry on one rank's range fails every rank", "[mpi][sketch][errors]") {
  Communicator comm;
  auto a = test_tensor<double>();
  a.data(a.data.size() - 1) = std::numeric_limits<double>::infinity();  // on the last rank
  randattn::SparsifyOptions opt;
  opt.budget = 100;
  const auto range = randattn::mpi::sketch_range(a.data.size(), comm.rank(), comm.size());
  std::string message;
  try {
    randattn::mpi::sparsify(comm, kDims, a.data.data() + range.first, range.count, opt);
  } catch (const randattn::invalid_argument& e) {  // the collective error type
    message = e.what();
  }
  REQUIRE(all_ranks(comm, message.find("non-finite entry at (39, 52, 49)") != std::string::npos));
}
