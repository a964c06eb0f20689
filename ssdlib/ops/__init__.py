"""Kernels with a compiled implementation (``ssdlib._C``, csrc/) and a pure-PyTorch reference, and
the pool of captured CUDA graphs (compiled, torch's, or plain calls)."""

from ssdlib.ops._extension import extension_available
from ssdlib.ops.graph_pool import EagerPool, GraphPool, NativeGraphPool, TorchGraphPool, make_graph_pool
from ssdlib.ops.tree_mask import tree_mask, tree_mask_full, tree_mask_full_reference, tree_mask_reference

__all__ = [
    "EagerPool",
    "GraphPool",
    "NativeGraphPool",
    "TorchGraphPool",
    "extension_available",
    "make_graph_pool",
    "tree_mask",
    "tree_mask_full",
    "tree_mask_full_reference",
    "tree_mask_reference",
]
