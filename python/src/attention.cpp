// randattn._core.attention: every attention method of the library behind one call, chosen by
// name from the method table below.
//
// To add a method: write a class deriving from TypedMethod<YourClass> with name(), summary(),
// options() (its keyword options and their defaults) and
//     template <class Scalar> Job<Scalar> plan(const Settings&, const KeywordOptions&, const
//     BatchShape&) const;
// which reads the options (with the GIL held) and returns the computation, run without the GIL;
// then append it in methods() below.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <randattn/randattn.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "bindings.hpp"
#include "feature_maps.hpp"
#include "options.hpp"

namespace randattn_python {

namespace {

using randattn::BatchShape;

// Options shared by every method.
struct Settings {
  bool causal = false;
  std::optional<double> scale;  // unset: the method's default
  std::uint64_t seed = 0;       // the method's random draws (unused by exact)
  bool check_finite = true;
  bool shared_qk = false;  // k is None: the keys are the queries (methods with keys_optional())
};

// The computation of one call on contiguous (batch, heads, n, ·) buffers; k is null for shared QK.
template <typename Scalar>
using Job = std::function<void(const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out)>;

class Method {
 public:
  virtual ~Method() = default;
  virtual const char* name() const = 0;
  virtual const char* summary() const = 0;
  virtual bool keys_optional() const { return false; }
  virtual std::vector<OptionSpec> options() const { return {}; }
  virtual Job<float> plan(const Settings&, const KeywordOptions&, const BatchShape&,
                          float) const = 0;
  virtual Job<double> plan(const Settings&, const KeywordOptions&, const BatchShape&,
                           double) const = 0;
};

// Implements both plan() overloads from Derived's plan<Scalar>.
template <typename Derived>
class TypedMethod : public Method {
 public:
  Job<float> plan(const Settings& s, const KeywordOptions& o, const BatchShape& b,
                  float) const final {
    return static_cast<const Derived&>(*this).template plan<float>(s, o, b);
  }
  Job<double> plan(const Settings& s, const KeywordOptions& o, const BatchShape& b,
                   double) const final {
    return static_cast<const Derived&>(*this).template plan<double>(s, o, b);
  }
};

class ExactMethod final : public TypedMethod<ExactMethod> {
 public:
  const char* name() const override { return "exact"; }
  const char* summary() const override { return "exact softmax attention"; }

  template <typename Scalar>
  Job<Scalar> plan(const Settings& s, const KeywordOptions&, const BatchShape& shape) const {
    randattn::ExactOptions opt;
    opt.causal = s.causal;
    opt.scale = s.scale;
    opt.check_finite = s.check_finite;
    return [opt, shape](const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
      randattn::exact_attention_batched(q, k, v, out, shape, opt);
    };
  }
};

// Random-feature attention with a map of one kind (feature_maps.hpp), one ω for every slice.
class FeatureMethod final : public TypedMethod<FeatureMethod> {
 public:
  FeatureMethod(const char* name, const char* summary, MapKind kind)
      : name_(name), summary_(summary), kind_(kind) {}
  const char* name() const override { return name_; }
  const char* summary() const override { return summary_; }
  std::vector<OptionSpec> options() const override { return map_kind(kind_).options; }

  template <typename Scalar>
  Job<Scalar> plan(const Settings& s, const KeywordOptions& o, const BatchShape& shape) const {
    const MapSpec spec = map_spec(kind_, shape.d, s.seed, o);
    randattn::RandomFeatureOptions opt;
    opt.causal = s.causal;
    opt.scale = s.scale;
    opt.check_finite = s.check_finite;
    return [spec, opt, shape](const Scalar* q, const Scalar* k, const Scalar* v, Scalar* out) {
      const AnyMap<Scalar> map = build_map<Scalar>(spec);
      std::visit(
          [&](const auto& m) {
            randattn::random_feature_attention_batched(m, q, k, v, out, shape, opt);
          },
          map);
    };
  }

