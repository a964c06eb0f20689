// CUDA kernel of the tree-decode mask (see tree_mask.h for the semantics).
//
// One thread per output element; the mask is small (a few thousand bools per sequence), so the
// kernel is launch-bound and kept simple. No host synchronisation, so it can be captured in a
// CUDA graph.
#include "tree_mask.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

namespace ssdlib {
namespace {

template <typename index_t>
__global__ void tree_mask_kernel(const index_t* __restrict__ fork_len, bool* __restrict__ out,
                                 int64_t total, int64_t B, int64_t K, int64_t q_depth0,
                                 int64_t rows_per_seq, int64_t cols) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t k = idx % cols;
    const int64_t r = idx / cols;
    const int64_t q = r % rows_per_seq;
    const int64_t seq = r / rows_per_seq;
    const int64_t qb = q % B;
    bool visible;
    if (k < K) {
      visible = k < static_cast<int64_t>(fork_len[seq * B + qb]);
    } else {
      const int64_t j = k - K;
      visible = (j % B == qb) && (j / B <= q_depth0 + q / B);
    }
    out[idx] = visible;
  }
}

}  // namespace

at::Tensor tree_mask_window_cuda(const at::Tensor& fork_len, const TreeMaskWindow& w) {
  TORCH_CHECK(fork_len.is_cuda(), "tree_mask_window_cuda: fork_len must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(fork_len.device());
  const at::Tensor fl = fork_len.contiguous();
  const int64_t n = fl.size(0);
  const int64_t B = fl.size(1);
  const int64_t rows_per_seq = w.q_depths * B;
  const int64_t cols = w.K + w.k_depths * B;
  at::Tensor out = at::empty({n, rows_per_seq, cols}, fl.options().dtype(at::kBool));
  const int64_t total = out.numel();
  if (total == 0) {
    return out;
  }
  constexpr int threads = 256;
  const int64_t max_blocks = 4096;  // grid-stride loop covers the rest
  const int blocks = static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, max_blocks));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(fl.scalar_type(), "tree_mask_cuda", [&] {
    tree_mask_kernel<index_t><<<blocks, threads, 0, stream>>>(
        fl.const_data_ptr<index_t>(), out.mutable_data_ptr<bool>(), total, B, w.K, w.q_depth0,
        rows_per_seq, cols);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace ssdlib
