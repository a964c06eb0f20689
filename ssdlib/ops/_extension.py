"""Loading the optional compiled extension ``ssdlib._C`` and deciding when to use it.

The extension registers ops under ``torch.ops.ssdlib`` and, in CUDA builds, has the class
``GraphPool`` (ssdlib.ops.graph_pool). It is optional: every op has a pure-PyTorch reference, and
CUDA graphs fall back to ``torch.cuda.CUDAGraph``, when the extension is missing, broken, lacks a
kernel for the tensor's device, or is disabled with ``SSDLIB_DISABLE_EXT=1`` (read at each call, so
tests and users can flip it at run time).

A missing extension on a CUDA machine is logged once, at first use, with the reason: setup.py
records the outcome of every install's extension build in ``ssdlib/_build_status.json`` (pip hides
setup.py's own warnings unless run with ``-v``). ``python3 -m ssdlib.ops.check_ext`` prints the
same diagnosis as one line.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from ssdlib import env
from ssdlib.log import get_logger

logger = get_logger(__name__)

# How to build the extension on a GPU machine (csrc/README.md). `python3 -m pip`, not `pip`: the
# build runs in pip's interpreter, which must be the one that has torch.
BUILD_COMMAND = "python3 -m pip install --no-deps --no-build-isolation -e ."
BUILD_STATUS_PATH = Path(__file__).resolve().parent.parent / "_build_status.json"

_warned: set[str] = set()


def _disabled() -> bool:
    return env.flag("SSDLIB_DISABLE_EXT")


@functools.lru_cache(maxsize=1)
def _load_result() -> tuple[ModuleType | None, str | None]:
    """(module, None), or (None, why it is missing)."""
    try:
        return importlib.import_module("ssdlib._C"), None
    except ModuleNotFoundError as exc:
        if exc.name == "ssdlib._C":
            return None, "ssdlib._C is not built"
        error = f"ssdlib._C failed to import ({exc})"  # it exists, but something it needs does not
    except (ImportError, OSError) as exc:  # e.g. built against another torch: undefined symbols
        error = f"ssdlib._C failed to load ({exc})"
    logger.warning("%s; using pure-PyTorch ops", error)
    return None, error


def _load() -> ModuleType | None:
    return _load_result()[0]


@functools.lru_cache(maxsize=1)
def build_status() -> dict | None:
    """What setup.py recorded about the extension at the last install, or None if nothing.

    Keys: ``result`` (built / skipped / failed / started), ``reason``, ``python`` and ``prefix``
    (the interpreter that ran setup.py), ``torch``, ``torch_cuda``, ``time``.
    """
    try:
        status = json.loads(BUILD_STATUS_PATH.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


_RESULT_WORDS = {
    "built": "built it",
    "skipped": "skipped it",
    "failed": "failed to build it",
    "started": "started building it but did not finish",
}


def describe_build_status(status: dict | None) -> str:
    """One sentence on the last install's extension build, for a message."""
    if status is None:
        return ("setup.py left no build record (ssdlib/_build_status.json): not installed from this "
                "checkout with pip, or by an older setup.py")
    result = status.get("result", "?")
    reason = str(status.get("reason", "?")).rstrip(". ")  # it is joined with more text below
    text = f"the last install ({status.get('time', '?')}) {_RESULT_WORDS.get(result, result)}: {reason}"
    prefix = status.get("prefix")
    if prefix and os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        text += (f"; NOTE: that install ran {status.get('python')} (environment {prefix}), not this "
                 f"interpreter {sys.executable} (environment {sys.prefix}): `pip` belongs to another "
                 f"Python, install with `{sys.executable} -m pip ...`")
    return text


def _unavailable(device_type: str, graph_pool: bool = False) -> str | None:
    """Why the extension cannot serve ``device_type`` (and GraphPool), or None when it can."""
    if _disabled():
        return "SSDLIB_DISABLE_EXT=1"
    module, error = _load_result()
    if module is None:
        return f"{error}; {describe_build_status(build_status())}"
    if device_type == "cuda" and not module.WITH_CUDA:
        return f"ssdlib._C was built without CUDA; {describe_build_status(build_status())}"
    if graph_pool and getattr(module, "GraphPool", None) is None:
        return "ssdlib._C has no GraphPool: it was built from older sources, rebuild it"
    return None


