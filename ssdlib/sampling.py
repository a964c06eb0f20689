"""Sampling parameters and the target distribution they define.

Conventions (also what SD/SSD verification must reproduce exactly):
temperature 0 = greedy; otherwise logits / temperature, then top-k, then top-p, where top-p keeps
the smallest set of most likely tokens whose cumulative probability reaches ``top_p`` (HF/vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ssdlib.errors import ConfigError


@dataclass
class SamplingParams:
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
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 or \
                self.temperature != self.temperature:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop must be a list of non-empty strings")
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
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep token i if the mass strictly before it is < top_p: the smallest set reaching top_p
        keep_sorted = (cum - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def row_generators(seed: int | None, rows: int, device: torch.device | str = "cpu",
                   offset: int = 0) -> list[torch.Generator]:
    """One independent random stream per row; a fixed seed makes the whole call reproducible."""
    gens = []
    base = torch.randint(0, 2**62, (1,)).item() if seed is None else seed
    for i in range(rows):
        g = torch.Generator(device=device)
        g.manual_seed((base * 1_000_003 + offset + i) % (2**63 - 1))
        gens.append(g)
    return gens


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
