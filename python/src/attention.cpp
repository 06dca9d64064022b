// randattn._core.attention: every attention method of the library's registry
// (include/randattn/registry/) behind one call, chosen by name. Keywords are converted here to
// the registry's typed values (TypeError for a wrong type, checked first); every value and
// combination is then checked by the registry (ValueError), as on the command line. q, k and v
// of one dtype: float32, float64, or float16 and bfloat16, which the registry runs in float32
// (registry/half_precision.hpp) with results and gradients rounded to their dtype.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <randattn/registry/layout.hpp>
#include <randattn/registry/registry.hpp>

#include <chrono>
#include <cmath>
#include <memory>
#include <cstdint>
#include <initializer_list>
#include <utility>
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
    case reg::OptionType::array: {  // any float dtype: the values are exact in float64
      const py::array a = as_attention_array(h, spec.name);
      reg::ArrayValue out;
      out.shape = shape_of(a);
      out.data = float64_values(a);
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

// A layout array keyword as the registry's IndexArray; TypeError unless its dtype is the declared
// one (integers or booleans).
reg::IndexArray to_index_array(const reg::LayoutInputSpec& spec, py::handle h) {
  if (!py::isinstance<py::array>(h))
    throw py::type_error(reg::layout_type_message(spec, type_name(h), kPython));
  const auto a = py::reinterpret_borrow<py::array>(h);
  const char kind = a.dtype().kind();
  const bool boolean = kind == 'b';
  if (kind != 'b' && kind != 'i' && kind != 'u')
    throw py::type_error(reg::layout_type_message(
        spec, "dtype " + std::string(py::str(py::handle(a.dtype()))), kPython));
  if (boolean != (spec.type == reg::LayoutInputType::booleans))
    throw py::type_error(reg::layout_type_message(
        spec, boolean ? "a boolean array" : "an integer array", kPython));
  const auto c =
      py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!c) throw py::error_already_set();
  return {shape_of(a), std::vector<std::int64_t>(c.data(), c.data() + c.size()), boolean};
}

// Takes the layout keywords (layout_inputs()) out of `options`: flags into the settings, arrays
// into the returned map. None is as if not given.
std::map<std::string, reg::IndexArray> take_layout(py::dict& options, reg::Settings& settings) {
  std::map<std::string, reg::IndexArray> arrays;
  for (const reg::LayoutInputSpec& spec : reg::layout_inputs()) {
    const py::str name(spec.name);
    if (!options.contains(name)) continue;
    const py::object value = options[name];
    PyDict_DelItem(options.ptr(), name.ptr());
    if (spec.type == reg::LayoutInputType::flag)
      reg::set_layout_flag(settings, spec.name, to_flag(value, spec.name));
    else if (!value.is_none())
      arrays[spec.name] = to_index_array(spec, value);
  }
  return arrays;
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

// The bytes [first, last) an array's elements span (negative strides included); first == last
// for an empty array. Arrays whose spans are disjoint share no memory.
std::pair<std::uintptr_t, std::uintptr_t> byte_span(const py::array& a) {
  auto first = reinterpret_cast<std::uintptr_t>(a.data()), last = first;
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    if (a.shape(i) == 0) return {first, first};
    const py::ssize_t reach = (a.shape(i) - 1) * a.strides(i);
    if (reach < 0) first -= std::uintptr_t(-reach);
    else last += std::uintptr_t(reach);
  }
  return {first, last + std::uintptr_t(a.itemsize())};
}

// The caller's `out` checked before anything is written: a writeable C-contiguous array of
// the result's dtype and shape whose memory overlaps none of the inputs; ValueError otherwise.
template <typename Scalar>
Scalar* output_buffer(const py::handle& out_obj, const std::vector<py::ssize_t>& shape,
                      std::initializer_list<std::pair<const char*, const py::array*>> inputs) {
  if (!py::isinstance<py::array>(out_obj))
    throw py::type_error("out must be a NumPy array or a CPU torch tensor, got " +
                         type_name(out_obj));
  auto out = py::reinterpret_borrow<py::array>(out_obj);
  const std::vector<Index> want(shape.begin(), shape.end());
  if (!py::array_t<Scalar>::check_(out))
    throw py::value_error("out has dtype " + dtype_text(out) + ", expected " +
                          randattn::scalar_type_name<Scalar>() + " (the dtype of q, k and v)");
  if (shape_of(out) != want)
    throw py::value_error("out has shape " + shape_str(shape_of(out)) + ", expected " +
                          shape_str(want));
  if (!(out.flags() & py::array::c_style))
    throw py::value_error("out must be C-contiguous (e.g. numpy.empty(shape, dtype))");
  if (!out.writeable()) throw py::value_error("out is read-only");
  const auto o = byte_span(out);
  for (const auto& [name, input] : inputs) {
    if (!input) continue;
    const auto x = byte_span(*input);
    if (o.first < o.second && x.first < x.second && o.first < x.second && x.first < o.second)
      throw py::value_error(std::string("out shares memory with ") + name +
                            "; pass an array of its own");
  }
  return static_cast<Scalar*>(out.mutable_data());
}

