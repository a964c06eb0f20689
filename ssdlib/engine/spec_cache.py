"""The speculation cache: for each row, B pre-drafted speculations keyed by outcome (k, t*).

Preallocated once at its maximum size (max_batch rows, B branches, K tokens; q only when some
row samples) so the buffers stay fixed (CUDA-graph friendly). It only ever holds the entries for
the *next* round: building overwrites, lookup reads.

Lookup answers an outcome on the speculator's critical path (the verifier waits for it), so it
reads a host mirror of the keys and tokens instead of the device: after each build, ``publish``
queues one device-to-host copy (pinned memory on GPU) that lands while the verifier verifies;
the lookup launches nothing and waits only for that copy, i.e. for the end of the build (already
past unless the build outlasted the verify).
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
        # host mirror of (fork, bonus, tokens, ready), refreshed by publish()
        pin = device.type == "cuda"
        self.host_fork = torch.full((max_batch, branches), -1, dtype=torch.int64,
                                    pin_memory=pin)
        self.host_bonus = torch.full((max_batch, branches), -1, dtype=torch.int64,
                                     pin_memory=pin)
        self.host_tokens = torch.zeros(max_batch, branches, k, dtype=torch.int64, pin_memory=pin)
        self.host_ready = torch.zeros(max_batch, dtype=torch.bool, pin_memory=pin)
        self._published = torch.cuda.Event() if pin else None

    @property
    def q(self) -> torch.Tensor:
        """[max_batch, B, K, V] float32, allocated on the first sampling batch."""
        if self._q is None:
            self._q = torch.zeros(self.ready.shape[0], self.B, self.K, self.V,
                                  dtype=torch.float32, device=self.device)
        return self._q

    def publish(self) -> None:
        """Queue the copy of the keys, tokens and ready flags to the host mirror (after a
        build; asynchronous on GPU, where lookup waits for it)."""
        nb = self._published is not None
        self.host_fork.copy_(self.fork, non_blocking=nb)
        self.host_bonus.copy_(self.bonus, non_blocking=nb)
        self.host_tokens.copy_(self.tokens, non_blocking=nb)
        self.host_ready.copy_(self.ready, non_blocking=nb)
        if nb:
            self._published.record()

    def invalidate(self, rows: list[int]) -> None:
        """Rows ``rows`` hold nothing (new sequences in those slots), on both sides."""
        self.ready[torch.tensor(rows, device=self.device)] = False
        self._wait_published()  # a queued copy must not land over the host write
        self.host_ready[rows] = False

    def _wait_published(self) -> None:
        if self._published is not None:
            self._published.synchronize()

    def store_keys(self, rows: torch.Tensor, fork: torch.Tensor, bonus: torch.Tensor) -> None:
        """rows [n] batch rows; fork, bonus [n, B]: the outcome each branch assumes."""
        self.fork[rows] = fork
        self.bonus[rows] = bonus
        self.ready.index_fill_(0, rows, True)  # no host scalar: capturable

    def lookup(self, rows: list[int], k: list[int], bonus: list[int]):
        """Outcomes (k, t*) of cache rows ``rows``, on the host mirror of the last publish ->
        (hit [n] bool, branch [n] int64, tokens [n, K] int64: the hit branch's, zeros on a
        miss), host tensors. The first matching branch answers."""
        n = len(rows)
        if self.B == 0 or n == 0:  # no cache (plain SD on a separate rank): every lookup misses
            return (torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int64),
                    torch.zeros(n, self.K, dtype=torch.int64))
        self._wait_published()
        # a handful of rows and branches: plain Python beats a chain of tiny tensor ops
        idx = torch.tensor(rows)
        forks, bonuses = self.host_fork[idx].tolist(), self.host_bonus[idx].tolist()
        ready = self.host_ready[idx].tolist()
        hit, branch = [False] * n, [0] * n
        tokens = torch.zeros(n, self.K, dtype=torch.int64)
        for i in range(n):
            if not ready[i]:
                continue
            for j, (f, t) in enumerate(zip(forks[i], bonuses[i])):
                if f == k[i] and t == bonus[i]:
                    hit[i], branch[i] = True, j
                    tokens[i] = self.host_tokens[rows[i], j]
                    break
        return torch.tensor(hit), torch.tensor(branch, dtype=torch.int64), tokens
