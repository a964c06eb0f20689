"""Leader <-> speculator wire protocol: every message defined once, used by both sides
(docs/PROTOCOL.md has the table).

Each message is a small dataclass that knows its wire layout: ``pack`` turns it into the tensors
that travel (one per message part, fixed dtype), ``unpack`` turns received tensors back into it.
:class:`~ssdlib.distributed.spec_link.SpecLink` (``spec_link.py``) moves them: point-to-point
send/recv on the two-rank ``spec_group``, tensors on the rank's device (NCCL on GPU, gloo on
CPU; ``staged``: gloo through host memory for ranks that share a GPU). Nothing is pickled.

Leader -> speculator messages start with a control frame: int64 [8 + (7 + K) * max_batch] = the
:class:`Header`, then OUTCOME's rows (zeros for other messages). An OUTCOME is therefore one
transfer and one read-back.

The leader looks the next speculation up itself: after each cache build the speculator pushes
the cache's keys and tokens (CACHE) to the leader, which receives them when its verify is done,
picks each row's next speculation (a cache hit, an n-gram / random fallback drawn on its host, or
a request for the draft just in time) and says which in the OUTCOME. The speculator answers with
a SPEC only when a row asked for a jit draft or the exchange samples (q travels in it). The
speculator's answers (SPEC, CACHE, STATS) carry no header (the leader knows what follows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

import numpy as np
import torch

from ssdlib import env
from ssdlib.sampling import SamplingParams


class Op(IntEnum):
    ADMIT = 1
    OUTCOME = 2
    SHUTDOWN = 3


OP_ADMIT, OP_OUTCOME, OP_SHUTDOWN = Op.ADMIT, Op.OUTCOME, Op.SHUTDOWN


@dataclass(frozen=True)
class Header:
    """int64 [8] = (op, b, n_tokens, sampling, verify_us, 0, 0, 0): what follows and its
    sizes."""

    op: int
    b: int = 0  # rows of the message
    n_tokens: int = 0  # ADMIT: prompt tokens, all rows together
    sampling: bool = False  # OUTCOME: the SPEC answer carries q
    verify_us: int = 0  # OUTCOME: the leader's last verify forward, µs (0: none yet)

    SIZE: ClassVar[int] = 8

    def values(self) -> list[int]:
        return [int(self.op), self.b, self.n_tokens, int(self.sampling), self.verify_us, 0, 0, 0]

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """Write into ``out`` (int64 [8]) and return it."""
        return out.copy_(torch.tensor(self.values()))

    @classmethod
    def unpack(cls, buf: torch.Tensor) -> "Header":
        op, b, n_tokens, sampling, verify_us = buf.tolist()[:5]
        return cls(op, b, n_tokens, bool(sampling), verify_us)


class ControlFrame:
    """What every leader -> speculator message starts with, int64 [8 + (7 + K) * max_batch]:
    the :class:`Header`, then an OUTCOME's rows [b, 7 + K] (zeros for the other messages)."""

    @staticmethod
    def size(max_batch: int, k: int) -> int:
        return Header.SIZE + Outcome.width(k) * max_batch

    @staticmethod
    def pack(out: torch.Tensor, header: Header, outcome: "Outcome | None" = None) -> torch.Tensor:
        """Write into ``out`` (a frame) and return it (one copy: this runs every round)."""
        flat = header.values() + ([] if outcome is None else outcome.values())
        out[:len(flat)].copy_(torch.tensor(flat, dtype=torch.int64))
        out[len(flat):].zero_()
        return out

    @staticmethod
    def unpack(buf: torch.Tensor, k: int) -> tuple[Header, torch.Tensor]:
        """-> (header, the rows part [max_batch, 7 + K]: an OUTCOME's first b rows)."""
        return Header.unpack(buf[:Header.SIZE]), buf[Header.SIZE:].view(-1, Outcome.width(k))


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


class Choice(IntEnum):
    """Where the leader took a row's next speculation from (an OUTCOME column)."""

    JIT = 0  # ask the speculator: its draft drafts it now (a sequence's first; a miss under jit)
    CACHE = 1  # the cache's branch ``arg`` (a hit)
    LOCAL = 2  # a fallback drawn on the leader: tokens in the row, ``arg`` = its QKind


