"""Captured step functions keyed by shape: CUDA graphs in one memory pool, or plain calls.

``make_graph_pool(device, enabled)`` returns one of three pools with the same interface
(:class:`GraphPool`):

  NativeGraphPool  the primary backend on CUDA where the extension is built:
                   ``ssdlib._C.GraphPool`` (csrc/graph_pool), capture and replay in C++
  TorchGraphPool   the fallback on CUDA, through ``torch.cuda.CUDAGraph``, when ``ssdlib._C`` is
                   missing, has no GraphPool, or is disabled (``SSDLIB_DISABLE_EXT``)
  EagerPool        CPU, or ``enabled=False``: ``replay`` calls the function

``capture(key, fn)`` registers ``fn`` under a hashable ``key`` (e.g. ``("verify", b, s, kv)``).
``fn`` takes no arguments: it reads static input tensors and writes static outputs (or rebinds
outputs it allocates, which then live in the graph's memory). After it, ``replay(key)`` has the
effect of ``fn()`` on the current stream. The graph pools run ``fn`` ``warmup`` times on a side
stream first (cuBLAS workspaces, NCCL communicators and autotuning are set up there, outside the
capture), then capture one call. All graphs of a pool share one memory pool: replay them one at a
time on one stream, never concurrently. A pool keeps ``fn`` (and so the static tensors it closes
over) alive as long as its graph.

Memory: what a graph frees during its capture (its intermediates) is reused by the graphs captured
after it; that is what makes one pool cheap. So a tensor that ``fn`` allocates and keeps (an
output it rebinds) holds its value after a replay only until a graph captured BEFORE it replays;
static outputs allocated before the capture, which ``fn`` writes into (nano-vllm's habit), always
hold. A step of several parts (the draft's K steps, the speculator's build) is captured as one
function, so one replay runs it.

Collectives (TP > 1) may be captured: the warm-up creates the NCCL communicator, and the default
capture mode ``"thread_local"`` keeps CUDA calls from other threads (the NCCL watchdog's event
queries, a loader thread) from invalidating the capture, while the capturing thread's own unsafe
calls (``.item()``, a sync, ``cudaMalloc`` outside the pool) still fail loudly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

import torch

from ssdlib.ops._extension import native_graph_pool_class
from ssdlib.ops.capture_rules import CaptureRules

StepFn = Callable[[], object]

DEFAULT_WARMUP = 2
CAPTURE_MODES = ("global", "thread_local", "relaxed")

# steps registered in this process, by every pool: a caller compares two readings to see whether
# something was captured between them (a run after the warm-up should capture nothing)
_registered = 0


def capture_count() -> int:
    """How many steps every pool of this process has registered (captured) so far."""
    return _registered


class GraphPool(ABC):
    """Step functions by key; ``replay(key)`` does what ``fn()`` would (see the module doc)."""

    kind: str = ""

    def __init__(self) -> None:
        self._fns: dict[Hashable, StepFn] = {}

    def capture(self, key: Hashable, fn: StepFn) -> None:
        """Register ``fn`` under ``key`` (graph pools: warm it up, then capture it)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if key in self._fns:
            raise ValueError(f"{key!r} is already captured")
        global _registered
        self._capture(key, fn)
        self._fns[key] = fn
        _registered += 1

    def has(self, key: Hashable) -> bool:
        return key in self._fns

    def keys(self) -> list:
        """The captured keys, in capture order."""
        return list(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} graphs)"

    @abstractmethod
    def _capture(self, key: Hashable, fn: StepFn) -> None: ...

    @abstractmethod
    def replay(self, key: Hashable) -> None:
        """Run the step of ``key`` (KeyError if it was never captured)."""

    def clear(self) -> None:
        """Forget every step (graph pools: after the device is idle, and free their memory)."""
        self._fns.clear()


def _missing(key: Hashable) -> KeyError:
    return KeyError(f"no graph captured for {key!r}")


class EagerPool(GraphPool):
    """No capture: ``replay`` calls the stored function (CPU, or CUDA graphs turned off).
    ``warmup`` > 0 runs a function that many times when it is registered, as the graph pools'
    warm-up does: tests use it to check on CPU that a step tolerates the repeated runs (its
    body must be idempotent for its inputs). Those runs also check what a capture would refuse
    (``ops/capture_rules.py``: a host read-back, a copy of host data to the device), so a CPU
    run of the captured-step path fails where a GPU's capture would."""

    kind = "eager"

    def __init__(self, warmup: int = 0) -> None:
        super().__init__()
        _check_warmup(warmup)
        self.warmup = warmup

    def _capture(self, key: Hashable, fn: StepFn) -> None:
        for _ in range(self.warmup):
            with CaptureRules(str(key)):
                fn()

    def replay(self, key: Hashable) -> None:
        try:
            fn = self._fns[key]
        except KeyError:
            raise _missing(key) from None
        fn()


