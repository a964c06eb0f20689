"""Write a wider copy of a draft that reads the target's embedding through projections (issue 12).

    python tools/widen_draft.py ssdlib/assets/smollm2-135m-draft OUT_DIR --target smollm2-135m \\
        --hidden 256 --heads 8 --kv-heads 4 --ffn 1024

A 16 MB draft cannot grow wider with its own embedding (49152 rows times its width). The wider
copy reads the target's frozen embedding through two projections instead
(``ssdlib_target_hidden_size``, ssdlib/loading/draft.py). A source with its own embedding is
first projected: each projection is the least-squares fit of the source's embedding (or LM
head) on the target's, and the tool prints the fit's relative residual. That fit is the one
change of function, and it can be large: for the shipped v4 the residual is 0.216, and greedy
agreement with SmolLM2 on held-out chat answers fell from 0.532 to 0.218 (MODEL_CARD.md,
session 13), so such a copy needs training before it drafts well.

Then every width grows and the function stays (up to RMSNorm's eps):
- The new residual dimensions start at zero. What writes them starts at zero: the embedding
  projection's new columns, and the new rows of o_proj and down_proj.
- New heads and FFN units write nothing: the new columns of o_proj and down_proj are zero.
- What reads the new dimensions or feeds the new units starts random, N(0, 0.02) as distill's
  fresh drafts do, so training moves them.
- The old dimensions' RMSNorm weights are scaled by sqrt(old / new width), since the mean of
  squares now runs over a wider vector.
- Query heads keep their KV groups: the group size and head_dim must stay.

``distill_draft.py --init-from OUT_DIR`` then trains it. Other files of the source directory
(tokenizer_source.json, ...) are copied; MODEL_CARD.md is not.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import replace

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TOOLS), TOOLS]  # the repository (ssdlib, tools) and tools/

from ssdlib.config import ModelConfig  # noqa: E402
from ssdlib.loading import load_checkpoint  # noqa: E402
from ssdlib.loading.draft import target_tensor_for  # noqa: E402
from ssdlib.loading.hf_dir import TARGET_PROJECTIONS, TARGET_SHARED_TENSORS  # noqa: E402
from tools.distill.models import least_squares_projection, write_checkpoint  # noqa: E402
from truncate_layers import copy_side_files  # noqa: E402

EMBED, HEAD = TARGET_SHARED_TENSORS
LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
READ_STD = 0.02  # the new entries that read new dimensions or feed new units
# per layer tensor: (rows grow with, columns grow with); "h" hidden, "q"/"kv" heads * head_dim,
# "f" FFN; writers (into the residual stream, or out of new units) get zeros, the rest random
PARTS = {"self_attn.q_proj.weight": ("q", "h"), "self_attn.k_proj.weight": ("kv", "h"),
         "self_attn.v_proj.weight": ("kv", "h"), "self_attn.o_proj.weight": ("h", "q"),
         "mlp.gate_proj.weight": ("f", "h"), "mlp.up_proj.weight": ("f", "h"),
         "mlp.down_proj.weight": ("h", "f")}
WRITERS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def fit_projection(base: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The projection P [T, h] with base [V, T] @ P closest to weight [V, h] (least squares),
    and the fit's relative residual ||base P - weight|| / ||weight||."""
    proj = least_squares_projection(base, weight)
    weight = weight.double()
    return proj, float((base.double() @ proj - weight).norm() / weight.norm().clamp_min(1e-30))


