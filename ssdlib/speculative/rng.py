"""Randomness for sampling and speculative decoding: one convention shared by every sampler.

Each row owns a counter-based random stream: a 64-bit key, derived from the request's seed and
index (:meth:`RowStream.from_seed`), and a counter. Draw j of a stream is a stateless hash of
(key, j) -- the splitmix64 output function (Steele, Lea & Flood 2014) in int64 tensor ops -- so
the uniforms of a whole batch are a short chain of elementwise integer kernels on the device (one
kernel once fused by a compiler): no host read, no state besides the counters, capturable in a
CUDA graph. A row's draws depend only on its key and counter, so its tokens are reproducible
from its seed and do not depend on which other rows share the batch.

Every call draws a fixed number of uniforms per row, decided before the call and never by an
outcome, so the host always knows each counter without reading the device: a call *reserves*
its draws on the host (:meth:`RowStreams.reserve` advances :attr:`RowStream.counter`) and sends
the rows' keys and first counters to the device with its other inputs. The fixed counts:

* sampling one token from a distribution: 1 (inverse CDF, :func:`sample_categorical`);
* verifying K draft tokens (:func:`~ssdlib.speculative.acceptance.verify_sampled`): K+1, K
  accept tests then the bonus draw (a row limited to n < K drafts: tests 0 .. n-1, the bonus
  draw n);
* drafting k tokens autoregressively: k (draw j for token j); k random draft tokens: k;
* the speculative loops reserve for K_max whatever K a round runs (adaptive K): K_max + 1
  draws for a verify, K_max for a proposal (also in a round that drafts nothing), so a row's
  draws never depend on the longest row of its batch;
* sampling B branch tokens of one row at once: B, in branch order.

``generators`` arguments take a :class:`RowStreams` (what the engine passes), a single
``torch.Generator`` for the whole batch or ``None`` (torch's global generator) -- vectorised
draws for statistical tests over many rows -- or, until every caller holds a :class:`RowStream`,
a list of one ``torch.Generator`` per row (one small ``torch.rand`` per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 value torch stores."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


_GAMMA = _signed(0x9E3779B97F4A7C15)  # golden-ratio increment between consecutive draws
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: clear the copied sign bits)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (products wrap modulo 2**64, as in C)."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def mix64_int(x: int) -> int:
    """:func:`mix64` on one Python int (host side; the same bits as the tensor version)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _signed(x ^ (x >> 31))


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """Draws counters[i] .. counters[i]+n-1 of stream keys[i]: keys [b], counters [b] int64 ->
    [b, n] float64 in [0, 1), multiples of 2**-53. Stateless: advancing the counters is the
    caller's business."""
    j = torch.arange(1, n + 1, dtype=torch.int64, device=keys.device)    # [n]
    x = keys[:, None] + (counters[:, None] + j) * _GAMMA                 # [b, n] splitmix64 state
    return _shr(mix64(x), 11).double() * 2.0 ** -53                      # top 53 bits


def counter_uniforms_host(key: int, counter: int, n: int) -> list[float]:
    """:func:`counter_uniforms` of one stream in Python ints (the same numbers, bit for bit):
    for a few draws on the host, where a chain of tensor ops costs more than it computes."""
    out = []
    for j in range(1, n + 1):
        x = mix64_int(key + (counter + j) * _GAMMA) & _MASK64
        out.append((x >> 11) * 2.0 ** -53)
    return out


@dataclass
class RowStream:
    """One row's stream on the host: its key and the first draw not yet reserved."""

    key: int  # an int64 value
    counter: int = 0

    @classmethod
    def from_seed(cls, seed: int | None, index: int = 0) -> "RowStream":
        """The stream of request ``index`` under ``seed`` (None: a seed from torch's global
        generator, so ``torch.manual_seed`` still makes an unseeded run reproducible)."""
        base = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed
        return cls(stream_key((base * 1_000_003 + index) % (2**63 - 1)))

    def reserve(self, n: int) -> int:
        """Take the next ``n`` draws; returns the first one's counter."""
        first = self.counter
        self.counter += n
        return first

    def uniforms_host(self, n: int) -> list[float]:
        """Reserve the next ``n`` draws and return them, computed on the host."""
        return counter_uniforms_host(self.key, self.reserve(n), n)


def stream_key(seed: int) -> int:
    """The key of the stream seeded by ``seed`` (any int): hashed, so that streams of nearby
    seeds (consecutive request indices) are unrelated."""
    return mix64_int(seed)


@dataclass(frozen=True, eq=False)
class RowStreams:
    """The streams of a batch's rows on the device: keys [b] and first counters [b] (int64).

    ``width`` draws per row starting at ``counters`` belong to this call (None: no limit).
    """

    keys: torch.Tensor
    counters: torch.Tensor
    width: int | None = None

    @classmethod
    def reserve(cls, streams: Sequence[RowStream], n: int,
                device: torch.device | str = "cpu") -> "RowStreams":
        """Reserve ``n`` draws of each row's stream (advancing its host counter) and put the
        keys and first counters on ``device`` in one host-to-device copy (no device read)."""
        dev = cls.reserve_host(streams, n).to(device, non_blocking=True)
        return cls(dev[:, 0], dev[:, 1], n)

    @staticmethod
    def reserve_host(streams: Sequence[RowStream], n: int) -> torch.Tensor:
        """Reserve ``n`` draws of each row's stream -> [b, 2] int64 on the host: (key, first
        counter) per row, the table a captured step copies in with its other inputs."""
        return torch.tensor([[s.key, s.reserve(n)] for s in streams],
                            dtype=torch.int64).reshape(-1, 2)

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    def uniforms(self, n: int, start: int = 0) -> torch.Tensor:
        """Draws start .. start+n-1 of this call's reservation: [b, n] float64 in [0, 1)."""
        if start < 0 or (self.width is not None and start + n > self.width):
            raise ValueError(f"draws {start}..{start + n - 1} are outside the {self.width} "
                             "reserved per row")
        counters = self.counters if start == 0 else self.counters + start
        return counter_uniforms(self.keys, counters, n)


