"""Grow a Llama checkpoint to a bigger shape without changing its function.

    python tools/inflate.py SRC OUT --like llama-3.1-8b|llama-3.2-1b [--head-dim N] [--match-total]
                            [--target T]
    python tools/inflate.py SRC OUT --layers L --hidden D --ffn F --heads H --kv-heads KV
                            [--head-dim N] [--dtype bfloat16] [--seed 0] [--device cuda]

SRC is anything ``ssdlib.loading.load_checkpoint`` reads (a named default such as
``smollm2-135m``, a ``.gguf`` file, an HF directory). A draft that reads its target's embedding
(``ssdlib_embedding_from_target``, such as the shipped ``smollm2-135m-draft``) needs ``--target``
(e.g. ``smollm2-135m``): the target's embedding, through the draft's projections where it has
them, is folded in and stored, so OUT is a plain Llama. OUT becomes an HF Llama directory
(``model-0000k-of-0000N.safetensors`` + index, config.json, generation_config.json, the
tokenizer) whose logits equal SRC's up to float rounding, while every GEMM has the bigger shape:

* residual stream ``[x, 0]``: the extra hidden channels are zero in the embedding and in every
  writer into the residual (o_proj / down_proj rows), so they stay zero; RMSNorm over d' channels
  of which d are nonzero divides by an RMS smaller by sqrt(d/d'), so norm weights on the
  original channels are multiplied by sqrt(d/d') and ``rms_norm_eps`` by d/d' (then
  ``x*w*c / sqrt(ms*d/d' + eps*d/d') == x*w / sqrt(ms + eps)`` exactly);
* extra attention heads and MLP channels: random q/k/v and gate/up rows (the GEMMs do real work),
  cancelled by zero o_proj columns / down_proj columns;
* extra layers (appended): identity blocks, o_proj and down_proj zero, the rest random;
* GQA: source KV head j becomes target KV head(s) j*m .. j*m+m-1 (m copies when the target
  group is smaller than the source's), its query heads fill those groups in order, so every
  original query head still reads its original keys and values (``head_layout``);
* head_dim: the source's by default; a larger one puts the source's rotary pairs (i, i+hd/2) at
  (i, i+hd'/2), raises rope_theta to theta**(hd'/hd) (same frequencies), zeroes the extra key
  dimensions and scales q by sqrt(hd'/hd) (same softmax scale); RoPE scaling and vocabulary kept.

Weights are made tensor by tensor (on ``--device``) and written one shard at a time, so memory
holds one shard, never the model. ``--like`` keeps the named model's projection widths (q width
heads*head_dim, KV width) and layer / hidden / ffn sizes, so non-embedding parameters equal the
named model's; the embedding keeps SRC's vocabulary (see ``report``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ssdlib.config import (  # noqa: E402
    EMBEDDING_FROM_TARGET_KEY,
    TARGET_HIDDEN_SIZE_KEY,
    ModelConfig,
)
from ssdlib.errors import SSDError  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INIT_STD = 0.02  # the random (cancelled) weights: HF Llama's initializer range
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer_source.json", "generation_config.json")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    def params(self) -> tuple[int, int]:
        """(total, non-embedding) parameter count."""
        d, qw, kvw = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * d + 2 * d * qw + 2 * d * kvw + 3 * d * self.ffn
        non_embedding = self.layers * per_layer + d
        return non_embedding + self.vocab * d * (1 if self.tied else 2), non_embedding


LIKE = {
    "llama-3.1-8b": Shape(32, 4096, 14336, 32, 8, 128, 128256, tied=False),
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 64, 128256, tied=True),
}


def source_shape(cfg: ModelConfig) -> Shape:
    return Shape(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                 cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size,
                 cfg.tie_word_embeddings)


def target_shape(cfg: ModelConfig, like: str | None = None, *, layers=None, hidden=None, ffn=None,
                 heads=None, kv_heads=None, head_dim=None, match_total: bool = False) -> Shape:
    """The inflated shape: ``like``'s sizes with the source's head_dim (heads = the named q and KV
    widths / head_dim), or the explicit sizes; explicit sizes override ``like``'s. With
    ``match_total`` the ffn is padded (to a multiple of 256) so that the total parameter count
    with the source's vocabulary comes closest to the named model's."""
    src = source_shape(cfg)
    hd = head_dim or src.head_dim
    if like is not None:
        if like not in LIKE:
            raise ValueError(f"--like: unknown shape {like!r} (known: {', '.join(LIKE)})")
        named = LIKE[like]
        for what, width in (("q", named.heads * named.head_dim),
                            ("KV", named.kv_heads * named.head_dim)):
            if width % hd:
                raise ValueError(f"{like}: {what} width {width} is not a multiple of head_dim "
                                 f"{hd}; give --heads/--kv-heads")
        base = Shape(named.layers, named.hidden, named.ffn, named.heads * named.head_dim // hd,
                     named.kv_heads * named.head_dim // hd, hd, src.vocab, src.tied)
    else:
        missing = [n for n, v in (("--layers", layers), ("--hidden", hidden), ("--ffn", ffn),
                                  ("--heads", heads), ("--kv-heads", kv_heads)) if v is None]
        if missing:
            raise ValueError(f"give --like or all of --layers --hidden --ffn --heads --kv-heads "
                             f"(missing {' '.join(missing)})")
        base = Shape(layers, hidden, ffn, heads, kv_heads, hd, src.vocab, src.tied)
    shape = replace(base, **{k: v for k, v in (("layers", layers), ("hidden", hidden),
                                               ("ffn", ffn), ("heads", heads),
                                               ("kv_heads", kv_heads)) if v is not None})
    if match_total:
        if like is None:
            raise ValueError("--match-total needs --like")
        deficit = LIKE[like].params()[0] - shape.params()[0]
        pad = round(deficit / (3 * shape.hidden * shape.layers) / 256) * 256
        shape = replace(shape, ffn=shape.ffn + max(pad, 0))
    check_growth(src, shape)
    return shape


def check_growth(src: Shape, dst: Shape) -> None:
    for what in ("layers", "hidden", "ffn", "head_dim"):
        if getattr(dst, what) < getattr(src, what):
            raise ValueError(f"{what}: {getattr(dst, what)} is smaller than the source's "
                             f"{getattr(src, what)} (inflate only grows)")
    if dst.head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {dst.head_dim}")
    if dst.kv_heads <= 0 or dst.heads % dst.kv_heads:
        raise ValueError(f"heads ({dst.heads}) must be a positive multiple of kv-heads "
                         f"({dst.kv_heads})")
    if dst.hidden % dst.heads:
        # transformers' LlamaConfig refuses it, even with an explicit head_dim
        raise ValueError(f"hidden ({dst.hidden}) must be a multiple of heads ({dst.heads})")
    head_layout(src.heads, src.kv_heads, dst.heads, dst.kv_heads)


def head_layout(src_heads: int, src_kv: int, heads: int, kv_heads: int):
    """(q_to, kv_to): the target query head of each source query head, and the target KV heads
    holding copies of each source KV head.

    Source group g = src_heads/src_kv, target group g' = heads/kv_heads, m = ceil(g/g') copies:
    source query head j*g + r (which reads KV head j) goes to target KV head j*m + r//g', slot
    r%g' of its group, i.e. target query head (j*m + r//g')*g' + r%g'. Target heads not hit are
    extra (random, cancelled). Needs kv_heads >= src_kv*m.
    """
    g, g2 = src_heads // src_kv, heads // kv_heads
    m = -(-g // g2)
    if kv_heads < src_kv * m:
        raise ValueError(f"{heads}/{kv_heads} heads cannot hold the source's {src_heads}/{src_kv} "
                         f"GQA groups: each source group of {g} query heads needs {m} target KV "
                         f"head(s) of {g2}, so kv-heads >= {src_kv * m}")
    q_to = [(j * m + r // g2) * g2 + r % g2 for j in range(src_kv) for r in range(g)]
    kv_to = [[j * m + t for t in range(m)] for j in range(src_kv)]
    return q_to, kv_to


def tensor_plan(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every output tensor, in writing order."""
    d, qw, kvw = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    plan = [("model.embed_tokens.weight", (s.vocab, d))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        plan += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (qw, d)),
                 (p + "self_attn.k_proj.weight", (kvw, d)),
                 (p + "self_attn.v_proj.weight", (kvw, d)),
                 (p + "self_attn.o_proj.weight", (d, qw)),
                 (p + "post_attention_layernorm.weight", (d,)),
                 (p + "mlp.gate_proj.weight", (s.ffn, d)), (p + "mlp.up_proj.weight", (s.ffn, d)),
                 (p + "mlp.down_proj.weight", (d, s.ffn))]
    plan.append(("model.norm.weight", (d,)))
    if not s.tied:
        plan.append(("lm_head.weight", (s.vocab, d)))
    return plan


