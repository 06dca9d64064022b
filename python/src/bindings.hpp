#pragma once
// The parts of randattn._core, each defined in its own translation unit.

#include <pybind11/pybind11.h>

namespace randattn_python {

void bind_attention(pybind11::module_& m);     // attention.cpp: attention(), the method table
void bind_feature_maps(pybind11::module_& m);  // feature_maps.cpp: FeatureMap, Decoder
void bind_sketch(pybind11::module_& m);        // sketch.cpp: sparsify(), hosvd(), unfold()
void bind_kv_cache(pybind11::module_& m);      // kv_cache.cpp: KVCache

}  // namespace randattn_python