template <typename Scalar>
py::object run_method(const reg::Method& method, const reg::Call& call, bool four_d,
                      const reg::Layout& layout, const py::array& q, const py::array* k,
                      const py::array& v, std::optional<int> threads, bool report,
                      py::handle out_obj) {
  const BatchShape& shape = call.shape;
  std::vector<py::ssize_t> out_shape;
  if (four_d) out_shape = {shape.batch, shape.heads};
  out_shape.push_back(shape.n_q);
  out_shape.push_back(shape.dv);
  py::object out;
  Scalar* out_data = nullptr;
  if (out_obj.is_none()) {
    py::array_t<Scalar> fresh(out_shape);
    out_data = fresh.mutable_data();
    out = std::move(fresh);
  } else {
    out_data = output_buffer<Scalar>(out_obj, out_shape, {{"q", &q}, {"k", k}, {"v", &v}});
    out = py::reinterpret_borrow<py::object>(out_obj);
  }
  const reg::Job<Scalar> job = reg::build_job<Scalar>(method, call, layout);
  const RowMajorInput<Scalar> qin(q), vin(v);
  const RowMajorInput<Scalar> kin = k ? RowMajorInput<Scalar>(*k) : RowMajorInput<Scalar>();
  reg::Report fields;
  double seconds = 0;
  run_without_gil(threads, [&] {
    const auto start = std::chrono::steady_clock::now();
    fields = job(qin.data(), kin.data(), vin.data(), out_data);
    seconds = reg::seconds_since(start);
  });
  if (!report) return out;
  return py::make_tuple(out, report_dict(method, call, fields, seconds));
}

// A call's arguments, converted and checked: the method, its options and settings, the layout
// and the arrays.
struct Arguments {
  const reg::Method* method = nullptr;
  reg::Call call;
  reg::Layout layout;
  py::array q, v;
  std::optional<py::array> k;
  bool four_d = false;
  Dtype dtype = Dtype::float32;
  std::optional<int> threads;

  const py::array* keys() const { return k ? &*k : nullptr; }
  // The result's shape: (n_q, dv) or (batch, heads, n_q, dv).
  std::vector<py::ssize_t> out_shape() const {
    const BatchShape& s = call.shape;
    std::vector<py::ssize_t> shape;
    if (four_d) shape = {s.batch, s.heads};
    shape.push_back(s.n_q);
    shape.push_back(s.dv);
    return shape;
  }
};

Arguments arguments(py::handle q_obj, py::handle k_obj, py::handle v_obj,
                    const std::string& method_name, py::handle causal, py::handle scale,
                    py::handle seed, py::handle check_finite, py::handle threads,
                    py::handle shared_qk, py::handle report, const py::dict& keywords,
                    const std::vector<std::string>& option_gradients = {}) {
  Arguments a;
  a.method = &reg::find_method(method_name, kPython);
  const reg::Method& method = *a.method;
  reg::Settings settings;
  py::dict options = py::reinterpret_steal<py::dict>(PyDict_Copy(keywords.ptr()));
  const std::map<std::string, reg::IndexArray> layout_given = take_layout(options, settings);
  std::map<std::string, reg::Value> given = keyword_values(method, options);

  settings.causal = to_flag(causal, "causal");
  std::optional<double> scale_value;
  if (!scale.is_none()) scale_value = to_real(scale, "scale");
  settings.seed = to_seed(seed, "seed");
  settings.check_finite = to_flag(check_finite, "check_finite");
  settings.shared_qk = to_flag(shared_qk, "shared_qk");
  settings.report = to_flag(report, "report");
  settings.option_gradients = option_gradients;
  a.threads = to_threads(threads);

  a.q = as_attention_array(q_obj, "q");
  a.v = as_attention_array(v_obj, "v");
  if (!k_obj.is_none()) a.k = as_attention_array(k_obj, "k");
  a.dtype = dtype_of(a.q);
  if (dtype_of(a.v) != a.dtype || (a.k && dtype_of(*a.k) != a.dtype))
    throw py::type_error(std::string("q, k and v must have the same dtype, got q ") +
                         dtype_name(a.dtype) + ", k " + (a.k ? dtype_name(dtype_of(*a.k)) : "None") +
                         ", v " + dtype_name(dtype_of(a.v)));
  reg::check_keys(method, a.k.has_value(), settings.shared_qk, kPython);
  const std::vector<Index> k_shape = a.k ? shape_of(*a.k) : std::vector<Index>();
  const reg::CallShape call_shape =
      reg::call_shape(shape_of(a.q), a.k ? &k_shape : nullptr, shape_of(a.v), kPython);
  settings.scale = reg::resolve_scale(scale_value, call_shape.shape.d, kPython);
  a.layout = reg::make_layout(method, layout_given, call_shape, settings, kPython);
  a.call = reg::make_call(method, std::move(given), settings, call_shape.shape, kPython);
  a.four_d = a.q.ndim() == 4;
  return a;
}

