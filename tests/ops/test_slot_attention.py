"""slot_attention: the torch reference against a float64 loop, the Triton kernel against the reference.

On CPU: the reference vs ``loop_attention`` (float64, one query and one key at a time), input
checks, dispatch, and the Triton kernel run by triton's interpreter (TRITON_INTERPRET=1) in a
subprocess, since the flag must be set before the kernels are defined and must not leak into the
CUDA tests. On CUDA (skipped without a GPU): the compiled kernel vs the reference over dtypes and
shapes, and a CUDA-graph capture replayed with new slots / limits / tree masks / cache contents.
Triton tests skip when triton is not installed.
"""

import importlib.metadata
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssdlib.ops.slot_attention import slot_attention, slot_attention_reference

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def needs_cuda_triton(test):
    """A GPU test (``-m gpu``), skipped without CUDA or triton."""
    return pytest.mark.gpu(pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")(test))


def _version(module: str) -> tuple[int, ...]:
    try:
        text = importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


# Triton's interpreter before 3.9 runs tl.max(...) into a 1-element array with numpy >= 2.4, which
# then fails to convert to a scalar (seen with triton 3.6.0); the compiled kernel is unaffected.
INTERPRETER_BROKEN = HAS_TRITON and _version("triton") < (3, 9) and _version("numpy") >= (2, 4)

# Triton kernel vs reference, (atol, rtol) per dtype: bf16/fp16 round the output and the
# probabilities fed to the P @ V product; fp32 runs the dots in IEEE fp32.
KERNEL_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def loop_attention(q, k_cache, v_cache, slots, kv_limit, scale, tree_k=None, tree_v=None, tree_mask=None,
                   kv_start=None):
    """The semantics one query at a time, in float64: q [b, s, hq, hd] -> [b, s, hq, hd] float64."""
    b, s, hq, hd = q.shape
    hkv, L = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(b, s, hq, hd, dtype=torch.float64)
    for i in range(b):
        slot = int(slots[i])
        for j in range(s):
            for h in range(hq):
                kvh = h // group
                first = 0 if kv_start is None else max(int(kv_start[i, j]), 0)
                seen = range(first, min(int(kv_limit[i, j]), L))
                pairs = [(k_cache[slot, kvh, n], v_cache[slot, kvh, n]) for n in seen]
                if tree_k is not None:
                    pairs += [(tree_k[slot, kvh, t], tree_v[slot, kvh, t])
                              for t in range(tree_k.shape[2]) if bool(tree_mask[i, j, t])]
                if not pairs:
                    continue
                logits = [float(q[i, j, h].double() @ key.double()) * scale for key, _ in pairs]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                out[i, j, h] = sum(w * value.double() for w, (_, value) in zip(weights, pairs)) / total
    return out


def make_inputs(b, s, hq, hkv, hd, L, T, dtype, device="cpu", n_slots=None, seed=0, window=None):
    """Random attention inputs with ragged limits (some 0, some L) and, if T, a random tree mask;
    with ``window``, each query's first key kv_start = limit - window (a sliding window's)."""
    gen = torch.Generator().manual_seed(seed)
    n_slots = n_slots or b + 2

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    kv_limit = torch.randint(0, L + 1, (b, s), generator=gen)
    kv_limit[-1, -1] = L
    kv_limit[0, 0] = 0 if b * s > 1 else L  # a query without slot keys (unless it is the only one)
    inputs = dict(
        q=randn(b, s, hq, hd), k_cache=randn(n_slots, hkv, L, hd), v_cache=randn(n_slots, hkv, L, hd),
        slots=torch.randperm(n_slots, generator=gen)[:b].to(device), kv_limit=kv_limit.to(device),
        scale=hd ** -0.5)
    if T:
        tree_mask = torch.rand(b, s, T, generator=gen) < 0.5
        if b * s > 1:
            tree_mask[0, 0] = False  # with kv_limit[0, 0] = 0: a query that sees nothing
        inputs.update(tree_k=randn(n_slots, hkv, T, hd), tree_v=randn(n_slots, hkv, T, hd),
                      tree_mask=tree_mask.to(device))
    if window is not None:
        inputs["kv_start"] = (kv_limit - window).to(device)
    return inputs


# (b, s, hq, hkv, hd, L, T)
REF_SHAPES = [
    (2, 3, 6, 2, 16, 24, 5),  # GQA, verify-like
    (1, 1, 9, 3, 8, 17, 0),  # SmolLM2 heads, one-row decode
    (3, 1, 9, 3, 8, 17, 4),
    (3, 4, 4, 4, 8, 10, 7),  # MHA
    (2, 2, 4, 1, 8, 12, 3),  # MQA
]
REF_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", REF_SHAPES, ids=str)
def test_reference_matches_loop(shape, dtype):
    inputs = make_inputs(*shape, dtype=dtype)
    got = slot_attention_reference(**inputs)
    assert got.dtype == dtype and got.shape == inputs["q"].shape
    want = loop_attention(**inputs)
    torch.testing.assert_close(got.double(), want, atol=REF_TOL[dtype], rtol=REF_TOL[dtype])
    assert torch.all(got[0, 0] == 0) or shape[:2] == (1, 1)  # the query with no key


@pytest.mark.parametrize("window", [1, 4, 9, 40], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("T", [0, 5])
def test_reference_sliding_window_matches_loop(window, T):
    inputs = make_inputs(3, 4, 6, 2, 8, 24, T, torch.float64, window=window, seed=window)
    got = slot_attention_reference(**inputs)
    torch.testing.assert_close(got, loop_attention(**inputs), atol=1e-10, rtol=1e-10)
    wide = make_inputs(3, 4, 6, 2, 8, 24, T, torch.float64, window=24, seed=window)
    no_window = dict(wide, kv_start=None)  # a window as long as the cache hides nothing
    torch.testing.assert_close(slot_attention_reference(**wide),
                               slot_attention_reference(**no_window), atol=0, rtol=0)
    if window < 9:  # a short window changes the result where a query had older keys
        plain = slot_attention_reference(**dict(inputs, kv_start=None))
        assert not torch.allclose(got, plain)


def test_reference_tree_only_and_limits_clamped():
    inputs = make_inputs(2, 3, 4, 2, 8, 10, 6, torch.float64)
    inputs["kv_limit"] = torch.tensor([[0, -3, 10], [25, 4, 0]])
    inputs["tree_mask"][0, 1] = True  # no slot key (negative limit), every tree key
    got = slot_attention_reference(**inputs)
    torch.testing.assert_close(got, loop_attention(**inputs), atol=1e-10, rtol=1e-10)
    clamped = dict(inputs, kv_limit=inputs["kv_limit"].clamp(0, 10))
    torch.testing.assert_close(got, slot_attention_reference(**clamped), atol=0, rtol=0)


def test_reference_noncontiguous_int32_duplicate_slots():
    inputs = make_inputs(3, 4, 6, 3, 8, 16, 5, torch.float32)
    inputs["q"] = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)  # strides of [b, hq, s, hd]
    inputs["k_cache"] = torch.cat([inputs["k_cache"], inputs["k_cache"]], dim=3)[..., ::2]
    inputs["kv_limit"] = inputs["kv_limit"].to(torch.int32)
    inputs["slots"] = torch.tensor([2, 2, 0], dtype=torch.int32)  # two rows on one slot (padding)
    assert not inputs["q"].is_contiguous() and not inputs["k_cache"].is_contiguous()
    got = slot_attention_reference(**inputs)
    torch.testing.assert_close(got.double(), loop_attention(**inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, error", [
    (dict(q=torch.zeros(2, 3, 6)), ValueError),
    (dict(q=torch.zeros(2, 3, 5, 8)), ValueError),  # 5 query heads, 2 kv heads
    (dict(q=torch.zeros(2, 3, 6, 4)), ValueError),  # head_dim
    (dict(q=torch.zeros(2, 3, 6, 8, dtype=torch.float16)), TypeError),
    (dict(slots=torch.zeros(3, dtype=torch.int64)), ValueError),
    (dict(slots=torch.zeros(2)), ValueError),
    (dict(kv_limit=torch.zeros(2, 4, dtype=torch.int64)), ValueError),
    (dict(kv_start=torch.zeros(2, 4, dtype=torch.int64)), ValueError),
    (dict(kv_start=torch.zeros(2, 3)), ValueError),
    (dict(tree_v=None), ValueError),
    (dict(tree_mask=torch.ones(2, 3, 5, dtype=torch.int64)), ValueError),
    (dict(tree_mask=torch.ones(2, 3, 4, dtype=torch.bool)), ValueError),
    (dict(tree_k=torch.zeros(7, 2, 5, 8), tree_v=torch.zeros(7, 2, 5, 8)), ValueError),  # n_slots
], ids=lambda x: str(x) if isinstance(x, type) else ",".join(x))
def test_bad_inputs(change, error):
    inputs = make_inputs(2, 3, 6, 2, 8, 10, 5, torch.float32)
    inputs.update(change)
    with pytest.raises(error):
        slot_attention(**inputs)


def test_dispatch_on_cpu(monkeypatch):
    inputs = make_inputs(2, 3, 6, 2, 8, 10, 5, torch.float32)
    want = slot_attention_reference(**inputs)
    monkeypatch.delenv("SSDLIB_ATTENTION", raising=False)
    for backend in ("auto", "torch"):
        torch.testing.assert_close(slot_attention(**inputs, backend=backend), want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="backend"):
        slot_attention(**inputs, backend="cuda")


@needs_triton
def test_triton_backend_needs_cuda_or_interpreter():
    from ssdlib.ops import triton_slot_attention as kernels

    if kernels._interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set for this process")
    with pytest.raises(ValueError, match="CUDA"):
        slot_attention(**make_inputs(1, 1, 2, 1, 16, 8, 0, torch.float32), backend="triton")


@needs_triton
def test_num_splits_static():
    from ssdlib.ops.triton_slot_attention import MAX_SPLITS, launch_config, num_splits

    assert launch_config(1, 3, 64, torch.bfloat16) == (16, 32, 64, 4)  # decode, SmolLM2 heads
    assert launch_config(64, 4, 128, torch.float16) == (64, 32, 128, 8)
    assert launch_config(64, 4, 128, torch.float32) == (32, 16, 128, 8)
    assert launch_config(6, 3, 64, torch.bfloat16) == (32, 64, 64, 4)  # verify
    assert launch_config(1, 1, 24, torch.bfloat16)[2] == 32
    assert num_splits(1, 3, 1, 4096, 64, 132) == MAX_SPLITS  # b=1 decode fans out over the SMs
    assert num_splits(1, 3, 1, 256, 64, 132) == 4  # no more splits than BLOCK_N tiles of L
    assert num_splits(8, 8, 4, 4096, 32, 132) == 2  # 256 programs already
    assert num_splits(64, 8, 4, 4096, 32, 132) == 1


# Interpreter cases: (name, shape (b, s, hq, hkv, hd, L, T), dtype, splits, extra) run in the child.
INTERPRETER_CASES = [
    *[(f"gqa-{dt}-T{T}", (2, 3, 6, 2, 32, 80, T), dt, None, "")
      for dt in ("float32", "float16", "bfloat16") for T in (0, 9)],
    *[(f"splits{n}-T{T}", (2, 3, 6, 2, 32, 80, T), "float32", n, "") for n in (1, 2, 7) for T in (0, 9)],
    ("decode-smollm2", (3, 1, 9, 3, 64, 64, 0), "bfloat16", None, ""),
    ("mha-hd24", (2, 2, 4, 4, 24, 40, 5), "float16", None, ""),
    ("m-blocks", (1, 23, 6, 2, 16, 50, 20), "float32", 3, ""),  # 69 queries per kv head: 2 blocks
    ("long-tiles", (2, 2, 4, 2, 16, 300, 0), "float32", 2, ""),  # several tiles per split
    ("odd-inputs", (3, 4, 6, 3, 16, 40, 6), "float32", None, "odd"),
    # sliding windows: starts inside and across tiles and splits, some before 0, with a tree
    *[(f"window{w}-splits{n}-T{T}", (2, 3, 6, 2, 16, 300, T), "float32", n, f"window{w}")
      for w, n, T in ((5, 1, 0), (37, 3, 6), (130, None, 0), (260, 7, 6))],
]


def _interpreter_child() -> None:
    """Runs in a subprocess with TRITON_INTERPRET=1: every INTERPRETER_CASES case vs the reference."""
    from ssdlib.ops.triton_slot_attention import _interpreted, triton_slot_attention

    assert _interpreted(), "TRITON_INTERPRET=1 did not select triton's interpreter"
    failures = []
    for name, shape, dtype_name, splits, extra in INTERPRETER_CASES:
        dtype = getattr(torch, dtype_name)
        window = int(extra[len("window"):]) if extra.startswith("window") else None
        inputs = make_inputs(*shape, dtype=dtype, seed=len(name), window=window)
        if extra == "odd":  # non-contiguous q, cache and slots, int32 limits beyond L and negative, shared slot
            inputs["q"] = inputs["q"].transpose(1, 2).contiguous().transpose(1, 2)
            inputs["v_cache"] = inputs["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)
            inputs["kv_limit"] = inputs["kv_limit"].to(torch.int32)
            inputs["kv_limit"][1, :2] = torch.tensor([-5, 1000])
            inputs["slots"][2] = inputs["slots"][0]
            # slots as a strided view (a column of a packed host arena, as captured steps pass)
            inputs["slots"] = torch.stack([inputs["slots"], inputs["slots"] * 0 + 10 ** 6], 1)[:, 0]
            assert inputs["slots"].stride(0) == 2
        want = slot_attention_reference(**inputs)
        got = triton_slot_attention(**inputs, splits=splits)
        via_dispatch = slot_attention(**inputs, backend="triton")
        atol, rtol = KERNEL_TOL[dtype]
        for label, out in (("kernel", got), ("dispatch", via_dispatch)):
            try:
                torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
                assert out.dtype == dtype and torch.all(out[0, 0] == 0)
                if window is not None:  # the loop is the semantics of kv_start
                    torch.testing.assert_close(out.double(), loop_attention(**inputs),
                                               atol=atol, rtol=rtol)
            except AssertionError as exc:
                failures.append(f"{name} ({label}): {exc}")
    if failures:
        raise AssertionError("\n".join(failures))


@needs_triton
@pytest.mark.skipif(INTERPRETER_BROKEN, reason="triton < 3.9's interpreter fails with numpy >= 2.4 "
                    "(tl.max gives a 1-element array)")
def test_triton_interpreter_matches_reference():
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    code = "from tests.ops.test_slot_attention import _interpreter_child; _interpreter_child()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]


# (b, s, hq, hkv, hd, L)
CUDA_SHAPES = [
    (1, 1, 9, 3, 64, 4096),  # SmolLM2 decode, long cache
    (4, 6, 9, 3, 64, 1024),  # verify
    (8, 64, 9, 3, 64, 512),  # tree step, all branches as queries
    (2, 1, 32, 8, 128, 2048),
    (3, 6, 32, 8, 128, 300),
    (2, 17, 8, 8, 96, 200),  # MHA, head_dim not a power of two
    (1, 5, 4, 1, 128, 77),  # MQA, L not a multiple of the tile
]


@needs_cuda_triton
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("T", [0, 70])
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_triton_cuda_matches_reference(dtype, shape, T, window):
    from ssdlib.ops.triton_slot_attention import triton_slot_attention

    inputs = make_inputs(*shape, T, dtype=dtype, device="cuda", seed=sum(shape) + T,
                         window=window)
    want = slot_attention_reference(**inputs)
    atol, rtol = KERNEL_TOL[dtype]
    for splits in (None, 1, 5):
        torch.testing.assert_close(triton_slot_attention(**inputs, splits=splits), want, atol=atol, rtol=rtol)
    assert torch.all(slot_attention(**inputs)[0, 0] == 0) or shape[:2] == (1, 1)


@needs_cuda_triton
def test_auto_backend_on_cuda(monkeypatch):
    from ssdlib.ops.triton_slot_attention import triton_slot_attention

    inputs = make_inputs(2, 6, 9, 3, 64, 256, 10, torch.bfloat16, device="cuda")
    monkeypatch.delenv("SSDLIB_ATTENTION", raising=False)
    torch.testing.assert_close(slot_attention(**inputs), triton_slot_attention(**inputs), atol=0, rtol=0)
    monkeypatch.setenv("SSDLIB_ATTENTION", "torch")
    torch.testing.assert_close(slot_attention(**inputs), slot_attention_reference(**inputs), atol=0, rtol=0)


@needs_cuda_triton
@pytest.mark.parametrize("T", [0, 24])
def test_triton_cuda_graph_replay(T):
    b, s, hq, hkv, hd, L = 4, 6, 9, 3, 64, 1024
    static = make_inputs(b, s, hq, hkv, hd, L, T, torch.bfloat16, device="cuda", n_slots=8, seed=1)
    fresh = make_inputs(b, s, hq, hkv, hd, L, T, torch.bfloat16, device="cuda", n_slots=8, seed=2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        slot_attention(**static, backend="triton")  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = slot_attention(**static, backend="triton")
    for step in range(3):
        for name in ("slots", "kv_limit", "tree_mask"):
            if name in static:
                static[name].copy_(fresh[name])
        static["k_cache"].mul_(-1.0)  # the cache is read in place, so new contents are seen
        fresh["kv_limit"] = (fresh["kv_limit"] * (step + 2)).clamp(max=L)
        fresh["slots"] = fresh["slots"].roll(1)
        graph.replay()
        torch.testing.assert_close(out, slot_attention_reference(**static), atol=2e-2, rtol=2e-2)
