// randattn._core.sparsify, .hosvd and .unfold: tensor sketching of NumPy arrays of any order
// k >= 2. Arrays are read in place through their strides (the library addresses entries by
// their row-major index whatever the storage), so no layout needs a copy.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <randattn/sketch/hosvd.hpp>
#include <randattn/sketch/sparse_tensor.hpp>
#include <randattn/sketch/sparsify.hpp>

#include <optional>
#include <string>
#include <vector>

#include "arguments.hpp"
#include "bindings.hpp"

namespace randattn_python {

namespace {

// A view of `a` in its own storage; byte orders other than the machine's, or strides that are
// not whole elements, go through one counted copy kept alive in `keep`.
template <typename Scalar>
randattn::TensorView<Scalar> view_of(const py::array& a, py::array& keep) {
  const std::vector<Index> dims = shape_of(a);
  const auto item = py::ssize_t(sizeof(Scalar));
  bool in_place = a.dtype().byteorder() == '=';
  std::vector<Index> strides(dims.size());
  for (py::ssize_t j = 0; j < a.ndim(); ++j) {
    in_place = in_place && a.strides(j) % item == 0;
    strides[std::size_t(j)] = a.strides(j) / item;
  }
  if (in_place) {
    keep = a;
    return randattn::TensorView<Scalar>(static_cast<const Scalar*>(a.data()), dims, strides);
  }
  keep = RowMajorInput<Scalar>(a).array();
  return randattn::TensorView<Scalar>(static_cast<const Scalar*>(keep.data()), dims);
}

template <typename Fn>
auto with_tensor(py::handle obj, Fn&& fn) {
  const py::array a = as_float_array(obj, "a");
  py::array keep;
  if (dtype_of(a) == Dtype::float32) return fn(view_of<float>(a, keep));
  return fn(view_of<double>(a, keep));
}

template <typename Scalar>
py::array_t<Scalar> to_numpy(const std::vector<Scalar>& v) {
  py::array_t<Scalar> out(py::ssize_t(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

randattn::SparsifyOptions sparsify_options(py::handle budget, const std::string& scheme,
                                           py::handle seed) {
  randattn::SparsifyOptions opt;
  opt.budget = to_real(budget, "budget");
  opt.scheme = randattn::parse_scheme(scheme);
  opt.seed = to_seed(seed, "seed");
  return opt;
}

// (flat row-major indices int64, values, statistics) of Algorithm 1's sketch (or a baseline's).
py::tuple sparsify(py::handle a, py::handle budget, const std::string& scheme, py::handle seed) {
  const randattn::SparsifyOptions opt = sparsify_options(budget, scheme, seed);
  return with_tensor(a, [&](const auto& view) {
    using Scalar = typename std::decay_t<decltype(view)>::Scalar;
    randattn::SparseSketch<Scalar> sketch;
    run_without_gil(std::nullopt, [&] { sketch = randattn::sparsify(view, opt); });
    py::dict stats;
    stats["scheme"] = randattn::scheme_name(sketch.stats.scheme);
    stats["budget"] = sketch.stats.budget;
    stats["frobenius_norm"] = sketch.stats.frobenius_norm;
    stats["expected_nnz"] = sketch.stats.expected_nnz;
    stats["keep_threshold"] = sketch.stats.keep_threshold();
    stats["uniform_threshold"] = sketch.stats.uniform_threshold();
    std::vector<std::int64_t> flat(sketch.indices().begin(), sketch.indices().end());
    return py::make_tuple(to_numpy(flat), to_numpy(sketch.values()), stats);
  });
}

// Factors U_j (d_j, r_j): exact HOSVD without a budget, Algorithm 2 with one.
py::list hosvd(py::handle a, py::handle ranks_obj, py::handle budget, py::handle seed) {
  std::vector<Index> ranks;
  if (!py::isinstance<py::sequence>(ranks_obj) || py::isinstance<py::str>(ranks_obj))
    throw py::type_error("ranks must be a sequence of integers, got " + type_name(ranks_obj));
  for (py::handle r : py::reinterpret_borrow<py::sequence>(ranks_obj))
    ranks.push_back(to_integer(r, "ranks"));
  std::optional<randattn::SparsifyOptions> opt;
  if (!budget.is_none())
    opt = sparsify_options(budget, "spa", seed);
  else
    to_seed(seed, "seed");
  return with_tensor(a, [&](const auto& view) {
    using Scalar = typename std::decay_t<decltype(view)>::Scalar;
    randattn::Hosvd<Scalar> result;
    run_without_gil(std::nullopt, [&] {
      if (opt)
        result = randattn::sketched_hosvd(view, ranks, *opt);
      else
        result = randattn::exact_hosvd(view, ranks);
    });
    py::list factors;
    for (const randattn::RowMatrix<Scalar>& u : result.factors) {
      py::array_t<Scalar> f({u.rows(), u.cols()});
      std::copy(u.data(), u.data() + u.size(), f.mutable_data());
      factors.append(f);
    }
    return factors;
  });
}

// The mode-`mode` unfolding of a sparse tensor as CSR arrays (data, indices, indptr, shape),
// columns running over the remaining indices in row-major order.
template <typename Scalar>
py::tuple typed_unfold(const std::vector<Index>& dims, const py::array& flat,
                       const py::array& values, Index mode) {
  const auto f = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(flat);
  const RowMajorInput<Scalar> vals(values);
  const Index nnz = f.size();
  if (values.size() != nnz)
    throw py::value_error(std::to_string(nnz) + " indices but " + std::to_string(values.size()) +
                          " values");
  randattn::SparseTensor<Scalar> s(dims, std::vector<Index>(f.data(), f.data() + nnz),
                                   std::vector<Scalar>(vals.data(), vals.data() + nnz));
  const auto m = randattn::unfold<Eigen::RowMajor>(s, mode);
  py::array_t<std::int64_t> indptr(m.outerSize() + 1), indices(nnz);
  py::array_t<Scalar> data(nnz);
  std::copy(m.outerIndexPtr(), m.outerIndexPtr() + m.outerSize() + 1, indptr.mutable_data());
  std::copy(m.innerIndexPtr(), m.innerIndexPtr() + nnz, indices.mutable_data());
  std::copy(m.valuePtr(), m.valuePtr() + nnz, data.mutable_data());
  return py::make_tuple(data, indices, indptr, py::make_tuple(m.rows(), m.cols()));
}

py::tuple unfold(py::handle dims_obj, py::handle flat_obj, py::handle values_obj, py::handle mode) {
  std::vector<Index> dims;
  for (py::handle d : py::reinterpret_borrow<py::sequence>(dims_obj))
    dims.push_back(to_integer(d, "shape"));
  if (!py::isinstance<py::array>(flat_obj)) throw py::type_error("indices must be a NumPy array");
  const auto flat = py::reinterpret_borrow<py::array>(flat_obj);
  const py::array values = as_float_array(values_obj, "values");
  const Index j = to_integer(mode, "mode");
  return dtype_of(values) == Dtype::float32 ? typed_unfold<float>(dims, flat, values, j)
                                            : typed_unfold<double>(dims, flat, values, j);
}

}  // namespace

void bind_sketch(py::module_& m) {
  using namespace pybind11::literals;
  m.def("sparsify", &sparsify, "a"_a, "budget"_a, "scheme"_a, "seed"_a);
  m.def("hosvd", &hosvd, "a"_a, "ranks"_a, "budget"_a.none(true), "seed"_a);
  m.def("unfold", &unfold, "shape"_a, "indices"_a, "values"_a, "mode"_a);
}

}  // namespace randattn_python