py::object attention(py::handle q_obj, py::handle k_obj, py::handle v_obj,
                     const std::string& method_name, py::handle causal, py::handle scale,
                     py::handle seed, py::handle check_finite, py::handle threads,
                     py::handle shared_qk, py::handle report, const py::dict& keywords,
                     py::handle out) {
  const Arguments a = arguments(q_obj, k_obj, v_obj, method_name, causal, scale, seed,
                                check_finite, threads, shared_qk, report, keywords);
  return with_scalar(a.dtype, [&](auto scalar) {
    return run_method<decltype(scalar)>(*a.method, a.call, a.four_d, a.layout, a.q, a.keys(), a.v,
                                        a.threads, a.call.settings.report, out);
  });
}

// A differentiable call (the registry's Gradient): forward() computes the output as attention()
// does, bit for bit, and keeps the inputs (read in place, or the one converted copy) and what the
// backward needs; backward(grad_out) returns (dq, dk or None, dv, {option: gradient}).
class GradientCall {
 public:
  GradientCall(py::handle q, py::handle k, py::handle v, const std::string& method,
               py::handle causal, py::handle scale, py::handle seed, py::handle check_finite,
               py::handle threads, py::handle shared_qk, py::handle report,
               const py::dict& options, const std::vector<std::string>& option_gradients)
      : args_(arguments(q, k, v, method, causal, scale, seed, check_finite, threads, shared_qk,
                        report, options, option_gradients)) {
    with_scalar(args_.dtype, [&](auto scalar) {
      state_ = std::make_unique<Typed<decltype(scalar)>>(args_);
    });
  }

  py::object forward() {
    if (done_forward_) throw py::value_error("forward() was already called on this call");
    py::object result = std::visit([&](auto& typed) { return typed->forward(args_); }, state_);
    done_forward_ = true;
    return result;
  }

  py::tuple backward(py::handle grad_out) {
    if (!done_forward_) throw py::value_error("backward() needs forward() first");
    return std::visit([&](auto& typed) { return typed->backward(args_, grad_out); }, state_);
  }

 private:
  template <typename Scalar>
  struct Typed {
    RowMajorInput<Scalar> q, k, v;
    reg::GradientPtr<Scalar> gradient;

    explicit Typed(const Arguments& a)
        : q(a.q), k(a.k ? RowMajorInput<Scalar>(*a.k) : RowMajorInput<Scalar>()), v(a.v),
          gradient(reg::build_gradient<Scalar>(*a.method, a.call, a.layout)) {}

    py::object forward(const Arguments& a) {
      py::array_t<Scalar> out(a.out_shape());
      Scalar* o = out.mutable_data();
      reg::Report fields;
      double seconds = 0;
      run_without_gil(a.threads, [&] {
        const auto start = std::chrono::steady_clock::now();
        fields = gradient->forward(q.data(), k.data(), v.data(), o);
        seconds = reg::seconds_since(start);
      });
      if (!a.call.settings.report) return std::move(out);
      return py::make_tuple(out, report_dict(*a.method, a.call, fields, seconds));
    }

