// Tensor sparsification (every scheme), sketched HOSVD and sparse-score attention driven by
// fuzzed orders, dimensions, budgets, ranks and values. Every call either throws
// std::invalid_argument or returns a sketch whose entries lie inside the tensor, finite factors
// with orthonormal columns, and finite attention output. A sketch of scheme spa streamed in
// blocks of a fuzzed size equals the in-memory one bit for bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include <randattn/randattn.hpp>

#include "fuzz_helpers.hpp"

namespace {

using randattn::Index;

template <typename Scalar>
void run(FuzzedDataProvider& in) {
  const int mode = in.ConsumeIntegralInRange(0, 2);
  const int order = in.ConsumeIntegralInRange(1, 4);
  std::vector<Index> dims(static_cast<std::size_t>(order));
  Index size = 1;
  for (Index& dim : dims) {
    dim = in.ConsumeIntegralInRange<Index>(0, 7);
    size *= dim;
  }
  randattn::SparsifyOptions opt;
  opt.budget = in.ConsumeBool() ? in.ConsumeFloatingPoint<double>()
                                : in.ConsumeFloatingPointInRange<double>(0, 400);
  opt.scheme = static_cast<randattn::SparsifyScheme>(in.ConsumeIntegralInRange(0, 3));
  opt.seed = in.ConsumeIntegral<std::uint32_t>();
  const int entry = in.ConsumeIntegralInRange(0, 2);
  fuzzing::context = "order " + std::to_string(order) + " size " + std::to_string(size) +
                     " budget " + std::to_string(opt.budget) + " entry " + std::to_string(entry);
  std::vector<Scalar> data(static_cast<std::size_t>(size));
  for (Scalar& x : data) x = fuzzing::consume_value<Scalar>(in, mode);
  try {
    const auto view = randattn::tensor_view(data.data(), dims);
    switch (entry) {
      case 0: {
        const auto sketch = randattn::sparsify(view, opt);
        FUZZ_REQUIRE(sketch.indices().size() == sketch.values().size());
        for (std::size_t e = 0; e < sketch.indices().size(); ++e) {
          FUZZ_REQUIRE(sketch.indices()[e] >= 0 && sketch.indices()[e] < size);
          FUZZ_REQUIRE(std::isfinite(double(sketch.values()[e])));
        }
        if (opt.scheme == randattn::SparsifyScheme::spa) {
          const Index block = in.ConsumeIntegralInRange<Index>(1, 300);
          randattn::StreamingSparsifier<Scalar> stream(dims, opt);
          for (int pass = 0; pass < 2; ++pass) {
            for (Index pos = 0; pos < size; pos += block) {
              const Index len = std::min(block, size - pos);
              pass == 0 ? stream.add_norm_block(data.data() + pos, len)
                        : stream.add_sample_block(data.data() + pos, len);
            }
          }
          const auto streamed = stream.finish();
          FUZZ_REQUIRE(streamed.indices() == sketch.indices() &&
                       streamed.values() == sketch.values());
          FUZZ_REQUIRE(streamed.stats.expected_nnz == sketch.stats.expected_nnz);
        }
        break;
      }
      case 1: {
        std::vector<Index> ranks;
        for (std::size_t j = 0; j < dims.size(); ++j)
          ranks.push_back(in.ConsumeIntegralInRange<Index>(0, 4));
        opt.scheme = randattn::SparsifyScheme::spa;
        const auto h = randattn::sketched_hosvd(view, ranks, opt);
        for (const auto& u : h.factors) {
          FUZZ_REQUIRE(u.allFinite());
          const randattn::RowMatrix<double> gram =
              u.template cast<double>().transpose() * u.template cast<double>();
          FUZZ_REQUIRE((gram - randattn::RowMatrix<double>::Identity(gram.rows(), gram.cols()))
                           .cwiseAbs()
                           .maxCoeff() < 1e-3);
        }
        break;
      }
      default: {  // sparse-score attention on a nonnegative score matrix
        if (order != 2) break;
        for (Scalar& x : data) x = std::abs(x);
        const auto sketch = randattn::sparsify(view, opt);
        const Index dv = in.ConsumeIntegralInRange<Index>(0, 3);
        const auto v = fuzzing::consume_matrix<Scalar>(in, dims[1], dv, mode);
        const auto out = randattn::sparse_score_accumulate(sketch, v).finalize();
        FUZZ_REQUIRE(out.rows() == dims[0] && out.cols() == dv && out.allFinite());
        break;
      }
    }
  } catch (const std::invalid_argument&) {
  }
}

}  // namespace

RANDATTN_FUZZ_FLOAT_AND_DOUBLE(run)
