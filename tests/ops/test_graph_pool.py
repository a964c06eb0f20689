"""Graph pools: EagerPool's contract on CPU; CUDA graphs (torch's and ssdlib._C's) against eager.

CPU tests always run. CUDA tests skip without a GPU. On a GPU machine,
``test_native_graph_pool_is_built`` FAILS unless ``ssdlib._C`` is built with CUDA and GraphPool
(``python3 -m pip install --no-deps --no-build-isolation -e .``; set SSDLIB_SKIP_EXT=1 to accept a
build without it). ``test_capture_with_nccl_collectives`` spawns its own 2 ranks (NCCL, one GPU
each) and needs 2 GPUs: ``pytest tests/ops/test_graph_pool.py -k nccl``.
"""

import importlib
import os

import pytest
import torch

from ssdlib.ops._extension import diagnose, native_graph_pool_class
from ssdlib.ops.graph_pool import (
    DEFAULT_WARMUP,
    EagerPool,
    NativeGraphPool,
    TorchGraphPool,
    make_graph_pool,
)

HAS_CUDA = torch.cuda.is_available()


def needs_cuda(test):
    """A GPU test (``-m gpu``), skipped without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")(test))


GRAPH_KINDS = ["torch", "native"]


class Step:
    """A model-like step over static buffers: out = softmax(x @ w); logits rebound each call.

    x: [B, D] static input, w: [D, V], out: [B, V] static output. ``logits`` is allocated inside
    the step (as a model's output is), so after capture it is the graph's own tensor.
    """

    def __init__(self, device: str, B: int = 4, D: int = 32, V: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(B, D, generator=gen).to(device)
        self.w = torch.randn(D, V, generator=gen).to(device)
        self.out = torch.empty(B, V, device=device)
        self.logits = None
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        self.logits = self.x @ self.w
        self.out.copy_(torch.softmax(self.logits, dim=-1))

    def expected(self) -> torch.Tensor:
        return torch.softmax(self.x @ self.w, dim=-1)


def counter_steps(buf: torch.Tensor) -> dict:
    return {"mul": lambda: buf.mul_(2), "add": lambda: buf.add_(1)}


# --- EagerPool and the choice of pool (CPU) -----------------------------------------------------


def test_make_graph_pool_without_cuda_graphs_is_eager():
    assert make_graph_pool("cpu").kind == "eager"
    assert make_graph_pool(torch.device("cpu"), enabled=True).kind == "eager"
    assert make_graph_pool("cuda", enabled=False).kind == "eager"  # no GPU needed
    with pytest.raises(ValueError):
        make_graph_pool("cpu", warmup=-1)
    with pytest.raises(ValueError):
        make_graph_pool("cpu", capture_error_mode="sometimes")


def test_eager_capture_stores_and_replay_calls():
    pool = EagerPool()
    step = Step("cpu")
    pool.capture(("verify", 4, 1, 64), step)
    assert step.calls == 0  # capture only stores the function
    assert pool.has(("verify", 4, 1, 64)) and not pool.has(("verify", 8, 1, 64))
    assert len(pool) == 1
    for trial in range(3):
        step.x.copy_(torch.randn(step.x.shape, generator=torch.Generator().manual_seed(trial)))
        pool.replay(("verify", 4, 1, 64))
        torch.testing.assert_close(step.out, step.expected())
    assert step.calls == 3


def test_eager_replays_in_call_order_and_missing_keys():
    pool = EagerPool()
    buf = torch.ones(3)
    for key, fn in counter_steps(buf).items():
        pool.capture(key, fn)
    pool.replay("mul")
    pool.replay("add")  # (1 * 2) + 1
    assert buf.tolist() == [3, 3, 3]
    buf.fill_(1)
    pool.replay("add")
    pool.replay("mul")  # (1 + 1) * 2
    assert buf.tolist() == [4, 4, 4]
    with pytest.raises(KeyError, match="nope"):
        pool.replay("nope")
    assert buf.tolist() == [4, 4, 4]


def test_eager_duplicate_bad_fn_and_clear():
    pool = EagerPool()
    pool.capture("a", lambda: None)
    with pytest.raises(ValueError, match="already captured"):
        pool.capture("a", lambda: None)
    with pytest.raises(TypeError):
        pool.capture("b", "not callable")
    assert not pool.has("b")
    pool.clear()
    assert len(pool) == 0 and not pool.has("a")
    pool.capture("a", lambda: None)  # a key can be captured again after clear()
    assert pool.has("a")


# --- CUDA graphs --------------------------------------------------------------------------------


def cuda_pool(kind: str, **options):
    if kind == "torch":
        return TorchGraphPool("cuda", **options)
    native = native_graph_pool_class()
    if native is None:
        pytest.skip("ssdlib._C.GraphPool is not available (test_native_graph_pool_is_built says why)")
    return NativeGraphPool("cuda", native_class=native, **options)


@needs_cuda
def test_native_graph_pool_is_built():
    """On a GPU machine the extension must be built, with CUDA and GraphPool."""
    if os.environ.get("SSDLIB_SKIP_EXT", "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.skip("SSDLIB_SKIP_EXT=1: the extension is not expected")
    why = diagnose()[1]
    try:
        module = importlib.import_module("ssdlib._C")
    except ImportError as exc:
        pytest.fail(f"ssdlib._C does not import ({exc}): {why}")
    assert module.WITH_CUDA, f"ssdlib._C was built without CUDA: {why}"
    assert hasattr(module, "GraphPool"), f"ssdlib._C has no GraphPool: {why}"
    if not os.environ.get("SSDLIB_DISABLE_EXT"):
        assert make_graph_pool("cuda").kind == "native"


@needs_cuda
def test_make_graph_pool_on_cuda(monkeypatch):
    expected = "native" if native_graph_pool_class() is not None else "torch"
    assert make_graph_pool("cuda").kind == expected
    monkeypatch.setenv("SSDLIB_DISABLE_EXT", "1")
    assert make_graph_pool("cuda").kind == "torch"


@needs_cuda
@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_replay_matches_eager(kind):
    pool = cuda_pool(kind)
    step = Step("cuda", B=8, D=64, V=128)
    pool.capture(("verify", 8, 1, 128), step)
    assert step.calls == DEFAULT_WARMUP + 1 and pool.has(("verify", 8, 1, 128)) and len(pool) == 1
    logits = step.logits  # the captured call's output: the graph writes it at every replay
    for trial in range(4):
        step.x.copy_(torch.randn(step.x.shape, generator=torch.Generator().manual_seed(trial)))
        pool.replay(("verify", 8, 1, 128))
        torch.testing.assert_close(step.out, step.expected(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, step.x @ step.w, rtol=1e-5, atol=1e-5)
    assert step.calls == DEFAULT_WARMUP + 1  # replays run no Python
    assert step.logits is logits


@needs_cuda
@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_replays_in_call_order(kind):
    pool = cuda_pool(kind, warmup=1)
    buf = torch.ones(16, device="cuda")
    for key, fn in counter_steps(buf).items():
        pool.capture(key, fn)
    buf.fill_(1)  # the warm-up calls changed it
    pool.replay("mul")
    pool.replay("add")
    assert buf.tolist() == [3] * 16
    buf.fill_(1)
    for key in ("add", "mul", "add"):
        pool.replay(key)
    assert buf.tolist() == [5] * 16
    with pytest.raises(KeyError):
        pool.replay("missing")  # nothing replayed
    assert buf.tolist() == [5] * 16


@needs_cuda
@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_graphs_share_one_memory_pool(kind):
    """Each capture's intermediates (~4 MiB each) are freed inside it, so with ONE pool the later
    graphs reuse the first one's memory; a pool per graph would add a segment per graph."""
    pool = cuda_pool(kind, warmup=1)
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)

    def step():
        out.copy_((x * 2).exp() + 1)

    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    pool.capture(("step", 0), step)
    first = torch.cuda.memory_reserved() - base
    for i in range(1, 6):
        pool.capture(("step", i), step)
    more = torch.cuda.memory_reserved() - base - first
    assert first > 0
    assert more <= first // 2, (first, more)
    for i in range(6):
        pool.replay(("step", i))
    torch.testing.assert_close(out, (x * 2).exp() + 1)


