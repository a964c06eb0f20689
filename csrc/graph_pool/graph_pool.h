// CUDA-graph pool of ssdlib._C (CUDA builds only; the class is defined in graph_pool.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace ssdlib {

// Adds the class GraphPool to the module m.
void bind_graph_pool(pybind11::module_& m);

}  // namespace ssdlib