 private:
  const char* name_;
  const char* summary_;
  MapKind kind_;
};

// LSH attention (Reformer): k = None shares queries and keys (sort-and-chunk or exact buckets);
// separate keys need exact_buckets=True. Every slice uses the same rotations.
class LshMethod final : public TypedMethod<LshMethod> {
 public:
  const char* name() const override { return "lsh"; }
  const char* summary() const override {
    return "LSH attention (Reformer, cross-polytope buckets)";
  }
  bool keys_optional() const override { return true; }
  std::vector<OptionSpec> options() const override {
    return {{"buckets", std::monostate{}, "number of buckets b, even (default 2*ceil(n/chunk))"},
            {"chunk", std::int64_t(64), "chunk length c of sort-and-chunk"},
            {"rounds", std::int64_t(4), "hash rounds r"},
            {"rotation", std::string("dense"), "random rotation: 'dense' or 'hadamard'"},
            {"rotations", std::monostate{}, "dense rotations (d, r, b/2), used as given"},
            {"dedupe", true,
             "count a key once however many rounds see it (False: once per round, trax/HF)"},
            {"exact_buckets", false, "attend to whole buckets instead of sorted chunks"}};
  }

  template <typename Scalar>
  Job<Scalar> plan(const Settings& s, const KeywordOptions& o, const BatchShape& shape) const {
    randattn::LshOptions opt;
    opt.causal = s.causal;
    opt.scale = s.scale;
    opt.check_finite = s.check_finite;
    opt.chunk = o.integer("chunk");
    opt.exact_buckets = o.flag("exact_buckets");
    opt.dedupe = o.flag("dedupe");
    if (!s.shared_qk && !opt.exact_buckets)
      throw py::value_error(
          "separate keys need exact_buckets=True (sort-and-chunk attention shares queries and "
          "keys; pass k=None)");
    if (opt.chunk < 1)
      throw py::value_error("chunk must be at least 1, got " + std::to_string(opt.chunk));
    const HashSpec hash = hash_spec(o, shape, s.seed);
    return [hash, opt, shape, shared = s.shared_qk](const Scalar* q, const Scalar* k,
                                                    const Scalar* v, Scalar* out) {
      const randattn::CrossPolytopeHash<Scalar> h = hash.build<Scalar>();
      if (shared)
        randattn::lsh_attention_batched(h, q, v, out, shape, opt);
      else
        randattn::lsh_attention_batched(h, q, k, v, out, shape, opt);
    };
  }

 private:
  struct HashSpec {
    randattn::RotationKind kind = randattn::RotationKind::dense;
    Index dim = 0, buckets = 0, rounds = 0;
    std::uint64_t seed = 0;
    std::optional<randattn::RowMatrix<double>> rotations;  // d x (rounds * buckets / 2)

    template <typename Scalar>
    randattn::CrossPolytopeHash<Scalar> build() const {
      if (rotations) return randattn::CrossPolytopeHash<Scalar>(rotations->cast<Scalar>(), rounds);
      return randattn::CrossPolytopeHash<Scalar>(kind, dim, buckets, rounds, seed);
    }
  };

