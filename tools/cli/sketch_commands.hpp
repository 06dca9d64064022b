#pragma once
// `randattn-cli sparsify` and `randattn-cli hosvd`: tensor sketching of a .npy array of any order
// k >= 2 (float32 or float64; outputs keep the input's dtype).
//
//   sparsify --in A.npy --budget n [--scheme spa|ndt|l2|uniform] [--seed s] --out Ahat.npy
//   [--report]
//       Ahat: the sketch, dense, with A's shape. The report holds nnz, expected_nnz, rel_fro_error
//       and rel_spectral_error (exact for k = 2, the power-method estimate otherwise).
//   hosvd --in A.npy --ranks r1,r2,... [--budget n [--seed s]] --out-prefix P [--report]
//       P0.npy, P1.npy, ...: the d_j x r_j factors (orthonormal columns); sketched HOSVD
//       (Algorithm 2) with --budget, exact HOSVD without.
// Outputs are written only after everything is computed; hosvd writes all factors to temporary
// files first and renames them at the end, so a failure leaves no factor behind.

#include <randattn/io/npy.hpp>
#include <randattn/sketch/hosvd.hpp>
#include <randattn/sketch/sparsify.hpp>
#include <randattn/sketch/spectral_norm.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

#include "common.hpp"

namespace randattn_cli {

// What the sketches take as --in: a float32 or float64 tensor of order k >= 2.
inline void require_sketchable(const Shape& shape, randattn::io::NpyDtype t) {
  if (shape.size() < 2)
    throw CliError("--in: expected an array of order k >= 2, got shape " + shape_str(shape));
  if (t == randattn::io::NpyDtype::float16)
    throw CliError("--in: float16 tensors are not sketched; convert them to float32");
}

// Options and input handling shared by the tensor subcommands.
class TensorCommand {
 public:
  bool selected() const { return cmd_->parsed(); }

 protected:
  TensorCommand(CLI::App& app, const char* name, const char* help)
      : cmd_(app.add_subcommand(name, help)) {
    cmd_->add_option("--in", in_path_, "Input tensor .npy of order k >= 2 (float32 or float64)")
        ->required();
    cmd_->add_flag("--report", report_, "Print one JSON line describing the run to stdout");
  }

  CLI::Option* add_budget(const std::string& help) {
    return cmd_->add_option("--budget", options_.budget, help);
  }
  CLI::Option* add_seed() {
    return add_seed_option(cmd_, options_.seed, "Seed of the sampling draws (default 0)");
  }

  // Loads --in and calls fn(view, shape) with a TensorView of the input's dtype.
  template <typename Fn>
  void with_input(Fn&& fn) {
    const randattn::io::NpyArray a = read_input("--in", in_path_);
    require_sketchable(a.shape, a.dtype());
    dtype_ = randattn::io::dtype_name(a.dtype());
    shape_ = a.shape;
    const std::vector<randattn::Index> dims(a.shape.begin(), a.shape.end());
    if (a.is_float32())
      fn(randattn::TensorView<float>(a.values<float>().data(), dims));
    else
      fn(randattn::TensorView<double>(a.values<double>().data(), dims));
  }

  static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  CLI::App* cmd_;
  std::string in_path_;
  bool report_ = false;
  randattn::SparsifyOptions options_;
  std::string dtype_;
  Shape shape_;
};

class SparsifyCommand : public TensorCommand {
 public:
  explicit SparsifyCommand(CLI::App& app)
      : TensorCommand(app, "sparsify",
                      "Sparsify a tensor (.npy of order k >= 2) and write the sketch densely") {
    add_budget("Sampling budget n > 0 (Algorithm 1's parameter; baselines match its expected nnz)")
        ->required();
    cmd_->add_option("--scheme", scheme_, "Scheme: spa (Algorithm 1), ndt, l2 or uniform")
        ->capture_default_str();
    add_seed();
    cmd_->add_option("--out", out_path_,
                     "Output .npy: the sketch, dense, with the shape and dtype of --in")
        ->required();
  }

  int run() {
    options_.scheme = randattn::parse_scheme(scheme_);
    with_input([&](const auto& a) { this->sparsify(a); });
    return 0;
  }

 protected:
  template <typename Scalar>
  void sparsify(const randattn::TensorView<Scalar>& a) {
    const auto start = std::chrono::steady_clock::now();
    const randattn::SparseSketch<Scalar> sketch = randattn::sparsify(a, options_);
    const double seconds = seconds_since(start);
    const randattn::Vector<Scalar> dense = randattn::densify(sketch);
    JsonObject json;
    if (report_) {
      const randattn::SketchError err = randattn::sketch_error(a, sketch);
      json.add("scheme", randattn::scheme_name(options_.scheme))
          .add("dtype", dtype_)
          .add("shape", shape_)
          .add("budget", options_.budget)
          .add("seed", std::uint64_t(options_.seed))
          .add("nnz", std::int64_t(sketch.nnz()))
          .add("expected_nnz", sketch.stats.expected_nnz)
          .add("keep_threshold", sketch.stats.keep_threshold())
          .add("uniform_threshold", sketch.stats.uniform_threshold())
          .add("rel_fro_error", err.relative_frobenius)
          .add("rel_spectral_error", err.relative_spectral)
          .add("spectral_exact", err.spectral_exact)
          .add("seconds", seconds);
    }
    try {
      randattn::io::write_npy(out_path_, dense.data(), shape_);
    } catch (const std::exception& e) {
      throw CliError(std::string("--out: ") + e.what());
    }
    if (report_) std::cout << json.str() << std::endl;
  }

