// The core's public entry points driven by fuzzed shapes, options and values (NaN, Inf,
// denormals, huge and tiny magnitudes included). Every call either throws
// std::invalid_argument or returns a result of the right shape with finite entries; softmax
// outputs are convex combinations of the value rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include <randattn/randattn.hpp>

#include "fuzz_helpers.hpp"

namespace {

using randattn::Index;
using randattn::RowMatrix;
using randattn::Vector;

using fuzzing::consume_matrix;
using fuzzing::consume_value;
using fuzzing::require_convex;

template <typename Scalar>
void run(FuzzedDataProvider& in) {
  const int entry = in.ConsumeIntegralInRange(0, 4);
  const int mode = in.ConsumeIntegralInRange(0, 2);
  const Index n_q = in.ConsumeIntegralInRange(0, 40), n_k = in.ConsumeIntegralInRange(0, 40);
  const Index d = in.ConsumeIntegralInRange(0, 9), dv = in.ConsumeIntegralInRange(0, 5);
  const bool causal = in.ConsumeBool();
  const RowMatrix<Scalar> q = consume_matrix<Scalar>(in, n_q, d, mode);
  const RowMatrix<Scalar> k = consume_matrix<Scalar>(in, n_k, d, mode);
  const RowMatrix<Scalar> v = consume_matrix<Scalar>(in, n_k, dv, mode);
  try {
    switch (entry) {
      case 0: {  // exact, tiled and naive
        randattn::ExactOptions opt;
        opt.causal = causal;
        if (in.ConsumeBool()) opt.scale = in.ConsumeFloatingPoint<double>();
        opt.block_size = in.ConsumeIntegralInRange<Index>(-1, 300);
        const bool naive = in.ConsumeBool();
        const RowMatrix<Scalar> out = naive ? randattn::naive_attention(q, k, v, opt)
                                            : randattn::exact_attention(q, k, v, opt);
        FUZZ_REQUIRE(out.rows() == n_q && out.cols() == dv && out.allFinite());
        require_convex(out, v, false);
        break;
      }
      case 1: {  // linear core on nonnegative features with log-scales: a convex combination
        randattn::LinearOptions opt;
        opt.causal = causal;
        opt.block_size = in.ConsumeIntegralInRange<Index>(-1, 50);
        // The additive guard (eps > 0) moves small positive denominators, so only eps = 0 keeps
        // nonnegative weights an exact convex combination.
        const bool guarded = in.ConsumeBool();
        opt.denominator_epsilon = guarded ? 1e-6 : 0.0;
        randattn::ScaledFeatures<Scalar> qf{q.cwiseAbs(), Vector<Scalar>()};
        randattn::ScaledFeatures<Scalar> kf{k.cwiseAbs(), Vector<Scalar>()};
        if (in.ConsumeBool()) qf.log_scale = consume_matrix<Scalar>(in, n_q, 1, mode).col(0);
        if (in.ConsumeBool()) kf.log_scale = consume_matrix<Scalar>(in, n_k, 1, mode).col(0);
        const RowMatrix<Scalar> out = randattn::linear_attention(qf, kf, v, opt);
        FUZZ_REQUIRE(out.rows() == n_q && out.cols() == dv && out.allFinite());
        if (!guarded) require_convex(out, v, true);
        break;
      }
      case 2: {  // linear core with signed features and the denominator guard
        randattn::LinearOptions opt;
        opt.causal = causal;
        opt.block_size = in.ConsumeIntegralInRange<Index>(0, 50);
        Vector<Scalar> signs(d);
        for (Index i = 0; i < d; ++i) signs(i) = in.ConsumeBool() ? Scalar(1) : Scalar(-1);
        const randattn::ScaledFeatures<Scalar> qf{q, Vector<Scalar>()}, kf{k, Vector<Scalar>()};
        const RowMatrix<Scalar> out = randattn::linear_attention(qf, kf, v, opt, signs);
        FUZZ_REQUIRE(out.rows() == n_q && out.cols() == dv && out.allFinite());
        break;
      }
      case 3: {  // streaming decoder
        randattn::LinearDecoderState<Scalar> state(d, dv);
        for (Index t = 0; t < std::min(n_q, n_k); ++t) {
          state.append(k.row(t).cwiseAbs(), v.row(t), consume_value<Scalar>(in, mode));
          const Scalar q_log = consume_value<Scalar>(in, mode);
          RowMatrix<Scalar> out(1, dv);
          if (t % 2 == 0) {
            out = state.query(q.row(t).cwiseAbs(), q_log);
          } else {
            state.query_into(q.row(t).cwiseAbs(), q_log, out);
          }
          FUZZ_REQUIRE(out.allFinite());
        }
        break;
      }
      default: {  // batched exact attention over (batch, heads) slices cut from the same data
        randattn::BatchShape shape;
        shape.batch = in.ConsumeIntegralInRange<Index>(0, 2);
        shape.heads = in.ConsumeIntegralInRange<Index>(1, 2);
        const Index s = std::max<Index>(shape.slices(), 1);
        shape.n_q = n_q / s;
        shape.n_k = n_k / s;
        shape.d = d;
        shape.dv = dv;
        randattn::ExactOptions opt;
        opt.causal = causal;
        RowMatrix<Scalar> out(shape.slices() * shape.n_q, dv);
        randattn::exact_attention_batched<Scalar>(q.data(), k.data(), v.data(), out.data(), shape,
                                                  opt);
        FUZZ_REQUIRE(out.allFinite());
        break;
      }
    }
  } catch (const std::invalid_argument&) {
  }
}

}  // namespace

RANDATTN_FUZZ_FLOAT_AND_DOUBLE(run)
