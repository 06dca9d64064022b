// LSH attention on a long sequence: Reformer-style shared-QK attention over n tokens whose
// vectors form many small clusters (the regime LSH is made for: each token's softmax mass sits
// on a few near neighbours). For several round counts r it prints the time, the speed-up over
// tiled exact attention and the relative error against exact shared-QK attention (same
// normalised keys and self rule), for sort-and-chunk (dense and Hadamard rotations, with and
// without the exact-union correction) and for exact buckets.
//
//   lsh_long_sequence [--n N] [--rounds 1,2,4,8] [--chunk c] [--threads t] [--no-exact] [--csv
//   file]
//
// --no-exact skips both exact runs (e.g. to measure the peak memory of LSH attention alone);
// --csv writes one row per run: mode,rotation,dedupe,rounds,seconds,speedup,rel_error.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <randattn/randattn.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif

using randattn::Index;
using randattn::RowMatrix;

namespace {

struct Settings {
  Index n = 16384, d = 64, dv = 64, chunk = 64, threads = 1;
  std::vector<Index> rounds = {1, 2, 4, 8};
  bool exact = true;
  std::string csv;
};

// The command line, read into s.
void add_options(CLI::App& app, Settings& s) {
  app.description("LSH attention on a long clustered sequence");
  app.add_option("--n", s.n, "sequence length")->check(CLI::Range(Index(2), Index(1) << 40));
  app.add_option("--rounds", s.rounds, "hash round counts, e.g. 1,2,4,8")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--chunk", s.chunk, "chunk length")->check(CLI::PositiveNumber);
  app.add_option("--threads", s.threads, "threads")->check(CLI::PositiveNumber);
  app.add_flag_callback(
      "--no-exact", [&s] { s.exact = false; }, "skip both exact runs");
  app.add_option("--csv", s.csv, "write one row per run to this file");
}

// n tokens around n / 16 random directions of norm 8 (angular spread about 0.2 rad), in a
// scattered order, so that each token's nearest neighbours are far apart in the sequence.
RowMatrix<float> clustered_sequence(Index n, Index d) {
  const randattn::Philox rng(2024);
  const Index clusters = std::max<Index>(1, n / 16);
  RowMatrix<float> centres = randattn::gaussian_matrix<float>(rng.with_stream(1), clusters, d);
  centres.rowwise().normalize();
  RowMatrix<float> x =
      randattn::gaussian_matrix<float>(rng.with_stream(2), n, d) * (0.2f / std::sqrt(float(d)));
  for (Index i = 0; i < n; ++i) x.row(i) += centres.row((i * 7919) % clusters);
  return 8.0f * x;
}

template <typename F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double rel_error(const RowMatrix<float>& a, const RowMatrix<float>& b) {
  return (a.cast<double>() - b.cast<double>()).norm() / b.cast<double>().norm();
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app;
  add_options(app, s);
  CLI11_PARSE(app, argc, argv);
#if defined(_OPENMP)
  omp_set_num_threads(int(s.threads));
#endif
  Eigen::setNbThreads(int(s.threads));

  const RowMatrix<float> q = clustered_sequence(s.n, s.d);
  const RowMatrix<float> v = randattn::gaussian_matrix<float>(randattn::Philox(7), s.n, s.dv);
  const Index buckets = randattn::reformer_buckets(s.n, s.chunk);
  std::cout << "LSH attention on a clustered sequence: n = " << s.n << ", d = " << s.d
            << ", dv = " << s.dv << ", chunk = " << s.chunk << ", buckets = " << buckets
            << ", threads = " << s.threads << "\n";

  // Exact references: tiled softmax attention over the same (q, normalised keys, v) for speed,
  // and exact shared-QK attention (self masked) for the error.
  double t_exact = 0;
  RowMatrix<float> reference;
  if (s.exact) {
    RowMatrix<float> keys = q;
    keys.rowwise().normalize();
    randattn::ExactOptions eopt;
    eopt.scale = 1.0;
    t_exact = seconds([&] { randattn::exact_attention(q, keys, v, eopt); });
    randattn::LshOptions reference_opt;
    reference_opt.scale = 1.0;  // Reformer's convention on unit keys, as the runs below
    reference = randattn::shared_qk_attention(q, v, reference_opt);
    std::cout << "tiled exact attention: " << std::fixed << std::setprecision(3) << t_exact
              << " s\n";
  }

  std::ofstream csv;
  if (!s.csv.empty()) {
    csv.open(s.csv);
    csv << "mode,rotation,dedupe,rounds,seconds,speedup,rel_error\n";
  }
  struct Variant {
    const char* mode;
    randattn::RotationKind rotation;
    bool dedupe, exact_buckets;
  };
  const Variant variants[] = {{"chunks", randattn::RotationKind::dense, true, false},
                              {"chunks", randattn::RotationKind::hadamard, true, false},
                              {"chunks", randattn::RotationKind::dense, false, false},
                              {"buckets", randattn::RotationKind::dense, true, true}};
  std::cout << "\nmode     rotation  dedupe  rounds   seconds   speed-up   rel. error\n";
  for (const Variant& var : variants) {
    for (Index r : s.rounds) {
      const randattn::CrossPolytopeHash<float> hash(var.rotation, s.d, buckets, r, 1234);
      randattn::LshOptions opt;
      opt.chunk = s.chunk;
      opt.scale = 1.0;
      opt.dedupe = var.dedupe;
      opt.exact_buckets = var.exact_buckets;
      RowMatrix<float> out;
      double t = INFINITY;  // best of three: the machine may be shared
      for (int rep = 0; rep < 3; ++rep)
        t = std::min(t, seconds([&] { out = randattn::lsh_attention(hash, q, v, opt); }));
      const double speedup = s.exact ? t_exact / t : NAN,
                   error = s.exact ? rel_error(out, reference) : NAN;
      const char* rotation = var.rotation == randattn::RotationKind::dense ? "dense" : "hadamard";
      std::cout << std::left << std::setw(9) << var.mode << std::setw(10) << rotation
                << std::setw(8) << (var.dedupe ? "yes" : "no") << std::right << std::setw(6) << r
                << std::fixed << std::setprecision(4) << std::setw(10) << t << std::setprecision(1)
                << std::setw(11) << speedup << std::scientific << std::setprecision(2)
                << std::setw(13) << error << std::defaultfloat << "\n";
      if (csv.is_open())
        csv << var.mode << "," << rotation << "," << (var.dedupe ? 1 : 0) << "," << r << "," << t
            << "," << speedup << "," << error << "\n";
    }
  }
  return 0;
}