@dataclass
class Outcome:
    """OUTCOME (L -> S): the rows of one exchange -- all running rows after a round, or the new
    rows after an ADMIT (k = 0, t* = the token sampled from the prefill) -- and each live row's
    next speculation as the leader chose it. An inactive row leaves the batch. After the header:
    int64 [b, 7 + K] = (slot, k accepted, bonus t*, active, choice, arg, limit, s_1..s_K):
    ``choice`` a :class:`Choice`, ``arg`` the cache branch (CACHE) or the QKind (LOCAL),
    ``limit`` how many of the next speculation's tokens the leader will verify (adaptive K, 0 ..
    K: the outcome of that speculation has k <= limit; a jit draft of a cacheless speculator
    drafts only that many), the tokens of a CACHE or LOCAL row (zeros for JIT)."""

    slots: list[int]
    accepted: list[int]  # k
    bonus: list[int]  # t*
    active: list[bool]
    sampling: bool  # some active row samples: the SPEC answer carries q
    k: int  # K, tokens per speculation
    choice: list[int] = field(default_factory=list)  # Choice per row (default: all JIT)
    arg: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # [b][K]
    verify_us: int = 0  # the leader's last verify forward, µs: a jit draft's cost is weighed
    # against it (Thm 17); in the header
    limit: list[int] = field(default_factory=list)  # per row (default: K)
    # a feature draft's speculator: the target's features of the positions verified since the
    # row's last OUTCOME (None: a standalone draft, nothing to carry)
    features: "FeatureRows | None" = None

    def __post_init__(self):
        n = len(self.slots)
        self.choice = self.choice or [int(Choice.JIT)] * n
        self.arg = self.arg or [0] * n
        self.tokens = self.tokens or [[0] * self.k for _ in range(n)]
        self.limit = self.limit or [self.k] * n
        if not (len(self.accepted) == len(self.bonus) == len(self.active) == len(self.choice)
                == len(self.arg) == len(self.tokens) == len(self.limit) == n):
            raise ValueError("Outcome: every column needs one entry per row")

    @staticmethod
    def width(k: int) -> int:
        return 7 + k

    def header(self) -> Header:
        return Header(Op.OUTCOME, len(self.slots), 0, self.sampling, self.verify_us)

    def spec_parts(self) -> tuple[bool, bool]:
        """Which parts of a SPEC answer this OUTCOME: (tokens: a live row asked for a jit
        draft, q: a live row and the exchange samples)."""
        live = [c for c, a in zip(self.choice, self.active) if a]
        return int(Choice.JIT) in live, bool(live) and self.sampling

    def values(self) -> list[int]:
        """The rows [b, 7 + K], flattened."""
        return [v for s, k, t, a, c, g, n, toks in zip(self.slots, self.accepted, self.bonus,
                                                       self.active, self.choice, self.arg,
                                                       self.limit, self.tokens)
                for v in (s, k, t, int(a), c, g, n, *toks)]

    def pack(self, out: torch.Tensor) -> torch.Tensor:
        """Write into the first b rows of ``out`` (int64 [>= b, 7 + K]) and return them."""
        rows = torch.tensor(self.values(), dtype=torch.int64).view(-1, self.width(self.k))
        return out[:rows.shape[0]].copy_(rows)

    @classmethod
    def unpack(cls, rows: torch.Tensor, header: Header, k: int) -> "Outcome":
        host = rows.tolist()  # one read
        return cls([r[0] for r in host], [r[1] for r in host], [r[2] for r in host],
                   [bool(r[3]) for r in host], header.sampling, k, [r[4] for r in host],
                   [r[5] for r in host], [r[7:] for r in host], header.verify_us,
                   [r[6] for r in host])


