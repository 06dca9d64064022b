// randattn._core.attention: every attention method of the library's registry
// (include/randattn/registry/) behind one call, chosen by name. Keywords are converted here to
// the registry's typed values (TypeError for a wrong type, checked first); every value and
// combination is then checked by the registry (ValueError), as on the command line.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <randattn/registry/layout.hpp>
#include <randattn/registry/registry.hpp>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "arguments.hpp"
#include "bindings.hpp"

namespace randattn_python {

namespace {

namespace reg = randattn::registry;
using randattn::BatchShape;

const reg::Spelling kPython{false};

// A registry value as a Python object (None when unset).
py::object to_python(const reg::Value& v) {
  return std::visit(
      [](const auto& x) -> py::object {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same<T, std::monostate>::value ||
                      std::is_same<T, reg::ArrayValue>::value) {
          return py::none();
        } else {
          return py::cast(x);
        }
      },
      v);
}

// A keyword as the registry's typed value; TypeError for a wrong type.
reg::Value to_value(const reg::OptionSpec& spec, py::handle h) {
  if (h.is_none()) return std::monostate{};
  switch (spec.type) {
    case reg::OptionType::flag:
      return to_flag(h, spec.name);
    case reg::OptionType::integer:
      return to_integer(h, spec.name);
    case reg::OptionType::real:
      return to_real(h, spec.name);
    case reg::OptionType::text:
      return to_text(h, spec.name);
    case reg::OptionType::array: {
      const py::array a = as_float_array(h, spec.name);
      const auto d = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(a);
      reg::ArrayValue out;
      out.shape = shape_of(a);
      out.data.assign(d.data(), d.data() + d.size());
      out.source = "array";
      return out;
    }
  }
  return std::monostate{};
}

// The method's keywords as typed values: TypeError for a keyword it does not own (naming the
// methods that do) or a value of the wrong type.
std::map<std::string, reg::Value> keyword_values(const reg::Method& method,
                                                 const py::dict& options) {
  std::map<std::string, reg::Value> values;
  const std::vector<reg::OptionSpec> specs = method.accepted_options();
  for (const auto& item : options) {
    const std::string name = py::str(item.first);
    const reg::OptionSpec* spec = nullptr;
    for (const reg::OptionSpec& s : specs)
      if (s.name == name) spec = &s;
    if (!spec) {
      std::string owners;
      for (const reg::Method* m : reg::owners(name))
        owners += std::string(owners.empty() ? "method '" : ", '") + m->name() + "'";
      if (!owners.empty())
        throw py::type_error("attention() got option '" + name + "', which belongs to " + owners +
                             ", not method '" + method.name() + "'");
      throw py::type_error("attention() got an unexpected keyword argument '" + name + "'");
    }
    values[name] = to_value(*spec, item.second);
  }
  return values;
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
    if (kk.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || kk.shape(1) != v.shape(1))
      throw py::value_error("batch dimensions of q, k and v, or head dimensions of k and v, differ: " +
                            shapes);
    s.batch = q.shape(0);
    s.heads = q.shape(1);
    if (kk.shape(1) != q.shape(1) && (kk.shape(1) == 0 || q.shape(1) % kk.shape(1) != 0))
      throw py::value_error("the heads of k and v (" + std::to_string(kk.shape(1)) +
                            ") must divide the heads of q (" + std::to_string(q.shape(1)) +
                            "): " + shapes);
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
  if (s.dv == 0) throw py::value_error("value dimension dv must be positive: " + shapes);
  return s;
}

// Key padding, packed sequences and grouped heads (checked by the registry).
reg::Layout layout_of(const py::array& q, const py::array* k, const BatchShape& shape,
                      py::handle key_lengths, py::handle key_padding_mask, py::handle cu_seqlens) {
  reg::Layout layout;
  if (k && k->ndim() == 4) layout.kv_heads = k->shape(1);
  if (!key_lengths.is_none()) {
    const auto a = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(
        key_lengths);
    if (a.ndim() != 1 || a.shape(0) != shape.batch)
      throw py::value_error("key_lengths must have shape (batch,) = (" +
                            std::to_string(shape.batch) + ",), got " + shape_str(shape_of(a)));
    layout.key_padding = reg::padding_of_lengths(
        std::vector<std::int64_t>(a.data(), a.data() + a.size()), shape.n_k, kPython);
  }
  if (!key_padding_mask.is_none()) {
    const auto a = py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>::ensure(
        key_padding_mask);
    if (a.ndim() != 2 || a.shape(0) != shape.batch || a.shape(1) != shape.n_k)
      throw py::value_error("key_padding_mask must have shape (batch, n_k) = (" +
                            std::to_string(shape.batch) + ", " + std::to_string(shape.n_k) +
                            "), got " + shape_str(shape_of(a)));
    layout.key_padding.assign(a.data(), a.data() + a.size());
  }
  if (!cu_seqlens.is_none()) {
    const auto a = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(
        cu_seqlens);
    if (a.ndim() != 1)
      throw py::value_error("cu_seqlens must be 1-D, got shape " + shape_str(shape_of(a)));
    layout.cu_seqlens.assign(a.data(), a.data() + a.size());
  }
  (void)q;
  return layout;
}

py::object report_dict(const reg::Method& method, const reg::Call& call, const reg::Report& fields,
                       double seconds) {
  py::dict d;
  d["method"] = method.name();
  d["scale"] = call.settings.scale;
  for (const auto& [key, value] : fields)
    d[py::str(key)] = std::visit([](const auto& x) { return py::cast(x); }, value);
  d["shared_qk"] = call.settings.shared_qk;
  d["seconds"] = seconds;
  return std::move(d);
}

template <typename Scalar>
py::object run_method(const reg::Method& method, const reg::Call& call, bool four_d,
                      const reg::Layout& layout, const py::array& q, const py::array* k,
                      const py::array& v, std::optional<int> threads, bool report) {
  const reg::Job<Scalar> job = reg::build_job<Scalar>(method, call, layout);
  const RowMajorInput<Scalar> qin(q), vin(v);
  const RowMajorInput<Scalar> kin = k ? RowMajorInput<Scalar>(*k) : RowMajorInput<Scalar>();
  const BatchShape& shape = call.shape;
  std::vector<py::ssize_t> out_shape;
  if (four_d) out_shape = {shape.batch, shape.heads};
  out_shape.push_back(shape.n_q);
  out_shape.push_back(shape.dv);
  py::array_t<Scalar> out(out_shape);
  Scalar* out_data = out.mutable_data();
  reg::Report fields;
  double seconds = 0;
  run_without_gil(threads, [&] {
    const auto start = std::chrono::steady_clock::now();
    fields = job(qin.data(), kin.data(), vin.data(), out_data);
    seconds = reg::seconds_since(start);
  });
  if (!report) return std::move(out);
  return py::make_tuple(out, report_dict(method, call, fields, seconds));
}

py::object attention(py::handle q_obj, py::handle k_obj, py::handle v_obj,
                     const std::string& method_name, py::handle causal, py::handle scale,
                     py::handle seed, py::handle check_finite, py::handle threads,
                     py::handle shared_qk, py::handle report, py::handle exclude_self,
                     py::handle key_lengths,
                     py::handle key_padding_mask, py::handle cu_seqlens, const py::dict& options) {
  const reg::Method& method = reg::find_method(method_name, kPython);
  std::map<std::string, reg::Value> given = keyword_values(method, options);

  reg::Settings settings;
  settings.causal = to_flag(causal, "causal");
  std::optional<double> scale_value;
  if (!scale.is_none()) scale_value = to_real(scale, "scale");
  settings.seed = to_seed(seed, "seed");
  settings.check_finite = to_flag(check_finite, "check_finite");
  settings.shared_qk = to_flag(shared_qk, "shared_qk");
  settings.report = to_flag(report, "report");
  settings.exclude_self = to_flag(exclude_self, "exclude_self");
  const std::optional<int> thread_count = to_threads(threads);

  const py::array q = as_float_array(q_obj, "q"), v = as_float_array(v_obj, "v");
  std::optional<py::array> k;
  if (!k_obj.is_none()) k = as_float_array(k_obj, "k");
  const Dtype dtype = dtype_of(q);
  if (dtype_of(v) != dtype || (k && dtype_of(*k) != dtype))
    throw py::type_error(std::string("q, k and v must have the same dtype, got q ") +
                         dtype_name(dtype) + ", k " + (k ? dtype_name(dtype_of(*k)) : "None") +
                         ", v " + dtype_name(dtype_of(v)));
  reg::check_keys(method, k.has_value(), settings.shared_qk, kPython);
  const BatchShape shape = batch_shape(q, k ? &*k : nullptr, v);
  settings.scale = reg::resolve_scale(scale_value, shape.d, kPython);
  const py::array* kp = k ? &*k : nullptr;
  const reg::Layout layout =
      layout_of(q, kp, shape, key_lengths, key_padding_mask, cu_seqlens);
  reg::check_layout(method, layout, shape, settings, kPython);
  const reg::Call call = reg::make_call(method, std::move(given), settings, shape, kPython);
  const bool four_d = q.ndim() == 4;
  return dtype == Dtype::float32
             ? run_method<float>(method, call, four_d, layout, q, kp, v, thread_count,
                                 settings.report)
             : run_method<double>(method, call, four_d, layout, q, kp, v, thread_count,
                                  settings.report);
}

}  // namespace

void bind_attention(py::module_& m) {
  using namespace pybind11::literals;
  m.def("attention", &attention, "q"_a, "k"_a.none(true), "v"_a, "method"_a, "causal"_a,
        "scale"_a.none(true), "seed"_a, "check_finite"_a, "threads"_a.none(true), "shared_qk"_a,
        "report"_a, "exclude_self"_a, "key_lengths"_a.none(true), "key_padding_mask"_a.none(true),
        "cu_seqlens"_a.none(true), "options"_a);
  py::dict table;
  for (const auto& method : reg::methods()) {
    py::dict entry, defaults;
    entry["summary"] = method->summary();
    entry["shared_qk"] = method->supports_shared_qk();
    for (const reg::OptionSpec& s : method->options())
      defaults[py::str(s.name)] = to_python(s.fallback);
    entry["options"] = defaults;
    table[py::str(method->name())] = entry;
  }
  m.attr("methods") = table;
}

}  // namespace randattn_python
