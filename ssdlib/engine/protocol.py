"""Leader <-> speculator wire protocol: every message defined once, used by both sides
(docs/PROTOCOL.md has the table).

Each message is a small dataclass that knows its wire layout: ``pack`` turns it into the tensors
that travel (one per message part, fixed dtype), ``unpack`` turns received tensors back into it.
:class:`~ssdlib.engine.spec_link.SpecLink` (``spec_link.py``) moves them: point-to-point
send/recv on the two-rank ``spec_group``, tensors on the rank's device (NCCL on GPU, gloo on
CPU; ``staged``: gloo through host memory for ranks that share a GPU). Nothing is pickled.

Leader -> speculator messages start with a control frame: int64 [8 + 4 * max_batch] = the
:class:`Header`, then OUTCOME's rows (zeros for other messages). An OUTCOME is therefore one
transfer and one read-back, the minimum for the exchange on the critical path. The speculator's
answers (SPEC, STATS) carry no header (the leader knows what it asked for); SPEC's int64 part
is packed on the host and travels in one copy, its q part (sampling) stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

import torch

from ssdlib.sampling import SamplingParams


class Op(IntEnum):
    ADMIT = 1
    OUTCOME = 2
    SHUTDOWN = 3


OP_ADMIT, OP_OUTCOME, OP_SHUTDOWN = Op.ADMIT, Op.OUTCOME, Op.SHUTDOWN


@dataclass(frozen=True)
class Header:
    """int64 [8] = (op, b, n_tokens, sampling, 0, 0, 0, 0): what follows and its sizes."""

    op: int
    b: int = 0  # rows of the message
    n_tokens: int = 0  # ADMIT: prompt tokens, all rows together
    sampling: bool = False  # OUTCOME: the SPEC answer carries q

    SIZE: ClassVar[int] = 8

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """Write into ``out`` (int64 [8]) and return it."""
        return out.copy_(torch.tensor([int(self.op), self.b, self.n_tokens, int(self.sampling),
                                       0, 0, 0, 0]))

    @classmethod
    def unpack(cls, buf: torch.Tensor) -> "Header":
        op, b, n_tokens, sampling = buf.tolist()[:4]
        return cls(op, b, n_tokens, bool(sampling))


class ControlFrame:
    """What every leader -> speculator message starts with, int64 [8 + 4 * max_batch]: the
    :class:`Header`, then an OUTCOME's rows [b, 4] (zeros for the other messages)."""

    @staticmethod
    def size(max_batch: int) -> int:
        return Header.SIZE + Outcome.WIDTH * max_batch

    @staticmethod
    def pack(out: torch.Tensor, header: Header, outcome: "Outcome | None" = None) -> torch.Tensor:
        """Write into ``out`` (a frame) and return it."""
        out.zero_()
        header.pack(out[:Header.SIZE])
        if outcome is not None:
            outcome.pack(out[Header.SIZE:].view(-1, Outcome.WIDTH))
        return out

    @staticmethod
    def unpack(buf: torch.Tensor) -> tuple[Header, torch.Tensor]:
        """-> (header, the rows part [max_batch, 4]: an OUTCOME's first b rows)."""
        return Header.unpack(buf[:Header.SIZE]), buf[Header.SIZE:].view(-1, Outcome.WIDTH)


@dataclass
class AdmitRow:
    """One sequence joining the batch."""

    slot: int  # KV slot: the row's identity on the wire and in the speculation cache
    tokens: list[int]  # its committed tokens (the prompt)
    request_index: int  # salts the speculator's random stream
    params: SamplingParams  # only temperature, top_p, top_k and seed travel


@dataclass
class Admit:
    """ADMIT (L -> S), when sequences join (any time; outside the hot loop). After the header:
    rows int64 [b, 4] = (slot, prompt_len, request_index, seed or -1),
    params float64 [b, 3] = (temperature, top_p, top_k), tokens int64 [n_tokens] (concatenated)."""

    rows: list[AdmitRow]

    def header(self) -> Header:
        return Header(Op.ADMIT, len(self.rows), sum(len(r.tokens) for r in self.rows))

    def pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (rows, params, tokens) on the host."""
        rows = torch.tensor([[r.slot, len(r.tokens), r.request_index,
                              -1 if r.params.seed is None else r.params.seed] for r in self.rows],
                            dtype=torch.int64)
        params = torch.tensor([[r.params.temperature, r.params.top_p, float(r.params.top_k)]
                               for r in self.rows], dtype=torch.float64)
        tokens = torch.tensor([t for r in self.rows for t in r.tokens], dtype=torch.int64)
        return rows, params, tokens

    @staticmethod
    def empty(header: Header, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Receive buffers for the parts announced by ``header``."""
        return (torch.empty(header.b, 4, dtype=torch.int64, device=device),
                torch.empty(header.b, 3, dtype=torch.float64, device=device),
                torch.empty(header.n_tokens, dtype=torch.int64, device=device))

    @classmethod
    def unpack(cls, rows: torch.Tensor, params: torch.Tensor, tokens: torch.Tensor) -> "Admit":
        tokens = tokens.tolist()
        out, offset = [], 0
        for (slot, length, index, seed), (temp, top_p, top_k) in zip(rows.tolist(),
                                                                     params.tolist()):
            sp = SamplingParams(temperature=temp, top_p=top_p, top_k=int(top_k),
                                seed=None if seed < 0 else seed)
            out.append(AdmitRow(slot, tokens[offset:offset + length], index, sp))
            offset += length
        return cls(out)