@dataclass
class FeatureRows:
    """The target's features that travel with an OUTCOME to a feature draft's speculator: for
    each row of the OUTCOME (its order), the positions [start, start + count) whose features
    the target computed since the row's last OUTCOME (count 0: none, an inactive row). After an
    admission that is the prompt, [0, prompt length); after a round that accepted k tokens of a
    speculation verified from position n - 1 (n committed before it), [n - 1, n + k): the last
    committed token's position and the k accepted ones'. Every committed position but the last
    (the bonus, not fed to the target yet) is thus covered exactly once over a row's life.
    ``values`` [rows, P, W] (W the target's feature width, P the longest span; on the device):
    row i's span in its first count_i places, the rest padding."""

    starts: list[int]
    counts: list[int]
    values: torch.Tensor  # [rows, P, W]
    # in the leader's process only (stream placement): the CUDA event after which ``values``
    # are ready on the leader's stream (None: ready now)
    ready: object = None

    def __post_init__(self):
        if not len(self.starts) == len(self.counts) == self.values.shape[0]:
            raise ValueError("FeatureRows: one start, one count and one row of values per row")
        if any(c < 0 for c in self.counts) or max(self.counts, default=0) > self.values.shape[1]:
            raise ValueError(f"FeatureRows: counts {self.counts} do not fit spans of "
                             f"{self.values.shape[1]} positions")

    @classmethod
    def gather(cls, features: torch.Tensor, slots: list[int], starts: list[int],
               counts: list[int]) -> "FeatureRows":
        """The rows' spans read from a target's feature buffer ``features`` [slots, max_len,
        W] in one device index (padding: positions past a span, clamped in the buffer); on a
        GPU with the event after it on the current stream."""
        width = max(max(counts, default=0), 1)
        # [rows, 1 + width]: the slot, then the span's positions
        index = np.empty((len(slots), 1 + width), dtype=np.int64)
        index[:, 0] = slots
        index[:, 1:] = np.minimum(np.asarray(starts, dtype=np.int64).reshape(-1, 1)
                                  + np.arange(width), features.shape[1] - 1)
        index = torch.from_numpy(index).to(features.device, non_blocking=True)
        values = features[index[:, :1], index[:, 1:]]
        ready = None
        if features.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(features.device))
        return cls(list(starts), list(counts), values, ready)

    # on the wire (the speculator on a rank of its own), after the OUTCOME's frame: int64
    # [1 + 2 * rows] = (P, starts, counts), then ``values`` [rows, P, W] in the target's dtype

    def pack_spans(self) -> torch.Tensor:
        return torch.tensor([self.values.shape[1], *self.starts, *self.counts], dtype=torch.int64)

    @staticmethod
    def spans_size(rows: int) -> int:
        return 1 + 2 * rows

    @staticmethod
    def values_shape(spans: torch.Tensor, width: int) -> tuple[int, int, int]:
        """The shape of the values that follow ``spans`` (host int64 [1 + 2 * rows])."""
        return ((spans.numel() - 1) // 2, int(spans[0]), width)

    @classmethod
    def unpack(cls, spans: torch.Tensor, values: torch.Tensor) -> "FeatureRows":
        host = spans.tolist()
        b = (len(host) - 1) // 2
        return cls(host[1:1 + b], host[1 + b:], values)


@dataclass
class Speculation:
    """SPEC (S -> L), in the parts :meth:`Outcome.spec_parts` names; rows in the OUTCOME's order.
    Tokens: int64 [b, K + 1] = (s_1..s_K, q kind), read for the JIT rows (the others are
    zeros). q: float32 [b, K, V] = the q each live row's tokens were drawn from (a CACHE row's
    from the cache, zeros for LOCAL); the leader receives it after launching its verify
    forward, so it travels during the forward."""

    tokens: torch.Tensor  # [b, K] int64
    kinds: torch.Tensor  # [b] int64 QKind of q
    q: torch.Tensor | None  # [b, K, V] float32 when sampling

    def pack(self, out: torch.Tensor, q_out: torch.Tensor | None) -> list[torch.Tensor]:
        """Write into the first b rows of ``out`` (int64 [>= b, K + 1]) and of ``q_out``."""
        b, k = self.tokens.shape
        buf = out[:b]
        buf[:, :k].copy_(self.tokens)
        buf[:, k].copy_(self.kinds)
        if self.q is None:
            return [buf]
        return [buf, q_out[:b].copy_(self.q)]

    @classmethod
    def unpack(cls, buf: torch.Tensor, q: torch.Tensor | None) -> "Speculation":
        """Copies out of the (reused) receive buffers (the int64 part may be a host copy)."""
        k = buf.shape[1] - 1
        return cls(buf[:, :k].clone(), buf[:, k].clone(), None if q is None else q.clone())


@dataclass
class CacheRows:
    """CACHE (S -> L), after each cache build, for the rows of the OUTCOME it answered (in its
    order; rows not built: ready 0): int64 [b, 2 + B * (K + 2)] = (ready, fallback, the B
    branches' forks k, their bonuses t*, their tokens [B, K]). ``fallback`` indexes
    :data:`ssdlib.speculative.fallback.FALLBACKS`: the backup the speculator chose (Thm 17) for the rows that miss."""

    ready: list[bool]
    fallback: list[int]
    fork: list[list[int]]  # [b][B]
    bonus: list[list[int]]  # [b][B]
    tokens: list[list[list[int]]]  # [b][B][K]

    @staticmethod
    def width(branches: int, k: int) -> int:
        return 2 + branches * (k + 2)

    @staticmethod
    def pack_device(ready: torch.Tensor, fallback: int, fork: torch.Tensor, bonus: torch.Tensor,
                    tokens: torch.Tensor) -> torch.Tensor:
        """The rows as one int64 [b, width] tensor from the cache's tensors (device ops, no
        read-back): ready [b] bool, fork / bonus [b, B], tokens [b, B, K]."""
        b = ready.shape[0]
        return torch.cat([ready.long()[:, None],
                          torch.full((b, 1), fallback, dtype=torch.int64, device=ready.device),
                          fork, bonus, tokens.reshape(b, -1)], dim=1)

    @classmethod
    def unpack(cls, host: torch.Tensor, branches: int, k: int) -> "CacheRows":
        rows = host.tolist()  # [b, width], on the host
        B = branches
        return cls([bool(r[0]) for r in rows], [r[1] for r in rows],
                   [r[2:2 + B] for r in rows], [r[2 + B:2 + 2 * B] for r in rows],
                   [[r[2 + 2 * B + j * k:2 + 2 * B + (j + 1) * k] for j in range(B)]
                    for r in rows])


# the speculator's phases of an OUTCOME round, in round order: from the frame to the answer
# (the outcomes' commit), the jit drafts of the rows that asked (a cacheless speculator's whole
# drafting) and q's gather, the SPEC's send (when one is due), the cache build (with the
# answer's bookkeeping before it), the CACHE's push
SPEC_PHASES = ("commit", "fallback", "send", "build", "push")
# its host-clock segments of the same rounds (``SSDLIB_HOST_TIMES=1``, zeros otherwise): the
# host's time to commit, to answer (jit drafts and q gather launched), to send, to launch the
# build, to push, and then the wait for the round's end (the build's, on the GPU)
SPEC_HOST_SEGMENTS = ("commit", "answer", "send", "build", "push", "end")


@dataclass
class SpeculatorStats:
    """STATS (S -> L), the answer to an OUTCOME with no active row; counters since the last
    STATS. float64 [7 + len(SPEC_PHASES) + len(SPEC_HOST_SEGMENTS)] = (idle s, busy s, cache
    hits, cache lookups, hits whose branch KV was reused, OUTCOME rounds answered with SPEC, then
    seconds per phase of those rounds in ``SPEC_PHASES`` order, then seconds per host segment
    in ``SPEC_HOST_SEGMENTS`` order, then the rows the speculator still holds: none once every
    row has left, which a test checks)."""

    idle_s: float
    busy_s: float
    hits: int
    lookups: int
    reused: int
    rounds: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)  # missing phases: 0
    host_s: dict[str, float] = field(default_factory=dict)  # missing segments: 0
    held: int = 0  # rows held when sent (not a counter)

    SIZE: ClassVar[int] = 7 + len(SPEC_PHASES) + len(SPEC_HOST_SEGMENTS)

    def __post_init__(self):
        for what, got, names in (("phases", self.phase_s, SPEC_PHASES),
                                 ("host segments", self.host_s, SPEC_HOST_SEGMENTS)):
            unknown = set(got) - set(names)
            if unknown:
                raise ValueError(f"SpeculatorStats: unknown {what} {sorted(unknown)}")
        self.phase_s = {p: float(self.phase_s.get(p, 0.0)) for p in SPEC_PHASES}
        self.host_s = {p: float(self.host_s.get(p, 0.0)) for p in SPEC_HOST_SEGMENTS}

    def plus(self, other: "SpeculatorStats") -> "SpeculatorStats":
        """The counters over both spans."""
        return SpeculatorStats(self.idle_s + other.idle_s, self.busy_s + other.busy_s,
                               self.hits + other.hits, self.lookups + other.lookups,
                               self.reused + other.reused, self.rounds + other.rounds,
                               {p: self.phase_s[p] + other.phase_s[p] for p in SPEC_PHASES},
                               {p: self.host_s[p] + other.host_s[p] for p in SPEC_HOST_SEGMENTS},
                               other.held)

    def pack(self) -> torch.Tensor:
        return torch.tensor([self.idle_s, self.busy_s, float(self.hits), float(self.lookups),
                             float(self.reused), float(self.rounds),
                             *(self.phase_s[p] for p in SPEC_PHASES),
                             *(self.host_s[p] for p in SPEC_HOST_SEGMENTS), float(self.held)],
                            dtype=torch.float64)

    @classmethod
    def unpack(cls, buf: torch.Tensor) -> "SpeculatorStats":
        idle, busy, hits, lookups, reused, rounds, *times, held = buf.tolist()
        n = len(SPEC_PHASES)
        return cls(idle, busy, int(hits), int(lookups), int(reused), int(rounds),
                   dict(zip(SPEC_PHASES, times[:n])), dict(zip(SPEC_HOST_SEGMENTS, times[n:])),
                   int(held))


