#pragma once
// Argument handling shared by the bindings: NumPy inputs seen as row-major buffers (in place
// when they are C-contiguous, one counted copy otherwise), keyword values converted with
// messages that name the argument, and the run of a computation without the GIL.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <randattn/core/half_precision.hpp>
#include <randattn/core/types.hpp>
#include <randattn/registry/options.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace randattn_python {

namespace py = pybind11;
using randattn::Index;

// NumPy has no bfloat16: such arrays travel as this one-field structured dtype of the raw 16 bits
// (python/randattn/_arrays.py makes the same from a torch bfloat16 tensor's bits).
inline py::dtype bfloat16_dtype() {
  // Made once, kept for the process (never destroyed after the interpreter).
  static const auto* dtype = [] {
    py::list fields;
    fields.append(py::make_tuple("bfloat16", "=u2"));
    return new py::dtype(py::module_::import("numpy").attr("dtype")(fields));
  }();
  return *dtype;
}

}  // namespace randattn_python

// Eigen's half types as NumPy dtypes, so that py::array_t<Eigen::half> and
// py::array_t<Eigen::bfloat16> read and make float16 and bfloat16 arrays.
namespace pybind11::detail {
template <>
struct npy_format_descriptor<Eigen::half> {
  static constexpr auto name = const_name("numpy.float16");
  static pybind11::dtype dtype() { return pybind11::dtype("float16"); }
};
template <>
struct npy_format_descriptor<Eigen::bfloat16> {
  static constexpr auto name = const_name("bfloat16");
  static pybind11::dtype dtype() { return randattn_python::bfloat16_dtype(); }
};
}  // namespace pybind11::detail

namespace randattn_python {

// Inputs copied because they were not C-contiguous (or not in native byte order). Tests read
// it to check that C-contiguous inputs are used in place.
inline std::atomic<std::int64_t>& input_copies() {
  static std::atomic<std::int64_t> count{0};
  return count;
}

// float16 and bfloat16 only from as_attention_array().
enum class Dtype { float32, float64, float16, bfloat16 };

inline const char* dtype_name(Dtype t) {
  switch (t) {
    case Dtype::float32:
      return "float32";
    case Dtype::float64:
      return "float64";
    case Dtype::float16:
      return "float16";
    case Dtype::bfloat16:
      return "bfloat16";
  }
  return "?";
}

inline std::string type_name(py::handle h) {
  return py::str(py::type::handle_of(h).attr("__name__"));
}

// "(2, 3)": Python tuple notation.
inline std::string shape_str(const std::vector<Index>& s) {
  std::string out = "(";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  if (s.size() == 1) out += ",";
  return out + ")";
}

inline std::vector<Index> shape_of(const py::array& a) {
  return std::vector<Index>(a.shape(), a.shape() + a.ndim());
}

// `obj` as a NumPy array of float32 or float64 (any byte order); TypeError otherwise.
inline py::array as_float_array(py::handle obj, const std::string& name) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(name + " must be a NumPy array, got " + type_name(obj));
  auto a = py::reinterpret_borrow<py::array>(obj);
  const py::dtype t = a.dtype();
  if (t.kind() != 'f' || (t.itemsize() != 4 && t.itemsize() != 8))
    throw py::type_error(name + " must have dtype float32 or float64, got " +
                         std::string(py::str(py::handle(t))));
  return a;
}

inline bool is_bfloat16(const py::array& a) { return py::array_t<Eigen::bfloat16>::check_(a); }

// A dtype as NumPy prints it, bfloat16 by its name.
inline std::string dtype_text(const py::array& a) {
  return is_bfloat16(a) ? "bfloat16" : std::string(py::str(py::handle(a.dtype())));
}

// `obj` as a NumPy array of float16, bfloat16, float32 or float64 (any byte order): q, k and v
// of attention; TypeError otherwise.
inline py::array as_attention_array(py::handle obj, const std::string& name) {
  if (!py::isinstance<py::array>(obj))
    throw py::type_error(name + " must be a NumPy array, got " + type_name(obj));
  auto a = py::reinterpret_borrow<py::array>(obj);
  const py::dtype t = a.dtype();
  if (!is_bfloat16(a) && (t.kind() != 'f' || (t.itemsize() != 2 && t.itemsize() != 4 &&
                                               t.itemsize() != 8)))
    throw py::type_error(name + " must have dtype float16, bfloat16, float32 or float64, got " +
                         std::string(py::str(py::handle(t))));
  return a;
}

// The dtype of an array from as_float_array() or as_attention_array().
inline Dtype dtype_of(const py::array& a) {
  if (is_bfloat16(a)) return Dtype::bfloat16;
  switch (a.dtype().itemsize()) {
    case 2:
      return Dtype::float16;
    case 4:
      return Dtype::float32;
    default:
      return Dtype::float64;
  }
}

