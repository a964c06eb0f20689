"""Model configuration: one dataclass for every Llama checkpoint ssdlib loads.

It is built from an HF ``config.json`` (classic ``rope_theta``/``rope_scaling`` or the
transformers-5 ``rope_parameters`` form) or from GGUF metadata, and validated before any weight
is touched so a bad checkpoint fails with a clear :class:`CheckpointError`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ssdlib.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
# Mistral is Llama with a sliding attention window (same layers, same tensor names)
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
# config.json key of a draft that stores no token embedding and uses its target's (frozen) one,
# as its LM head too when tied; such a draft loads only beside its target (loading/draft.py).
EMBEDDING_FROM_TARGET_KEY = "ssdlib_embedding_from_target"
# config.json key of such a draft that is narrower than its target: it reads the target's
# embedding (this wide) through two learned projections to its own width, one for its input
# embedding and one for its LM head (loading/draft.py folds them in at load time).
TARGET_HIDDEN_SIZE_KEY = "ssdlib_target_hidden_size"
# The smallest sliding window accepted: a branch token of the speculator's tree sees at most the
# speculation (K <= 32 tokens) and its own branch (<= K + 1) in the tree region, all of which stay
# inside its window, so tree keys need no window check.
MIN_SLIDING_WINDOW = 128


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 style scaling dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    attention_bias: bool = False
    mlp_bias: bool = False
    # a draft whose embedding (and tied head) is its target's: see EMBEDDING_FROM_TARGET_KEY
    embedding_from_target: bool = False
    # a narrower draft of that kind: its target's hidden size (see TARGET_HIDDEN_SIZE_KEY)
    target_hidden_size: int | None = None
    # sliding-window attention: a token attends to itself and the sliding_window - 1 tokens
    # before it (Mistral's convention and config key); None: to every earlier token
    sliding_window: int | None = None

    @property
    def context_reach(self) -> int | None:
        """How many positions back a token's output can depend on through every layer's
        sliding window: num_hidden_layers x (sliding_window - 1). The KV of a position further
        back than that from every later query is never read. None without a window."""
        if self.sliding_window is None:
            return None
        return self.num_hidden_layers * (self.sliding_window - 1)

    @property
    def projects_target_embedding(self) -> bool:
        """A draft that reads its target's embedding through learned projections."""
        return self.target_hidden_size is not None

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ("llama3", "default", None):
                raise CheckpointError(f"config: unsupported rope_scaling type {rope_type!r} "
                                      "(supported: llama3)")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool)
                              or w < MIN_SLIDING_WINDOW):
            raise CheckpointError(
                f"config: sliding_window must be an integer >= {MIN_SLIDING_WINDOW} (or null), "
                f"got {w!r}")
        if self.attention_bias or self.mlp_bias:
            raise CheckpointError("config: attention_bias/mlp_bias Llama variants are not supported")
        if self.target_hidden_size is not None:
            t = self.target_hidden_size
            if not isinstance(t, int) or isinstance(t, bool) or t <= 0:
                raise CheckpointError(
                    f"config: {TARGET_HIDDEN_SIZE_KEY} must be a positive integer, got {t!r}")
            if not self.embedding_from_target:
                raise CheckpointError(
                    f"config: {TARGET_HIDDEN_SIZE_KEY} is only meaningful with "
                    f"{EMBEDDING_FROM_TARGET_KEY}: true (a draft that reads its target's "
                    "embedding through projections)")
            if self.tie_word_embeddings:
                raise CheckpointError(
                    f"config: a draft with {TARGET_HIDDEN_SIZE_KEY} has its own projections for "
                    "the embedding and the LM head, so tie_word_embeddings must be false")
        return self

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_hf_dict(self) -> dict[str, Any]:
        """The classic HF ``config.json`` form (what transformers 4.x and 5.x both read)."""
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.embedding_from_target:
            d[EMBEDDING_FROM_TARGET_KEY] = True
        if self.target_hidden_size is not None:
            d[TARGET_HIDDEN_SIZE_KEY] = self.target_hidden_size
        if self.sliding_window is not None:  # Hugging Face's Llama has no window: Mistral has
            d.update(architectures=["MistralForCausalLM"], model_type="mistral",
                     sliding_window=self.sliding_window)
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                 else list(self.eos_token_ids))
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse an HF Llama ``config.json`` dict (transformers 4.x or 5.x form)."""
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        model_type = d.get("model_type", "llama")
        if (model_type not in SUPPORTED_MODEL_TYPES
                or not any(a in SUPPORTED_ARCHITECTURES for a in archs)):
            raise CheckpointError(
                f"{source}: unsupported architecture {archs} (model_type {model_type!r}); "
                "ssdlib runs Llama-architecture models (LlamaForCausalLM, or "
                "MistralForCausalLM: Llama with a sliding window)")
        if d.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: unsupported hidden_act {d.get('hidden_act')!r}")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            rope_params = d.get("rope_parameters")
            rope_theta = d.get("rope_theta")
            rope_scaling = d.get("rope_scaling")
            if isinstance(rope_params, dict):
                # transformers 5: everything RoPE lives in rope_parameters.
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
            if isinstance(rope_scaling, dict) and rope_scaling.get(
                    "rope_type", rope_scaling.get("type")) == "default":
                rope_scaling = None
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int)
                                              else [int(e) for e in eos])
            cfg = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                embedding_from_target=bool(d.get(EMBEDDING_FROM_TARGET_KEY, False)),
                target_hidden_size=d.get(TARGET_HIDDEN_SIZE_KEY),
                sliding_window=d.get("sliding_window"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: missing or invalid field: {e}") from None
        return cfg.validate()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
