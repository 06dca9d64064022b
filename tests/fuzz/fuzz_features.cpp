// Random-feature and hybrid attention driven by fuzzed shapes, feature counts, projections,
// options and values (NaN, Inf, denormals, huge norms included). Every call either throws
// std::invalid_argument or returns finite output of the right shape; nonnegative maps give
// convex combinations of the value rows (or, after total underflow, documented zero rows).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

#include <randattn/randattn.hpp>

#include "fuzz_helpers.hpp"

namespace {

using randattn::Index;
using randattn::RowMatrix;

using fuzzing::consume_matrix;

template <typename Map, typename Scalar = typename Map::Scalar>
void attend(FuzzedDataProvider& in, const Map& map, const RowMatrix<Scalar>& q,
            const RowMatrix<Scalar>& k, const RowMatrix<Scalar>& v) {
  randattn::RandomFeatureOptions opt;
  opt.causal = in.ConsumeBool();
  if (in.ConsumeBool()) opt.scale = in.ConsumeFloatingPoint<double>();
  if (in.ConsumeBool())
    opt.denominator_epsilon = in.ConsumeFloatingPointInRange<double>(-1e-3, 1e-3);
  opt.block_size = in.ConsumeIntegralInRange<Index>(-1, 40);
  {
    std::ostringstream c;
    c << "causal " << opt.causal << " scale " << (opt.scale ? *opt.scale : -1.0) << " eps "
      << (opt.denominator_epsilon ? *opt.denominator_epsilon : -1.0) << " block " << opt.block_size
      << "\nq\n"
      << q << "\nk\n"
      << k << "\nv\n"
      << v;
    fuzzing::context += c.str();
  }
  const RowMatrix<Scalar> out = randattn::random_feature_attention(map, q, k, v, opt);
  FUZZ_REQUIRE(out.rows() == q.rows() && out.cols() == v.cols() && out.allFinite());
  if (Map::nonnegative && !opt.denominator_epsilon)
    fuzzing::require_convex(out, v, /*zero_rows_allowed=*/true);
}

template <typename Scalar>
void run(FuzzedDataProvider& in) {
  const int map_kind = in.ConsumeIntegralInRange(0, 5);
  const int projection_kind = in.ConsumeIntegralInRange(0, 2);
  const int mode = in.ConsumeIntegralInRange(0, 2);
  const Index n = in.ConsumeIntegralInRange(0, 24), d = in.ConsumeIntegralInRange(0, 9);
  const Index dv = in.ConsumeIntegralInRange(0, 4), m = in.ConsumeIntegralInRange(0, 12);
  const std::uint64_t seed = in.ConsumeIntegral<std::uint32_t>();
  fuzzing::context = "map " + std::to_string(map_kind) + " projection " +
                     std::to_string(projection_kind) + " m " + std::to_string(m) + " seed " +
                     std::to_string(seed) + " " + (sizeof(Scalar) == 4 ? "float " : "double ");
  const RowMatrix<Scalar> q = consume_matrix<Scalar>(in, n, d, mode);
  const RowMatrix<Scalar> k = consume_matrix<Scalar>(in, n, d, mode);
  const RowMatrix<Scalar> v = consume_matrix<Scalar>(in, n, dv, mode);
  try {
    auto with_projection = [&](auto make_map) {
      switch (projection_kind) {
        case 0:
          return attend(in, make_map(randattn::GaussianProjection<Scalar>(m, d, seed)), q, k, v);
        case 1:
          return attend(in, make_map(randattn::OrthogonalProjection<Scalar>(m, d, seed)), q, k, v);
        default:
          return attend(in, make_map(randattn::HadamardProjection<Scalar>(m, d, seed)), q, k, v);
      }
    };
    switch (map_kind) {
      case 0:
        with_projection([](auto p) { return randattn::PositiveFeatures(std::move(p)); });
        break;
      case 1:
        with_projection([](auto p) { return randattn::HyperbolicFeatures(std::move(p)); });
        break;
      case 2:
        with_projection([](auto p) { return randattn::TrigFeatures(std::move(p)); });
        break;
      case 3:
        attend(in,
               randattn::angular_hybrid<Scalar>(m, in.ConsumeIntegralInRange<Index>(0, 4), d, seed),
               q, k, v);
        break;
      case 4:
        attend(in,
               randattn::gaussian_hybrid<Scalar>(m, in.ConsumeIntegralInRange<Index>(0, 4), d,
                                                 in.ConsumeFloatingPoint<double>(), seed),
               q, k, v);
        break;
      default: {  // streaming decoder of a positive map
        randattn::RandomFeatureDecoder decoder(
            randattn::PositiveFeatures(randattn::OrthogonalProjection<Scalar>(m, d, seed)), dv);
        for (Index t = 0; t < n; ++t) {
          decoder.append(k.row(t), v.row(t));
          FUZZ_REQUIRE(decoder.query(q.row(t)).allFinite());
        }
        break;
      }
    }
  } catch (const std::invalid_argument&) {
  }
}

}  // namespace

RANDATTN_FUZZ_FLOAT_AND_DOUBLE(run)
