"""ssdlib.ops.triton_modules: a kernel module that cannot be imported gives None (its caller
takes the torch path), once."""

import sys

from ssdlib.ops import row_top, slot_attention
from ssdlib.ops.triton_modules import triton_module


def test_a_module_that_does_not_import_gives_none():
    assert triton_module("no_such_kernels") is None
    assert triton_module("no_such_kernels") is None  # cached: tried once


def test_callers_follow_whether_triton_imports():
    have_triton = "triton" in sys.modules or _imports("triton")
    assert (row_top._triton_module() is not None) == have_triton
    assert slot_attention.triton_available() == have_triton


def _imports(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True
