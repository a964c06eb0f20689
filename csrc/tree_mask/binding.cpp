// Registers the tree-mask ops with the PyTorch dispatcher and validates their inputs.
//
//   torch.ops.ssdlib.tree_mask(Tensor fork_len, int K, int depth) -> Tensor
//   torch.ops.ssdlib.tree_mask_full(Tensor fork_len, int K, int D) -> Tensor
//
// fork_len: [B] or [n, B], int32 or int64. tree_mask returns bool [(n,) B, K + B*(depth+1)],
// tree_mask_full bool [(n,) B*D, K + B*D]. Semantics: tree_mask.h and docs/ATTENTION.md.
// Kernels: CPU (tree_mask_cpu.cpp), CUDA (tree_mask.cu, when built with SSDLIB_WITH_CUDA), and
// Meta (shape only, for torch.compile / fake tensors). The Python module that loads this library
// is csrc/module.cpp; this file needs no Python.
//
// fork_len values are not range-checked: that would need a device-to-host copy on CUDA (and break
// CUDA-graph capture). The formula `key < fork_len` makes values outside [0, K] act as clamped.
#include "tree_mask.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

// The op namespace is a macro so that a second copy (the JIT build in the tests) can be loaded
// next to the installed extension without clashing.
#ifndef SSDLIB_OP_NAMESPACE
#define SSDLIB_OP_NAMESPACE ssdlib
#endif
#define SSDLIB_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define SSDLIB_TORCH_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace ssdlib {
namespace {

// Returns fork_len as [n, B] after checking dtype and rank.
at::Tensor batched_fork_len(const at::Tensor& fork_len, const char* op) {
  const auto dtype = fork_len.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kInt || dtype == at::kLong, op,
                   ": fork_len must be int32 or int64, got ", dtype);
  TORCH_CHECK_VALUE(fork_len.dim() == 1 || fork_len.dim() == 2, op,
                    ": fork_len must have shape [B] or [n, B], got ", fork_len.sizes());
  return fork_len.dim() == 1 ? fork_len.unsqueeze(0) : fork_len;
}

void check_non_negative(int64_t value, const char* name, const char* op) {
  TORCH_CHECK_VALUE(value >= 0, op, ": ", name, " must be >= 0, got ", value);
}

using WindowKernel = at::Tensor (*)(const at::Tensor&, const TreeMaskWindow&);

at::Tensor tree_mask_window_meta(const at::Tensor& fork_len, const TreeMaskWindow& w) {
  const int64_t B = fork_len.size(1);
  return at::empty({fork_len.size(0), w.q_depths * B, w.K + w.k_depths * B},
                   fork_len.options().dtype(at::kBool));
}

template <WindowKernel kernel>
at::Tensor tree_mask(const at::Tensor& fork_len, int64_t K, int64_t depth) {
  const at::Tensor fl = batched_fork_len(fork_len, "tree_mask");
  check_non_negative(K, "K", "tree_mask");
  check_non_negative(depth, "depth", "tree_mask");
  const at::Tensor out = kernel(fl, TreeMaskWindow{K, depth, 1, depth + 1});
  return fork_len.dim() == 1 ? out.squeeze(0) : out;
}

template <WindowKernel kernel>
at::Tensor tree_mask_full(const at::Tensor& fork_len, int64_t K, int64_t D) {
  const at::Tensor fl = batched_fork_len(fork_len, "tree_mask_full");
  check_non_negative(K, "K", "tree_mask_full");
  check_non_negative(D, "D", "tree_mask_full");
  const at::Tensor out = kernel(fl, TreeMaskWindow{K, 0, D, D});
  return fork_len.dim() == 1 ? out.squeeze(0) : out;
}

}  // namespace
}  // namespace ssdlib

SSDLIB_TORCH_LIBRARY(SSDLIB_OP_NAMESPACE, m) {
  m.def("tree_mask(Tensor fork_len, int K, int depth) -> Tensor");
  m.def("tree_mask_full(Tensor fork_len, int K, int D) -> Tensor");
}

SSDLIB_TORCH_LIBRARY_IMPL(SSDLIB_OP_NAMESPACE, CPU, m) {
  m.impl("tree_mask", &ssdlib::tree_mask<ssdlib::tree_mask_window_cpu>);
  m.impl("tree_mask_full", &ssdlib::tree_mask_full<ssdlib::tree_mask_window_cpu>);
}

SSDLIB_TORCH_LIBRARY_IMPL(SSDLIB_OP_NAMESPACE, Meta, m) {
  m.impl("tree_mask", &ssdlib::tree_mask<ssdlib::tree_mask_window_meta>);
  m.impl("tree_mask_full", &ssdlib::tree_mask_full<ssdlib::tree_mask_window_meta>);
}

#ifdef SSDLIB_WITH_CUDA
SSDLIB_TORCH_LIBRARY_IMPL(SSDLIB_OP_NAMESPACE, CUDA, m) {
  m.impl("tree_mask", &ssdlib::tree_mask<ssdlib::tree_mask_window_cuda>);
  m.impl("tree_mask_full", &ssdlib::tree_mask_full<ssdlib::tree_mask_window_cuda>);
}
#endif