@needs_cuda
@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_failed_capture_raises_and_leaves_pool_usable(kind):
    pool = cuda_pool(kind, warmup=1)
    calls = []

    def breaks_during_capture():
        calls.append(1)
        if len(calls) == 2:  # the warm-up passes, the captured call raises
            raise ValueError("boom inside capture")

    with pytest.raises(ValueError, match="boom inside capture"):
        pool.capture("bad", breaks_during_capture)
    assert not pool.has("bad") and len(pool) == 0
    step = Step("cuda")
    pool.capture("good", step)
    step.x.normal_()
    pool.replay("good")
    torch.testing.assert_close(step.out, step.expected(), rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_clear_then_capture_again(kind):
    pool = cuda_pool(kind, warmup=1)
    step = Step("cuda")
    pool.capture("k", step)
    pool.clear()
    assert len(pool) == 0 and not pool.has("k")
    with pytest.raises(KeyError):
        pool.replay("k")
    pool.capture("k", step)
    step.x.normal_()
    pool.replay("k")
    torch.testing.assert_close(step.out, step.expected(), rtol=1e-5, atol=1e-6)


# --- collectives inside a capture (2 ranks, NCCL) ----------------------------------------------


def _rank_input(trial: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * trial + rank))


def nccl_capture_rank(kind: str, out_queue) -> None:
    """One TP rank: capture matmul + all_reduce + all_gather on a TP group, replay with new inputs."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))  # an explicit group, as the TP layers take
        pool = TorchGraphPool("cuda") if kind == "torch" else NativeGraphPool("cuda")
        w = torch.randn(8, 16, generator=torch.Generator().manual_seed(7)).cuda()
        x = _rank_input(0, rank).cuda()
        probs = torch.empty(4, 16, device="cuda")
        gathered = torch.empty(4 * world, 8, device="cuda")

        def step():
            y = x @ w  # row-parallel partial sums
            dist.all_reduce(y, group=group)
            probs.copy_(torch.softmax(y, dim=-1))
            dist.all_gather_into_tensor(gathered, x, group=group)

        pool.capture(("tp", 4), step)
        for trial in range(1, 4):
            xs = [_rank_input(trial, r).cuda() for r in range(world)]
            x.copy_(xs[rank])
            pool.replay(("tp", 4))
            expected = torch.softmax(sum(xr @ w for xr in xs), dim=-1)
            torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(gathered, torch.cat(xs))
        dist.barrier(group=group)
        if rank == 0:
            out_queue.put("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("kind", GRAPH_KINDS)
def test_capture_with_nccl_collectives(kind):
    import torch.multiprocessing as mp

    from ssdlib.distributed.launcher import RankGroup

    if kind == "native" and native_graph_pool_class() is None:
        pytest.skip("ssdlib._C.GraphPool is not available")
    q = mp.get_context("spawn").Queue()
    ranks = RankGroup(2, nccl_capture_rank, (kind, q))
    assert ranks.wait(q, timeout_s=180) == "ok"
    ranks.join()
