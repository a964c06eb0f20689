"""What every checkpoint format yields: a :class:`Checkpoint` serving weights by HF name.

The types live apart from the resolver (:mod:`ssdlib.loading.checkpoint`), which imports each
format's loader; the loaders build these types without importing the resolver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ssdlib.config import ModelConfig
from ssdlib.tokenizer import Tokenizer


class WeightSource(Protocol):
    """Read access to a checkpoint's tensors by HF name."""

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        """The tensor ``name`` (float), or its slice ``[start:stop]`` along ``dim``."""
        ...


@dataclass
class Checkpoint:
    """A loaded-on-demand checkpoint: validated config, weights by name, tokenizer factory."""

    source: str
    config: ModelConfig
    weights: WeightSource
    tokenizer_factory: Callable[[], Tokenizer | None] = field(default=lambda: None, repr=False)
    _tokenizer: Tokenizer | None = field(default=None, init=False, repr=False)
    _tokenizer_loaded: bool = field(default=False, init=False, repr=False)

    @property
    def tokenizer(self) -> Tokenizer | None:
        if not self._tokenizer_loaded:
            self._tokenizer = self.tokenizer_factory()
            self._tokenizer_loaded = True
        return self._tokenizer
