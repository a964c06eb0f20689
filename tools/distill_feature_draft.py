#!/usr/bin/env python
r"""Train a feature draft (EAGLE-style, ``ssdlib.models.feature_draft``) for a target ssdlib
loads.

The draft reads the target's features and its own predicted ones, and is trained by
distillation with self-conditioning: ``--ttt-steps`` unroll steps, each on the draft's own
features of the step before (tools/distill/feature_train.py says exactly how). The features
(``--features``): ``last``, the target's last decoder layer's output before the final norm, or
``fused`` (EAGLE-3), three of its layers' outputs concatenated (``--fused-layers``, default
1, L // 2 and L - 1 of L layers), which the draft maps to its width with a learned ``fuse``.
The data is a data.safetensors made by ``tools/distill_data.py gen``; its held-out split
measures KL and greedy agreement at each unroll depth. Output: a feature draft directory
(``ssdlib.loading.feature_draft``): config.json, model.safetensors (fc, fuse for fused
features, layers, norm), the target's tokenizer named in tokenizer_source.json (a named target)
or copied, and feature_distill.json (the run's settings and evaluations).

    python tools/distill_data.py gen --target smollm2-135m --out data.safetensors
    python tools/distill_feature_draft.py --target smollm2-135m --out runs/feature \
        --data-from data.safetensors --layers 1 --init-layer-from-target 29 --max-mb 16
    python -m tools.distill.feature_eval --draft runs/feature --target smollm2-135m \
        --data-from data.safetensors

A run may span several calls (each under its own time limit) with one schedule: the first gets
the whole run's ``--train-budget`` and ``--stop-after`` (seconds, or ``--stop-after-steps``);
where it stops before its schedule ends it writes the draft trained so far and the run's state
(``--work-dir``, default OUT.work: the tensors, the optimizer, the step, the data's place) and
``--resume --work-dir DIR --out OUT`` goes on with the same schedule, from the same optimizer,
as if it had not stopped (no fresh warm-up, unlike ``--init-from``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ssdlib.errors import CheckpointError  # noqa: E402
from ssdlib.loading import load_checkpoint, registry  # noqa: E402
from ssdlib.loading.draft_vocab import (TRAINED_VOCAB_KEY, first_tokens,  # noqa: E402
                                        write_ranking)
from ssdlib.loading.feature_draft import (check_max_mb, load_feature_draft,  # noqa: E402
                                          save_feature_draft, tokenizer_source)
from ssdlib.models.feature_draft import FeatureDraft  # noqa: E402
from ssdlib.models.feature_spec import FUSED, LAST_PRENORM, FeatureSpec  # noqa: E402
from tools.distill import models  # noqa: E402
from tools.distill.budget import StepBudget  # noqa: E402
from tools.distill.data import Batcher, load_splits, mixed_batcher, pack_rows  # noqa: E402
from tools.distill.feature_train import (FEATURE_KEYS, TTT_KEYS,  # noqa: E402
                                         FeatureTrainer, FeatureTrainSettings,
                                         grow_feature_draft, init_feature_draft,
                                         token_gain_for)
from tools.distill.run_state import (SHARED_KEYS, RunStateError, read_state,  # noqa: E402
                                     write_state)
from tools.distill.train import LOSSES  # noqa: E402
from tools.distill.vocab import rank_training_tokens  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
FEATURE_KINDS = {"last": LAST_PRENORM, "fused": FUSED}  # --features -> FeatureSpec kind


def feature_spec(features: str | None, fused_layers: str | None,
                 num_layers: int) -> FeatureSpec | None:
    """The FeatureSpec of --features and --fused-layers for a target of ``num_layers`` layers;
    None when neither is given (ValueError on a bad pair)."""
    if fused_layers is not None and features != "fused":
        raise ValueError("--fused-layers goes with --features fused")
    if features is None:
        return None
    if features == "last":
        return FeatureSpec()
    layers = None
    if fused_layers is not None:
        try:
            layers = [int(x) for x in fused_layers.split(",")]
        except ValueError:
            raise ValueError(f"--fused-layers must be integers like 1,6,11, got "
                             f"{fused_layers!r}") from None
    return FeatureSpec.fused(num_layers, layers)


def draft_vocabulary(ck, train_docs, size: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                         torch.Tensor]:
    """--draft-vocab: ((ranked ids, their counts), the token ids trained over), ranked as
    ``tools/distill_data.py vocab`` ranks them, from the training documents."""
    vocab_size = ck.config.vocab_size
    ranked, counts, _ = rank_training_tokens(ck, [train_docs])
    if not 1 <= size <= ranked.numel():
        raise SystemExit(f"--draft-vocab {size}: the training data ranks {ranked.numel():,} "
                         f"tokens (1 to that many)")
    return (ranked, counts), first_tokens(ranked, size, vocab_size, ck.config.eos_token_ids)


def set_trained_size(directory: str, size: int) -> None:
    """Record in ``directory``'s config.json that its draft was trained over ``size`` tokens."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[TRAINED_VOCAB_KEY] = size
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="target checkpoint (name, HF dir "
                   "or .gguf)")
    p.add_argument("--out", required=True, help="output feature draft directory")
    p.add_argument("--data-from", default=None,
                   help="data.safetensors of tools/distill_data.py gen (train and held-out); "
                        "required but with --resume")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the draft")
    p.add_argument("--features", choices=tuple(FEATURE_KINDS), default=None,
                   help="the target features the draft reads: last (the last layer's output "
                        "before the final norm) or fused (three layers' outputs, EAGLE-3); "
                        "default: last, or --init-from's")
    p.add_argument("--fused-layers", default=None, metavar="I,J,K",
                   help="the target layers of --features fused, increasing (default: 1, L // 2, "
                        "L - 1 for a target of L layers)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="continue training the feature draft in DIR (its layers, features and "
                        "weights; a fresh optimizer and schedule): a long training split over "
                        "several runs")
    p.add_argument("--init-layer-from-target", type=int, default=None, metavar="I",
                   help="start every draft layer as target layer I (default: random); with "
                        "--grow-layers, the new layers")
    p.add_argument("--grow-layers", type=int, default=None, metavar="N",
                   help="with --init-from: N more decoder layers after DIR's, starting as a "
                        "copy of its last layer (or --init-layer-from-target's) with zero "
                        "output projections, so the deeper draft starts computing what DIR did")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="unroll steps per training step (1: the target's features only)")
    p.add_argument("--ttt-keys", choices=TTT_KEYS, default="inference",
                   help="the keys an unroll step's queries attend to: inference (those the "
                        "draft's KV cache holds at inference: the target's features up to where "
                        "its own start, its own after) or uniform (every key at the step's "
                        "depth: one causal forward a step, cheaper)")
    p.add_argument("--feature-loss-weight", type=float, default=0.1,
                   help="weight of the smooth-L1 regression of the next feature")
    p.add_argument("--token-gain", default="auto", metavar="C",
                   help="train fc's token columns as C * W' and start them C times larger, so "
                        "that the token embedding and the (much larger, pre-norm) feature weigh "
                        "alike (tools/distill/feature_train.py); auto: the median RMS ratio "
                        "feature / embedding on the first training rows; 1: plain")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="train over the N tokens the target writes most often in --data-from "
                        "(its training documents' scored positions) and the end-of-sequence "
                        "tokens: the draft's logits and the KL over those only (EAGLE-3's "
                        "reduced head). The ranking is written beside the draft and its config "
                        "says N, so the engine runs it with that vocabulary (default: the full "
                        "vocabulary)")
    p.add_argument("--loss", choices=tuple(LOSSES), default="kl")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="default steps/20, at most 100")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--train-budget", type=float, default=None, metavar="SECONDS",
                   help="wall-clock seconds for the whole run from its start: after timing its "
                        "first steps the run cuts its step count once to what fits, so its "
                        "schedule ends (and the draft is written) on time")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="end this call after SECONDS from its start even if the schedule goes "
                        "on: the draft so far is written and the run's state kept in --work-dir "
                        "for --resume")
    p.add_argument("--stop-after-steps", type=int, default=None, metavar="N",
                   help="end this call after N steps, as --stop-after")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="where a stopped run keeps its state (default: OUT.work)")
    p.add_argument("--resume", action="store_true", default=False,
                   help="go on with the run stopped in --work-dir: its settings, schedule, "
                        "optimizer and data order (this call's --out, --device, --stop-after* "
                        "and --work-dir apply; every other option is the run's)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--long-seq-len", type=int, default=None, metavar="N",
                   help="also train on rows of N tokens (a draft that holds on long prompts): "
                        "every --long-every-th batch is --long-batch such rows")
    p.add_argument("--long-batch", type=int, default=None,
                   help="rows in a long batch (default: as many tokens as a short batch)")
    p.add_argument("--long-every", type=int, default=2, help="every N-th batch is a long one")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--eval-depth", type=int, default=4,
                   help="unroll depths measured on held-out data")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="target weights and draft autocast (auto: bfloat16 on GPU, else float32)")
    p.add_argument("--storage-dtype", default="float16", choices=tuple(models.STORAGE_DTYPES))
    p.add_argument("--max-mb", type=float, default=None,
                   help="refuse a draft whose model.safetensors exceeds this (MB)")
    p.add_argument("--compile", default="auto", choices=("auto", "off", "loss", "all"),
                   help="torch.compile in the training step: the KL loss (loss), also the "
                        "teacher's forward (all); auto: all on a GPU, off on a CPU")
    p.add_argument("--seed", type=int, default=0)
    return p


