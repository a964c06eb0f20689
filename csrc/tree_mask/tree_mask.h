// Tree-decode attention mask: shared declarations for the CPU and CUDA kernels.
//
// Both ops are one computation over a (query-depth, key-depth) window of the full tree mask:
//   queries: depths [q_depth0, q_depth0 + q_depths), B per depth, depth-major (q = d*B + b)
//   keys:    K speculation keys, then B * k_depths branch keys, depth-major (K + d*B + b)
//   mask[i, q, k] = k < K ? k < fork_len[i, b(q)]
//                         : b(k) == b(q) && d(k) <= d(q)
// tree_mask(depth) is the window (q_depth0=depth, q_depths=1, k_depths=depth+1);
// tree_mask_full(D) is (0, D, D).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace ssdlib {

struct TreeMaskWindow {
  int64_t K;         // speculation keys
  int64_t q_depth0;  // depth of the first query row
  int64_t q_depths;  // query depths in the output (rows = q_depths * B)
  int64_t k_depths;  // branch depths among the keys (cols = K + k_depths * B)
};

// fork_len: [n, B] int32/int64, contiguous, on the kernel's device. Returns bool [n, q_depths*B, K + k_depths*B].
at::Tensor tree_mask_window_cpu(const at::Tensor& fork_len, const TreeMaskWindow& w);
at::Tensor tree_mask_window_cuda(const at::Tensor& fork_len, const TreeMaskWindow& w);

}  // namespace ssdlib
