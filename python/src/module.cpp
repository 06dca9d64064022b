// randattn._core: the compiled half of the Python package. The pure-Python half
// (python/randattn/) handles torch tensors, 2-D/4-D layouts and keyword defaults; every check of
// a value and every computation happens here. Invalid arguments raise ValueError (the library's
// std::invalid_argument, translated by pybind11) or TypeError; computations run without the GIL.

#include <pybind11/pybind11.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "arguments.hpp"
#include "bindings.hpp"

#ifndef RANDATTN_VERSION
#define RANDATTN_VERSION "unknown"
#endif

PYBIND11_MODULE(_core, m) {
  namespace rp = randattn_python;
  m.doc() = "randattn compiled core (use the randattn package)";
  m.attr("__version__") = RANDATTN_VERSION;
  rp::bind_attention(m);
  rp::bind_feature_maps(m);
  rp::bind_sketch(m);
  rp::bind_kv_cache(m);
  m.def(
      "input_copies", [] { return rp::input_copies().load(); },
      "Number of inputs copied because they were not C-contiguous (arrays that are used in place "
      "are not counted)");
  m.def(
      "max_threads",
      [] {
#ifdef _OPENMP
        return omp_get_max_threads();
#else
        return 1;
#endif
      },
      "OpenMP threads a call uses when threads=None");
}
