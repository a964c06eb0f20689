"""Teacher and draft: both are ssdlib's Llama. The draft shares the target's vocabulary and special
ids, ties its embeddings (most of a small draft's size is the embedding) and is written out as an
HF checkpoint directory.

With ``embedding_from_target`` the draft's embedding (tied head) is the target's, frozen: only
its layers and final norm are trained, counted and stored, and config.json carries the flag
(ssdlib loads it beside the target: ssdlib/loading/draft.py). A narrower draft of that kind
(``target_hidden_size``) reads the target's embedding through two trained projections
[target hidden, hidden], one for its embedding and one for its (untied) LM head: during
training both weights are torch parametrizations (the target's matrix times the projection),
and only the projections are stored."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn.utils import parametrize

from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.loading import Checkpoint
from ssdlib.loading.draft import load_draft, target_tensor_for
from ssdlib.loading.hf_dir import TARGET_PROJECTIONS, TARGET_SHARED_TENSORS
from ssdlib.models.llama import LlamaForCausalLM

STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")


def load_teacher(ck: Checkpoint, device: torch.device, dtype: torch.dtype,
                 max_positions: int) -> LlamaForCausalLM:
    """The target in ``dtype`` on ``device``, frozen (the RoPE tables stay float32)."""
    with torch.device(device):
        model = LlamaForCausalLM(ck.config, None, max_positions=max_positions)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.load_weights(ck.weights)
    return model.eval().requires_grad_(False)


def draft_config(target: ModelConfig, hidden: int, layers: int, heads: int, kv_heads: int,
                 ffn: int, head_dim: int | None = None,
                 embedding_from_target: bool = False) -> ModelConfig:
    """A small Llama with the target's vocabulary, special ids and RoPE, embeddings tied
    (``head_dim`` default: hidden / heads). ``embedding_from_target``: the embedding is the
    target's; narrower than the target, through projections (``target_hidden_size``, an untied
    head)."""
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"--hidden ({hidden}) must be a multiple of --heads ({heads})")
        head_dim = hidden // heads
    projected = embedding_from_target and hidden != target.hidden_size
    return replace(target, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                   head_dim=head_dim, tie_word_embeddings=not projected,
                   eos_token_ids=list(target.eos_token_ids),
                   embedding_from_target=embedding_from_target,
                   target_hidden_size=target.hidden_size if projected else None).validate()


def count_params(cfg: ModelConfig) -> int:
    """Parameters the draft stores (the target's embedding, when shared, is not stored)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    layer = attn + 3 * h * cfg.intermediate_size + 2 * h
    head = 0 if cfg.tie_word_embeddings or cfg.embedding_from_target else cfg.vocab_size * h
    embed = 0 if cfg.embedding_from_target else cfg.vocab_size * h
    projections = 2 * cfg.target_hidden_size * h if cfg.projects_target_embedding else 0
    return embed + cfg.num_hidden_layers * layer + h + head + projections


def build_draft(cfg: ModelConfig, device: torch.device, max_positions: int,
                seed: int) -> LlamaForCausalLM:
    """A randomly initialised draft (float32 master weights): N(0, 0.02) matrices, residual
    output projections scaled down by sqrt(2 * layers) as in GPT-2, unit norms."""
    with torch.device(device):
        model = LlamaForCausalLM(cfg, None, max_positions=max_positions)
    g = torch.Generator().manual_seed(seed)
    out_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
                continue
            std = 0.02 * (out_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1)
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


@torch.no_grad()
def init_embeddings_from_target(draft: LlamaForCausalLM, ck: Checkpoint) -> None:
    """Draft embedding = the target embedding projected on its top principal directions (the
    leading right singular vectors of E [V, H]), so similar tokens start out similar."""
    emb = ck.weights.get(TARGET_SHARED_TENSORS[0]).double()  # [V, H]
    proj = emb @ _top_directions(emb, draft.config.hidden_size)  # [V, min(d, H)]
    w = draft.model.embed_tokens.weight
    w[:, :proj.shape[1]] = proj.to(w.dtype).to(w.device)


@torch.no_grad()
def share_target_embedding(draft: LlamaForCausalLM, ck: Checkpoint) -> None:
    """The draft's embedding (and tied head) := the target's, frozen (not trained, not stored)."""
    w = draft.model.embed_tokens.weight
    w.copy_(ck.weights.get(TARGET_SHARED_TENSORS[0]).to(w.dtype))
    w.requires_grad_(False)


class FromTarget(nn.Module):
    """A parametrization: weight = the target's matrix [V, target hidden] (frozen, not saved)
    @ the trained projection [target hidden, hidden]."""

    def __init__(self, base: torch.Tensor):
        super().__init__()
        self.register_buffer("base", base, persistent=False)

    def forward(self, projection: torch.Tensor) -> torch.Tensor:
        return self.base.to(projection.dtype) @ projection

    @torch.no_grad()
    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        """The projection whose product is closest to ``weight`` (least squares): the
        projection itself when ``weight`` is such a product (a loaded draft)."""
        return least_squares_projection(self.base, weight).to(weight.dtype).to(weight.device)


def least_squares_projection(base: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The projection P [T, h] (float64, on the CPU) whose product base [V, T] @ P is closest
    to weight [V, h]."""
    return torch.linalg.lstsq(base.double().cpu(), weight.double().cpu()).solution


def _projection_param(name: str) -> str:
    """The parameter name torch.nn.utils.parametrize gives the projection of ``name``."""
    module, _, attr = name.rpartition(".")
    return f"{module}.parametrizations.{attr}.original"


@torch.no_grad()
def project_target_embedding(draft: LlamaForCausalLM, ck: Checkpoint, fresh: bool) -> None:
    """A narrower draft's embedding and LM head := the target's matrices through trained
    projections (parametrizations). Its current weights become the least-squares projections
    (a draft loaded by --init-from keeps exactly its function); ``fresh``: both projections
    start as the target embedding's top principal directions (the --init-embeddings-from-target
    start of a draft of this width)."""
    cfg = draft.config
    modules = {TARGET_SHARED_TENSORS[0]: draft.model.embed_tokens,
               TARGET_SHARED_TENSORS[1]: draft.lm_head}
    device = draft.model.embed_tokens.weight.device
    top = None
    if fresh:  # [H, d]: zero columns past the target's width (a wider draft)
        emb = ck.weights.get(TARGET_SHARED_TENSORS[0]).double()
        top = torch.zeros(emb.shape[1], cfg.hidden_size, dtype=torch.float64)
        found = _top_directions(emb, cfg.hidden_size)
        top[:, :found.shape[1]] = found
        top = top.float()
    for name in TARGET_SHARED_TENSORS:
        source = target_tensor_for(name, ck.weights)
        base = ck.weights.get(source).float().to(device)  # [V, target hidden]
        if tuple(base.shape) != (cfg.vocab_size, cfg.target_hidden_size):
            raise ValueError(f"the target's {source} has shape {tuple(base.shape)}, the draft "
                             f"expects ({cfg.vocab_size}, {cfg.target_hidden_size})")
        module = modules[name]
        if top is not None:
            module.weight.copy_(base @ top.to(device))
        parametrize.register_parametrization(module, "weight", FromTarget(base), unsafe=True)


def _top_directions(emb: torch.Tensor, d: int) -> torch.Tensor:
    """The leading ``d`` right singular vectors of an embedding E [V, H]: [H, min(d, H)]."""
    evals, evecs = torch.linalg.eigh(emb.T @ emb)  # E^T E [H, H], cheap for any V
    return evecs[:, evals.argsort(descending=True)[:d]]


def stored_tensors(draft: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors an exported draft stores, by name: not the target's embedding (or head);
    a narrower draft's projections under their checkpoint names."""
    tensors = draft.hf_state_dict()
    cfg = draft.config
    if cfg.projects_target_embedding:
        for served, stored in TARGET_PROJECTIONS.items():
            tensors[stored] = tensors.pop(_projection_param(served))
    if cfg.embedding_from_target:
        for name in TARGET_SHARED_TENSORS:
            tensors.pop(name, None)
    return tensors


def parse_layer_list(text: str, n_target: int) -> list[int]:
    """``"3,7,11"`` -> [3, 7, 11], each a layer index of the target."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--init-layers-from-target: expected comma-separated layer indices, "
                         f"got {text!r}") from None
    bad = [i for i in layers if not 0 <= i < n_target]
    if not layers or bad:
        raise ValueError(f"--init-layers-from-target: layer indices must be in 0..{n_target - 1} "
                         f"(the target has {n_target} layers), got {text!r}")
    return layers


class _LayerMap:
    """Target weights under draft names: draft layer n reads target layer ``layers[n]``."""

    def __init__(self, weights, layers: list[int]):
        self.weights, self.layers = weights, layers

    def _name(self, name: str) -> str:
        parts = name.split(".")
        if name.startswith("model.layers."):
            parts[2] = str(self.layers[int(parts[2])])
        return ".".join(parts)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weights.shape(self._name(name)))

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        return self.weights.get(self._name(name), dim=dim, start=start, stop=stop)


@torch.no_grad()
def init_layers_from_target(draft: LlamaForCausalLM, ck: Checkpoint, layers: list[int]) -> None:
    """Draft layer n := target layer ``layers[n]`` (norms, attention, MLP), the final norm := the
    target's. The shapes must match (a draft as wide as the target: --embedding-from-target)."""
    if len(layers) != draft.config.num_hidden_layers:
        raise ValueError(f"--init-layers-from-target names {len(layers)} layers but the draft has "
                         f"--layers {draft.config.num_hidden_layers}")
    source = _LayerMap(ck.weights, layers)
    modules = [(name, m) for name, m in draft.named_modules()
               if hasattr(m, "checkpoint_tensors")
               and (name.startswith("model.layers.") or name == "model.norm")]
    for name, module in modules:
        for tensor, expected in module.checkpoint_tensors(name):
            found = source.shape(tensor)
            if found != expected:
                raise ValueError(
                    f"--init-layers-from-target: the draft's {tensor} has shape {expected} but "
                    f"the target's {source._name(tensor)} has {found}; use "
                    "--embedding-from-target (the target's widths) or --hidden/--heads/"
                    "--kv-heads/--ffn equal to the target's")
    for name, module in modules:
        module.load(source, name)


@torch.no_grad()
def init_from_draft(draft: LlamaForCausalLM, ck: Checkpoint, directory: str) -> ModelConfig:
    """Every weight of ``draft`` := the exported draft in ``directory`` (``load_draft``: a draft
    stored without its embedding reads the target's), cast to the draft's (float32) dtype.
    ``draft`` must have ``directory``'s architecture (distill_draft.py --init-from takes it from
    there). Returns the source's config; raises ValueError when it does not fit ``draft``/``ck``.
    A shared target embedding is set (and frozen) by :func:`share_target_embedding` after this,
    exactly as for a fresh --embedding-from-target draft."""
    where = f"--init-from {directory}"
    try:
        source = load_draft(directory, ck)
    except CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None
    src, cfg = source.config, draft.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "embedding_from_target",
            "target_hidden_size")
    diff = [f"{k} {getattr(src, k)} (the draft: {getattr(cfg, k)})" for k in keys
            if getattr(src, k) != getattr(cfg, k)]
    if not src.tie_word_embeddings and not src.projects_target_embedding:
        diff.append("an untied LM head (distill_draft.py trains tied drafts)")
    if diff:
        raise ValueError(f"{where}: the source draft does not fit: {', '.join(diff)}")
    try:
        draft.load_weights(source.weights)  # checks every tensor's shape first
    except CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None
    return src