  static HashSpec hash_spec(const KeywordOptions& o, const BatchShape& shape, std::uint64_t seed) {
    HashSpec h;
    h.dim = shape.d;
    h.seed = seed;
    const std::string rotation = o.text("rotation");
    if (rotation != "dense" && rotation != "hadamard")
      throw py::value_error("rotation must be 'dense' or 'hadamard', got '" + rotation + "'");
    h.kind =
        rotation == "hadamard" ? randattn::RotationKind::hadamard : randattn::RotationKind::dense;
    h.rounds = o.integer("rounds");
    if (!o.given("rotations")) {
      h.buckets = o.given("buckets") ? o.integer("buckets")
                                     : randattn::reformer_buckets(shape.n_k, o.integer("chunk"));
      return h;
    }
    if (o.given("rotation")) throw py::value_error("rotation and rotations exclude each other");
    const py::array r = as_float_array(o.value("rotations"), "rotations");
    if (r.ndim() != 3 || r.shape(0) != shape.d || r.shape(1) < 1 || r.shape(2) < 1)
      throw py::value_error("rotations: expected shape (d, r, b/2) with d = " +
                            std::to_string(shape.d) + ", got " + shape_str(shape_of(r)));
    if (o.given("rounds") && h.rounds != r.shape(1))
      throw py::value_error("rounds=" + std::to_string(h.rounds) +
                            " disagrees with rotations of shape " + shape_str(shape_of(r)));
    if (o.given("buckets") && o.integer("buckets") != 2 * r.shape(2))
      throw py::value_error("buckets=" + std::to_string(o.integer("buckets")) +
                            " disagrees with rotations of shape " + shape_str(shape_of(r)));
    h.rounds = r.shape(1);
    h.buckets = 2 * r.shape(2);
    const auto rd = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(r);
    h.rotations = Eigen::Map<const randattn::RowMatrix<double>>(rd.data(), r.shape(0),
                                                                r.shape(1) * r.shape(2));
    return h;
  }
};

// The method table: one entry per method, in the order listed to users.
const std::vector<std::unique_ptr<Method>>& methods() {
  static const std::vector<std::unique_ptr<Method>> table = [] {
    std::vector<std::unique_ptr<Method>> t;
    t.push_back(std::make_unique<ExactMethod>());
    t.push_back(std::make_unique<FeatureMethod>(
        "favor", "FAVOR+ positive random features (m features)", MapKind::positive));
    t.push_back(std::make_unique<FeatureMethod>(
        "favor-hyp", "hyperbolic positive random features (2m features)", MapKind::hyperbolic));
    t.push_back(std::make_unique<FeatureMethod>(
        "trig", "trigonometric random features (2m features, guarded denominator)", MapKind::trig));
    t.push_back(std::make_unique<FeatureMethod>(
        "hybrid", "angular hybrid lambda*hyperbolic + (1-lambda)*trig, lambda = angle/pi",
        MapKind::angular_hybrid));
    t.push_back(std::make_unique<FeatureMethod>(
        "hybrid-gaussian",
        "Gaussian hybrid lambda*trig + (1-lambda)*positive, lambda = exp(-s^2|x-y|^2/2)",
        MapKind::gaussian_hybrid));
    t.push_back(std::make_unique<LshMethod>());
    return t;
  }();
  return table;
}

const Method& find_method(const std::string& name) {
  std::string names;
  for (const auto& m : methods()) {
    if (name == m->name()) return *m;
    names += std::string(names.empty() ? "" : ", ") + m->name();
  }
  throw py::value_error("unknown method '" + name + "' (available: " + names + ")");
}

// The methods other than `self` that own option `name` ("method 'lsh'"), or "".
std::string owners_of(const std::string& name, const Method& self) {
  std::string owners;
  for (const auto& m : methods()) {
    if (m.get() == &self) continue;
    for (const OptionSpec& s : m->options())
      if (s.name == name)
        owners += std::string(owners.empty() ? "method '" : ", '") + m->name() + "'";
  }
  return owners;
}

// Checks the shapes of q, k (absent for shared QK) and v: 2-D (n, d) or 4-D (batch, heads, n, d).
BatchShape batch_shape(const py::array& q, const py::array* k, const py::array& v) {
  const struct {
    const char* name;
    const py::array* a;
  } inputs[] = {{"q", &q}, {"k", k}, {"v", &v}};
  for (const auto& in : inputs) {
    if (in.a && in.a->ndim() != 2 && in.a->ndim() != 4)
      throw py::value_error(
          std::string(in.name) +
          ": expected a 2-D (n, d) or 4-D (batch, heads, n, d) array, got shape " +
          shape_str(shape_of(*in.a)));
  }
  const py::array& kk = k ? *k : q;
  const std::string shapes = "q " + shape_str(shape_of(q)) + ", k " +
                             (k ? shape_str(shape_of(*k)) : "None") + ", v " +
                             shape_str(shape_of(v));
  if (q.ndim() != kk.ndim() || q.ndim() != v.ndim())
    throw py::value_error("q, k and v must have the same number of dimensions, got " + shapes);
  const py::ssize_t r = q.ndim() - 2;  // the token axis
  BatchShape s;
  if (r == 2) {
    if (kk.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || kk.shape(1) != q.shape(1) ||
        v.shape(1) != q.shape(1))
      throw py::value_error("batch and head dimensions of q, k and v differ: " + shapes);
    s.batch = q.shape(0);
    s.heads = q.shape(1);
  }
  s.n_q = q.shape(r);
  s.d = q.shape(r + 1);
  s.n_k = kk.shape(r);
  s.dv = v.shape(r + 1);
  if (kk.shape(r + 1) != s.d)
    throw py::value_error("q and k must have the same feature dimension d: " + shapes);
  if (v.shape(r) != s.n_k)
    throw py::value_error("k and v must have the same number of tokens n_k: " + shapes);
  if (s.d == 0) throw py::value_error("feature dimension d must be positive: " + shapes);
  if (s.n_k == 0) throw py::value_error("at least one key is needed: " + shapes);
  return s;
}

template <typename Scalar>
py::array run_method(const Method& method, const Settings& settings, const KeywordOptions& options,
                     const BatchShape& shape, bool four_d, const py::array& q, const py::array* k,
                     const py::array& v, std::optional<int> threads) {
  const Job<Scalar> job = method.plan(settings, options, shape, Scalar());
  const RowMajorInput<Scalar> qin(q), vin(v);
  const RowMajorInput<Scalar> kin = k ? RowMajorInput<Scalar>(*k) : RowMajorInput<Scalar>();
  std::vector<py::ssize_t> out_shape;
  if (four_d) out_shape = {shape.batch, shape.heads};
  out_shape.push_back(shape.n_q);
  out_shape.push_back(shape.dv);
  py::array_t<Scalar> out(out_shape);
  Scalar* out_data = out.mutable_data();
  run_without_gil(threads, [&] { job(qin.data(), kin.data(), vin.data(), out_data); });
  return std::move(out);
}

py::array attention(py::handle q_obj, py::handle k_obj, py::handle v_obj,
                    const std::string& method_name, py::handle causal, py::handle scale,
                    py::handle seed, py::handle check_finite, py::handle threads,
                    const py::dict& options) {
  const Method& method = find_method(method_name);
  const std::vector<OptionSpec> specs = method.options();
  check_keywords(options, specs, "attention", "method '" + method_name + "'",
                 [&](const std::string& name) { return owners_of(name, method); });

  Settings settings;
  settings.causal = to_flag(causal, "causal");
  if (!scale.is_none()) settings.scale = to_real(scale, "scale");
  settings.seed = to_seed(seed, "seed");
  settings.check_finite = to_flag(check_finite, "check_finite");
  settings.shared_qk = k_obj.is_none();
  const std::optional<int> thread_count = to_threads(threads);

  const py::array q = as_float_array(q_obj, "q"), v = as_float_array(v_obj, "v");
  std::optional<py::array> k;
  if (settings.shared_qk) {
    if (!method.keys_optional())
      throw py::value_error(std::string("k is required for method '") + method.name() + "'");
  } else {
    k = as_float_array(k_obj, "k");
  }
  const Dtype dtype = dtype_of(q);
  if (dtype_of(v) != dtype || (k && dtype_of(*k) != dtype))
    throw py::type_error(std::string("q, k and v must have the same dtype, got q ") +
                         dtype_name(dtype) + ", k " + (k ? dtype_name(dtype_of(*k)) : "None") +
                         ", v " + dtype_name(dtype_of(v)));
  const BatchShape shape = batch_shape(q, k ? &*k : nullptr, v);
  const KeywordOptions keywords(specs, options);
  const bool four_d = q.ndim() == 4;
  const py::array* kp = k ? &*k : nullptr;
  return dtype == Dtype::float32
             ? run_method<float>(method, settings, keywords, shape, four_d, q, kp, v, thread_count)
             : run_method<double>(method, settings, keywords, shape, four_d, q, kp, v,
                                  thread_count);
}

}  // namespace

void bind_attention(py::module_& m) {
  using namespace pybind11::literals;
  m.def("attention", &attention, "q"_a, "k"_a.none(true), "v"_a, "method"_a, "causal"_a,
        "scale"_a.none(true), "seed"_a, "check_finite"_a, "threads"_a.none(true), "options"_a);
  py::dict table;
  for (const auto& method : methods()) {
    py::dict entry;
    entry["summary"] = method->summary();
    entry["keys_optional"] = method->keys_optional();
    entry["options"] = defaults_of(method->options());
    table[py::str(method->name())] = entry;
  }
  m.attr("methods") = table;
}

}  // namespace randattn_python