def source_projections(src, target) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The source's two projections by served tensor name ({EMBED, HEAD}), and the residual of
    each fit (0 for a source that stores its projections)."""
    cfg = src.config
    if cfg.projects_target_embedding:
        return ({n: src.weights.get(p).double() for n, p in TARGET_PROJECTIONS.items()},
                {n: 0.0 for n in TARGET_PROJECTIONS})
    if cfg.embedding_from_target:
        raise ValueError("the source uses the target's embedding at the target's width: it is "
                         "as wide as the target already")
    projections, residuals = {}, {}
    for name in TARGET_SHARED_TENSORS:
        own = EMBED if name == HEAD and cfg.tie_word_embeddings else name
        base = target.weights.get(target_tensor_for(name, target.weights))
        projections[name], residuals[name] = fit_projection(base, src.weights.get(own))
    return projections, residuals


def grown(old: torch.Tensor, shape: tuple[int, ...], zero: bool,
          gen: torch.Generator) -> torch.Tensor:
    """``old`` in the leading block of a new tensor of ``shape``; the rest zero or random."""
    new = (torch.zeros(shape, dtype=torch.float64) if zero
           else torch.randn(shape, generator=gen, dtype=torch.float64) * READ_STD)
    new[tuple(slice(0, n) for n in old.shape)] = old.double()
    return new


def widened_config(src: ModelConfig, target: ModelConfig, hidden: int, heads: int, kv: int,
                   ffn: int) -> ModelConfig:
    """The wider draft's config; ValueError when it is not a widening of ``src``."""
    if hidden >= target.hidden_size:
        raise ValueError(f"--hidden {hidden} is not below the target's {target.hidden_size}: "
                         "a draft as wide as the target uses its embedding as is")
    old = (src.hidden_size, src.num_attention_heads, src.num_key_value_heads,
           src.intermediate_size)
    names = ("--hidden", "--heads", "--kv-heads", "--ffn")
    for name, o, n in zip(names, old, (hidden, heads, kv, ffn)):
        if n < o:
            raise ValueError(f"{name} {n} is below the source's {o}: this tool only widens")
    if heads % kv or heads // kv != src.num_queries_per_kv:
        raise ValueError(f"--heads {heads} / --kv-heads {kv} must keep the source's "
                         f"{src.num_queries_per_kv} query heads per KV head (its heads keep "
                         "their KV groups)")
    return replace(src, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                   intermediate_size=ffn, tie_word_embeddings=False,
                   embedding_from_target=True,
                   target_hidden_size=target.hidden_size).validate()


def widen(src, target, hidden: int, heads: int, kv: int, ffn: int,
          seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, float]]:
    """The wider draft: (config, tensors by checkpoint name in float64, fit residuals)."""
    old_cfg = src.config
    cfg = widened_config(old_cfg, target.config, hidden, heads, kv, ffn)
    gen = torch.Generator().manual_seed(seed)
    hd = old_cfg.head_dim
    size = {"h": hidden, "q": heads * hd, "kv": kv * hd, "f": ffn}
    norm_scale = math.sqrt(old_cfg.hidden_size / hidden)
    projections, residuals = source_projections(src, target)
    tensors = {}
    for served, proj in projections.items():  # [T, h]: new columns read (head) or write (embed)
        tensors[TARGET_PROJECTIONS[served]] = grown(
            proj, (target.config.hidden_size, hidden), zero=served == EMBED, gen=gen)
    for name in src.weights.names():
        if name in TARGET_SHARED_TENSORS or name in TARGET_PROJECTIONS.values():
            continue
        t = src.weights.get(name)
        m = LAYER.match(name)
        part = m.group(2) if m else name
        if part in PARTS:
            rows, cols = PARTS[part]
            tensors[name] = grown(t, (size[rows], size[cols]), zero=part in WRITERS, gen=gen)
        elif part in NORMS or name == "model.norm.weight":
            scaled = t.double() * norm_scale
            new = torch.full((hidden,), float(scaled.mean()), dtype=torch.float64)
            new[:t.shape[0]] = scaled
            tensors[name] = new
        else:
            raise ValueError(f"{name}: not a tensor of a Llama draft this tool knows")
    return cfg, tensors, residuals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the draft to widen (a directory)")
    p.add_argument("out")
    p.add_argument("--target", default="smollm2-135m", help="the target whose embedding it reads")
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, help="default: the source's, times hidden's growth")
    p.add_argument("--kv-heads", type=int, help="default: --heads / the source's group size")
    p.add_argument("--ffn", type=int, help="default: the source's, times hidden's growth")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    src, target = load_checkpoint(a.src), load_checkpoint(a.target)
    c = src.config
    grow = a.hidden / c.hidden_size
    heads = a.heads or round(c.num_attention_heads * grow)
    kv = a.kv_heads or max(1, heads // c.num_queries_per_kv)
    ffn = a.ffn or round(c.intermediate_size * grow)
    dtype = src.weights.get(src.weights.names()[0]).dtype  # stored as the source is
    try:
        cfg, tensors, residuals = widen(src, target, a.hidden, heads, kv, ffn, a.seed)
    except ValueError as e:
        raise SystemExit(f"widen_draft: {e}") from None
    size = write_checkpoint(a.out, cfg, tensors, str(dtype).removeprefix("torch."))
    copy_side_files(a.src, a.out)
    n = sum(t.numel() for t in tensors.values())
    print(f"{a.out}: hidden {c.hidden_size} -> {a.hidden}, heads {c.num_attention_heads}/"
          f"{c.num_key_value_heads} -> {heads}/{kv}, ffn {c.intermediate_size} -> {ffn}, "
          f"{c.num_hidden_layers} layers; {n / 1e6:.2f} M stored parameters "
          f"({size / 1e6:.2f} MB); "
          "projection fit residual: " + ", ".join(f"{k} {v:.4f}" for k, v in residuals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