    py::tuple backward(const Arguments& a, py::handle grad_out_obj) {
      const std::vector<py::ssize_t> shape = a.out_shape();
      if (!py::isinstance<py::array>(grad_out_obj))
        throw py::type_error("grad_out must be an array, got " + type_name(grad_out_obj));
      const auto g = py::reinterpret_borrow<py::array>(grad_out_obj);
      if (!py::array_t<Scalar>::check_(g))
        throw py::value_error("grad_out has dtype " + dtype_text(g) + ", expected " +
                              randattn::scalar_type_name<Scalar>() + " (the dtype of the output)");
      if (shape_of(g) != std::vector<Index>(shape.begin(), shape.end()))
        throw py::value_error("grad_out has shape " + shape_str(shape_of(g)) +
                              ", expected the output's shape " +
                              shape_str(std::vector<Index>(shape.begin(), shape.end())));
      const RowMajorInput<Scalar> go(g);
      const py::ssize_t count = g.size();
      for (py::ssize_t i = 0; i < count; ++i)
        if (!std::isfinite(double(go.data()[i])))
          throw py::value_error("grad_out holds a non-finite value (" +
                                std::to_string(double(go.data()[i])) + ") at flat index " +
                                std::to_string(i));
      py::array_t<Scalar> dq(shape_of(a.q)), dv(shape_of(a.v));
      py::object dk = py::none();
      Scalar* dk_data = nullptr;
      if (a.k) {
        py::array_t<Scalar> dk_array(shape_of(*a.k));
        dk_data = dk_array.mutable_data();
        dk = std::move(dk_array);
      }
      Scalar* dq_data = dq.mutable_data();
      Scalar* dv_data = dv.mutable_data();
      std::vector<std::pair<std::string, std::vector<double>>> options;
      run_without_gil(a.threads, [&] {
        gradient->backward(go.data(), dq_data, dk_data, dv_data);
        options = gradient->option_gradients();
      });
      py::dict option_grads;
      for (const auto& [name, values] : options) {
        py::array_t<double> array(py::ssize_t(values.size()));
        std::copy(values.begin(), values.end(), array.mutable_data());
        option_grads[py::str(name)] = array;
      }
      return py::make_tuple(dq, dk, dv, option_grads);
    }
  };

  Arguments args_;
  std::variant<std::unique_ptr<Typed<float>>, std::unique_ptr<Typed<double>>,
               std::unique_ptr<Typed<Eigen::half>>, std::unique_ptr<Typed<Eigen::bfloat16>>>
      state_;
  bool done_forward_ = false;
};

}  // namespace

void bind_attention(py::module_& m) {
  using namespace pybind11::literals;
  m.def("attention", &attention, "q"_a, "k"_a.none(true), "v"_a, "method"_a, "causal"_a,
        "scale"_a.none(true), "seed"_a, "check_finite"_a, "threads"_a.none(true), "shared_qk"_a,
        "report"_a, "options"_a, "out"_a.none(true) = py::none());
  py::class_<GradientCall>(m, "GradientCall")
      .def(py::init<py::handle, py::handle, py::handle, const std::string&, py::handle,
                    py::handle, py::handle, py::handle, py::handle, py::handle, py::handle,
                    const py::dict&, const std::vector<std::string>&>(),
           "q"_a, "k"_a.none(true), "v"_a, "method"_a, "causal"_a, "scale"_a.none(true), "seed"_a,
           "check_finite"_a, "threads"_a.none(true), "shared_qk"_a, "report"_a, "options"_a,
           "option_gradients"_a)
      .def("forward", &GradientCall::forward)
      .def("backward", &GradientCall::backward, "grad_out"_a);
  // The layout keywords (key padding, packed sequences, self-exclusion), as the registry
  // declares them.
  py::list layout_inputs;
  for (const reg::LayoutInputSpec& s : reg::layout_inputs()) {
    py::dict entry;
    entry["name"] = s.name;
    entry["type"] = s.type == reg::LayoutInputType::flag       ? "flag"
                    : s.type == reg::LayoutInputType::booleans ? "booleans"
                                                               : "integers";
    entry["shape"] = s.type == reg::LayoutInputType::flag ? py::object(py::none())
                                                          : py::object(py::str(reg::shape_rule(s)));
    entry["help"] = s.help;
    layout_inputs.append(entry);
  }
  m.attr("layout_inputs") = layout_inputs;
  py::dict table;
  for (const auto& method : reg::methods()) {
    py::dict entry, defaults;
    entry["summary"] = method->summary();
    entry["shared_qk"] = method->supports_shared_qk();
    entry["differentiable"] = method->differentiable();
    entry["differentiable_options"] = method->differentiable_options();
    for (const reg::OptionSpec& s : method->options())
      defaults[py::str(s.name)] = to_python(s.fallback);
    entry["options"] = defaults;
    table[py::str(method->name())] = entry;
  }
  m.attr("methods") = table;
}

}  // namespace randattn_python