def _warn_fallback(what: str, reason: str) -> None:
    """Log once per reason (one warning for every op that falls back for the same cause)."""
    if reason in _warned:
        return
    _warned.add(reason)
    if reason == "SSDLIB_DISABLE_EXT=1":
        logger.warning("%s on CUDA uses the pure-PyTorch path (SSDLIB_DISABLE_EXT=1)", what)
        return
    logger.warning("%s on CUDA uses the pure-PyTorch path: %s. Build the extension with `%s` "
                   "(diagnosis: `python3 -m ssdlib.ops.check_ext`)", what, reason, BUILD_COMMAND)


def extension_available(device: torch.device | str | None = None) -> bool:
    """True when the compiled ops can be used (on ``device``'s type, if given).

    False when ``ssdlib._C`` is not built or fails to load, when ``SSDLIB_DISABLE_EXT=1``, or when
    it has no kernel for ``device`` (CUDA kernels exist only in a CUDA build).
    """
    if _disabled():
        return False
    module = _load()
    if module is None:
        return False
    if device is None:
        return True
    kind = torch.device(device).type
    return kind == "cpu" or (kind == "cuda" and bool(module.WITH_CUDA))


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its import of torch._dynamo (1-2 s at
    start-up, in every process, compiling or not): the decorator sets this one mark, which
    dynamo reads when it traces (tests/ops/test_extension_status.py checks that torch's does
    the same)."""
    fn._dynamo_marked_constant = True
    return fn


# Under torch.compile the decision is taken once while tracing and baked into the graph.
@assume_constant_result
def use_extension(device: torch.device, op: str) -> bool:
    """Whether ``op`` should run compiled for a tensor on ``device``; on CUDA, logs once why not."""
    if extension_available(device):
        return True
    if device.type == "cuda":
        _warn_fallback(op, _unavailable("cuda") or "unknown reason")
    return False


def native_graph_pool_class() -> type | None:
    """``ssdlib._C.GraphPool`` when the extension has it and is enabled; else None, logged once."""
    reason = _unavailable("cuda", graph_pool=True)
    if reason is None:
        return _load().GraphPool
    _warn_fallback("CUDA-graph capture (torch.cuda.CUDAGraph instead of ssdlib._C.GraphPool)", reason)
    return None


def status() -> tuple[bool, str]:
    """(ok, what ``ssdlib._C`` is in this process: OK with its facts, MISSING with why, or NOT
    USABLE HERE with why): ok when it serves this machine fully (with a visible GPU: CUDA
    kernels and GraphPool). :func:`diagnose`'s line starts with it."""
    cuda = torch.cuda.is_available()
    module, error = _load_result()
    if module is None:
        return False, f"ssdlib._C: MISSING: {error}; {describe_build_status(build_status())}"
    with_cuda = bool(module.WITH_CUDA)
    has_pool = getattr(module, "GraphPool", None) is not None
    facts = f"WITH_CUDA={with_cuda}, GraphPool={'yes' if has_pool else 'no'}, {module.__file__}"
    reason = _unavailable("cuda" if cuda else "cpu", graph_pool=cuda)
    if reason is None:
        return True, f"ssdlib._C: OK ({facts})"
    return False, f"ssdlib._C: NOT USABLE HERE ({facts}): {reason}"


def diagnose() -> tuple[bool, str]:
    """(ok, one line) on ``ssdlib._C`` for this process: :func:`status`, the command that
    builds it where it does not serve, and the environment. ``python3 -m ssdlib.ops.check_ext``
    prints it."""
    cuda = torch.cuda.is_available()
    env = (f"python {sys.executable}, torch {torch.__version__} "
           f"({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'}), "
           f"{'GPU visible' if cuda else 'no GPU'}")
    ok, line = status()
    return ok, f"{line} | {env}" if ok else f"{line} | fix: {BUILD_COMMAND} | {env}"
