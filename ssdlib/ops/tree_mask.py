"""Boolean attention mask of the speculator's tree-decode step.

A sequence's speculation has K tokens s_1..s_K whose draft KV sits in the tree region's keys
0..K-1. B branches fork from it: branch b forks after the first ``fork_len[b]`` (in [0, K])
speculation tokens. Branch tokens follow the speculation keys depth-major: key ``K + d*B + b``
holds branch b's token at depth d.

Query (depth d, branch b) may see speculation key i iff ``i < fork_len[b]``, and branch key
(d', b') iff ``b' == b and d' <= d``. The committed prefix is not part of this mask (it is
attended to unmasked and merged by log-sum-exp; docs/ATTENTION.md).

``tree_mask`` gives the B queries of one depth, ``tree_mask_full`` all B*D branch tokens at once.
Both dispatch to ``torch.ops.ssdlib`` (csrc/tree_mask) when the extension can serve the tensor's
device, else to the pure-PyTorch ``*_reference`` functions, which define the semantics.
"""

import operator

import torch

from ssdlib.ops._extension import use_extension


def _check(fork_len: torch.Tensor, K: int, depth_name: str, depth: int) -> tuple[int, int]:
    if not isinstance(fork_len, torch.Tensor):
        raise TypeError(f"fork_len must be a torch.Tensor, got {type(fork_len).__name__}")
    if fork_len.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"fork_len must be int32 or int64, got {fork_len.dtype}")
    if fork_len.dim() not in (1, 2):
        raise ValueError(f"fork_len must have shape [B] or [n, B], got {tuple(fork_len.shape)}")
    K, depth = operator.index(K), operator.index(depth)
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K}")
    if depth < 0:
        raise ValueError(f"{depth_name} must be >= 0, got {depth}")
    return K, depth


def _window_reference(fork_len: torch.Tensor, K: int, q_depth0: int, q_depths: int, k_depths: int) -> torch.Tensor:
    # fork_len: [n, B] -> mask: [n, q_depths*B, K + k_depths*B]
    n, B = fork_len.shape
    device = fork_len.device
    q = torch.arange(q_depths * B, device=device)
    q_branch, q_depth = q % B, q_depth0 + q // B  # [Q]
    spec = torch.arange(K, device=device) < fork_len[:, q_branch, None]  # [n, Q, K]
    j = torch.arange(k_depths * B, device=device)
    own = (j % B)[None, :] == q_branch[:, None]  # [Q, k_depths*B]
    reached = (j // B)[None, :] <= q_depth[:, None]
    branch = (own & reached).expand(n, -1, -1)
    return torch.cat([spec, branch], dim=-1)


def tree_mask_reference(fork_len: torch.Tensor, K: int, depth: int) -> torch.Tensor:
    """Pure-PyTorch ``tree_mask``: fork_len [(n,) B] -> bool [(n,) B, K + B*(depth+1)]."""
    K, depth = _check(fork_len, K, "depth", depth)
    batched = fork_len if fork_len.dim() == 2 else fork_len[None]
    mask = _window_reference(batched, K, depth, 1, depth + 1)
    return mask if fork_len.dim() == 2 else mask[0]


def tree_mask_full_reference(fork_len: torch.Tensor, K: int, D: int) -> torch.Tensor:
    """Pure-PyTorch ``tree_mask_full``: fork_len [(n,) B] -> bool [(n,) B*D, K + B*D]."""
    K, D = _check(fork_len, K, "D", D)
    batched = fork_len if fork_len.dim() == 2 else fork_len[None]
    mask = _window_reference(batched, K, 0, D, D)
    return mask if fork_len.dim() == 2 else mask[0]


def tree_mask(fork_len: torch.Tensor, K: int, depth: int) -> torch.Tensor:
    """Mask of one tree-decode step: the B queries at ``depth`` (0-based) against the tree region.

    Args:
        fork_len: [B] or [n, B], int32/int64; branch b forks after ``fork_len[..., b]`` of the K
            speculation tokens. Values are not range-checked (that would sync the GPU); outside
            [0, K] they act as clamped.
        K: number of speculation tokens (keys 0..K-1 of the tree region).
        depth: depth of the queried branch tokens.

    Returns:
        bool [B, K + B*(depth+1)] or [n, B, K + B*(depth+1)]; ``mask[..., b, key]`` is True where
        query b may attend to ``key``.
    """
    K, depth = _check(fork_len, K, "depth", depth)
    if use_extension(fork_len.device, "tree_mask"):
        return torch.ops.ssdlib.tree_mask(fork_len, K, depth)
    return tree_mask_reference(fork_len, K, depth)


def tree_mask_full(fork_len: torch.Tensor, K: int, D: int) -> torch.Tensor:
    """Mask of all B*D branch tokens (queries depth-major: row ``d*B + b``) against the tree region.

    Args:
        fork_len: [B] or [n, B], int32/int64 (as in :func:`tree_mask`).
        K: number of speculation tokens.
        D: number of branch depths.

    Returns:
        bool [B*D, K + B*D] or [n, B*D, K + B*D]; rows ``d*B : (d+1)*B`` restricted to the first
        ``K + B*(d+1)`` keys equal ``tree_mask(fork_len, K, d)``.
    """
    K, D = _check(fork_len, K, "D", D)
    if use_extension(fork_len.device, "tree_mask_full"):
        return torch.ops.ssdlib.tree_mask_full(fork_len, K, D)
    return tree_mask_full_reference(fork_len, K, D)