def _described(spec: FeatureSpec) -> str:
    if spec.layers is None:
        return "the target's last-layer features"
    return f"the target's fused features of layers {list(spec.layers)}"


def fmt_eval(r: dict) -> str:
    depths = " ".join(f"{kl:.4f}/{ag:.3f}" for kl, ag in zip(r["kl"], r["agreement"]))
    return f"step {r['step']:>6}  KL/agreement by unroll depth: {depths}"


# what a --resume call sets itself; every other option is the stopped run's
RESUME_OWN = ("out", "work_dir", "resume", "stop_after", "stop_after_steps", "device")
STATE_FILE, RUN_FILE = "state.pt", "run.json"
# what STATE_FILE holds: the trainer's state and the number of training rows it was packed into
STATE_KEYS = (*SHARED_KEYS, *FEATURE_KEYS, "rows")


def _resumed_args(args: argparse.Namespace) -> tuple[argparse.Namespace, dict, dict]:
    """--resume: the stopped run's options (with this call's RESUME_OWN), its record and its
    state; SystemExit naming what is missing."""
    run_path = os.path.join(args.work_dir, RUN_FILE)
    state_path = os.path.join(args.work_dir, STATE_FILE)
    if not (os.path.isfile(run_path) and os.path.isfile(state_path)):
        raise SystemExit(f"--resume: no stopped run in {args.work_dir} (it holds no "
                         f"{RUN_FILE} and {STATE_FILE})")
    with open(run_path) as f:
        record = json.load(f)
    merged = dict(record["args"])
    merged.setdefault("ttt_keys", "uniform")  # a run recorded before --ttt-keys: its keys
    merged.setdefault("draft_vocab", None)  # and before --draft-vocab: the full vocabulary
    merged.update({k: getattr(args, k) for k in RESUME_OWN})
    if isinstance(merged.get("fused_layers"), list):  # saved as read from the draft
        merged["fused_layers"] = ",".join(str(i) for i in merged["fused_layers"])
    try:
        state = read_state(state_path, STATE_KEYS)
    except RunStateError as e:
        raise SystemExit(f"--resume: {e}") from None
    return argparse.Namespace(**merged), record, state


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    args.work_dir = args.work_dir or args.out.rstrip("/\\") + ".work"
    record, state = {}, None
    if args.resume:
        args, record, state = _resumed_args(args)
    elif args.data_from is None:
        raise SystemExit("--data-from is required (a data.safetensors of tools/distill_data.py "
                         "gen)")
    if args.train_budget is not None and args.train_budget <= 0:
        raise SystemExit(f"--train-budget must be positive, got {args.train_budget}")
    for flag, value in (("--stop-after", args.stop_after),
                        ("--stop-after-steps", args.stop_after_steps)):
        if value is not None and not value > 0:
            raise SystemExit(f"{flag} must be positive, got {value}")
    # the steps it times come after the first short and long batches (their compiles); a
    # resumed run's schedule was cut by its first call
    skip = 3 + (max(args.long_every, 1) if args.long_seq_len else 0)
    budget = StepBudget(args.train_budget, skip=skip, on_decide=lambda r: print(
        f"train budget {r['seconds']:.0f} s: {1e3 * r['seconds_per_step']:.1f} ms a step, "
        f"steps cut from {r['steps_before']} to {r['steps']}")) if (
        args.train_budget and state is None) else None
    if args.layers < 1:
        raise SystemExit(f"--layers must be at least 1, got {args.layers}")
    try:
        fixed_gain = None if args.token_gain == "auto" else float(args.token_gain)
    except ValueError:
        raise SystemExit(f"--token-gain must be a number or auto, got "
                         f"{args.token_gain!r}") from None
    device = torch.device(args.device if args.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype if args.dtype != "auto"
                   else ("bfloat16" if device.type == "cuda" else "float32")]
    storage = models.STORAGE_DTYPES[args.storage_dtype]
    compiled = args.compile if args.compile != "auto" else (
        "all" if device.type == "cuda" else "off")
    if compiled != "off":  # a function torch.compile cannot compile runs eagerly (a warning)
        torch._dynamo.config.suppress_errors = True
    torch.manual_seed(args.seed)
    try:
        ck = load_checkpoint(args.target)
        train_docs, held_out = load_splits(args.data_from)
    except (CheckpointError, OSError) as e:
        raise SystemExit(str(e)) from None
    if len(held_out) == 0:
        raise SystemExit(f"{args.data_from}: no held-out documents")
    ranking = vocab = None
    if args.draft_vocab is not None:
        ranking, vocab = draft_vocabulary(ck, train_docs, args.draft_vocab)
    try:
        spec = feature_spec(args.features, args.fused_layers, ck.config.num_hidden_layers)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    max_positions = max(ck.config.max_position_embeddings, args.seq_len, args.long_seq_len or 0)
    teacher = models.load_teacher(ck, device, dtype, max_positions)
    eos = ck.config.eos_token_ids
    try:
        separator = eos[0] if eos else None
        rows = pack_rows(train_docs, args.seq_len, args.seed, separator)
        batcher = Batcher(rows, args.batch, args.seed)
        if args.long_seq_len:
            long_batch = args.long_batch or max(1, args.batch * args.seq_len // args.long_seq_len)
            batcher = mixed_batcher(train_docs, args.seq_len, args.batch, args.long_seq_len,
                                    long_batch, args.long_every, args.seed, separator)
        if state is not None:  # the stopped run's draft: its shape here, its tensors below
            with torch.device(device):
                draft = FeatureDraft.for_target(teacher, args.layers, max_positions, spec)
        elif args.init_from:
            if args.init_layer_from_target is not None and args.grow_layers is None:
                raise ValueError("--init-from and --init-layer-from-target exclude each other "
                                 "(but with --grow-layers, for the new layers)")
            draft = load_feature_draft(args.init_from, ck, teacher, device, torch.float32,
                                       max_positions).requires_grad_(True)  # (loaded frozen)
            if spec is not None and spec != draft.feature:
                raise ValueError(f"--init-from {args.init_from} reads {_described(draft.feature)}"
                                 f"; it keeps them (--features asks for {_described(spec)})")
            if args.grow_layers is not None:
                draft = grow_feature_draft(draft, teacher, args.grow_layers,
                                           args.init_layer_from_target)  # (trainable, as DIR)
            args.layers = len(draft.layers)
        else:
            if args.grow_layers is not None:
                raise ValueError("--grow-layers grows the draft of --init-from")
            with torch.device(device):
                draft = FeatureDraft.for_target(teacher, args.layers, max_positions, spec)
        args.features = next(k for k, v in FEATURE_KINDS.items() if v == draft.feature.kind)
        args.fused_layers = None if draft.feature.layers is None else list(draft.feature.layers)
        gain = record["token_gain"] if state is not None else (
            fixed_gain if fixed_gain is not None else token_gain_for(
                draft, teacher, rows[:8].to(device)))
        if not args.init_from and state is None:
            init_feature_draft(draft, teacher, args.seed, args.init_layer_from_target, gain)
        mb = check_max_mb(draft, storage, args.max_mb)
        settings = FeatureTrainSettings(
            steps=args.steps, lr=args.lr,
            warmup=args.warmup if args.warmup is not None else min(100, args.steps // 20),
            eval_every=args.eval_every, eval_batch=args.eval_batch, seq_len=args.seq_len,
            loss=args.loss, ttt_steps=args.ttt_steps, ttt_keys=args.ttt_keys,
            feature_loss_weight=args.feature_loss_weight, eval_depth=args.eval_depth,
            token_gain=gain,
            compile_loss=compiled in ("loss", "all"), compile_teacher=compiled == "all",
            amp_dtype=dtype if device.type == "cuda" and dtype != torch.float32 else None)
    except (ValueError, CheckpointError) as e:
        raise SystemExit(str(e)) from None
    print(f"feature draft: {args.layers} layer(s) of width {draft.config.hidden_size} reading "
          f"{_described(draft.feature)}, {mb:.2f} MB as {args.storage_dtype}; "
          f"{rows.shape[0]} training rows of "
          f"{args.seq_len} tokens" + (f" and rows of {args.long_seq_len} every {args.long_every} "
                                      "batches" if args.long_seq_len else "")
          + f", {args.ttt_steps} unroll step(s) a step, token gain {gain:.3g}")

    def on_step(step: int, loss: torch.Tensor) -> None:
        if step % 10 == 0 or step == args.steps:  # reading the loss waits for the device
            print(f"step {step:>6}  loss {float(loss):.4f}")

    t0 = time.perf_counter()
    trainer = FeatureTrainer(draft, teacher, batcher, held_out, settings,
                             None if vocab is None else vocab.to(device))
    rows_count = int(rows.shape[0])
    if state is not None:
        if state.get("rows") != rows_count:
            raise SystemExit(f"--resume: {args.data_from} now packs into {rows_count} rows, the "
                             f"stopped run's into {state.get('rows')}: not the same data")
        try:
            trainer.restore(state)
        except ValueError as e:
            raise SystemExit(f"--resume: {e}") from None
        print(f"resumed at step {trainer.step} of {trainer.s.steps}")
    first_step = trainer.step

    def stop(step: int) -> bool:
        return ((args.stop_after is not None and time.perf_counter() - t_start >= args.stop_after)
                or (args.stop_after_steps is not None
                    and step - first_step >= args.stop_after_steps))

    stopped: dict = {}
    history = trainer.run(on_step, lambda r: print("eval " + fmt_eval(r)), budget, stop=stop,
                          on_stop=lambda st: stopped.update(st, rows=rows_count))
    train_s = time.perf_counter() - t0 + record.get("train_seconds", 0.0)
    ref = tokenizer_source(args.target, ck) if args.target in registry.names() else None
    try:
        size = save_feature_draft(draft, args.out, storage, ref, args.max_mb)
    except CheckpointError as e:
        raise SystemExit(str(e)) from None
    if ref is None:
        models.copy_tokenizer(ck, args.out)
    if ranking is not None:  # the engine then runs it with the vocabulary it was trained over
        write_ranking(args.out, *ranking)
        set_trained_size(args.out, args.draft_vocab)
    command = " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    report = {"command": command, "commands": [*record.get("commands", []), command],
              "args": vars(args), "token_gain": gain, "safetensors_bytes": size,
              "train_seconds": round(train_s, 1), "history": history}
    with open(os.path.join(args.out, "feature_distill.json"), "w") as f:
        json.dump(report, f, indent=2)
    if stopped:  # the schedule goes on in a later call
        write_state(stopped, os.path.join(args.work_dir, STATE_FILE))
        with open(os.path.join(args.work_dir, RUN_FILE), "w") as f:
            json.dump({k: report[k] for k in ("commands", "args", "token_gain", "train_seconds")},
                      f, indent=2)
        print(f"stopped at step {trainer.step} of {trainer.s.steps}: the draft so far is in "
              f"{args.out}; go on with --resume --work-dir {args.work_dir} --out DIR")
    elif state is not None:  # the resumed run is complete: nothing is left to go on with
        for name in (STATE_FILE, RUN_FILE):
            os.remove(os.path.join(args.work_dir, name))
    last = history[-1]
    print(f"done: step {trainer.step}, held-out KL {last['kl'][0]:.4f} with the target's "
          f"features, {last['kl'][-1]:.4f} at unroll depth {len(last['kl']) - 1}; wrote "
          f"{args.out} ({size / 1e6:.2f} MB model.safetensors)")
    return report


if __name__ == "__main__":
    main()