// fn(Scalar()) for the scalar type of `t`.
template <typename Fn>
decltype(auto) with_scalar(Dtype t, Fn&& fn) {
  switch (t) {
    case Dtype::float16:
      return fn(Eigen::half());
    case Dtype::bfloat16:
      return fn(Eigen::bfloat16());
    case Dtype::float32:
      return fn(float());
    default:
      return fn(double());
  }
}

// The values of a float array of any of the four dtypes, row-major, as float64 (exact).
inline std::vector<double> float64_values(const py::array& a) {
  if (is_bfloat16(a)) {
    const auto c =
        py::array_t<Eigen::bfloat16, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!c) throw py::error_already_set();
    return std::vector<double>(c.data(), c.data() + c.size());
  }
  const auto d = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!d) throw py::error_already_set();
  return std::vector<double>(d.data(), d.data() + d.size());
}

// A float array read as a C-contiguous buffer of Scalar: the caller's memory when it already is
// one, otherwise a single converted copy (counted by input_copies()). Never written to.
template <typename Scalar>
class RowMajorInput {
 public:
  RowMajorInput() = default;
  explicit RowMajorInput(const py::array& a) {
    using Contiguous = py::array_t<Scalar, py::array::c_style | py::array::forcecast>;
    array_ = Contiguous::ensure(a);
    if (!array_) {
      // ensure() clears the Python error; NumPy's own copy raises it again (MemoryError when
      // the copy does not fit), anything else is a bad input.
      const py::dtype want = py::dtype::of<Scalar>();
      py::module_::import("numpy").attr("ascontiguousarray")(a, want);
      throw py::value_error("cannot convert an array of shape " + shape_str(shape_of(a)) +
                            " to a C-contiguous " + std::string(py::str(py::handle(want))) + " array");
    }
    if (array_.ptr() != a.ptr()) ++input_copies();
  }
  const Scalar* data() const { return array_ ? array_.data() : nullptr; }
  const py::array& array() const { return array_; }

 private:
  py::array_t<Scalar, py::array::c_style | py::array::forcecast> array_;
};

// --- Keyword values ---------------------------------------------------------------------------

inline std::int64_t to_integer(py::handle h, const std::string& name) {
  if (PyBool_Check(h.ptr()) || !PyIndex_Check(h.ptr()))
    throw py::type_error(name + " must be an integer, got " + type_name(h));
  const auto i = py::reinterpret_steal<py::object>(PyNumber_Index(h.ptr()));
  if (!i) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow) throw py::value_error(name + " = " + std::string(py::str(i)) + " is out of range");
  return v;
}

inline std::uint64_t to_seed(py::handle h, const std::string& name) {
  if (PyBool_Check(h.ptr()) || !PyIndex_Check(h.ptr()))
    throw py::type_error(name + " must be an integer, got " + type_name(h));
  const auto i = py::reinterpret_steal<py::object>(PyNumber_Index(h.ptr()));
  if (!i) throw py::error_already_set();
  const unsigned long long v = PyLong_AsUnsignedLongLong(i.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(name + " must be an integer in [0, 2**64), got " +
                          std::string(py::str(i)));
  }
  return v;
}

inline double to_real(py::handle h, const std::string& name) {
  if (PyBool_Check(h.ptr()) || !PyNumber_Check(h.ptr()) || PyComplex_Check(h.ptr()))
    throw py::type_error(name + " must be a real number, got " + type_name(h));
  const double v = PyFloat_AsDouble(h.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

inline bool to_flag(py::handle h, const std::string& name) {
  if (PyBool_Check(h.ptr())) return h.ptr() == Py_True;
  if (py::isinstance(h, py::module_::import("numpy").attr("bool_"))) return h.cast<bool>();
  throw py::type_error(name + " must be True or False, got " + type_name(h));
}

inline std::string to_text(py::handle h, const std::string& name) {
  if (!py::isinstance<py::str>(h))
    throw py::type_error(name + " must be a string, got " + type_name(h));
  return h.cast<std::string>();
}

// --- Running without the GIL ------------------------------------------------------------------

// The number of OpenMP threads of the calling thread for one scope (unset: left as it is).
class ThreadCount {
 public:
  explicit ThreadCount(std::optional<int> threads) {
#ifdef _OPENMP
    if (threads) {
      previous_ = omp_get_max_threads();
      omp_set_num_threads(*threads);
    }
#else
    (void)threads;
#endif
  }
  ~ThreadCount() {
#ifdef _OPENMP
    if (previous_ > 0) omp_set_num_threads(previous_);
#endif
  }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int previous_ = 0;
};

// threads=None or an integer >= 1.
inline std::optional<int> to_threads(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return randattn::registry::checked_threads(to_integer(h, "threads"),
                                             randattn::registry::Spelling{});
}

// Runs fn() with the GIL released and `threads` OpenMP threads. Everything fn touches must have
// been read from Python objects before.
template <typename Fn>
void run_without_gil(std::optional<int> threads, Fn&& fn) {
  py::gil_scoped_release release;
  ThreadCount scope(threads);
  std::forward<Fn>(fn)();
}

}  // namespace randattn_python
