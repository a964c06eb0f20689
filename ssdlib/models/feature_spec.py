"""Which of its target's hidden states a feature draft reads (``ssdlib.models.feature_draft``).

Two kinds:

- ``last_prenorm``: the target's last decoder layer's output, before the final norm (width H);
- ``fused`` (EAGLE-3): the outputs, before any final norm, of three of the target's decoder
  layers, low, middle and high, concatenated (width 3H; by default layers 1, L // 2 and L - 1 of
  a target of L layers). The draft maps them to H with its learned ``fuse`` linear first.

The target keeps the features the draft reads per KV slot (``KVCache.features``, written by
``LlamaModel.forward``), so a spec is resolved against the target's layer count into the layer
indices whose outputs it concatenates (``target_layers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LAST_PRENORM = "last_prenorm"
FUSED = "fused"
KINDS = (LAST_PRENORM, FUSED)
FUSED_LAYER_COUNT = 3  # low, middle and high


def default_fused_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice for a target of ``num_layers`` decoder layers: (1, L // 2, L - 1)."""
    return 1, num_layers // 2, num_layers - 1


@dataclass(frozen=True)
class FeatureSpec:
    """A feature kind and, for ``fused``, the target's decoder layers it concatenates."""

    kind: str = LAST_PRENORM
    layers: tuple[int, ...] | None = None  # fused only: increasing layer indices

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown feature kind {self.kind!r}: choose from "
                             f"{', '.join(KINDS)}")
        if self.kind == LAST_PRENORM:
            if self.layers is not None:
                raise ValueError(f"{LAST_PRENORM!r} features name no layers (they are the last "
                                 f"layer's), got {self.layers!r}")
            return
        layers = self.layers
        if not isinstance(layers, (list, tuple)) or len(layers) != FUSED_LAYER_COUNT or any(
                isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise ValueError(f"{FUSED!r} features read {FUSED_LAYER_COUNT} target layers (low, "
                             f"middle, high) given as integers, got {layers!r}")
        if any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0:
            raise ValueError(f"{FUSED!r} feature layers must be increasing layer indices >= 0, "
                             f"got {list(layers)}")
        object.__setattr__(self, "layers", tuple(layers))

    @classmethod
    def fused(cls, num_layers: int, layers: Sequence[int] | None = None) -> "FeatureSpec":
        """Fused features of a target of ``num_layers`` layers: ``layers``, or the default
        (``default_fused_layers``); checked against the target (ValueError)."""
        if layers is None:
            layers = default_fused_layers(num_layers)
            if num_layers < 4:  # 1, L // 2, L - 1 increase from L = 4 on
                raise ValueError(f"a target of {num_layers} decoder layers has no default fused "
                                 f"layers ({', '.join(map(str, layers))} do not increase): "
                                 "name three")
        spec = cls(FUSED, layers)
        spec.target_layers(num_layers)
        return spec

    @property
    def parts(self) -> int:
        """How many target hidden states of width H one feature concatenates."""
        return 1 if self.layers is None else len(self.layers)

    def width(self, hidden_size: int) -> int:
        """The feature's width for a target of ``hidden_size``: H or 3H."""
        return self.parts * hidden_size

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The decoder layers of a target of ``num_layers`` whose outputs make the feature, in
        order (ValueError when the target has no such layer)."""
        if self.layers is None:
            return (num_layers - 1,)
        if self.layers[-1] >= num_layers:
            raise ValueError(f"{FUSED!r} features read layers {list(self.layers)} but the "
                             f"target has {num_layers} decoder layers (0..{num_layers - 1})")
        return self.layers

    def to_config(self) -> dict:
        """The entries of config.json's ``ssdlib_feature_draft`` this spec sets."""
        out: dict = {"feature": self.kind}
        if self.layers is not None:
            out["layers"] = list(self.layers)
        return out

    @classmethod
    def from_config(cls, entry: dict) -> "FeatureSpec":
        """The spec of config.json's ``ssdlib_feature_draft`` entry (ValueError when it is not
        one)."""
        kind = entry.get("feature")
        if kind not in KINDS:
            raise ValueError(f"it reads features {kind!r}; ssdlib serves "
                             f"{' and '.join(repr(k) for k in KINDS)}")
        layers = entry.get("layers")
        if kind == FUSED and layers is None:
            raise ValueError(f"{FUSED!r} features need \"layers\": [low, middle, high]")
        return cls(kind, layers)
