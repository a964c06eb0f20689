"""Tree-decode mask: the torch reference against a plain loop, and the compiled op against both.

Runs on CPU in CI. The compiled-op tests skip unless ``ssdlib._C`` is built (``pip install
--no-build-isolation -e .`` with CUDA, or with SSDLIB_BUILD_CPU_EXT=1); the CUDA tests skip without
a GPU. ``SSDLIB_TEST_BUILD_EXT=1`` additionally compiles csrc/tree_mask on the fly with
torch.utils.cpp_extension.load (minutes on a small machine) and checks that build too.
"""

import itertools
import os
from pathlib import Path

import pytest
import torch

from ssdlib.ops import (
    extension_available,
    tree_mask,
    tree_mask_full,
    tree_mask_full_reference,
    tree_mask_reference,
)

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "tree_mask"
HAS_CUDA = torch.cuda.is_available()

# (K, B, depth, n): n=None means an unbatched fork_len of shape [B].
SHAPES = list(itertools.product([0, 1, 3, 5], [1, 2, 4], [0, 1, 3], [None, 1, 3]))
DTYPES = [torch.int32, torch.int64]


def loop_tree_mask(fork_len: list[int], K: int, depth: int) -> list[list[bool]]:
    """The semantics written as loops: B queries at ``depth`` vs K spec keys + B*(depth+1) branch keys."""
    B = len(fork_len)
    mask = []
    for b in range(B):
        row = [i < fork_len[b] for i in range(K)]
        for d in range(depth + 1):
            for b2 in range(B):
                row.append(b2 == b and d <= depth)
        mask.append(row)
    return mask


def loop_tree_mask_full(fork_len: list[int], K: int, D: int) -> list[list[bool]]:
    """All B*D branch tokens as queries, depth-major (row d*B + b)."""
    B = len(fork_len)
    mask = []
    for d in range(D):
        for b in range(B):
            row = [i < fork_len[b] for i in range(K)]
            for d2 in range(D):
                for b2 in range(B):
                    row.append(b2 == b and d2 <= d)
            mask.append(row)
    return mask


def make_fork_len(K: int, B: int, n, dtype, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * K + 10 * B + (n or 0))
    rows = n or 1
    fork_len = torch.randint(0, K + 1, (rows, B), generator=gen)
    fork_len[0, 0] = K  # always cover both ends of [0, K]
    fork_len[-1, -1] = 0
    fork_len = fork_len.to(dtype)
    return (fork_len if n else fork_len[0]).to(device)


def loop_expected(fork_len: torch.Tensor, K: int, depth_or_D: int, full: bool) -> torch.Tensor:
    loop = loop_tree_mask_full if full else loop_tree_mask
    rows = fork_len.cpu().reshape(-1, fork_len.shape[-1]).tolist()
    B = fork_len.shape[-1]
    queries = B * depth_or_D if full else B
    cols = K + B * (depth_or_D if full else depth_or_D + 1)
    expected = torch.tensor([loop(r, K, depth_or_D) for r in rows], dtype=torch.bool)
    expected = expected.reshape(len(rows), queries, cols)
    return expected if fork_len.dim() == 2 else expected[0]


