// The Python module ssdlib._C.
//
// Loading the library registers the tree-mask ops with the PyTorch dispatcher (TORCH_LIBRARY in
// tree_mask/binding.cpp runs at load time); the module object itself carries
//   WITH_CUDA   True when the CUDA kernels are built in
//   GraphPool   CUDA builds only: captured CUDA graphs in one memory pool (graph_pool/)
// Python reaches the ops through ssdlib.ops, which picks the compiled op or the reference.
#include <pybind11/pybind11.h>  // includes Python.h first, as it must be

#ifdef SSDLIB_WITH_CUDA
#include "graph_pool/graph_pool.h"
#endif

// torch.utils.cpp_extension defines TORCH_EXTENSION_NAME from the extension's name ("_C").
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ssdlib compiled ops; importing it registers torch.ops.ssdlib.*";
#ifdef SSDLIB_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  ssdlib::bind_graph_pool(m);
#else
  m.attr("WITH_CUDA") = false;
#endif
}
