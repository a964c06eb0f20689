"""Sampling parameters and the target distribution they define.

Conventions (also what SD/SSD verification must reproduce exactly):
temperature 0 = greedy, and so is any temperature below :data:`GREEDY_BELOW` (dividing float32
logits by a smaller one overflows; vLLM draws the same line); otherwise logits / temperature, then top-k, then top-p, where top-p keeps
the smallest set of most likely tokens whose cumulative probability reaches ``top_p`` (HF/vLLM;
among equally likely tokens the lower id comes first); the most likely token is always kept, so
no ``top_p`` can empty the distribution.

:func:`target_probs` states the rule for one parameter set; :func:`target_distributions` applies
it to a batch whose rows have their own parameters (:class:`SamplingTensors`), with no per-row
Python and no host read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from ssdlib.errors import ConfigError
from ssdlib.speculative.rng import RowStream


# Temperatures below this mean greedy: logits / 1e-5 stays far inside float32's range for any
# logit a model produces, while a subnormal or 1e-300 temperature (0 in float32) would give inf/NaN.
GREEDY_BELOW = 1e-5
# top_k at or above any vocabulary means "off"; larger values are clamped here so that they fit
# the int64 / float64 tensors that carry them (the speculator's wire included).
TOP_K_MAX = 2**31 - 1
# Seeds are taken modulo this (the modulus RowStream.from_seed already applies), so any Python
# int seeds the same stream as before and fits an int64 on the wire.
SEED_MODULUS = 2**63 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request samples. :meth:`validate` (run at construction) raises ConfigError on a
    bad value and normalises the rest: a temperature below :data:`GREEDY_BELOW` becomes 0
    (greedy), top_k is clamped to :data:`TOP_K_MAX`, a seed is taken modulo
    :data:`SEED_MODULUS` (the same random stream)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> "SamplingParams":
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or \
                self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), "
                              f"got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or \
                any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {self.stop!r:.80}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False, got {self.ignore_eos!r:.80}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.top_k = min(self.top_k, TOP_K_MAX)
        if self.seed is not None:
            self.seed %= SEED_MODULUS
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
    """The distribution AR samples from. logits: [..., V] -> probs [..., V] (float32).

    Must not be called with temperature 0 (greedy has no distribution; use argmax).
    """
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        probs = _top_p_cut(probs, top_p)
    return probs


def _top_p_cut(probs: torch.Tensor, top_p) -> torch.Tensor:
    """probs [..., V] restricted to the smallest set of tokens reaching ``top_p`` (a float, or a
    tensor broadcasting over [..., 1]) and renormalised: token i is kept if the mass strictly
    before it (in descending order, ties in index order) is < top_p; the first always is."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    keep_sorted = (cum - sorted_p) < top_p
    keep_sorted[..., 0] = True  # the most likely token survives any top_p (1e-300 is 0 in float32)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    cut = probs * keep
    return cut / cut.sum(dim=-1, keepdim=True)


class SamplingFacts(NamedTuple):
    """What the host knows of a batch's sampling parameters without reading the device (lets
    :func:`target_distributions` skip work; part of a captured sampled step's key)."""

    any_greedy: bool
    any_sampled: bool
    max_top_k: int  # >= the largest top_k of a sampled row (0: no row uses top-k)
    any_top_p: bool  # a sampled row has top_p < 1


