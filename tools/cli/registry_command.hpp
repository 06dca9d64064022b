#pragma once
// `randattn-cli attention` and `randattn-cli methods`, generated from the method registry
// (include/randattn/registry/): one flag per registered option (--kebab-case of its name; a flag
// on by default is turned off with --no-NAME), converted here from text to a typed value and
// checked by the registry. A flag of another method than the selected one is refused.

#include <randattn/io/npy.hpp>
#include <randattn/io/npy_index.hpp>
#include <randattn/registry/layout.hpp>
#include <randattn/registry/registry.hpp>

#include <CLI/CLI.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <new>
#include <string>
#include <variant>
#include <vector>

#include "common.hpp"

namespace randattn_cli {

namespace reg = randattn::registry;

// The command line's spelling of a registered option: "--lambda-features", or "--no-dedupe" for
// a flag that is on by default.
inline std::string flag_of(const reg::OptionSpec& s) {
  const bool negated = s.type == reg::OptionType::flag &&
                       std::holds_alternative<bool>(s.fallback) && std::get<bool>(s.fallback);
  return (negated ? "--no-" : "--") + reg::Spelling::kebab(s.name);
}

// A default as JSON ("null" when there is none).
inline std::string json_value(const reg::Value& v) {
  JsonObject one;
  if (const auto* b = std::get_if<bool>(&v)) one.add("v", *b);
  if (const auto* i = std::get_if<std::int64_t>(&v)) one.add("v", *i);
  if (const auto* x = std::get_if<double>(&v)) one.add("v", *x);
  if (const auto* t = std::get_if<std::string>(&v)) one.add("v", *t);
  const std::string s = one.str();  // {"v":...} or {}
  return s.size() > 2 ? s.substr(5, s.size() - 6) : "null";
}

// Text of a JSON string.
inline std::string json_string(const std::string& s) {
  const std::string o = JsonObject().add("v", s).str();
  return o.substr(5, o.size() - 6);
}

class RegistryAttentionCommand {
 public:
  explicit RegistryAttentionCommand(CLI::App& app) {
    cmd_ = app.add_subcommand("attention", "Compute attention of Q, K, V given as .npy files");
    cmd_->add_option("--method", method_, "Attention method (" + reg::method_names() + ")")
        ->capture_default_str();
    cmd_->add_option("--q", q_path_, "Queries .npy: (n_q, d) or (batch, heads, n_q, d)")
        ->required();
    k_opt_ = cmd_->add_option("--k", k_path_, "Keys .npy: (n_k, d) or (batch, heads, n_k, d)");
    cmd_->add_option("--v", v_path_, "Values .npy: (n_k, dv) or (batch, heads, n_k, dv)")
        ->required();
    cmd_->add_option("--out", out_path_,
                     "Output .npy: (n_q, dv) or (batch, heads, n_q, dv), dtype of the inputs")
        ->required();
    cmd_->add_flag("--shared-qk", shared_qk_,
                   "No --k: the keys are the normalised queries, each query's own key excluded "
                   "(methods that support it: " +
                       shared_qk_methods() + ")");
    cmd_->add_flag("--causal", causal_, "Query i attends to keys j <= i only (needs n_q == n_k)");
    scale_opt_ = cmd_->add_option("--scale", scale_, "Logit scale (default 1/sqrt(d))");
    threads_opt_ = cmd_->add_option("--threads", threads_, "Number of OpenMP threads");
    cmd_->add_flag("--report", report_, "Print one JSON line describing the run to stdout");
    add_seed_option(cmd_, seed_, "Seed of the method's random draws (default 0)");
    cmd_->add_flag(
        "--compare", compare_,
        "Also compute exact attention and add \"rel_error\" (relative Frobenius error) to the "
        "--report line (implies --report)");
    for (const reg::LayoutInputSpec& s : reg::layout_inputs()) add_layout_input(s);
    for (const reg::OptionSpec& s : reg::all_options()) add_registered(s);
  }

  bool selected() const { return cmd_->parsed(); }