Generators = Union[RowStreams, torch.Generator, Sequence[torch.Generator], None]


def uniforms(generators: Generators, rows: int, n: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` uniforms in [0, 1) per row, float64: returns [rows, n] on ``device`` (a
    :class:`RowStreams` answers on its own device)."""
    if isinstance(generators, RowStreams):
        if generators.batch != rows:
            raise ValueError(f"got streams for {generators.batch} rows, need {rows}")
        return generators.uniforms(n)
    if generators is None or isinstance(generators, torch.Generator):
        gen_device = generators.device if generators is not None else device
        u = torch.rand(rows, n, dtype=torch.float64, generator=generators, device=gen_device)
        return u.to(device)
    if len(generators) != rows:
        raise ValueError(f"got {len(generators)} generators for {rows} rows (need one per row)")
    if rows == 0:
        return torch.empty(0, n, dtype=torch.float64, device=device)
    u = [torch.rand(n, dtype=torch.float64, generator=g, device=g.device) for g in generators]
    return torch.stack(u).to(device)


CDF_BLOCK = 256  # tokens per block of blocked_cdf
# Rows for which sample_categorical takes blocked_cdf: one row scans fast as is (torch's 1-D scan,
# 7 µs at V = 49152 on an H200 against 23 µs in blocks), and from ~128 rows the last-dim scan has
# rows enough to be parallel (127 vs 138 µs); 4-16 rows: 80 vs 24-31 µs (dev/gpu_micro_cdf.py,
# one H200, inside a CUDA graph). Blocks cost more launches where it runs eagerly.
BLOCKED_CDF_ROWS = range(2, 65)


def blocked_cdf(probs: torch.Tensor) -> torch.Tensor:
    """The running sum along the last dim of probs [n, V] (non-negative), computed in blocks of
    ``CDF_BLOCK``: each block's own running sum plus the running sum of the block totals before
    it. Same values as ``probs.cumsum(-1)`` up to rounding (the additions are grouped per block),
    and, like it, non-decreasing with a zero-probability token's value equal to the one before
    it. Why: CUDA's scan along the last dim runs a few rows as one thread block walking V
    serially (a [16, 49152] cumsum took a large part of a sampled tree build); in blocks the
    scans are [n * V / 256, 256] and [n, V / 256], parallel over rows."""
    n, vocab = probs.shape
    if vocab <= CDF_BLOCK:
        return probs.cumsum(-1)
    blocks = -(-vocab // CDF_BLOCK)
    extra = blocks * CDF_BLOCK - vocab
    padded = torch.nn.functional.pad(probs, (0, extra)) if extra else probs  # zeros after V
    local = padded.view(n, blocks, CDF_BLOCK).cumsum(-1)                 # [n, blocks, BLOCK]
    # block j's offset is the running sum of the totals of blocks < j: off_j = off_{j-1} +
    # total_{j-1}, the very addition that gives block j-1's last value (so the join is exact)
    ends = local[..., -1].cumsum(-1)                                     # [n, blocks]
    offsets = torch.nn.functional.pad(ends[:, :-1], (1, 0))              # [n, blocks]
    cdf = local + offsets.unsqueeze(-1)
    return cdf.view(n, blocks * CDF_BLOCK)[:, :vocab].contiguous()


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: probs [n, V] (non-negative, each row with positive mass, need not be
    normalised), u [n] uniforms in [0, 1) -> token ids [n] int64. No host read.

    A zero-probability token is never returned: its CDF interval is empty (cumsum in float64).
    """
    probs = probs.double()
    cdf = blocked_cdf(probs) if probs.shape[0] in BLOCKED_CDF_ROWS else probs.cumsum(-1)  # [n, V]
    total = cdf[:, -1:].contiguous()                                     # [n, 1]
    idx = torch.searchsorted(cdf, u.double()[:, None] * total, right=True)  # first cdf > target
    # u * total rounded up to total (float64 makes this all but impossible) finds no cdf above
    # it: take the first token where the cdf reaches the total, which has positive mass.
    last = torch.searchsorted(cdf, total, right=False)                   # [n, 1]
    return torch.minimum(idx, last).squeeze(-1)


def sample_token(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """Draw one token per distribution from probs [..., V] -> [...] int64 (one uniform each).

    :class:`RowStreams` cover the first dim: row i draws probs[i].numel() / V uniforms, in
    row-major order ([b, B, V]: B per row). A list of generators holds one per distribution.
    """
    flat = probs.reshape(-1, probs.shape[-1])                            # [n, V]
    if isinstance(generators, RowStreams):
        if probs.dim() < 2 or generators.batch != probs.shape[0]:
            raise ValueError(f"streams for {generators.batch} rows cannot sample probs of shape "
                             f"{tuple(probs.shape)} (need [b, ..., V] with b rows)")
        u = generators.uniforms(flat.shape[0] // max(probs.shape[0], 1)).reshape(-1)
    else:
        u = uniforms(generators, flat.shape[0], 1, probs.device)[:, 0]   # [n]
    return sample_categorical(flat, u.to(probs.device)).reshape(probs.shape[:-1])