@dataclass
class Replies:
    """What the speculator still owes the leader after the leader's last OUTCOME, beyond a
    SPEC's tokens (received at once when due), in the order it sends them: a sampling exchange's
    q, then, from an SSD speculator, the CACHE it pushes after building. The leader receives
    both before it sends any other message, so the two directions never cross; the q (and the
    CACHE's receive, posted) is taken once the next verify forward is launched, so that it
    travels during the forward."""

    q_slots: list[int] | None = None  # rows of the q still to come (the OUTCOME's order)
    cache_slots: list[int] | None = None  # rows of the CACHE still to come
    cache_posted: bool = False  # the CACHE's receive is posted

    @classmethod
    def after(cls, msg: Outcome, pushes_cache: bool) -> "Replies":
        """What an OUTCOME with a live row is answered with, beyond the SPEC's tokens."""
        _, want_q = msg.spec_parts()
        return cls(msg.slots if want_q else None, msg.slots if pushes_cache else None)


def chain_max_rows() -> int:
    """The largest batch that runs chained rounds (``SSDLIB_CHAIN_MAX_ROWS``, default 8; their
    captured steps exist for these batch buckets only). On one H200 (SmolLM2-135M + the
    default draft, K = 3, 16 HumanEval prompts, b = 8 greedy, one invocation): SD 5605.8
    tok/s, SSD with chains up to 4 rows (every round through the host) 5304.6, up to 8 rows
    7002.9 (docs/BENCHMARKS.md, 2026-12-03). Larger batches are not measured."""
    return env.integer("SSDLIB_CHAIN_MAX_ROWS")