def export_hf(draft: LlamaForCausalLM, ck: Checkpoint, out_dir: str, storage_dtype: str) -> int:
    """Write ``out_dir`` as an HF Llama checkpoint (config.json, model.safetensors, the target's
    tokenizer files) that ssdlib and transformers load (a draft that uses the target's embedding:
    ssdlib only, beside its target). Returns the safetensors file size."""
    size = write_checkpoint(out_dir, draft.config, stored_tensors(draft), storage_dtype)
    copy_tokenizer(ck, out_dir)
    return size


def write_checkpoint(out_dir: str, cfg: ModelConfig, tensors: dict[str, torch.Tensor],
                     storage_dtype: str) -> int:
    """``out_dir``/model.safetensors (``tensors`` in ``storage_dtype``, written atomically) and
    config.json (``cfg`` naming that dtype). Returns the safetensors file size."""
    os.makedirs(out_dir, exist_ok=True)
    dtype = STORAGE_DTYPES[storage_dtype]
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in tensors.items()}
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    os.chmod(weights + ".tmp", 0o644)
    os.replace(weights + ".tmp", weights)
    raw = cfg.to_hf_dict()
    raw["torch_dtype"] = storage_dtype
    raw["dtype"] = storage_dtype  # transformers 5 name
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return os.path.getsize(weights)


def copy_tokenizer(ck: Checkpoint, out_dir: str) -> bool:
    """Tokenizer files of the target into ``out_dir``: copied from an HF directory, else written
    by ssdlib's tokenizer (GGUF targets). False when the target has no tokenizer."""
    if os.path.isdir(ck.source):
        found = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(ck.source, f))]
        for f in found:
            shutil.copy(os.path.join(ck.source, f), os.path.join(out_dir, f))
        if any(f.startswith("tokenizer") for f in found):
            return True
    tok = ck.tokenizer
    if tok is None:
        return False
    tok.save_hf(out_dir)
    return True
