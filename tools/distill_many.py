#!/usr/bin/env python
r"""Train several drafts side by side in one process, sharing the teacher's forward.

    python tools/distill_many.py --root DIR --candidate "a|--lr 1e-3" \
        --candidate "b|--init-from OLD --loss tvd" -- --target smollm2-135m \
        --data-from DATA.safetensors --steps 2000 --batch 32 --seq-len 512

Everything after ``--`` is given to every candidate; each ``--candidate NAME|FLAGS`` adds its
own ``tools/distill_draft.py`` flags (they win). Candidate NAME writes DIR/cand_NAME (the
exported draft, as ``distill_draft.py --out``) and keeps its training state in
DIR/cand_NAME.work, so ``--resume`` continues all of them (they must have stopped at the same
step). Every candidate sees the same batches in the same order, exactly those it would see
trained alone by ``distill_draft.py`` with the same flags; the teacher's logits for each batch
are computed once (tools/distill/lockstep.py), where separate processes would each compute
them. The candidates must agree on what they share: the target, ``--data-from`` (required),
``--batch``, ``--seq-len``, ``--seed``, ``--device``, ``--dtype`` and ``--train-budget`` (one
budget for the run, which cuts every candidate's steps alike). Output lines are prefixed with
``[NAME]``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import distill_draft  # noqa: E402
from tools.distill.lockstep import Hooks, check_lockstep, run_lockstep  # noqa: E402

# settings the candidates share (one target, one data file, one batch sequence, one device)
SHARED_KEYS = ("target", "data_from", "batch", "seq_len", "seed", "device", "dtype",
               "train_budget")


def parse_candidate(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("|")
    name = name.strip()
    if not sep or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise SystemExit(f"--candidate {text!r}: expected NAME|FLAGS with a plain NAME "
                         "(letters, digits, - and _)")
    return name, shlex.split(flags)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--root", required=True, help="DIR: candidate NAME writes DIR/cand_NAME")
    p.add_argument("--candidate", action="append", required=True, metavar="NAME|FLAGS",
                   help="a candidate and its own distill_draft.py flags (repeat)")
    p.add_argument("--resume", action="store_true", help="continue every candidate's run")
    return p


def candidate_args(root: str, name: str, flags: list[str], common: list[str],
                   resume: bool) -> argparse.Namespace:
    out = os.path.join(root, f"cand_{name}")
    argv = [*common, *flags, "--out", out, "--work-dir", out + ".work"]
    if resume:
        argv.append("--resume")
    return distill_draft.resolve_args(argv)


def check_shared(named: dict[str, argparse.Namespace]) -> None:
    first = next(iter(named.values()))
    if not first.data_from:
        raise SystemExit("--data-from is required: candidates trained together read one data "
                         "file (make it with tools/distill_data.py)")
    for key in SHARED_KEYS:
        values = {name: getattr(a, key) for name, a in named.items()}
        if len({str(v) for v in values.values()}) > 1:
            raise SystemExit(f"the candidates must share --{key.replace('_', '-')}, got "
                             + ", ".join(f"{n}: {v}" for n, v in values.items()))
    for name, a in named.items():
        if a.eval:
            raise SystemExit(f"candidate {name}: --eval is not run here; evaluate each output "
                             "with python -m tools.distill.candidates evaluate")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(shlex.quote(x) for x in ["tools/distill_many.py", *argv])
    common = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1:]
    a = build_parser().parse_args(argv)
    cands = [parse_candidate(c) for c in a.candidate]
    names = [n for n, _ in cands]
    if len(set(names)) != len(names):
        raise SystemExit(f"candidate names must differ, got {names}")
    named = {n: candidate_args(a.root, n, flags, common, a.resume) for n, flags in cands}
    check_shared(named)
    budget = distill_draft.time_budget(next(iter(named.values())))

    def say_for(name):
        return lambda text: print(f"[{name}] {text}", flush=True)

    shared = distill_draft.load_shared(next(iter(named.values())), say=print)
    built = {n: distill_draft.build_candidate(args, shared, say=say_for(n))
             for n, args in named.items()}
    trainers = [c.trainer for c in built.values()]
    try:
        check_lockstep(trainers)
    except ValueError as e:
        raise SystemExit(str(e)) from None

    def hooks(name, cand):
        say = say_for(name)

        def on_step(step, loss, rate):
            steps = cand.trainer.s.steps  # (a budget may have cut it)
            if loss is not None and (step % 100 == 0 or step == steps):
                say(f"step {step}/{steps}  loss {loss:.4f}  {rate:,.0f} tokens/s")
        return Hooks(on_step=on_step,
                     on_eval=lambda r: say("eval " + distill_draft.fmt_eval(r)),
                     on_save=cand.export)

    t1 = time.perf_counter()
    run_lockstep(trainers, [hooks(n, c) for n, c in built.items()], budget)
    train_s = time.perf_counter() - t1
    return {n: distill_draft.finish(c, shared, command, train_s, say=say_for(n), budget=budget)
            for n, c in built.items()}


if __name__ == "__main__":
    main()
