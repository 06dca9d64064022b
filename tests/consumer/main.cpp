// Smoke test of a downstream build: exact attention on a 4x3 problem. Every output row must be a
// convex combination of the rows of V and match a direct softmax evaluation.
#include <randattn/randattn.hpp>

#include <cmath>
#include <cstdio>

int main() {
  randattn::RowMatrix<double> q(4, 3), k(4, 3), v(4, 3);
  q << 0.5, -1.0, 0.25, 1.5, 0.0, -0.5, -0.75, 0.5, 1.0, 0.0, 2.0, 0.5;
  k << 1.0, 0.5, -0.5, -1.0, 0.25, 0.75, 0.5, -1.5, 0.0, 0.25, 1.0, 1.25;
  // The last row lies inside the simplex spanned by the first three, so "convex combination of
  // the rows of V" means: entries in [0, 1] summing to 1.
  v << 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0 / 3, 1.0 / 3, 1.0 / 3;

  const randattn::RowMatrix<double> out = randattn::exact_attention(q, k, v);
  if (out.rows() != 4 || out.cols() != 3) {
    std::printf("unexpected output shape %ldx%ld\n", static_cast<long>(out.rows()),
                static_cast<long>(out.cols()));
    return 1;
  }

  const double scale = 1.0 / std::sqrt(3.0);
  int failures = 0;
  for (int i = 0; i < 4; ++i) {
    double sum = 0;
    for (int c = 0; c < 3; ++c) {
      if (!(out(i, c) >= 0.0 && out(i, c) <= 1.0)) ++failures;
      sum += out(i, c);
    }
    if (std::abs(sum - 1.0) > 1e-12) ++failures;

    double w[4], total = 0;
    for (int j = 0; j < 4; ++j) total += (w[j] = std::exp(scale * q.row(i).dot(k.row(j))));
    for (int c = 0; c < 3; ++c) {
      double expected = 0;
      for (int j = 0; j < 4; ++j) expected += w[j] / total * v(j, c);
      if (std::abs(out(i, c) - expected) > 1e-12) ++failures;
    }
  }
  std::printf("randattn consumer: %s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
