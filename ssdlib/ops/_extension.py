"""Loading the optional compiled extension ``ssdlib._C`` and deciding when to use it.

The extension registers ops under ``torch.ops.ssdlib``. It is optional: every op has a pure-PyTorch
reference that is used when the extension is missing, broken, lacks a kernel for the tensor's
device, or is disabled with ``SSDLIB_DISABLE_EXT=1`` (read at each call, so tests and users can
flip it at run time).
"""

import functools
import importlib
import os
from types import ModuleType

import torch

from ssdlib.log import get_logger

logger = get_logger(__name__)

_warned: set[str] = set()


def _disabled() -> bool:
    return os.environ.get("SSDLIB_DISABLE_EXT", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def _load() -> ModuleType | None:
    try:
        return importlib.import_module("ssdlib._C")
    except ModuleNotFoundError as exc:
        if exc.name != "ssdlib._C":  # the module exists but something it needs does not
            logger.warning("ssdlib._C failed to import (%s); using pure-PyTorch ops", exc)
        return None
    except (ImportError, OSError) as exc:  # e.g. built against another torch: undefined symbols
        logger.warning("ssdlib._C failed to load (%s); using pure-PyTorch ops", exc)
        return None


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


# Under torch.compile the decision is taken once while tracing and baked into the graph.
@torch.compiler.assume_constant_result
def use_extension(device: torch.device, op: str) -> bool:
    """Whether ``op`` should run compiled for a tensor on ``device``; warns once per reason on CUDA."""
    if extension_available(device):
        return True
    if device.type == "cuda":
        if _disabled():
            reason = "SSDLIB_DISABLE_EXT=1"
        elif _load() is None:
            reason = "ssdlib._C is not built"
        else:
            reason = "ssdlib._C was built without CUDA"
        if reason not in _warned:
            _warned.add(reason)
            logger.warning("%s on CUDA uses the pure-PyTorch reference (%s)", op, reason)
    return False
