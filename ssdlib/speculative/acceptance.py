"""The verifier's exact acceptance rule, batched (Leviathan et al. 2023; SSD paper Sec. 2).

Greedy: accept while s_i == argmax p_i; the bonus token t* is the argmax at the first mismatch (or
at position k+1 when every valid draft token was accepted).

Sampling: accept s_i with probability min(1, p_i(s_i) / q_i(s_i)) in order; at the first rejection
sample t* from norm(max(p_i - q_i, 0)); after k = num_draft acceptances sample t* from p_{k+1}. The
output then has exactly the target's distribution, whatever q is -- provided q is the distribution
each token was *actually* drawn from. :class:`DraftQ` carries that q: dense per position (a draft
model, Saguaro-scaled or not), or declared by kind (one-hot for a deterministic proposer such as
n-gram lookup, uniform for random tokens), so the verifier never materialises [b, K, V] one-hots.

Rows may carry fewer valid draft tokens than K (``num_draft``): the per-row limit. A row with
num_draft = n < K is verified exactly as if only its first n drafts had been proposed: positions
>= n are ignored (their token ids and q may be garbage), at most n drafts are accepted, and after
n acceptances t* is drawn from p_{n+1} (greedy: its argmax), not from a residual. This is how a
batch runs rows of different speculation lengths in one forward (adaptive K: the forward has
max n + 1 positions a row). Randomness follows :mod:`ssdlib.speculative.rng`: each row reserves
K+1 uniforms per call and uses draws 0 .. n-1 for its accept tests and draw n for t*, the very
draws a call with its n drafts alone would use (a row's tokens do not depend on the longest row
of its batch). Both rules are batched over rows and read nothing back to the host (checks of
host-side inputs aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import torch

from ssdlib.speculative.rng import Generators, sample_categorical, uniforms


class QKind(IntEnum):
    DENSE = 0    # an explicit distribution per position (draft model, Saguaro sampling)
    ONEHOT = 1   # deterministic proposer (n-gram): q = 1 on the proposed token
    UNIFORM = 2  # random proposer: tokens drawn uniformly over the vocabulary


def _check_kinds(kinds: torch.Tensor, has_probs: bool) -> None:
    """Host-side checks of a DraftQ's kinds [b]."""
    if bool(((kinds < 0) | (kinds > max(QKind))).any()):
        raise ValueError(f"DraftQ.kinds must hold QKind values, got {kinds.tolist()}")
    if not has_probs and bool((kinds == QKind.DENSE).any()):
        raise ValueError("DraftQ has DENSE rows but no probs")


