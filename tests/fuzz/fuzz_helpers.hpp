#pragma once
// Shared pieces of the fuzz targets: decoding values in three magnitude regimes (bounded,
// wide, anything including NaN/Inf/denormals) and a check that prints what failed.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <randattn/core/types.hpp>

namespace fuzzing {

inline std::string context;  // what the current input exercises, printed when a check fails

#define FUZZ_REQUIRE(cond)                                                                     \
  do {                                                                                         \
    if (!(cond)) {                                                                             \
      std::fprintf(stderr, "fuzz check failed: %s (%s:%d) in %s\n", #cond, __FILE__, __LINE__, \
                   fuzzing::context.c_str());                                                  \
      std::abort();                                                                            \
    }                                                                                          \
  } while (0)

template <typename Scalar>
Scalar consume_value(FuzzedDataProvider& in, int mode) {
  switch (mode) {
    case 0:
      return in.ConsumeFloatingPointInRange<Scalar>(Scalar(-3), Scalar(3));
    case 1:
      return in.ConsumeFloatingPointInRange<Scalar>(Scalar(-30), Scalar(30));
    default:
      return in.ConsumeFloatingPoint<Scalar>();
  }
}

template <typename Scalar>
randattn::RowMatrix<Scalar> consume_matrix(FuzzedDataProvider& in, randattn::Index rows,
                                           randattn::Index cols, int mode) {
  randattn::RowMatrix<Scalar> m(rows, cols);
  for (randattn::Index i = 0; i < m.size(); ++i) m.data()[i] = consume_value<Scalar>(in, mode);
  return m;
}

// Softmax outputs are convex combinations of the value rows: each entry lies in the column's
// range (up to rounding). Linear attention on nonnegative features may also return a zero row,
// the documented result when every weight of the row is zero or underflows to zero.
template <typename Scalar>
void require_convex(const randattn::RowMatrix<Scalar>& out, const randattn::RowMatrix<Scalar>& v,
                    bool zero_rows_allowed = false) {
  if (v.size() == 0) return;
  const double slack = 1e-3 * std::max(1.0, double(v.cwiseAbs().maxCoeff()));
  for (randattn::Index i = 0; i < out.rows(); ++i) {
    if (zero_rows_allowed && (out.row(i).array() == 0).all()) continue;
    for (randattn::Index c = 0; c < v.cols(); ++c)
      FUZZ_REQUIRE(out(i, c) >= v.col(c).minCoeff() - slack &&
                   out(i, c) <= v.col(c).maxCoeff() + slack);
  }
}

}  // namespace fuzzing

// Defines the libFuzzer entry point: the first decoded bool picks float or double for run<Scalar>.
#define RANDATTN_FUZZ_FLOAT_AND_DOUBLE(run)                                           \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) { \
    FuzzedDataProvider in(data, size);                                                \
    if (in.ConsumeBool()) {                                                           \
      run<float>(in);                                                                 \
    } else {                                                                          \
      run<double>(in);                                                                \
    }                                                                                 \
    return 0;                                                                         \
  }
