"""Leader <-> speculator wire protocol (one definition used by both sides; see docs/PROTOCOL.md).

Point-to-point send/recv on the two-rank ``spec_group``, tensors on the rank's device (NCCL on
GPU, gloo on CPU). Hot-loop buffers are preallocated at their maximum size (max_batch rows) and
only the first ``b`` rows travel; nothing is pickled.

Messages, each preceded by the int64 header [8] = (op, b, n_tokens, sampling, 0, 0, 0, 0):
- ADMIT (leader -> speculator), when sequences join the batch (any time; outside the hot loop):
  rows int64 [b, 4] = (slot, prompt_len, request_index, seed or -1),
  params float64 [b, 3] = (temperature, top_p, top_k), tokens int64 [n_tokens] (prompts, concat.).
- OUTCOME (leader -> speculator): int64 [b, 4] = (slot, k accepted, bonus t*, active) for the
  rows of one exchange (all running rows after a round; the new rows after an ADMIT, with k = 0
  and t* = the token sampled from the prefill). ``sampling`` in the header says whether the SPEC
  answer carries q (some listed active row samples).
- SPEC (speculator -> leader), the answer to an OUTCOME with an active row (no header), rows in
  the OUTCOME's order: int64 [b, K + 2] = (s_1..s_K, q kind (QKind), hit 0/1); then, only when
  ``sampling``, float32 [b, K, V] = the q each token was sampled from (dense rows).
  An OUTCOME with no active row is answered with STATS instead: float64 [5] = (speculator idle s,
  busy s, cache hits, cache lookups, hits whose branch KV was reused) since the last STATS.
- SHUTDOWN (leader -> speculator): header only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

OP_ADMIT = 1
OP_OUTCOME = 2
OP_SHUTDOWN = 3


@dataclass
class Speculation:
    """A speculation per row as the verifier receives it."""

    tokens: torch.Tensor  # [b, K] int64
    kinds: torch.Tensor  # [b] int64 QKind of q
    hit: torch.Tensor  # [b] bool, served from the speculation cache
    q: torch.Tensor | None  # [b, K, V] float32 when sampling


class SpecLink:
    def __init__(self, group, peer: int, device: torch.device, max_batch: int, k: int,
                 vocab_size: int, staged: bool = False):
        self.group, self.peer, self.device = group, peer, device
        self.staged = staged  # a gloo link between ranks on one GPU: tensors travel via the host
        self.k, self.vocab_size, self.max_batch = k, vocab_size, max_batch
        self.header = torch.zeros(8, dtype=torch.int64, device=device)
        self.outcome_buf = torch.zeros(max_batch, 4, dtype=torch.int64, device=device)
        self.spec_buf = torch.zeros(max_batch, k + 2, dtype=torch.int64, device=device)
        self._q_buf: torch.Tensor | None = None  # allocated on the first sampling batch

    def _send(self, t: torch.Tensor) -> None:
        dist.send(t.cpu() if self.staged else t.contiguous(), dst=self.peer, group=self.group)

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        if self.staged:
            host = torch.empty(t.shape, dtype=t.dtype)
            dist.recv(host, src=self.peer, group=self.group)
            t.copy_(host)
            return t
        dist.recv(t, src=self.peer, group=self.group)
        return t

    def q_buf(self) -> torch.Tensor:
        if self._q_buf is None:
            self._q_buf = torch.zeros(self.max_batch, self.k, self.vocab_size,
                                      dtype=torch.float32, device=self.device)
        return self._q_buf

    def _send_header(self, op: int, b: int = 0, n_tokens: int = 0, sampling: int = 0) -> None:
        self.header.copy_(torch.tensor([op, b, n_tokens, sampling, 0, 0, 0, 0]))
        self._send(self.header)

    # -- leader side ------------------------------------------------------------------------
    def send_admit(self, rows: torch.Tensor, params: torch.Tensor, tokens: torch.Tensor) -> None:
        self._send_header(OP_ADMIT, rows.shape[0], tokens.numel())
        self._send(rows.to(self.device))
        self._send(params.to(self.device, torch.float64))
        self._send(tokens.to(self.device))

    def send_outcome(self, outcome: torch.Tensor, sampling: bool) -> None:
        b = outcome.shape[0]
        self._send_header(OP_OUTCOME, b, 0, int(sampling))
        self.outcome_buf[:b].copy_(outcome)
        self._send(self.outcome_buf[:b])

    def recv_spec(self, b: int, sampling: bool) -> Speculation:
        buf = self._recv(self.spec_buf[:b])
        q = self._recv(self.q_buf()[:b]) if sampling else None
        k = self.k
        return Speculation(buf[:, :k].clone(), buf[:, k].clone(), buf[:, k + 1].bool(),
                           None if q is None else q.clone())

    def recv_stats(self) -> list[float]:
        return self._recv(torch.zeros(5, dtype=torch.float64, device=self.device)).tolist()

    def send_shutdown(self) -> None:
        self._send_header(OP_SHUTDOWN)

    # -- speculator side --------------------------------------------------------------------
    def recv_header(self) -> tuple[int, int, int, int]:
        op, b, n, sampling = self._recv(self.header).tolist()[:4]
        return op, b, n, sampling

    def recv_admit(self, b: int, n_tokens: int):
        rows = self._recv(torch.empty(b, 4, dtype=torch.int64, device=self.device))
        params = self._recv(torch.empty(b, 3, dtype=torch.float64, device=self.device))
        tokens = self._recv(torch.empty(n_tokens, dtype=torch.int64, device=self.device))
        return rows.cpu(), params.cpu(), tokens.cpu()

    def recv_outcome(self, b: int) -> torch.Tensor:
        return self._recv(self.outcome_buf[:b]).cpu()

    def send_spec(self, tokens: torch.Tensor, kinds: torch.Tensor, hit: torch.Tensor,
                  q: torch.Tensor | None) -> None:
        b, k = tokens.shape
        buf = self.spec_buf[:b]
        buf[:, :k].copy_(tokens)
        buf[:, k].copy_(kinds)
        buf[:, k + 1].copy_(hit.long())
        self._send(buf)
        if q is not None:
            qb = self.q_buf()[:b]
            qb.copy_(q)
            self._send(qb)

    def send_stats(self, stats: torch.Tensor) -> None:
        self._send(stats.to(self.device, torch.float64))