class Inflater:
    """Builds each output tensor from the source's weights (float32, on ``device``)."""

    def __init__(self, weights, src: Shape, dst: Shape, device="cpu", seed: int = 0):
        self.w, self.src, self.dst, self.device = weights, src, dst, torch.device(device)
        self.gen = torch.Generator(self.device).manual_seed(seed)
        q_to, kv_to = head_layout(src.heads, src.kv_heads, dst.heads, dst.kv_heads)
        dev = self.device
        self.q_to = torch.tensor(q_to, device=dev)
        self.kv_to = torch.tensor([t for ts in kv_to for t in ts], device=dev)
        self.kv_from = torch.tensor([j for j, ts in enumerate(kv_to) for _ in ts], device=dev)
        half, half2 = src.head_dim // 2, dst.head_dim // 2
        # rotate-half layout: source dims (i, i + hd/2) are one rotary pair -> (i, i + hd'/2)
        self.dims = torch.cat([torch.arange(half), half2 + torch.arange(half)]).to(dev)
        keep = torch.zeros(dst.head_dim, dtype=torch.bool, device=dev)
        keep[self.dims] = True
        self.extra_dims = (~keep).nonzero().flatten()
        self.q_scale = math.sqrt(dst.head_dim / src.head_dim)
        self.norm_scale = math.sqrt(src.hidden / dst.hidden)

    def _src(self, name: str) -> torch.Tensor:
        return self.w.get(name).to(self.device, torch.float32)

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device).mul_(INIT_STD)

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, device=self.device)

    def build(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        s, d = self.src, self.src.hidden
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # embedding: extra columns zero (they start the residual); lm_head: they read zeros
            out = self._zeros(*shape) if name.startswith("model.") else self._rand(*shape)
            out[:, :d] = self._src(name)
            return out
        if name == "model.norm.weight":
            return self._norm(name)
        layer = int(name.split(".")[2])
        kind = name.split(".", 3)[3]
        if layer >= s.layers:  # identity block: nothing reaches the residual stream
            if kind.endswith("layernorm.weight"):
                return torch.ones(shape, device=self.device)
            return self._zeros(*shape) if kind.endswith(("o_proj.weight", "down_proj.weight")) \
                else self._rand(*shape)
        if kind.endswith("layernorm.weight"):
            return self._norm(name)
        return getattr(self, "_" + kind.split(".")[1])(name, shape)

    def _norm(self, name: str) -> torch.Tensor:
        out = torch.ones(self.dst.hidden, device=self.device)
        out[:self.src.hidden] = self._src(name) * self.norm_scale
        return out

    def _q_proj(self, name, shape):
        s, t = self.src, self.dst
        out = self._rand(t.heads, t.head_dim, t.hidden)
        src = self._src(name).view(s.heads, s.head_dim, s.hidden) * self.q_scale
        out[self.q_to[:, None], self.dims[None, :], :s.hidden] = src
        return out.view(shape)

    def _k_proj(self, name, shape, zero_extra_dims: bool = True):
        s, t = self.src, self.dst
        out = self._rand(t.kv_heads, t.head_dim, t.hidden)
        if zero_extra_dims and len(self.extra_dims):
            # original heads' extra dims: q . k gets nothing from them
            out[self.kv_to[:, None], self.extra_dims[None, :], :] = 0
        src = self._src(name).view(s.kv_heads, s.head_dim, s.hidden)
        out[self.kv_to[:, None], self.dims[None, :], :s.hidden] = src[self.kv_from]
        return out.view(shape)

    def _v_proj(self, name, shape):
        return self._k_proj(name, shape, zero_extra_dims=False)  # extra dims: o_proj drops them

    def _o_proj(self, name, shape):
        s, t = self.src, self.dst
        out = self._zeros(t.hidden, t.heads, t.head_dim)
        src = self._src(name).view(s.hidden, s.heads, s.head_dim)
        out[:s.hidden, self.q_to[:, None], self.dims[None, :]] = src
        return out.view(shape)

    def _gate_proj(self, name, shape):
        out = self._rand(*shape)
        out[:self.src.ffn, :self.src.hidden] = self._src(name)
        return out

    _up_proj = _gate_proj

    def _down_proj(self, name, shape):
        out = self._zeros(*shape)
        out[:self.src.hidden, :self.src.ffn] = self._src(name)
        return out


def out_config(cfg: ModelConfig, dst: Shape, dtype: str) -> dict:
    src = source_shape(cfg)
    hf = cfg.to_hf_dict()
    # every tensor is stored (a target's embedding folded in): a plain Llama
    hf.pop(EMBEDDING_FROM_TARGET_KEY, None)
    hf.pop(TARGET_HIDDEN_SIZE_KEY, None)
    hf.update(hidden_size=dst.hidden, intermediate_size=dst.ffn, num_hidden_layers=dst.layers,
              num_attention_heads=dst.heads, num_key_value_heads=dst.kv_heads,
              head_dim=dst.head_dim, torch_dtype=dtype,
              rms_norm_eps=cfg.rms_norm_eps * src.hidden / dst.hidden,
              rope_theta=cfg.rope_theta ** (dst.head_dim / src.head_dim))
    return hf


def report(src: Shape, dst: Shape, dtype: str, like: str | None,
           match_total: bool = False) -> tuple[list[str], float | None]:
    """Printable lines and the deviation from the named shape that must stay within 10%:
    non-embedding parameters, or the total with ``match_total`` (None without ``like``)."""
    nbytes = DTYPES[dtype].itemsize
    total, non_emb = dst.params()
    lines = [f"source:   {_shape_text(src)}",
             f"inflated: {_shape_text(dst)}",
             f"  parameters {total:,} (non-embedding {non_emb:,}, embedding {total - non_emb:,} "
             f"with the source's vocab {dst.vocab}{', tied' if dst.tied else ''}); "
             f"{total * nbytes / 1e9:.2f} GB in {dtype}"]
    if like is None:
        return lines, None
    named = LIKE[like]
    n_total, n_non = named.params()
    with_vocab = replace(dst, vocab=named.vocab, tied=named.tied).params()[0]
    dev_non, dev_total = non_emb / n_non - 1, total / n_total - 1
    lines += [f"{like}: {_shape_text(named)}{'' if named.tied else ', untied'}",
              f"  parameters {n_total:,} (non-embedding {n_non:,}); "
              f"{n_total * nbytes / 1e9:.2f} GB in {dtype}",
              f"  inflated vs {like}: non-embedding {dev_non:+.1%}, total {dev_total:+.1%} "
              f"(vocab {dst.vocab} vs {named.vocab}); with {like}'s vocab and tying "
              f"{with_vocab:,} ({with_vocab / n_total - 1:+.1%}); checked (limit 10%): "
              f"{'total' if match_total else 'non-embedding'}"]
    return lines, dev_total if match_total else dev_non


def _shape_text(s: Shape) -> str:
    return (f"{s.layers} layers, hidden {s.hidden}, ffn {s.ffn}, heads {s.heads}/{s.kv_heads} "
            f"x head_dim {s.head_dim}, vocab {s.vocab}")


def shard_plan(plan, nbytes: int, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards, size = [[]], 0
    for name, shape in plan:
        n = math.prod(shape) * nbytes
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def copy_tokenizer(ckpt, out_dir: str) -> None:
    """HF directory: its tokenizer files (or its tokenizer_source.json pointer) as they are;
    GGUF: tokenizer.json + tokenizer_config.json + generation_config.json written from it."""
    if os.path.isdir(ckpt.source):
        for f in TOKENIZER_FILES:
            if os.path.exists(os.path.join(ckpt.source, f)):
                shutil.copy(os.path.join(ckpt.source, f), out_dir)
        return
    cfg = ckpt.config
    generation = {} if cfg.bos_token_id is None else {"bos_token_id": cfg.bos_token_id}
    if cfg.eos_token_ids:
        eos = cfg.eos_token_ids
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save_hf(out_dir)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def inflate(src, out_dir: str, like: str | None = None, *, dtype: str = "bfloat16",
            seed: int = 0, device: str = "cpu", shard_mb: int = 2048, force: bool = False,
            progress: bool = True, match_total: bool = False, dry_run: bool = False, say=None,
            target=None, **sizes) -> list[str]:
    """Write the inflated checkpoint of ``src`` (a ``load_checkpoint`` spec or a loaded
    :class:`~ssdlib.loading.Checkpoint`) to ``out_dir``; returns the report lines (also passed to
    ``say`` before writing starts). ``sizes``: layers, hidden, ffn, heads, kv_heads, head_dim
    (see ``target_shape``). ``dry_run``: only the report, nothing written. ``target`` (a spec):
    the target whose embedding a draft ``src`` reads (needed for such a draft unless
    ``dry_run``)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ssdlib.loading import load_checkpoint
    from ssdlib.loading.draft import load_draft

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: one of {', '.join(DTYPES)}, got {dtype!r}")
    if not dry_run and os.path.exists(os.path.join(out_dir, "config.json")) and not force:
        raise ValueError(f"{out_dir} already holds a checkpoint (config.json); use --force")
    ckpt = load_checkpoint(src) if isinstance(src, (str, os.PathLike)) else src
    if target is not None:
        ckpt = load_draft(ckpt.source, load_checkpoint(target))
    elif ckpt.config.embedding_from_target and not dry_run:
        raise ValueError(f"{ckpt.source} reads its target's embedding "
                         f"({EMBEDDING_FROM_TARGET_KEY}): give --target (the target it drafts "
                         "for, e.g. smollm2-135m)")
    src_shape = source_shape(ckpt.config)
    dst = target_shape(ckpt.config, like, match_total=match_total, **sizes)
    lines, dev = report(src_shape, dst, dtype, like, match_total)
    if dev is not None and abs(dev) > 0.10:
        raise ValueError(f"{'total' if match_total else 'non-embedding'} parameters {dev:+.1%} "
                         f"off {like}'s (limit 10%): " + "; ".join(lines))
    if say is not None:
        say("\n".join(lines))
    if dry_run:
        return lines
    plan = tensor_plan(dst)
    nbytes = DTYPES[dtype].itemsize
    shards = shard_plan(plan, nbytes, shard_mb << 20)
    inflater = Inflater(ckpt.weights, src_shape, dst, device, seed)
    os.makedirs(out_dir, exist_ok=True)
    weight_map, total = {}, sum(math.prod(s) for _, s in plan) * nbytes
    with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, desc="inflate",
                               disable=not progress) as bar:
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name, shape in shard:
                bar.set_postfix_str(name.removeprefix("model."), refresh=False)
                t = inflater.build(name, shape)
                tensors[name] = t.to(DTYPES[dtype]).cpu().contiguous()
                weight_map[name] = fname
                bar.update(t.numel() * nbytes)
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
            del tensors  # one shard in memory at a time
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(os.path.join(out_dir, "config.json"), out_config(ckpt.config, dst, dtype))
    copy_tokenizer(ckpt, out_dir)
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="named checkpoint (smollm2-135m), .gguf file or HF directory")
    parser.add_argument("out", help="output HF directory")
    parser.add_argument("--like", choices=sorted(LIKE), help="grow to this model's sizes")
    for flag in ("layers", "hidden", "ffn", "heads", "kv-heads", "head-dim"):
        parser.add_argument("--" + flag, type=int, help="explicit size (overrides --like's)")
    parser.add_argument("--match-total", action="store_true",
                        help="pad ffn so total parameters (source vocab) match --like's")
    parser.add_argument("--target", help="for a draft that reads its target's embedding: that "
                        "target (named, .gguf or HF directory); its embedding is folded in")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cancelled random weights")
    parser.add_argument("--device", default="cpu", help="where weights are made (cuda: fast)")
    parser.add_argument("--shard-mb", type=int, default=2048, help="max safetensors shard size")
    parser.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the shape and counts only")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = dict(layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads,
                 kv_heads=args.kv_heads, head_dim=args.head_dim)
    try:
        inflate(args.src, args.out, args.like, dtype=args.dtype, seed=args.seed,
                        device=args.device, shard_mb=args.shard_mb, force=args.force,
                        match_total=args.match_total, dry_run=args.dry_run, say=print,
                        target=args.target, **sizes)
    except (SSDError, ValueError) as e:
        print(f"inflate: error: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:
        print(f"inflate: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if not args.dry_run:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
