"""row_argmax / top_indices (ssdlib/ops/row_top.py): the Triton kernels against the plain
references (argmax's first maximum, a stable sort's first k), ties included; torch's kernels
when called eagerly, the Triton ones inside a CUDA-graph capture."""

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


def _kernel_top(x, k):
    """The Triton kernels on x [..., V] whatever the dispatch rule."""
    return row_top._triton_module().row_top(row_top._rows(x), k).view(*x.shape[:-1], k)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,vocab", [((1,), 49152), ((4,), 49152), ((8, 16), 49152),
                                         ((3,), 50001), ((2, 2), 4100), ((5,), 300)])
def test_kernels_equal_the_references(shape, vocab, dtype):
    x = _logits(shape, vocab, dtype, seed=vocab + len(shape))
    assert torch.equal(_kernel_top(x, 1)[..., 0], row_argmax_reference(x))
    for k in (2, 4, 17, 32):
        # bf16 logits of 49k normals hold many equal values: the order among them is checked
        assert torch.equal(_kernel_top(x, k), top_indices_reference(x, k)), k


@needs_kernel
def test_kernels_on_a_slice_and_on_few_finite_logits():
    full = _logits((2, 3), 49200, torch.bfloat16, seed=3)
    x = full[..., :49152]  # a draft's vocabulary of the target's rows: row stride 49200
    assert torch.equal(_kernel_top(x, 1)[..., 0], row_argmax_reference(x))
    assert torch.equal(_kernel_top(x, 17), top_indices_reference(x, 17))
    masked = torch.full((2, 8192), float("-inf"), device="cuda")
    masked[0, [5, 4000, 8000]] = torch.tensor([1.0, 3.0, 2.0], device="cuda")
    masked[1, 7] = 0.0  # fewer finite logits than k: then the -inf ones, lowest index first
    assert torch.equal(_kernel_top(masked, 6), top_indices_reference(masked, 6))
    assert _kernel_top(masked, 1)[:, 0].tolist() == [4000, 7]


@needs_kernel
def test_eager_calls_take_torch_and_captures_the_kernels(monkeypatch):
    """Eagerly: torch's kernels; inside a capture: the Triton ones, compiled there on first
    use (k = 5 over fp16 logits is used nowhere else); SSDLIB_ROW_TOP=torch switches them off."""
    x = _logits((4,), 49152, torch.float16, seed=5)
    assert not row_top._use_kernel(x, 5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        top_indices(x, 5), row_argmax(x)  # the pool's warm-up: eager, torch's kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert row_top._use_kernel(x, 5) and row_top._use_kernel(x, 1)
        top, arg = top_indices(x, 5), row_argmax(x)
        monkeypatch.setenv("SSDLIB_ROW_TOP", "torch")
        assert not row_top._use_kernel(x, 5)
        monkeypatch.delenv("SSDLIB_ROW_TOP")
        assert not row_top._use_kernel(x[:1].expand(128, -1), 5)  # many rows: torch's top-k
    x.copy_(_logits((4,), 49152, torch.float16, seed=6))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(top, top_indices_reference(x, 5))
    assert torch.equal(arg, row_argmax_reference(x))
