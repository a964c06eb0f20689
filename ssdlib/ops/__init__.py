"""Kernels with a compiled implementation (``ssdlib._C``, csrc/) and a pure-PyTorch reference."""

from ssdlib.ops._extension import extension_available
from ssdlib.ops.tree_mask import tree_mask, tree_mask_full, tree_mask_full_reference, tree_mask_reference

__all__ = [
    "extension_available",
    "tree_mask",
    "tree_mask_full",
    "tree_mask_full_reference",
    "tree_mask_reference",
]