def _cuda_index(device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError(f"a CUDA graph pool needs a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _check_warmup(warmup: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")


def _check_options(warmup: int, capture_error_mode: str) -> None:
    _check_warmup(warmup)
    if capture_error_mode not in CAPTURE_MODES:
        raise ValueError(f"capture_error_mode must be one of {CAPTURE_MODES}, got {capture_error_mode!r}")


class TorchGraphPool(GraphPool):
    """CUDA graphs through ``torch.cuda.CUDAGraph``; one side stream and one memory pool."""

    kind = "torch"

    def __init__(self, device: torch.device | str, warmup: int = DEFAULT_WARMUP,
                 capture_error_mode: str = "thread_local") -> None:
        super().__init__()
        _check_options(warmup, capture_error_mode)
        self.device = torch.device("cuda", _cuda_index(torch.device(device)))
        self.warmup = warmup
        self.capture_error_mode = capture_error_mode
        self._stream = torch.cuda.Stream(self.device)
        self._mempool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}

    def _capture(self, key: Hashable, fn: StepFn) -> None:
        with torch.cuda.device(self.device):
            self._stream.wait_stream(torch.cuda.current_stream())  # static inputs written there
            with torch.cuda.stream(self._stream):
                for _ in range(self.warmup):
                    fn()
            graph = torch.cuda.CUDAGraph()
            try:
                # Synchronizes the device first; captures on our side stream into the shared
                # pool.
                with torch.cuda.graph(graph, pool=self._mempool, stream=self._stream,
                                      capture_error_mode=self.capture_error_mode):
                    fn()
            except BaseException:
                if not self._graphs:
                    # the failed graph may hold the pool's only reference: once it is freed, a
                    # capture into the same pool id trips the allocator's use-count assert (as
                    # csrc's pool did); later captures take a fresh pool
                    self._mempool = torch.cuda.graph_pool_handle()
                raise
        self._graphs[key] = graph

    def replay(self, key: Hashable) -> None:
        try:
            graph = self._graphs[key]
        except KeyError:
            raise _missing(key) from None
        graph.replay()

    def clear(self) -> None:
        if self._graphs:
            torch.cuda.synchronize(self.device)  # no replay may still use the pool's memory
        self._graphs.clear()
        # A fresh pool id: the old pool is released once its last graph is gone.
        self._mempool = torch.cuda.graph_pool_handle()
        super().clear()


class NativeGraphPool(GraphPool):
    """CUDA graphs held by ``ssdlib._C.GraphPool``; Python keys map to the C++ pool's int keys."""

    kind = "native"

    def __init__(self, device: torch.device | str, warmup: int = DEFAULT_WARMUP,
                 capture_error_mode: str = "thread_local", native_class: type | None = None) -> None:
        super().__init__()
        _check_options(warmup, capture_error_mode)
        native_class = native_class or native_graph_pool_class()
        if native_class is None:
            raise RuntimeError("ssdlib._C.GraphPool is not available (see `python3 -m ssdlib.ops.check_ext`)")
        self.device = torch.device("cuda", _cuda_index(torch.device(device)))
        self.warmup = warmup
        self.capture_error_mode = capture_error_mode
        self._native = native_class(self.device.index, warmup, capture_error_mode)
        self._ids: dict[Hashable, int] = {}
        self._next_id = 0

    def _capture(self, key: Hashable, fn: StepFn) -> None:
        native_id = self._next_id
        self._native.capture(native_id, fn)
        self._next_id += 1
        self._ids[key] = native_id

    def replay(self, key: Hashable) -> None:
        try:
            native_id = self._ids[key]
        except KeyError:
            raise _missing(key) from None
        self._native.replay(native_id)

    def clear(self) -> None:
        self._native.clear()
        self._ids.clear()
        super().clear()


def make_graph_pool(device: torch.device | str, enabled: bool = True, *, warmup: int = DEFAULT_WARMUP,
                    capture_error_mode: str = "thread_local") -> GraphPool:
    """The pool for ``device``: native CUDA graphs (:class:`NativeGraphPool`, the primary backend)
    where ``ssdlib._C`` has them, torch's (:class:`TorchGraphPool`) otherwise (logging once why), and plain calls
    (:class:`EagerPool`) on CPU or with ``enabled=False``.

    Args:
        device: where the step functions run.
        enabled: False gives an :class:`EagerPool` on any device.
        warmup: eager calls of a step before its capture (graph pools).
        capture_error_mode: cudaStreamCaptureMode of the captures: ``"thread_local"`` (default),
            ``"global"`` or ``"relaxed"``.
    """
    _check_options(warmup, capture_error_mode)
    device = torch.device(device)
    if not enabled or device.type != "cuda":
        return EagerPool()
    native_class = native_graph_pool_class()
    if native_class is not None:
        return NativeGraphPool(device, warmup, capture_error_mode, native_class)
    return TorchGraphPool(device, warmup, capture_error_mode)