# --- reference vs loop ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,B,depth,n", SHAPES)
def test_reference_matches_loop(K, B, depth, n, dtype):
    fork_len = make_fork_len(K, B, n, dtype)
    got = tree_mask_reference(fork_len, K, depth)
    assert got.dtype == torch.bool
    assert torch.equal(got, loop_expected(fork_len, K, depth, full=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,B,D,n", SHAPES)
def test_full_reference_matches_loop(K, B, D, n, dtype):
    fork_len = make_fork_len(K, B, n, dtype)
    assert torch.equal(tree_mask_full_reference(fork_len, K, D), loop_expected(fork_len, K, D, full=True))


@pytest.mark.parametrize("K,B,D", [(0, 1, 1), (3, 2, 3), (5, 4, 4)])
def test_full_rows_are_per_depth_masks(K, B, D):
    fork_len = make_fork_len(K, B, 3, torch.int64)
    full = tree_mask_full_reference(fork_len, K, D)
    for d in range(D):
        step = full[:, d * B : (d + 1) * B, : K + B * (d + 1)]
        assert torch.equal(step, tree_mask_reference(fork_len, K, d))
        assert not full[:, d * B : (d + 1) * B, K + B * (d + 1) :].any()


def test_empty_shapes():
    assert tree_mask_reference(torch.zeros(0, 3, dtype=torch.int32), 2, 1).shape == (0, 3, 8)
    assert tree_mask_reference(torch.zeros(0, dtype=torch.int64), 2, 1).shape == (0, 2)
    assert tree_mask_full_reference(torch.zeros(2, 3, dtype=torch.int64), 2, 0).shape == (2, 0, 2)


@pytest.mark.parametrize("fn", [tree_mask, tree_mask_full, tree_mask_reference, tree_mask_full_reference])
def test_rejects_bad_input(fn):
    with pytest.raises(TypeError):
        fn(torch.zeros(2, dtype=torch.float32), 2, 1)
    with pytest.raises(TypeError):
        fn([1, 2], 2, 1)
    with pytest.raises(ValueError):
        fn(torch.zeros(1, 2, 3, dtype=torch.int64), 2, 1)
    with pytest.raises(ValueError):
        fn(torch.zeros(2, dtype=torch.int64), -1, 1)
    with pytest.raises(ValueError):
        fn(torch.zeros(2, dtype=torch.int64), 2, -1)


def test_dispatch_falls_back_when_disabled(monkeypatch):
    monkeypatch.setenv("SSDLIB_DISABLE_EXT", "1")
    assert not extension_available()
    fork_len = make_fork_len(3, 2, 2, torch.int32)
    assert torch.equal(tree_mask(fork_len, 3, 2), tree_mask_reference(fork_len, 3, 2))
    assert torch.equal(tree_mask_full(fork_len, 3, 2), tree_mask_full_reference(fork_len, 3, 2))


# --- compiled op vs reference --------------------------------------------------------------------


def check_compiled(ops, device: str) -> None:
    """Compare ``ops.tree_mask`` / ``ops.tree_mask_full`` with the reference over all shapes.

    The error cases format numbers into the message (K, shapes): with a statically linked libstdc++
    in the extension that segfaults (see setup.py, LINK_ARGS), so they guard the build too.
    """
    for (K, B, depth, n), dtype in itertools.product(SHAPES, DTYPES):
        fork_len = make_fork_len(K, B, n, dtype, device)
        got = ops.tree_mask(fork_len, K, depth)
        assert got.device == fork_len.device and got.dtype == torch.bool
        assert torch.equal(got.cpu(), tree_mask_reference(fork_len.cpu(), K, depth)), (K, B, depth, n, dtype)
        got = ops.tree_mask_full(fork_len, K, depth)
        assert torch.equal(got.cpu(), tree_mask_full_reference(fork_len.cpu(), K, depth)), (K, B, depth, n, dtype)
    # Non-contiguous input and the compiled op's own validation.
    fork_len = make_fork_len(4, 3, 5, torch.int64, device).t()
    assert torch.equal(ops.tree_mask(fork_len, 4, 2).cpu(), tree_mask_reference(fork_len.cpu(), 4, 2))
    with pytest.raises(TypeError):
        ops.tree_mask(torch.zeros(2, device=device), 2, 1)
    with pytest.raises(ValueError):
        ops.tree_mask_full(torch.zeros(1, 1, 2, dtype=torch.int32, device=device), 2, 1)
    with pytest.raises(ValueError):
        ops.tree_mask(torch.zeros(2, dtype=torch.int32, device=device), 2, -1)


needs_ext = pytest.mark.skipif(not extension_available(), reason="ssdlib._C is not built (see csrc/README.md)")


@needs_ext
def test_compiled_cpu_matches_reference():
    check_compiled(torch.ops.ssdlib, "cpu")


@needs_ext
def test_compiled_meta_shapes():
    fork_len = torch.empty(3, 4, dtype=torch.int64, device="meta")
    assert torch.ops.ssdlib.tree_mask(fork_len, 5, 2).shape == (3, 4, 5 + 4 * 3)
    assert torch.ops.ssdlib.tree_mask_full(fork_len, 5, 2).shape == (3, 8, 5 + 8)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.skipif(not extension_available("cuda"), reason="ssdlib._C is not built with CUDA")
def test_compiled_cuda_matches_reference():
    check_compiled(torch.ops.ssdlib, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_reference_on_cuda_matches_cpu():
    for (K, B, depth, n), dtype in itertools.product(SHAPES, DTYPES):
        fork_len = make_fork_len(K, B, n, dtype, "cuda")
        expected = tree_mask_full_reference(fork_len.cpu(), K, depth)
        assert torch.equal(tree_mask_full(fork_len, K, depth).cpu(), expected)
        assert torch.equal(tree_mask_full_reference(fork_len, K, depth).cpu(), expected)


# --- on-the-fly build of csrc (opt-in: slow) ----------------------------------------------------


@pytest.fixture(scope="module")
def jit_ops(tmp_path_factory):
    if os.environ.get("SSDLIB_TEST_BUILD_EXT") != "1":
        pytest.skip("set SSDLIB_TEST_BUILD_EXT=1 to compile csrc/tree_mask on the fly")
    from torch.utils.cpp_extension import load

    # A separate op namespace, so this build can be loaded next to an installed ssdlib._C.
    sources = [str(CSRC / "binding.cpp"), str(CSRC / "tree_mask_cpu.cpp")]
    cflags = ["-O2", "-DSSDLIB_OP_NAMESPACE=ssdlib_jit"]
    cuda_cflags = []
    if HAS_CUDA and torch.version.cuda is not None:
        sources.append(str(CSRC / "tree_mask.cu"))
        cflags.append("-DSSDLIB_WITH_CUDA")
        major, minor = torch.cuda.get_device_capability()
        cuda_cflags = ["-O2", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
    load(
        name="ssdlib_tree_mask_jit",
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=["-l:libstdc++.so.6"],  # as setup.py: never a private static libstdc++
        build_directory=str(tmp_path_factory.mktemp("tree_mask_build")),
        is_python_module=False,
    )
    return torch.ops.ssdlib_jit


def test_jit_build_cpu_matches_reference(jit_ops):
    check_compiled(jit_ops, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_jit_build_cuda_matches_reference(jit_ops):
    check_compiled(jit_ops, "cuda")
