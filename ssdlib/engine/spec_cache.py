"""The speculation cache: for each row, B pre-drafted speculations keyed by outcome (k, t*).

Preallocated once at its maximum size (max_batch rows, B branches, K tokens; q only when some
row samples) so the buffers stay fixed (CUDA-graph friendly). It only ever holds the entries for
the *next* round: building overwrites, lookup reads. Lookup runs on the device: one comparison
of [b, B] keys, no Python loop over branches.
"""

from __future__ import annotations

import torch


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

    def clear(self) -> None:
        self.ready.zero_()
        self.fork.fill_(-1)

    def store_keys(self, rows: torch.Tensor, fork: torch.Tensor, bonus: torch.Tensor) -> None:
        """rows [n] batch rows; fork, bonus [n, B]: the outcome each branch assumes."""
        self.fork[rows] = fork
        self.bonus[rows] = bonus
        self.ready.index_fill_(0, rows, True)  # no host scalar: capturable

    def lookup(self, rows: torch.Tensor, k: torch.Tensor, bonus: torch.Tensor):
        """rows [n], outcome k [n], t* [n] -> (hit [n] bool, branch [n] int64)."""
        rows, k, bonus = rows.to(self.device), k.to(self.device), bonus.to(self.device)
        if self.B == 0:  # no cache (plain SD on a separate rank): every lookup misses
            return torch.zeros_like(rows, dtype=torch.bool), torch.zeros_like(rows)
        match = (self.fork[rows] == k[:, None]) & (self.bonus[rows] == bonus[:, None])  # [n, B]
        hit = match.any(-1) & self.ready[rows]
        return hit, match.int().argmax(-1)
