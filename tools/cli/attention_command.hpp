#pragma once
// `randattn-mpi attention`: attention of .npy inputs, written to a .npy output, with the method
// classes of methods.hpp (randattn-cli's attention command is generated from the registry, see
// registry_command.hpp).

#include <randattn/io/npy.hpp>

#include <CLI/CLI.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "common.hpp"
#include "methods.hpp"

namespace randattn_cli {

class AttentionCommand {
 public:
  explicit AttentionCommand(CLI::App& app) : methods_(make_methods()) {
    std::string names;
    for (const auto& m : methods_) names += std::string(names.empty() ? "" : ", ") + m->name();
    cmd_ = app.add_subcommand("attention", "Compute attention of Q, K, V given as .npy files");
    cmd_->add_option("--method", method_, "Attention method (" + names + ")")
        ->capture_default_str();
    cmd_->add_option("--q", q_path_, "Queries .npy: (n_q, d) or (batch, heads, n_q, d)")
        ->required();
    k_opt_ = cmd_->add_option("--k", k_path_, "Keys .npy: (n_k, d) or (batch, heads, n_k, d)");
    cmd_->add_flag("--shared-qk", shared_qk_,
                   "No --k: the keys are the normalised queries, each query's own key excluded "
                   "(lsh)");
    cmd_->add_option("--v", v_path_, "Values .npy: (n_k, dv) or (batch, heads, n_k, dv)")
        ->required();
    cmd_->add_option("--out", out_path_,
                     "Output .npy: (n_q, dv) or (batch, heads, n_q, dv), dtype of the inputs")
        ->required();
    cmd_->add_flag("--causal", settings_.causal,
                   "Query i attends to keys j <= i only (needs n_q == n_k)");
    scale_opt_ = cmd_->add_option("--scale", scale_, "Logit scale (default 1/sqrt(d))");
    threads_opt_ = cmd_->add_option("--threads", threads_, "Number of OpenMP threads");
    cmd_->add_flag("--report", report_, "Print one JSON line describing the run to stdout");
    cmd_->add_option("--seed", settings_.seed, "Seed of the method's random draws (default 0)");
    cmd_->add_flag(
        "--compare", compare_,
        "Also compute exact attention and add \"rel_error\" (relative Frobenius error) to the "
        "--report line (implies --report)");
    for (auto& m : methods_) m->add_options(*cmd_);
  }

  bool selected() const { return cmd_->parsed(); }

  int run() {
    const AttentionMethod& method = prepare();
    const randattn::io::NpyArray q = load("--q", q_path_);
    const randattn::io::NpyArray k_file =
        settings_.shared_qk ? randattn::io::NpyArray() : load("--k", k_path_);
    const randattn::io::NpyArray& k = settings_.shared_qk ? q : k_file;
    const randattn::io::NpyArray v = load("--v", v_path_);
    const randattn::BatchShape shape = check_shapes(info(q), info(k), info(v));
    const double scale = settings_.scale ? *settings_.scale : method.default_scale(shape.d);
    settings_.scale = scale;  // every method gets the resolved scale, whatever its library default
    const Shape out_shape = output_shape(q.ndim(), shape);

    double seconds = 0, rel_error = 0;
    if (q.is_float32())
      seconds = compute<float>(method, q, k, v, shape, out_shape, scale, rel_error);
    else
      seconds = compute<double>(method, q, k, v, shape, out_shape, scale, rel_error);

    if (report_ || compare_) {
      JsonObject json = report_json(method, info(q), info(k), info(v), out_shape, scale);
      if (compare_ && !method.own_comparison()) json.add("rel_error", rel_error);
      json.add("seconds", seconds);
      std::cout << json.str() << std::endl;
    }
    return 0;
  }

 protected:
  // The shape and dtype of an input, whether read whole or only its header.
  struct InputInfo {
    Shape shape;
    randattn::io::NpyDtype dtype;
    std::size_t ndim() const { return shape.size(); }
  };
  static InputInfo info(const randattn::io::NpyArray& a) { return {a.shape, a.dtype()}; }

