"""The speculation cache: for each row, B pre-drafted speculations keyed by outcome (k, t*).

Preallocated once at its maximum size (max_batch rows, B branches, K tokens; q only when some
row samples) so the buffers stay fixed (CUDA-graph friendly). It only ever holds the entries for
the *next* round: building overwrites.

The lookup happens on the leader (``cache_mirror.py``): after each build the speculator pushes
the built rows' keys and tokens (:meth:`SpeculationCache.pushed_rows`, the CACHE message); q
stays here and travels only for a hit row of a sampling exchange. Chained rounds (the stream
placement, ``engine/leader/chained_rounds.py``) look up on the device instead
(:meth:`SpeculationCache.lookup`, :func:`next_speculation`), in two caches that alternate by
round parity.
"""

from __future__ import annotations

import torch

from ssdlib import env
from ssdlib.distributed.protocol import CacheRows
from ssdlib.speculative.ngram import propose_ngram_device


class SpeculationCache:
    def __init__(self, max_batch: int, branches: int, k: int, vocab_size: int,
                 device: torch.device):
        self.B, self.K, self.V = branches, k, vocab_size
        self.fork = torch.full((max_batch, branches), -1, dtype=torch.int64, device=device)
        self.bonus = torch.full((max_batch, branches), -1, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(max_batch, branches, k, dtype=torch.int64, device=device)
        self.ready = torch.zeros(max_batch, dtype=torch.bool, device=device)
        self.device = device
        self._q: torch.Tensor | None = None

    @property
    def q(self) -> torch.Tensor:
        """[max_batch, B, K, V] float32, allocated on the first sampling batch."""
        if self._q is None:
            self._q = torch.zeros(self.ready.shape[0], self.B, self.K, self.V,
                                  dtype=torch.float32, device=self.device)
        return self._q

    def invalidate(self, rows: list[int]) -> None:
        """Rows ``rows`` hold nothing (new sequences in those slots)."""
        self.ready[torch.tensor(rows, device=self.device)] = False

    def store_keys(self, rows: torch.Tensor, fork: torch.Tensor, bonus: torch.Tensor) -> None:
        """rows [n] batch rows; fork, bonus [n, b]: the outcome each of the first b <= B
        branches assumes (the others assume none: a build of a smaller budget)."""
        b = fork.shape[1]
        if b < self.B:  # a device tensor of -1 (a host scalar written here is not capturable)
            none = fork.new_full((fork.shape[0], self.B - b), -1)
            fork, bonus = torch.cat([fork, none], dim=1), torch.cat([bonus, none], dim=1)
        self.fork[rows] = fork
        self.bonus[rows] = bonus
        self.ready.index_fill_(0, rows, True)  # no host scalar: capturable

    def pushed_rows(self, rows: torch.Tensor, live: torch.Tensor, fallback: int) -> torch.Tensor:
        """The CACHE message of cache rows ``rows`` [n] (device int64; ``live`` [n] bool: rows
        not live are sent not ready): int64 [n, CacheRows.width] on the device, no read-back."""
        return CacheRows.pack_device(self.ready[rows] & live, fallback, self.fork[rows],
                                     self.bonus[rows], self.tokens[rows])

    def lookup(self, rows: torch.Tensor, k: torch.Tensor,
               bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cache's answer to outcomes (k, t*) on the device, as the leader's mirror gives it
        on the host (``cache_mirror.CacheMirror.lookup``, the reference it is tested against):
        rows, k, bonus [n] (device int64) -> (hit [n] bool, branch [n]: the first branch
        assuming the outcome, 0 on a miss, tokens [n, K]: that branch's, any on a miss).
        Nothing is read back."""
        return _lookup(self.fork, self.bonus, self.tokens, self.ready, rows, k, bonus)

    def gather_q(self, rows: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """q of branch ``branch`` [n] of cache rows ``rows`` [n] (device): [n, K, V]."""
        return self.q[rows, branch]


def _lookup(fork, keys, tokens, ready, rows, k, bonus):
    """:meth:`SpeculationCache.lookup` on the cache's tensors."""
    match = (fork[rows] == k.view(-1, 1)) & (keys[rows] == bonus.view(-1, 1))
    match &= ready[rows].view(-1, 1)                                  # [n, B]
    hit = match.any(-1)
    branch = match.to(torch.uint8).argmax(-1)  # the first match (argmax: first maximum)
    return hit, branch, tokens[rows, branch]


def _next_speculation(fork, keys, tokens, ready, slots, k, bonus, n, real, history,
                      ngram: bool):
    """:func:`next_speculation` on tensors (``ngram``: a miss's fallback is the n-gram
    proposal, else zeros)."""
    hit, branch, cached = _lookup(fork, keys, tokens, ready, slots, k, bonus)
    length = torch.where(real, n + k + 1, torch.ones_like(n))
    if ngram:
        fallback, found = propose_ngram_device(history, length, tokens.shape[-1])
    else:
        fallback, found = torch.zeros_like(cached), torch.zeros_like(hit)
    spec = torch.where(hit.view(-1, 1), cached, fallback)
    return hit, branch, spec, length, found & ~hit


_compiled: list = []  # torch.compile of _next_speculation, made on first use


def next_speculation(cache: SpeculationCache, slots: torch.Tensor, state, before: int, rows: int,
                     compiled: bool = False):
    """A chained round's next speculation, on the device (both sides of chained rounds compute
    it, each on its stream: the same inputs give the same values): rows ``slots`` [rows] whose
    round (index ``before`` of ``state``, a ``protocol.ChainState``) verified n committed tokens +
    its speculation and ended with outcome (k, t*) -> (hit [rows], branch [rows], speculation
    [rows, K], committed length n + k + 1 [rows], n-gram [rows]: a miss's speculation is an
    n-gram proposal). A hit's speculation is the cache's branch; a miss's the n-gram proposal
    over the committed tokens (``ngram.propose_ngram_device``; zeros where no suffix recurs,
    or with ``SSDLIB_CHAIN_NGRAM=0``: a greedy verify is exact whatever it is given). Rows not
    ``real``, the ghost rows of a captured step, keep length 1. ``compiled`` (where the
    runners' steps compile, unless ``SSDLIB_CHAIN_COMPILE=0``): through ``torch.compile``, its
    ~50 small kernels fused (on one H200 a chained round took 1.38 ms instead of 1.48, the same
    tokens; docs/BENCHMARKS.md, 2026-12-03)."""
    fn = _next_speculation
    if compiled and env.flag("SSDLIB_CHAIN_COMPILE"):
        if not _compiled:
            _compiled.append(torch.compile(_next_speculation, dynamic=False))
        fn = _compiled[0]
    return fn(cache.fork, cache.bonus, cache.tokens, cache.ready, slots, state.k[before, :rows],
              state.bonus[before, :rows], state.n[before, :rows], state.real[:rows],
              state.history[:rows, :-1], env.flag("SSDLIB_CHAIN_NGRAM"))