@dataclass
class ChainState:
    """Chained rounds' device state (stream placement, ``engine/leader/chained_rounds.py``),
    shared in process by the leader's captured verify and the speculator's captured build:
    per row of the batch bucket, at index ``r % 2`` for round r: the committed length the
    round verified from (``n``), its outcome (``k`` accepted, ``bonus`` t*); ``real`` marks
    the batch's rows (the others are ghost rows of a captured step). Round r + 1 reads index
    r % 2 and writes the other. No wire layout: in process only."""

    real: torch.Tensor  # [rows] bool
    n: torch.Tensor  # [2, rows] int64
    k: torch.Tensor  # [2, rows] int64
    bonus: torch.Tensor  # [2, rows] int64
    spec: torch.Tensor  # [2, rows, K] int64: the speculation the round verified
    # [rows, max_len + 1] int64: each row's committed tokens (up to its round's n + k + 1; the
    # last column takes the writes of tokens a round did not commit): a miss's n-gram fallback
    history: torch.Tensor
    # sampling rows' random streams (``speculative/rng.py``), column 0 the verifier's, column 1
    # the speculator's: keys [rows, 2], and at index r % 2 the first draw after round r
    # [2, rows, 2] (round r + 1's verify draws from column 0's K + 1, its build from column
    # 1's K * B: each side advances its own column, the host mirrors it)
    keys: torch.Tensor
    draws: torch.Tensor

    @classmethod
    def empty(cls, rows: int, k: int, max_len: int, device) -> "ChainState":
        def table(*shape):
            return torch.zeros(2, rows, *shape, dtype=torch.int64, device=device)
        return cls(torch.zeros(rows, dtype=torch.bool, device=device), table(), table(),
                   table(), table(k),
                   torch.zeros(rows, max_len + 1, dtype=torch.int64, device=device),
                   torch.zeros(rows, 2, dtype=torch.int64, device=device), table(2))

    def start_streams(self, column: int, streams: torch.Tensor) -> None:
        """A chain's first rows' streams in ``column`` (0: the verifier's, 1: the
        speculator's): ``streams`` [b, 2] (key, next draw) on the host
        (``RowStreams.reserve_host``), the next draw as round 0's."""
        b = streams.shape[0]
        self.keys[:b, column].copy_(streams[:, 0], non_blocking=True)
        self.draws[0, :b, column].copy_(streams[:, 1], non_blocking=True)

    def set_stream(self, column: int, parity: int, row: int, key: int, draw: int) -> None:
        """Row ``row`` (a row joining a running chain) draws from stream ``key`` at ``draw``
        on, in ``column``, from the round that reads index ``parity``."""
        self.keys[row, column] = key
        self.draws[parity, row, column] = draw

    def commit(self, p: int, rows: int) -> None:
        """Write round ``p``'s committed tokens (its speculation's first k, then t*) into the
        history at positions n .. n + k (device ops; the positions past k go to the last
        column)."""
        commit_history(self.history[:rows], self.n[p, :rows], self.k[p, :rows],
                       self.spec[p, :rows], self.bonus[p, :rows])