  // The selected method, after checking the common flags (applies --threads).
  const AttentionMethod& prepare() {
    const AttentionMethod& method = select_method();
    if (scale_opt_->count() > 0) {
      if (!std::isfinite(scale_)) throw CliError("--scale must be a finite number");
      settings_.scale = scale_;
    }
    if (threads_opt_->count() > 0) {
      if (threads_ < 1)
        throw CliError("--threads must be at least 1, got " + std::to_string(threads_));
#ifdef _OPENMP
      omp_set_num_threads(threads_);
#endif
    }

    settings_.shared_qk = shared_qk_;
    settings_.report = report_ || compare_;
    settings_.compare = compare_;
    if (shared_qk_ && !method.keys_optional())
      throw CliError(std::string("--method ") + method.name() + " does not support --shared-qk");
    if (shared_qk_ && k_opt_->count() > 0) throw CliError("--k and --shared-qk exclude each other");
    if (!shared_qk_ && k_opt_->count() == 0)
      throw CliError(std::string("--k is required for --method ") + method.name() +
                     (method.keys_optional() ? ", or --shared-qk" : ""));
    return method;
  }

  static Shape output_shape(std::size_t ndim, const randattn::BatchShape& shape) {
    Shape out;
    if (ndim == 4) out = {shape.batch, shape.heads};
    out.push_back(shape.n_q);
    out.push_back(shape.dv);
    return out;
  }

  // The --report line without the timing fields.
  JsonObject report_json(const AttentionMethod& method, const InputInfo& q, const InputInfo& k,
                         const InputInfo& v, const Shape& out_shape, double scale) const {
    JsonObject json;
    json.add("method", method.name())
        .add("dtype", randattn::io::dtype_name(q.dtype))
        .add("q", q.shape)
        .add("k", k.shape)
        .add("v", v.shape)
        .add("out", out_shape)
        .add("causal", settings_.causal)
        .add("scale", scale)
        .add("threads", effective_threads());
    method.report(json);
    return json;
  }

  const AttentionMethod& select_method() const {
    const AttentionMethod* chosen = nullptr;
    std::string names;
    for (const auto& m : methods_) {
      names += std::string(names.empty() ? "" : ", ") + m->name();
      if (method_ == m->name()) chosen = m.get();
    }
    if (!chosen) throw CliError("unknown --method '" + method_ + "' (available: " + names + ")");
    for (const auto& m : methods_) {
      if (m.get() == chosen) continue;
      for (const CLI::Option* opt : m->own_options())
        if (opt->count() > 0 && !chosen->owns(opt))
          throw CliError("option " + opt->get_name() + " belongs to --method " + m->name() +
                         ", not " + method_);
    }
    return *chosen;
  }

  static int effective_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
  }

  static randattn::io::NpyArray load(const char* flag, const std::string& path) {
    return read_input(flag, path);
  }

  static randattn::BatchShape check_shapes(const InputInfo& q, const InputInfo& k,
                                           const InputInfo& v) {
    const struct {
      const char* flag;
      const InputInfo& a;
    } inputs[] = {{"--q", q}, {"--k", k}, {"--v", v}};
    for (const auto& in : inputs) {
      if (in.a.ndim() != 2 && in.a.ndim() != 4)
        throw CliError(std::string(in.flag) +
                       ": expected a 2-D (n, d) or 4-D (batch, heads, n, d) array, got shape " +
                       shape_str(in.a.shape));
    }
    const std::string shapes =
        "q " + shape_str(q.shape) + ", k " + shape_str(k.shape) + ", v " + shape_str(v.shape);
    if (q.dtype != k.dtype || q.dtype != v.dtype)
      throw CliError(std::string("--q, --k and --v must have the same dtype, got q ") +
                     randattn::io::dtype_name(q.dtype) + ", k " +
                     randattn::io::dtype_name(k.dtype) + ", v " +
                     randattn::io::dtype_name(v.dtype));
    if (q.ndim() != k.ndim() || q.ndim() != v.ndim())
      throw CliError("--q, --k and --v must have the same number of dimensions, got " + shapes);

    const std::size_t r = q.ndim() - 2;  // index of the token axis
    randattn::BatchShape s;
    if (r == 2) {
      if (k.shape[0] != q.shape[0] || v.shape[0] != q.shape[0] || k.shape[1] != q.shape[1] ||
          v.shape[1] != q.shape[1])
        throw CliError("batch and head dimensions of --q, --k and --v differ: " + shapes);
      s.batch = q.shape[0];
      s.heads = q.shape[1];
    }
    s.n_q = q.shape[r];
    s.d = q.shape[r + 1];
    s.n_k = k.shape[r];
    s.dv = v.shape[r + 1];
    if (k.shape[r + 1] != s.d)
      throw CliError("--q and --k must have the same feature dimension d: " + shapes);
    if (v.shape[r] != s.n_k)
      throw CliError("--k and --v must have the same number of tokens n_k: " + shapes);
    if (s.d == 0) throw CliError("feature dimension d must be positive: " + shapes);
    if (s.n_k == 0) throw CliError("at least one key is needed: " + shapes);
    return s;
  }