  int run() {
    const reg::Method& method = prepare();
    const randattn::io::NpyArray q = read_input("--q", q_path_);
    const randattn::io::NpyArray k_file =
        shared_qk_ ? randattn::io::NpyArray() : read_input("--k", k_path_);
    const randattn::io::NpyArray& k = shared_qk_ ? q : k_file;
    const randattn::io::NpyArray v = read_input("--v", v_path_);
    reg::Call call = make_call(method, info(q), info(k), info(v));
    const reg::Layout layout = make_layout(method, info(q), info(k), info(v), call);
    if (front_end_compares(method, call, layout)) call.settings.compare = false;
    const Shape out_shape = output_shape(q.ndim(), call.shape);
    // float16 inputs run the float32 method on their exact widening; the output is rounded once.
    Outcome outcome = randattn::io::with_element_type(q.dtype(), [&](auto tag) {
      return compute<decltype(tag)>(method, call, layout, q, k, v, out_shape);
    });

    if (report_ || compare_) {
      JsonObject json =
          report_json(method, call, info(q), info(k), info(v), out_shape, outcome.report);
      if (compare_ && front_end_compares(method, call, layout))
        json.add("rel_error", outcome.rel_error);
      json.add("seconds", outcome.seconds);
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

  struct Outcome {
    reg::Report report;
    double seconds = 0, rel_error = 0;
  };

  // The selected method, after checking the flags that do not need the inputs (applies
  // --threads).
  const reg::Method& prepare() const {
    const reg::Method& method = select_method();
    reg::check_keys(method, k_opt_->count() > 0, shared_qk_, reg::Spelling{true});
    if (threads_opt_->count() > 0) {
      const int threads = reg::checked_threads(threads_, reg::Spelling{true});
#ifdef _OPENMP
      omp_set_num_threads(threads);
#else
      (void)threads;
#endif
    }
    return method;
  }

  // The method's call on inputs of these shapes: option values and settings checked.
  reg::Call make_call(const reg::Method& method, const InputInfo& q, const InputInfo& k,
                      const InputInfo& v) const {
    const reg::Spelling spell{true};
    std::map<std::string, reg::Value> given = option_values(method);
    const randattn::BatchShape shape = check_shapes(q, k, v).shape;
    reg::Settings settings;
    settings.causal = causal_;
    settings.scale = reg::resolve_scale(
        scale_opt_->count() ? std::optional<double>(scale_) : std::nullopt, shape.d, spell);
    settings.seed = seed_;
    settings.shared_qk = shared_qk_;
    settings.report = report_ || compare_;
    settings.compare = compare_;
    for (const auto& [name, on] : layout_flags_) reg::set_layout_flag(settings, name, on);
    return reg::make_call(method, std::move(given), settings, shape, spell);
  }

  // True when a layout input (key padding, packed sequences, self-exclusion) was given.
  bool layout_given() const {
    for (const auto& [name, path] : layout_paths_)
      if (!path.empty()) return true;
    for (const auto& [name, on] : layout_flags_)
      if (on) return true;
    return false;
  }

  // Key padding, packed sequences and grouped heads from the layout flags and the input shapes,
  // checked by the registry.
  reg::Layout make_layout(const reg::Method& method, const InputInfo& q, const InputInfo& k,
                          const InputInfo& v, const reg::Call& call) const {
    std::map<std::string, reg::IndexArray> given;
    for (const auto& [name, path] : layout_paths_)
      if (!path.empty()) given[name] = read_index(name, path);
    const reg::Layout layout = reg::make_layout(method, given, check_shapes(q, k, v),
                                                call.settings, reg::Spelling{true});
    if (compare_ && shared_qk_ && (!layout.plain(call.shape) || call.settings.exclude_self))
      throw CliError(
          "--compare with --shared-qk compares a plain call only (no --cu-seqlens or "
          "--exclude-self)");
    return layout;
  }

  // A layout input's .npy file (integer or boolean; the registry checks which).
  static reg::IndexArray read_index(const std::string& name, const std::string& path) {
    try {
      randattn::io::NpyIndexArray a = randattn::io::read_npy_index(path);
      return {std::move(a.shape), std::move(a.data), a.boolean};
    } catch (const std::exception& e) {
      throw CliError(reg::Spelling{true}.option(name) + ": " + e.what());
    }
  }

  // The front end adds rel_error unless the method compares itself (a plain call without
  // self-exclusion).
  static bool front_end_compares(const reg::Method& method, const reg::Call& call,
                                 const reg::Layout& layout) {
    return !method.own_comparison() || !layout.plain(call.shape) || call.settings.exclude_self;
  }

  static Shape output_shape(std::size_t ndim, const randattn::BatchShape& shape) {
    Shape out;
    if (ndim == 4) out = {shape.batch, shape.heads};
    out.push_back(shape.n_q);
    out.push_back(shape.dv);
    return out;
  }

  // The --report line without the comparison and timing fields.
  JsonObject report_json(const reg::Method& method, const reg::Call& call, const InputInfo& q,
                         const InputInfo& k, const InputInfo& v, const Shape& out_shape,
                         const reg::Report& fields) const {
    // "auto" reports the method that ran.
    std::string ran = method.name();
    for (const auto& [key, value] : fields)
      if (key == "method" && std::holds_alternative<std::string>(value))
        ran = std::get<std::string>(value);
    JsonObject json;
    json.add("method", ran)
        .add("dtype", randattn::io::dtype_name(q.dtype))
        .add("q", q.shape)
        .add("k", k.shape)
        .add("v", v.shape)
        .add("out", out_shape)
        .add("causal", causal_)
        .add("scale", call.settings.scale)
        .add("threads", effective_threads());
    for (const auto& [key, value] : fields)
      if (key != "method") std::visit([&, &key = key](const auto& x) { json.add(key, x); }, value);
    json.add("shared_qk", shared_qk_);
    return json;
  }

  static std::string shared_qk_methods() {
    std::string names;
    for (const auto& m : reg::methods())
      if (m->supports_shared_qk()) names += std::string(names.empty() ? "" : ", ") + m->name();
    return names;
  }

  // One flag per layout input: a path for an array, a flag for a setting.
  void add_layout_input(const reg::LayoutInputSpec& s) {
    const std::string flag = "--" + reg::Spelling::kebab(s.name);
    if (s.type == reg::LayoutInputType::flag) {
      cmd_->add_flag(flag, layout_flags_[s.name], s.help);
      return;
    }
    const char* kind = s.type == reg::LayoutInputType::booleans ? "Boolean" : "Integer";
    cmd_->add_option(flag, layout_paths_[s.name],
                     std::string(kind) + " .npy " + reg::shape_rule(s) + ": " + s.help);
  }

  // One flag per registered option, its help tagged with the methods that own it.
  void add_registered(const reg::OptionSpec& s) {
    std::string owners;
    for (const reg::Method* m : reg::owners(s.name))
      owners += std::string(owners.empty() ? "" : ", ") + m->name();
    std::string help = "[" + owners + "] " + s.help;
    if (s.type == reg::OptionType::array) help += " (.npy file)";
    const std::string def = json_value(s.fallback);
    // The owners that declare another default (hedgehog's features) are named with theirs.
    std::string others;
    for (const reg::Method* m : reg::owners(s.name))
      for (const reg::OptionSpec& own : m->options())
        if (own.name == s.name && json_value(own.fallback) != def)
          others += std::string("; ") + m->name() + " " + json_value(own.fallback);
    if (s.type != reg::OptionType::flag && def != "null") help += " (default " + def + others + ")";
    const std::string flag = flag_of(s);
    // Flags are read from their count; add_flag(name, x) would take x as the flag's target.
    CLI::Option* opt = s.type == reg::OptionType::flag
                           ? cmd_->add_flag(flag)->description(help)
                           : cmd_->add_option(flag, text_[s.name], help);
    registered_.push_back({s, opt});
  }

  const reg::Method& select_method() const {
    const reg::Method& chosen = reg::find_method(method_, reg::Spelling{true});
    for (const auto& [spec, opt] : registered_) {
      if (opt->count() == 0 || reg::accepts(chosen, spec.name)) continue;
      throw CliError("option " + opt->get_name() + " belongs to --method " +
                     reg::owners(spec.name).front()->name() + ", not " + method_);
    }
    return chosen;
  }

  // The given flags of `method` as typed values; the registry checks them.
  std::map<std::string, reg::Value> option_values(const reg::Method& method) const {
    std::map<std::string, reg::Value> values;
    for (const auto& [spec, opt] : registered_) {
      if (opt->count() == 0 || !reg::accepts(method, spec.name)) continue;
      const std::string flag = opt->get_name();
      const std::string& text = text_.count(spec.name) ? text_.at(spec.name) : std::string();
      switch (spec.type) {
        case reg::OptionType::flag:
          values[spec.name] = flag.rfind("--no-", 0) != 0;
          break;
        case reg::OptionType::integer: {
          char* end = nullptr;
          errno = 0;
          const long long i = std::strtoll(text.c_str(), &end, 10);
          if (text.empty() || *end != '\0' || errno == ERANGE)
            throw CliError(flag + ": expected an integer, got '" + text + "'");
          values[spec.name] = std::int64_t(i);
          break;
        }
        case reg::OptionType::real: {
          char* end = nullptr;
          const double x = std::strtod(text.c_str(), &end);
          if (text.empty() || *end != '\0')
            throw CliError(flag + ": expected a number, got '" + text + "'");
          values[spec.name] = x;
          break;
        }
        case reg::OptionType::text:
          values[spec.name] = text;
          break;
        case reg::OptionType::array:
          values[spec.name] = read_array(flag, text);
          break;
      }
    }
    return values;
  }

  static reg::ArrayValue read_array(const std::string& flag, const std::string& path) {
    const randattn::io::NpyArray a = read_input(flag.c_str(), path);
    reg::ArrayValue out;
    out.shape = a.shape;
    out.source = path;
    std::visit([&](const auto& data) { out.data.assign(data.begin(), data.end()); }, a.data);
    return out;
  }

  static int effective_threads() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
  }

  // The call's shape (checked by the registry) of inputs of one dtype; k is q under shared QK.
  reg::CallShape check_shapes(const InputInfo& q, const InputInfo& k, const InputInfo& v) const {
    const reg::CallShape shape =
        reg::call_shape(q.shape, shared_qk_ ? nullptr : &k.shape, v.shape, reg::Spelling{true});
    if (q.dtype != k.dtype || q.dtype != v.dtype)
      throw CliError(std::string("--q, --k and --v must have the same dtype, got q ") +
                     randattn::io::dtype_name(q.dtype) + ", k " +
                     randattn::io::dtype_name(k.dtype) + ", v " +
                     randattn::io::dtype_name(v.dtype));
    return shape;
  }

  template <typename Scalar>
  Outcome compute(const reg::Method& method, const reg::Call& call, const reg::Layout& layout,
                  const randattn::io::NpyArray& q, const randattn::io::NpyArray& k,
                  const randattn::io::NpyArray& v, const Shape& out_shape) const {
    const reg::Job<Scalar> job = reg::build_job<Scalar>(method, call, layout);
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

    Outcome outcome;
    const Scalar* keys = call.settings.shared_qk ? nullptr : k.values<Scalar>().data();
    const auto start = std::chrono::steady_clock::now();
    outcome.report = job(q.values<Scalar>().data(), keys, v.values<Scalar>().data(), out.data());
    outcome.seconds = reg::seconds_since(start);
    if (compare_ && front_end_compares(method, call, layout)) {
      // Exact attention under the same layout.
      std::vector<Scalar> exact(out.size());
      const reg::Method& exact_method = reg::find_method("exact", reg::Spelling{true});
      reg::Call exact_call = reg::make_call(exact_method, {}, call.settings, call.shape,
                                            reg::Spelling{true});
      exact_call.settings.shared_qk = false;
      exact_call.settings.compare = false;
      reg::build_job<Scalar>(exact_method, exact_call, layout)(
          q.values<Scalar>().data(), keys ? keys : q.values<Scalar>().data(),
          v.values<Scalar>().data(), exact.data());
      outcome.rel_error = reg::relative_error(out.data(), exact.data(), out.size());
    }
    try {
      randattn::io::write_npy(out_path_, out.data(), out_shape);
    } catch (const std::exception& e) {
      throw CliError(std::string("--out: ") + e.what());
    }
    return outcome;
  }

  struct Registered {
    reg::OptionSpec spec;
    CLI::Option* option;
  };

  CLI::App* cmd_ = nullptr;
  CLI::Option* k_opt_ = nullptr;
  CLI::Option* scale_opt_ = nullptr;
  CLI::Option* threads_opt_ = nullptr;
  std::string method_ = "exact";
  std::string q_path_, k_path_, v_path_, out_path_;
  std::map<std::string, std::string> layout_paths_;  // the .npy file of each layout array
  std::map<std::string, bool> layout_flags_;         // each flag layout input
  bool shared_qk_ = false, causal_ = false, report_ = false, compare_ = false;
  double scale_ = 0;
  std::int64_t threads_ = 1;
  std::uint64_t seed_ = 0;
  std::vector<Registered> registered_;
  std::map<std::string, std::string> text_;  // the text of each non-flag option
};

// `randattn-cli methods [--json]`: the registered methods, their options and defaults.
class MethodsCommand {
 public:
  explicit MethodsCommand(CLI::App& app) {
    cmd_ = app.add_subcommand("methods", "List the attention methods and their options");
    cmd_->add_flag("--json", json_, "One JSON object: {name: {summary, shared_qk, options}}");
  }
  bool selected() const { return cmd_->parsed(); }