def commit_history(history: torch.Tensor, n: torch.Tensor, k: torch.Tensor, spec: torch.Tensor,
                   bonus: torch.Tensor) -> None:
    """:meth:`ChainState.commit` on tensors: rows' history [rows, max_len + 1] takes their
    speculation spec [rows, K]'s first k [rows], then bonus [rows], at positions n [rows] on."""
    n, k = n.view(-1, 1), k.view(-1, 1)
    K = spec.shape[-1]
    i = torch.arange(K + 1, device=n.device).view(1, -1)
    tokens = torch.cat([spec, spec[:, :1]], dim=1)                      # [rows, K+1]
    tokens = torch.where(i == k, bonus.view(-1, 1), tokens)
    last = history.shape[1] - 1
    at = torch.where(i <= k, (n + i).clamp(max=last), torch.full_like(i, last))
    history.scatter_(1, at, tokens)


@dataclass
class ChainStart:
    """A chain starts for rows ``slots`` (host; the batch's order) over ``state``: the
    speculator's build reads it from now on, after the leader's events; ``sampling``: some row
    samples (the speculator fills its column of ``state.keys`` and ``state.draws``)."""

    slots: list[int]
    state: ChainState
    sampling: bool = False


@dataclass
class ChainRegroup:
    """A running chain's rows change before its next round (which reads index ``parity`` of
    the state): ``slots`` per row of the chain (-1: a ghost row, a sequence that ended), and
    ``joined`` the rows that are new sequences (admitted since, their draft prefilled; the
    speculator fills their column of ``state.keys`` and ``state.draws`` where the chain
    samples). In-process only."""

    slots: list[int]
    joined: list[int]
    parity: int


@dataclass
class ChainSeen:
    """A chained round read back, for the speculator's online estimates (Thm 12's a_p and r,
    the fallbacks' hit rate), which chained rounds otherwise never tell it: each row's accepted
    tokens out of ``k`` verified, and each lookup against a cache built for its row (the
    outcome position it looked up, hit or not, and the lookup's kind) with ``fan`` the fan-out of
    the build that cache came from (None: not known to the leader, the lookups are not counted).
    In-process only."""

    accepted: list[int]
    k: int
    lookups: list[tuple[int, bool, bool]]  # (k, hit, fresh: ``fanout.lookup_is_fresh``)
    fan: tuple | None
    cached: list[bool] = field(default_factory=list)  # per row of ``accepted``: its
    # speculation was the cache's (else the miss's backup); empty: not told


@dataclass
class ChainEnd:
    """Chained rounds ended: each listed row's committed tokens as the leader holds them
    (``tokens``, all but the last: the next OUTCOME commits that one, as after an admission),
    which the speculator takes as its row's state: the draft's KV is valid for all but the last
    committed token, nothing is in flight. In-process only."""

    slots: list[int]
    tokens: list[list[int]]
