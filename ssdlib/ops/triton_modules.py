"""The Triton kernel modules of ``ssdlib.ops``, imported when a kernel is first wanted.

triton is optional (a CPU install has none) and slow to import, so each kernel module
(``triton_slot_attention``, ``triton_row_top``; importing one needs triton) is imported on first
use, once: where triton is missing or broken the caller gets None and takes its torch path.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from ssdlib.log import get_logger

logger = get_logger(__name__)


@functools.lru_cache(maxsize=None)
def triton_module(name: str) -> ModuleType | None:
    """``ssdlib.ops.<name>`` (a module of Triton kernels), or None where it cannot be imported."""
    try:
        return importlib.import_module(f"ssdlib.ops.{name}")
    except ImportError as exc:
        logger.debug("triton kernels %s are not available (%s)", name, exc)
        return None