  std::string scheme_ = "spa";
  std::string out_path_;
};

class HosvdCommand : public TensorCommand {
 public:
  explicit HosvdCommand(CLI::App& app)
      : TensorCommand(app, "hosvd",
                      "HOSVD subspaces of a tensor (.npy of order k >= 2), exact or sketched") {
    cmd_->add_option("--ranks", ranks_,
                     "Comma-separated ranks r_1,...,r_k, one per mode, 1 <= r_j <= d_j")
        ->required()
        ->delimiter(',');
    budget_opt_ =
        add_budget("Sketch with this budget (two Algorithm 1 sketches); exact HOSVD when absent");
    add_seed()->needs(budget_opt_);
    cmd_->add_option("--out-prefix", prefix_, "Factor j is written to <prefix>j.npy (d_j x r_j)")
        ->required();
  }

  int run() {
    with_input([&](const auto& a) { this->hosvd(a); });
    return 0;
  }

 protected:
  template <typename Scalar>
  void hosvd(const randattn::TensorView<Scalar>& a) {
    const std::vector<randattn::Index> ranks(ranks_.begin(), ranks_.end());
    const bool sketched = budget_opt_->count() > 0;
    JsonObject json;
    json.add("method", sketched ? "sketched" : "exact")
        .add("dtype", dtype_)
        .add("shape", shape_)
        .add("ranks", ranks_);
    const auto start = std::chrono::steady_clock::now();
    randattn::Hosvd<Scalar> result;
    if (sketched) {
      const randattn::SketchedHosvd<Scalar> s = randattn::sketched_hosvd(a, ranks, options_);
      json.add("budget", options_.budget)
          .add("seed", std::uint64_t(options_.seed))
          .add("nnz", Shape{s.nnz[0], s.nnz[1]})
          .add("expected_nnz", s.stats.expected_nnz);
      result = s;
    } else {
      result = randattn::exact_hosvd(a, ranks);
    }
    json.add("seconds", seconds_since(start));
    write_factors(result.factors);
    if (report_) std::cout << json.str() << std::endl;
  }

  // All factors go to temporary files first and are renamed at the end: all of them appear or
  // none. Files they replace are kept (hard-linked, or copied) until every rename succeeded, and
  // put back if one fails, so a failed run leaves every existing file as it was.
  template <typename Scalar>
  void write_factors(const std::vector<randattn::RowMatrix<Scalar>>& factors) const {
    namespace fs = std::filesystem;
    std::vector<fs::path> finals, temps, backups;
    std::size_t renamed = 0;
    try {
      for (std::size_t j = 0; j < factors.size(); ++j) {
        finals.emplace_back(prefix_ + std::to_string(j) + ".npy");
        randattn::io::require_replaceable(finals.back());
      }
      for (std::size_t j = 0; j < factors.size(); ++j) {
        temps.push_back(randattn::io::temporary_path_beside(finals[j]));
        const auto& u = factors[j];
        randattn::io::write_npy(temps.back(), u.data(),
                                {std::int64_t(u.rows()), std::int64_t(u.cols())});
      }
      for (const fs::path& f : finals) {
        std::error_code ec;
        backups.emplace_back();
        if (!fs::exists(f, ec)) continue;
        const fs::path b = randattn::io::temporary_path_beside(f);
        fs::create_hard_link(f, b, ec);
        if (ec) fs::copy_file(f, b, ec);
        if (ec) throw CliError(f.string() + ": cannot keep a copy of the existing file: " + ec.message());
        backups.back() = b;
      }
      for (; renamed < finals.size(); ++renamed) {
        std::error_code ec;
        fs::rename(temps[renamed], finals[renamed], ec);
        if (ec) throw CliError(finals[renamed].string() + ": cannot write: " + ec.message());
      }
    } catch (const std::exception& e) {
      std::error_code ignored;
      for (std::size_t j = 0; j < temps.size(); ++j) {
        if (j >= renamed) {
          fs::remove(temps[j], ignored);
        } else if (j < backups.size() && !backups[j].empty()) {
          fs::rename(backups[j], finals[j], ignored);  // the user's file, back in place
        } else {
          fs::remove(finals[j], ignored);
        }
      }
      for (std::size_t j = renamed; j < backups.size(); ++j)
        if (!backups[j].empty()) fs::remove(backups[j], ignored);
      throw CliError(std::string("--out-prefix: ") + e.what());
    }
    std::error_code ignored;
    for (const fs::path& b : backups)
      if (!b.empty()) fs::remove(b, ignored);
  }

  std::vector<std::int64_t> ranks_;
  CLI::Option* budget_opt_ = nullptr;
  std::string prefix_;
};

}  // namespace randattn_cli