@dataclass(frozen=True, eq=False)
class DraftQ:
    """The distribution each draft token was sampled from, per row.

    kinds: [b] int64 :class:`QKind` per row (rows of one batch may differ: cache hits carry the
    draft's dense q, missed rows the fallback's declared q). probs: [b, K, V], read only on DENSE
    rows (None when there are none); rows need not be normalised -- q / q.sum(-1) is used, which is
    what :func:`~ssdlib.speculative.rng.sample_token` draws from, so a q rounded for the wire stays
    exact.
    """

    kinds: torch.Tensor
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kinds.dim() != 1:
            raise ValueError(f"DraftQ.kinds must be [b], got shape {tuple(self.kinds.shape)}")
        if self.probs is not None and (self.probs.dim() != 3
                                       or self.probs.shape[0] != self.kinds.shape[0]):
            raise ValueError(f"DraftQ.probs must be [b, K, V] with b = {self.kinds.shape[0]}, "
                             f"got {tuple(self.probs.shape)}")
        if self.kinds.device.type == "cpu":  # on a device, checking would read it back
            _check_kinds(self.kinds, self.probs is not None)

    @classmethod
    def computed(cls, kinds: torch.Tensor, probs: torch.Tensor | None = None) -> "DraftQ":
        """A DraftQ whose kinds a captured step computed from QKind values: not checked on any
        device (on a GPU a check would read the kinds back, which a capture refuses; the CPU
        runs the same step unchanged)."""
        q = object.__new__(cls)
        object.__setattr__(q, "kinds", kinds)
        object.__setattr__(q, "probs", probs)
        return q

    @classmethod
    def from_probs(cls, probs: torch.Tensor) -> "DraftQ":
        """Dense q for every row: probs [b, K, V]."""
        return cls(torch.full((probs.shape[0],), int(QKind.DENSE), device=probs.device), probs)

    @classmethod
    def onehot(cls, batch: int, device: torch.device | str = "cpu") -> "DraftQ":
        return cls(torch.full((batch,), int(QKind.ONEHOT), device=device))

    @classmethod
    def uniform(cls, batch: int, device: torch.device | str = "cpu") -> "DraftQ":
        return cls(torch.full((batch,), int(QKind.UNIFORM), device=device))

    @classmethod
    def per_row(cls, kinds: Sequence[int] | torch.Tensor,
                probs: torch.Tensor | None = None) -> "DraftQ":
        """Mixed kinds: kinds [b] (QKind values); probs [b, K, V] needed if any row is DENSE.
        Host kinds are checked on the host, then moved to probs' device."""
        if probs is not None:
            device = probs.device
        else:
            device = kinds.device if isinstance(kinds, torch.Tensor) else "cpu"
        kinds = torch.as_tensor(kinds, dtype=torch.int64)
        if kinds.device.type == "cpu":
            _check_kinds(kinds, probs is not None)
        return cls(kinds.to(device, non_blocking=True), probs)

    @property
    def batch(self) -> int:
        return self.kinds.shape[0]

    def prob_of(self, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """q_i(s_i): tokens [b, K] -> [b, K] float64."""
        kinds = self.kinds.to(tokens.device)[:, None]                       # [b, 1]
        one = torch.ones((), dtype=torch.float64, device=tokens.device)
        out = torch.where(kinds == QKind.ONEHOT, one, one / vocab_size).expand(tokens.shape)
        if self.probs is not None:
            q = self.probs.to(tokens.device)
            q_tok = q.gather(-1, tokens[..., None]).squeeze(-1).double()   # [b, K]
            q_tok = q_tok / q.sum(-1).double()
            out = torch.where(kinds == QKind.DENSE, q_tok, out)
        return out

    def at(self, pos: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q at one position per row: pos [b] (< K), tokens [b] (the token drafted there) -> [b, V].

        This is all the residual max(p - q, 0) needs, so a declared q costs one [b, V] row.
        """
        b, device = tokens.shape[0], tokens.device
        kinds = self.kinds.to(device)[:, None]                              # [b, 1]
        out = torch.full((b, vocab_size), 1.0 / vocab_size, dtype=dtype, device=device)
        onehot = torch.zeros_like(out).scatter_(1, tokens[:, None], 1.0)   # [b, V]
        out = torch.where(kinds == QKind.ONEHOT, onehot, out)
        if self.probs is not None:
            q = self.probs.to(device)[torch.arange(b, device=device), pos].to(dtype)   # [b, V]
            out = torch.where(kinds == QKind.DENSE, q / q.sum(-1, keepdim=True), out)
        return out

    def to_dense(self, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The full q [b, K, V] (for tests and debugging; the verifier never builds it)."""
        b, K = tokens.shape
        return torch.stack([self.at(torch.full((b,), i, device=tokens.device), tokens[:, i],
                                    vocab_size, torch.float64) for i in range(K)], dim=1)


@dataclass(frozen=True, eq=False)
class VerifyOutcome:
    """Result of verifying one speculation per row.

    accepted: [b] int64, k = number of draft tokens accepted (0..num_draft).
    bonus: [b] int64, t* (residual sample at the first rejection, or target sample / argmax at k+1).
    accepted_mask: [b, K] bool, True on the accepted prefix (for per-position acceptance metrics).
    num_draft: [b] int64, the valid draft length of each row.
    """

    accepted: torch.Tensor
    bonus: torch.Tensor
    accepted_mask: torch.Tensor
    num_draft: torch.Tensor

    @property
    def rejected(self) -> torch.Tensor:
        """[b] bool: a draft token was rejected (so t* came from the residual / a mismatch)."""
        return self.accepted < self.num_draft

    def tokens(self, draft_tokens: torch.Tensor) -> list[list[int]]:
        """The tokens each row commits: s_1..s_k followed by t*."""
        drafts, ks, bonus = draft_tokens.tolist(), self.accepted.tolist(), self.bonus.tolist()
        return [d[:k] + [t] for d, k, t in zip(drafts, ks, bonus)]


def _num_draft(num_draft: torch.Tensor | Sequence[int] | int | None, b: int, K: int,
               device: torch.device) -> torch.Tensor:
    if num_draft is None:
        return torch.full((b,), K, dtype=torch.int64, device=device)
    if isinstance(num_draft, int):
        num_draft = [num_draft] * b
    if not isinstance(num_draft, torch.Tensor):  # a host list (the engine's, every round)
        if len(num_draft) != b:
            raise ValueError(f"num_draft must have shape [{b}], got {len(num_draft)} values")
        if b and (min(num_draft) < 0 or max(num_draft) > K):
            raise ValueError(f"num_draft must be in [0, {K}], got {list(num_draft)}")
        return torch.tensor(num_draft, dtype=torch.int64).to(device, non_blocking=True)
    nd = torch.as_tensor(num_draft, dtype=torch.int64)
    if nd.shape != (b,):
        raise ValueError(f"num_draft must have shape [{b}], got {tuple(nd.shape)}")
    # values are checked on the host only: on a device, checking would read it back
    if nd.device.type == "cpu" and bool(((nd < 0) | (nd > K)).any()):
        raise ValueError(f"num_draft must be in [0, {K}], got {nd.tolist()}")
    return nd.to(device, non_blocking=True)


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [b, K], got {tuple(draft_tokens.shape)}")
    b, K = draft_tokens.shape
    if target.dim() != 3 or target.shape[:2] != (b, K + 1):
        raise ValueError(f"target must be [b, K+1, V] = [{b}, {K + 1}, V], "
                         f"got {tuple(target.shape)}")
    return b, K


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_draft: torch.Tensor | Sequence[int] | int | None = None) -> VerifyOutcome:
    """Greedy verification. draft_tokens [b, K] int64; target_logits [b, K+1, V] (logits or
    probabilities: only the argmax is used; ties go to torch.argmax's choice, as in AR greedy);
    num_draft [b] valid draft tokens per row, each row's limit (default K; module doc)."""
    b, K = _check_shapes(draft_tokens, target_logits)
    nd = _num_draft(num_draft, b, K, draft_tokens.device)
    return accept_greedy(draft_tokens, target_logits.argmax(-1), nd)


def accept_greedy(draft_tokens: torch.Tensor, best: torch.Tensor,
                  nd: torch.Tensor) -> VerifyOutcome:
    """:func:`verify_greedy` from the target's argmax ``best`` [b, K+1] (int64) and each row's
    limit ``nd`` [b] (device int64): device ops only, no check, no host value (a compiled
    chained round fuses them)."""
    K = draft_tokens.shape[1]
    device = draft_tokens.device
    valid = torch.arange(K, device=device) < nd[:, None]              # [b, K]
    match = (draft_tokens == best[:, :K]) & valid                     # [b, K]
    accepted_mask = match.long().cumprod(-1).bool()                   # [b, K] accepted prefix
    k = accepted_mask.sum(-1)                                         # [b]
    bonus = best.gather(1, k[:, None]).squeeze(1)                     # [b] argmax at position k+1
    return VerifyOutcome(k, bonus, accepted_mask, nd)


def verify_sampled(draft_tokens: torch.Tensor, draft_q: DraftQ, target_p: torch.Tensor,
                   num_draft: torch.Tensor | Sequence[int] | int | None = None,
                   generators: Generators = None) -> VerifyOutcome:
    """Exact speculative sampling. draft_tokens [b, K] int64; draft_q the q they were drawn from;
    target_p [b, K+1, V] the exact target distribution (after temperature / top-k / top-p, see
    :func:`ssdlib.sampling.target_distributions`); num_draft [b] each row's limit (default K;
    module doc); generators: the rows' :class:`~ssdlib.speculative.rng.RowStreams` with at least
    K+1 draws reserved per row (the engine's form), one generator for the batch, or None (see
    :mod:`ssdlib.speculative.rng`)."""
    b, K = _check_shapes(draft_tokens, target_p)
    device, V = draft_tokens.device, target_p.shape[-1]
    if draft_q.batch != b or (draft_q.probs is not None and draft_q.probs.shape[1:] != (K, V)):
        shape = None if draft_q.probs is None else tuple(draft_q.probs.shape)
        raise ValueError(f"draft_q must cover [b, K, V] = [{b}, {K}, {V}], got {draft_q.batch} "
                         f"rows, probs {shape}")
    nd = _num_draft(num_draft, b, K, device)
    valid = torch.arange(K, device=device) < nd[:, None]              # [b, K]
    tokens = draft_tokens.masked_fill(~valid, 0)                      # [b, K] padding -> valid id
    u = uniforms(generators, b, K + 1, device)                        # [b, K+1]: K tests + bonus

    p_sum = target_p.sum(-1).double()                                 # [b, K+1] (normally 1)
    p_tok = target_p[:, :K].gather(-1, tokens[..., None]).squeeze(-1) / p_sum[:, :K]  # [b, K]
    q_tok = draft_q.prob_of(tokens, V)                                # [b, K] q_i(s_i)
    # accept with probability min(1, p/q): u < p/q  <=>  u*q < p, which needs no division by q
    accept = (u[:, :K] * q_tok < p_tok) & valid                       # [b, K]
    accepted_mask = accept.long().cumprod(-1).bool()                  # [b, K] accepted prefix
    k = accepted_mask.sum(-1)                                         # [b]
    rejected = k < nd                                                 # [b]

    rows = torch.arange(b, device=device)
    p_k = target_p[rows, k] / p_sum[rows, k, None].to(target_p.dtype)  # [b, V] target at k+1
    dist = p_k
    if K > 0:
        pos = k.clamp(max=K - 1)                                      # rows not rejected: unused
        q_k = draft_q.at(pos, tokens[rows, pos], V, p_k.dtype)        # [b, V]
        residual = (p_k - q_k).clamp_min(0)                           # [b, V] max(p - q, 0)
        # An all-zero residual means p == q, where rejection has probability 0; if rounding made
        # one happen anyway, p itself is the right distribution.
        use_residual = rejected & (residual.sum(-1) > 0)              # [b]
        dist = torch.where(use_residual[:, None], residual, p_k)
    bonus = sample_categorical(dist, u.gather(1, nd[:, None])[:, 0])  # [b]: draw num_draft
    return VerifyOutcome(k, bonus, accepted_mask, nd)