@dataclass
class Outcome:
    """OUTCOME (L -> S): the rows of one exchange -- all running rows after a round, or the new
    rows after an ADMIT (k = 0, t* = the token sampled from the prefill). An inactive row leaves
    the batch. After the header: int64 [b, 4] = (slot, k accepted, bonus t*, active)."""

    slots: list[int]
    accepted: list[int]  # k
    bonus: list[int]  # t*
    active: list[bool]
    sampling: bool  # some active row samples: the SPEC answer carries q

    WIDTH: ClassVar[int] = 4

    def header(self) -> Header:
        return Header(Op.OUTCOME, len(self.slots), 0, self.sampling)

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """Write into the first b rows of ``out`` (int64 [>= b, 4]) and return them."""
        rows = torch.tensor([[s, k, t, int(a)] for s, k, t, a in
                             zip(self.slots, self.accepted, self.bonus, self.active)],
                            dtype=torch.int64).view(-1, self.WIDTH)
        return out[:rows.shape[0]].copy_(rows)

    @classmethod
    def unpack(cls, rows: torch.Tensor, header: Header) -> "Outcome":
        cols = rows.T.tolist()  # one read: slot, k, t*, active columns
        return cls(cols[0], cols[1], cols[2], [bool(a) for a in cols[3]], header.sampling)


@dataclass
class Speculation:
    """SPEC (S -> L), the answer to an OUTCOME with an active row; rows in the OUTCOME's order
    (inactive rows: zeros, ignored). int64 [b, K + 2] = (s_1..s_K, q kind, hit); then, only when
    the OUTCOME said ``sampling``, float32 [b, K, V] = the q each token was drawn from."""

    tokens: torch.Tensor  # [b, K] int64
    kinds: torch.Tensor  # [b] int64 QKind of q
    hit: torch.Tensor  # [b] bool, served from the speculation cache
    q: torch.Tensor | None  # [b, K, V] float32 when sampling

    def pack(self, out: torch.Tensor, q_out: torch.Tensor | None) -> list[torch.Tensor]:
        """Write into the first b rows of ``out`` (int64 [>= b, K + 2]) and of ``q_out``."""
        b, k = self.tokens.shape
        buf = out[:b]
        buf[:, :k].copy_(self.tokens)
        buf[:, k].copy_(self.kinds)
        buf[:, k + 1].copy_(self.hit.long())
        if self.q is None:
            return [buf]
        return [buf, q_out[:b].copy_(self.q)]

    @classmethod
    def unpack(cls, buf: torch.Tensor, q: torch.Tensor | None) -> "Speculation":
        """Copies out of the (reused) receive buffers (the int64 part may be a host copy)."""
        k = buf.shape[1] - 2
        return cls(buf[:, :k].clone(), buf[:, k].clone(), buf[:, k + 1].bool(),
                   None if q is None else q.clone())


# the speculator's phases of an OUTCOME round, in round order: from the frame to the lookup
# (the outcomes' commit), the cache lookup on its host mirror, the missed rows' fallback (a
# JitSpeculator's whole drafting), the answer's send, the cache build (with the answer's
# bookkeeping before it)
SPEC_PHASES = ("commit", "lookup", "fallback", "send", "build")


@dataclass
class SpeculatorStats:
    """STATS (S -> L), the answer to an OUTCOME with no active row; counters since the last
    STATS. float64 [6 + len(SPEC_PHASES)] = (idle s, busy s, cache hits, cache lookups, hits
    whose branch KV was reused, OUTCOME rounds answered with SPEC, then seconds per phase of
    those rounds in ``SPEC_PHASES`` order)."""

    idle_s: float
    busy_s: float
    hits: int
    lookups: int
    reused: int
    rounds: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)  # missing phases: 0

    SIZE: ClassVar[int] = 6 + len(SPEC_PHASES)

    def __post_init__(self):
        unknown = set(self.phase_s) - set(SPEC_PHASES)
        if unknown:
            raise ValueError(f"SpeculatorStats: unknown phases {sorted(unknown)}")
        self.phase_s = {p: float(self.phase_s.get(p, 0.0)) for p in SPEC_PHASES}

    def plus(self, other: "SpeculatorStats") -> "SpeculatorStats":
        """The counters over both spans."""
        return SpeculatorStats(self.idle_s + other.idle_s, self.busy_s + other.busy_s,
                               self.hits + other.hits, self.lookups + other.lookups,
                               self.reused + other.reused, self.rounds + other.rounds,
                               {p: self.phase_s[p] + other.phase_s[p] for p in SPEC_PHASES})

    def pack(self) -> torch.Tensor:
        return torch.tensor([self.idle_s, self.busy_s, float(self.hits), float(self.lookups),
                             float(self.reused), float(self.rounds),
                             *(self.phase_s[p] for p in SPEC_PHASES)], dtype=torch.float64)

    @classmethod
    def unpack(cls, buf: torch.Tensor) -> "SpeculatorStats":
        idle, busy, hits, lookups, reused, rounds, *phases = buf.tolist()
        return cls(idle, busy, int(hits), int(lookups), int(reused), int(rounds),
                   dict(zip(SPEC_PHASES, phases)))