@dataclass(frozen=True, eq=False)
class SamplingTensors:
    """The sampling parameters of a batch's rows as [b] device tensors, plus facts known on the
    host that let :func:`target_distributions` skip work without reading the device.

    temperature [b] float32 (1 on greedy rows); top_k [b] int64 (0 = off); top_p [b] float32
    (1 = off); greedy [b] bool. Greedy rows carry neutral top-k / top-p.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    any_greedy: bool
    any_sampled: bool
    max_top_k: int  # the largest top_k of a sampled row (0: no row uses top-k)
    any_top_p: bool  # a sampled row has top_p < 1

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    device: torch.device | str = "cpu") -> "SamplingTensors":
        """One host-to-device copy for the whole batch."""
        return cls.from_table(cls.host_table(params).to(device, non_blocking=True),
                              cls.host_facts(params))

    @staticmethod
    def host_table(params: Sequence[SamplingParams]) -> torch.Tensor:
        """[b, 4] float64 on the host: (temperature, top_k, top_p, greedy) per row."""
        return torch.tensor([[1.0, 0.0, 1.0, 1.0] if p.greedy else
                             [p.temperature, float(p.top_k), p.top_p, 0.0] for p in params],
                            dtype=torch.float64).reshape(-1, 4)

    @staticmethod
    def host_facts(params: Sequence[SamplingParams]) -> SamplingFacts:
        """What the host knows of a batch's parameters."""
        sampled = [p for p in params if not p.greedy]
        max_top_k = max((p.top_k for p in sampled), default=0)
        # rounded up to a power of two: top-k keeps the k-th largest of the top max_top_k, any
        # bound >= every row's k gives the same result, and few values keep graph keys few
        return SamplingFacts(len(sampled) < len(params), bool(sampled),
                             1 << (max_top_k - 1).bit_length() if max_top_k > 0 else 0,
                             any(p.top_p < 1.0 for p in sampled))

    @classmethod
    def from_table(cls, table: torch.Tensor, facts: SamplingFacts) -> "SamplingTensors":
        """Over a :meth:`host_table` on the device. The tensors are computed from ``table``
        (not views of it): a captured step must call this inside its body, so that each replay
        reads the table's current values."""
        return cls(table[:, 0].float(), table[:, 1].long(), table[:, 2].float(), table[:, 3] > 0,
                   any_greedy=facts.any_greedy, any_sampled=facts.any_sampled,
                   max_top_k=facts.max_top_k, any_top_p=facts.any_top_p)

    @property
    def batch(self) -> int:
        return self.greedy.shape[0]


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """A point mass on each token: tokens [...] -> probs [..., vocab] float32, on the tokens'
    device. The distribution of a greedy choice: a greedy draft's q (its argmax tokens are
    drawn from it), a greedy row's target distribution."""
    probs = torch.zeros(*tokens.shape, vocab, device=tokens.device)
    return probs.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def target_distributions(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Each row's exact AR distribution: logits [b, ..., V] -> probs [b, ..., V] float32, row i
    under row i's parameters: :func:`target_probs` on sampled rows (the same float32 operations,
    so the same numbers), one-hot on the argmax of the logits on greedy rows."""
    b, vocab = logits.shape[0], logits.shape[-1]
    if params.batch != b:
        raise ValueError(f"sampling parameters for {params.batch} rows, logits have {b}")
    per_row = (b,) + (1,) * (logits.dim() - 1)  # views [b] params over [b, ..., V]
    onehot = None
    if params.any_greedy:
        onehot = one_hot(logits.argmax(-1), vocab)
        if not params.any_sampled:
            return onehot
    x = logits.float() / params.temperature.view(per_row)
    if params.max_top_k > 0:
        kmax = min(params.max_top_k, vocab)
        top = x.topk(kmax, dim=-1).values                                 # [b, ..., kmax]
        pick = (params.top_k.clamp(1, kmax) - 1).view(per_row).expand(*x.shape[:-1], 1)
        kth = top.gather(-1, pick)                                        # [b, ..., 1] k-th largest
        on = ((params.top_k > 0) & (params.top_k < vocab)).view(per_row)
        x = x.masked_fill((x < kth) & on, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.any_top_p:
        top_p = params.top_p.view(per_row)
        probs = torch.where(top_p < 1.0, _top_p_cut(probs, top_p), probs)  # 1: untouched
    if onehot is not None:
        probs = torch.where(params.greedy.view(per_row), onehot, probs)
    return probs


def row_streams(seed: int | None, rows: int, offset: int = 0) -> list[RowStream]:
    """One random stream per row (rows offset, offset+1, ...): a fixed seed makes every row
    reproducible, and row i's stream is the one :meth:`RowStream.from_seed` gives request
    ``offset + i``."""
    base = int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed
    return [RowStream.from_seed(base, offset + i) for i in range(rows)]


def row_generators(seed: int | None, rows: int, device: torch.device | str = "cpu",
                   offset: int = 0) -> list[torch.Generator]:
    """One ``torch.Generator`` per row, seeded as :meth:`RowStream.from_seed` keys its stream
    (``generator.initial_seed()`` hashed by :func:`~ssdlib.speculative.rng.stream_key` is that
    key). Kept for callers that still hold generators; new code holds a
    :class:`~ssdlib.speculative.rng.RowStream`."""
    gens = []
    base = torch.randint(0, 2**62, (1,)).item() if seed is None else seed
    for i in range(rows):
        g = torch.Generator(device=device)
        g.manual_seed((base * 1_000_003 + offset + i) % (2**63 - 1))
        gens.append(g)
    return gens
