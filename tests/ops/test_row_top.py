"""row_argmax / top_indices (ssdlib/ops/row_top.py): the Triton kernels against the plain
references (argmax's first maximum, a stable sort's first k), ties included; the torch path
on CPU."""

import pytest
import torch

from ssdlib.ops import row_top
from ssdlib.ops.row_top import (row_argmax, row_argmax_reference, top_indices,
                                top_indices_reference)

needs_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or row_top._triton_module() is None,
    reason="needs CUDA and triton")


def test_cpu_path_matches_the_references():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6000)  # fp32 normals: no ties
    assert torch.equal(row_argmax(x), row_argmax_reference(x))
    assert torch.equal(top_indices(x, 17), top_indices_reference(x, 17))


def test_the_references_break_ties_to_the_lower_index():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, -1.0]])
    assert row_argmax_reference(x).tolist() == [1]
    assert top_indices_reference(x, 4).tolist() == [[1, 3, 4, 2]]


@pytest.mark.parametrize("k", [0, 7])
def test_k_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match="k must be in 1..6"):
        top_indices(torch.zeros(2, 6), k)


def _logits(shape, vocab, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, vocab, device="cuda", generator=g).to(dtype)
    x[..., 11] = x.max() + 1  # a planted tie for the maximum, further on too
    x[..., vocab - 3] = x[..., 11]
    return x


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,vocab", [((1,), 49152), ((4,), 49152), ((8, 16), 49152),
                                         ((3,), 50001), ((2, 2), 4100)])
def test_kernels_equal_the_references(shape, vocab, dtype):
    x = _logits(shape, vocab, dtype, seed=vocab + len(shape))
    assert torch.equal(row_argmax(x), row_argmax_reference(x))
    for k in (1, 2, 4, 17, 32):
        # bf16 logits of 49k normals hold many equal values: the order among them is checked
        assert torch.equal(top_indices(x, k), top_indices_reference(x, k)), k


@needs_kernel
def test_kernels_on_a_slice_and_on_few_finite_logits():
    full = _logits((2, 3), 49200, torch.bfloat16, seed=3)
    x = full[..., :49152]  # a draft's vocabulary of the target's rows: row stride 49200
    assert torch.equal(row_argmax(x), row_argmax_reference(x))
    assert torch.equal(top_indices(x, 17), top_indices_reference(x, 17))
    masked = torch.full((2, 8192), float("-inf"), device="cuda")
    masked[0, [5, 4000, 8000]] = torch.tensor([1.0, 3.0, 2.0], device="cuda")
    masked[1, 7] = 0.0  # fewer finite logits than k: then the -inf ones, lowest index first
    assert torch.equal(top_indices(masked, 6), top_indices_reference(masked, 6))
    assert row_argmax(masked).tolist() == [4000, 7]


@needs_kernel
def test_kernels_replay_in_a_cuda_graph(monkeypatch):
    x = _logits((4,), 49152, torch.bfloat16, seed=5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        top_indices(x, 17), row_argmax(x)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        top, arg = top_indices(x, 17), row_argmax(x)
    x.copy_(_logits((4,), 49152, torch.bfloat16, seed=6))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(top, top_indices_reference(x, 17))
    assert torch.equal(arg, row_argmax_reference(x))
    monkeypatch.setenv("SSDLIB_ROW_TOP", "torch")  # the switch back to torch's kernels
    assert not row_top._use_kernel(x, 17)
