// LSH attention (shared QK and exact buckets, dense and Hadamard rotations) driven by fuzzed
// shapes, bucket counts, chunk lengths, rounds, options and values. Every call either throws
// std::invalid_argument or returns finite convex combinations of the value rows.
#include <cstdint>
#include <stdexcept>

#include <randattn/randattn.hpp>

#include "fuzz_helpers.hpp"

namespace {

using fuzzing::consume_matrix;
using randattn::Index;
using randattn::RowMatrix;

template <typename Scalar>
void run(FuzzedDataProvider& in) {
  const int mode = in.ConsumeIntegralInRange(0, 2);
  const Index n = in.ConsumeIntegralInRange(0, 48), n_k = in.ConsumeIntegralInRange(0, 48);
  const Index d = in.ConsumeIntegralInRange(0, 9), dv = in.ConsumeIntegralInRange(0, 4);
  const Index buckets = in.ConsumeIntegralInRange(-1, 20),
              rounds = in.ConsumeIntegralInRange(-1, 5);
  const bool hadamard = in.ConsumeBool(), separate_keys = in.ConsumeBool();
  randattn::LshOptions opt;
  opt.chunk = in.ConsumeIntegralInRange<Index>(-1, 60);
  opt.exact_buckets = separate_keys || in.ConsumeBool();
  opt.causal = in.ConsumeBool();
  opt.dedupe = in.ConsumeBool();
  if (in.ConsumeBool()) opt.scale = in.ConsumeFloatingPoint<double>();
  const std::uint64_t seed = in.ConsumeIntegral<std::uint32_t>();
  fuzzing::context = "n " + std::to_string(n) + " n_k " + std::to_string(n_k) + " d " +
                     std::to_string(d) + " buckets " + std::to_string(buckets) + " rounds " +
                     std::to_string(rounds) + " chunk " + std::to_string(opt.chunk);
  const RowMatrix<Scalar> q = consume_matrix<Scalar>(in, n, d, mode);
  const RowMatrix<Scalar> k = consume_matrix<Scalar>(in, separate_keys ? n_k : n, d, mode);
  const RowMatrix<Scalar> v = consume_matrix<Scalar>(in, separate_keys ? n_k : n, dv, mode);
  try {
    const randattn::CrossPolytopeHash<Scalar> hash(
        hadamard ? randattn::RotationKind::hadamard : randattn::RotationKind::dense, d, buckets,
        rounds, seed);
    const RowMatrix<Scalar> out = separate_keys ? randattn::lsh_attention(hash, q, k, v, opt)
                                                : randattn::lsh_attention(hash, q, v, opt);
    FUZZ_REQUIRE(out.rows() == n && out.cols() == dv && out.allFinite());
    fuzzing::require_convex(out, v);
  } catch (const std::invalid_argument&) {
  }
}

}  // namespace

RANDATTN_FUZZ_FLOAT_AND_DOUBLE(run)