  int run() const {
    if (!json_) {
      for (const auto& m : reg::methods()) {
        std::cout << m->name() << ": " << m->summary()
                  << (m->supports_shared_qk() ? " [--shared-qk]" : "") << "\n";
        for (const reg::OptionSpec& s : m->options())
          std::cout << "  " << flag_of(s) << " (" << reg::type_name(s.type) << ", default "
                    << json_value(s.fallback) << "): " << s.help << "\n";
      }
      return 0;
    }
    std::string out = "{";
    for (const auto& m : reg::methods()) {
      if (out.size() > 1) out += ",";
      out += json_string(m->name()) + ":{\"summary\":" + json_string(m->summary()) +
             ",\"shared_qk\":" + (m->supports_shared_qk() ? "true" : "false") + ",\"options\":{";
      bool first = true;
      for (const reg::OptionSpec& s : m->options()) {
        out += (first ? "" : ",") + json_string(s.name) + ":{\"flag\":" + json_string(flag_of(s)) +
               ",\"type\":" + json_string(reg::type_name(s.type)) +
               ",\"default\":" + json_value(s.fallback) + "}";
        first = false;
      }
      out += "}}";
    }
    std::cout << out << "}" << std::endl;
    return 0;
  }

 private:
  CLI::App* cmd_ = nullptr;
  bool json_ = false;
};

}  // namespace randattn_cli
