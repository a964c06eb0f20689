// CPU kernel of the tree-decode mask (see tree_mask.h for the semantics).
#include "tree_mask.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

namespace ssdlib {
namespace {

template <typename index_t>
void fill_rows(const index_t* fork_len, bool* out, int64_t n, int64_t B, const TreeMaskWindow& w) {
  const int64_t rows_per_seq = w.q_depths * B;
  const int64_t cols = w.K + w.k_depths * B;
  const int64_t branch_cols = w.k_depths * B;
  // One row per (sequence, query); rows are short, so parallelise over rows only.
  at::parallel_for(0, n * rows_per_seq, /*grain_size=*/64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t seq = r / rows_per_seq;
      const int64_t q = r % rows_per_seq;
      const int64_t qb = q % B;
      const int64_t qd = w.q_depth0 + q / B;
      const int64_t f = static_cast<int64_t>(fork_len[seq * B + qb]);
      bool* row = out + r * cols;
      for (int64_t k = 0; k < w.K; ++k) {
        row[k] = k < f;
      }
      for (int64_t j = 0; j < branch_cols; ++j) {
        row[w.K + j] = (j % B == qb) && (j / B <= qd);
      }
    }
  });
}

}  // namespace

at::Tensor tree_mask_window_cpu(const at::Tensor& fork_len, const TreeMaskWindow& w) {
  TORCH_CHECK(fork_len.device().is_cpu(), "tree_mask_window_cpu: fork_len must be a CPU tensor");
  const at::Tensor fl = fork_len.contiguous();
  const int64_t n = fl.size(0);
  const int64_t B = fl.size(1);
  at::Tensor out = at::empty({n, w.q_depths * B, w.K + w.k_depths * B}, fl.options().dtype(at::kBool));
  if (out.numel() == 0) {
    return out;
  }
  AT_DISPATCH_INDEX_TYPES(fl.scalar_type(), "tree_mask_cpu", [&] {
    fill_rows<index_t>(fl.const_data_ptr<index_t>(), out.mutable_data_ptr<bool>(), n, B, w);
  });
  return out;
}

}  // namespace ssdlib