 private:
  template <typename Scalar>
  double compute(const AttentionMethod& method, const randattn::io::NpyArray& q,
                 const randattn::io::NpyArray& k, const randattn::io::NpyArray& v,
                 const randattn::BatchShape& shape, const Shape& out_shape, double scale,
                 double& rel_error) const {
    std::uint64_t count = 1;
    for (std::int64_t dim : out_shape) {
      const auto u = static_cast<std::uint64_t>(dim);
      if (u != 0 && count > std::numeric_limits<std::uint64_t>::max() / sizeof(Scalar) / u)
        throw CliError("output shape " + shape_str(out_shape) + " is too large");
      count *= u;
    }
    std::vector<Scalar> out;
    try {
      out.resize(static_cast<std::size_t>(count));
    } catch (const std::bad_alloc&) {
      throw CliError("out of memory allocating the output " + shape_str(out_shape));
    } catch (const std::length_error&) {
      throw CliError("output shape " + shape_str(out_shape) + " is too large");
    }

    const auto start = std::chrono::steady_clock::now();
    method.run(q.values<Scalar>().data(), k.values<Scalar>().data(), v.values<Scalar>().data(),
               out.data(), shape, settings_);
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (compare_ && !method.own_comparison())
      rel_error = compare_with_exact(q, k, v, out, shape, scale);

    try {
      randattn::io::write_npy(out_path_, out.data(), out_shape);
    } catch (const std::exception& e) {
      throw CliError(std::string("--out: ") + e.what());
    }
    return elapsed.count();
  }

  // ‖out − exact‖_F / ‖exact‖_F against exact attention with the same scale and mask.
  template <typename Scalar>
  double compare_with_exact(const randattn::io::NpyArray& q, const randattn::io::NpyArray& k,
                            const randattn::io::NpyArray& v, const std::vector<Scalar>& out,
                            const randattn::BatchShape& shape, double scale) const {
    std::vector<Scalar> exact(out.size());
    randattn::ExactOptions opt;
    opt.causal = settings_.causal;
    opt.scale = scale;
    randattn::exact_attention_batched(q.values<Scalar>().data(), k.values<Scalar>().data(),
                                      v.values<Scalar>().data(), exact.data(), shape, opt);
    return relative_error(out.data(), exact.data(), out.size());
  }

 protected:
  std::vector<std::unique_ptr<AttentionMethod>> methods_;
  CLI::App* cmd_ = nullptr;
  CLI::Option* k_opt_ = nullptr;
  CLI::Option* scale_opt_ = nullptr;
  CLI::Option* threads_opt_ = nullptr;
  std::string method_ = "exact";
  std::string q_path_, k_path_, v_path_, out_path_;
  double scale_ = 0;
  int threads_ = 1;
  bool report_ = false;
  bool compare_ = false;
  bool shared_qk_ = false;
  CommonSettings settings_;
};

}  // namespace randattn_cli
