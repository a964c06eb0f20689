#!/usr/bin/env python
"""Make the training data of tools/distill_draft.py on its own, in shards, and merge them.

``gen`` samples one shard's documents with the target (the same sources and library code as
distill_draft.py) and writes a data.safetensors that ``distill_draft.py --data-from`` reads, plus
PATH.json (token counts per source, timings, the sampler's counters). Counts are totals over all
shards: shard I of N makes its share of the self-instruct / docinstruct / held-out requests with
its own sampling seed (docstring requests: its own slice of one list); pysrc is shard 0's. One
process per GPU:

    CUDA_VISIBLE_DEVICES=0 python tools/distill_data.py gen --shard 0/2 --out s0.safetensors &
    CUDA_VISIBLE_DEVICES=1 python tools/distill_data.py gen --shard 1/2 --out s1.safetensors &
    wait; python tools/distill_data.py merge --out data.safetensors s0.safetensors s1.safetensors

``merge`` concatenates the train and held-out splits of its inputs (sources kept).

``vocab`` ranks the target's tokens by how often the training documents' scored positions (the
target's own output) hold them and writes the ranking into a draft's directory
(draft_vocab.safetensors: ``--draft-vocab N`` keeps its first N, tools/distill/vocab.py):

    python tools/distill_data.py vocab --target smollm2-135m --into DRAFT_DIR data.safetensors
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

from tools.distill.data import (Docs, default_text_roots, merge_splits,  # noqa: E402
                                save_splits)
from tools.distill.selfinstruct import unit_fraction  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_shard(spec: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {spec!r}: expected I/N") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {spec!r}: need 0 <= I < N")
    return index, count


def share(total: int, shard: tuple[int, int]) -> int:
    """Shard ``index``'s part of ``total`` (the parts add up to ``total``)."""
    index, count = shard
    return total // count + (index < total % count)


def summary(train: Docs, held: Docs) -> dict:
    return {"train_tokens": train.n_tokens(), "train_docs": len(train),
            "held_out_tokens": held.n_tokens(), "held_out_docs": len(held),
            "train_by_source": train.by_source(), "held_out_by_source": held.by_source()}


def print_summary(label: str, s: dict) -> None:
    print(f"{label}: {s['train_tokens']:,} training tokens in {s['train_docs']} documents, "
          f"{s['held_out_docs']} held out ({s['held_out_tokens']:,} tokens)")
    total = max(1, s["train_tokens"])
    for src, n in sorted(s["train_by_source"].items()):
        print(f"  {src:>22}: {n:>11,} train tokens ({100 * n / total:5.1f} %), "
              f"{s['held_out_by_source'].get(src, 0):>9,} held out")


def line_progress(label: str, total: int):
    """A progress callback that prints a line per batch (logs, not terminals)."""
    t0, done = time.perf_counter(), [0]

    def advance(n: int) -> None:
        done[0] += n
        print(f"  {label}: {done[0]}/{total} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return advance


def gen_main(a: argparse.Namespace) -> dict:
    from ssdlib.loading import load_checkpoint
    from tools.distill import models
    from tools.distill.selfinstruct import GenSettings
    from tools.distill.sources import OPENER_SETS, SourceSettings, build_splits, parse_sources

    t0 = time.perf_counter()
    device = torch.device(a.device if a.device != "auto"
                          else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[a.dtype if a.dtype != "auto" else
                   ("bfloat16" if device.type == "cuda" else "float32")]
    sources = parse_sources(a.data)
    ck = load_checkpoint(a.target)
    teacher = models.load_teacher(ck, device, dtype, max(ck.config.max_position_embeddings,
                                                         4096, a.random_len + 8))
    load_s = time.perf_counter() - t0
    gen = GenSettings(user_max_tokens=a.user_max_tokens, answer_max_tokens=a.answer_max_tokens,
                      greedy_answers=a.greedy_answers, graphs=a.sampler_graphs,
                      batch_size=a.gen_batch or (1024 if device.type == "cuda" else 16))
    if a.time_budget:
        gen.deadline = time.monotonic() + a.time_budget
    cfg = SourceSettings(
        sources=sources, selfinstruct_samples=share(a.selfinstruct_samples, a.shard),
        docinstruct_samples=share(a.docinstruct_samples, a.shard),
        random_samples=share(a.random_samples, a.shard), random_len=a.random_len,
        pysrc_tokens=a.pysrc_tokens, eval_samples=max(1, share(a.eval_samples, a.shard)),
        text_roots=a.text_root or default_text_roots(), seed=a.seed, gen=gen, shard=a.shard,
        selfinstruct_openers=OPENER_SETS[a.selfinstruct_openers],
        multiturn_samples=share(a.multiturn_samples, a.shard))
    tokenizer = ck.tokenizer if any(s != "random-target-samples" for s in sources) else None
    print(f"shard {a.shard[0]}/{a.shard[1]} on {device} ({dtype}): self-instruct "
          f"{cfg.selfinstruct_samples}, docinstruct {cfg.docinstruct_samples}, held out "
          f"{cfg.eval_samples} per source, pysrc {cfg.pysrc_tokens if a.shard[0] == 0 else 0} "
          f"tokens, gen batch {gen.batch_size}, budget {a.time_budget or 'none'} s "
          f"(target loaded in {load_s:.1f} s)", flush=True)
    t1 = time.perf_counter()
    train, held = build_splits(teacher, tokenizer, cfg, device, line_progress, a.samples_jsonl)
    data_s = time.perf_counter() - t1
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    save_splits(a.out, train, held)
    st = dict(gen.stats)
    if st.get("forwards"):
        st["ms_per_forward"] = round(1e3 * st["seconds"] / st["forwards"], 2)
        st["mean_rows_per_forward"] = round(st["row_steps"] / st["forwards"], 1)
    report = {"shard": list(a.shard), "device": str(device), "dtype": str(dtype),
              "seconds": {"load": round(load_s, 1), "data": round(data_s, 1),
                          "sampling": round(st.get("seconds", 0.0), 1),
                          "total": round(time.perf_counter() - t0, 1)},
              "sampler": st, "deadline_hit": bool(st.get("skipped")) or (
                  gen.deadline is not None and time.monotonic() >= gen.deadline),
              **summary(train, held),
              "args": {k: v for k, v in vars(a).items() if k != "func"}}
    with open(a.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
    print_summary(f"shard {a.shard[0]}/{a.shard[1]} -> {a.out}", report)
    print(f"  seconds: {report['seconds']}; sampler: {st}", flush=True)
    return report


def merge_main(a: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    train, held = merge_splits(a.inputs)
    save_splits(a.out, train, held)
    shards = []
    for p in a.inputs:
        if os.path.exists(p + ".json"):
            with open(p + ".json") as f:
                r = json.load(f)
            shards.append({"path": p, "shard": r.get("shard"), "seconds": r.get("seconds"),
                           "sampler": r.get("sampler"), "deadline_hit": r.get("deadline_hit")})
        else:
            shards.append({"path": p})
    report = {**summary(train, held), "inputs": a.inputs, "shards": shards,
              "bytes": os.path.getsize(a.out), "seconds": round(time.perf_counter() - t0, 1)}
    with open(a.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
    print_summary(f"merged {len(a.inputs)} file(s) -> {a.out} "
                  f"({report['bytes'] / 2**20:.1f} MiB)", report)
    return report


def vocab_main(a: argparse.Namespace) -> dict:
    from ssdlib.loading import load_checkpoint
    from ssdlib.loading.draft_vocab import write_ranking
    from tools.distill.data import load_splits
    from tools.distill.vocab import coverage, rank_training_tokens, scored_counts

    if not os.path.isdir(a.into):
        raise SystemExit(f"--into {a.into!r}: not a directory (the draft's)")
    ck = load_checkpoint(a.target)
    splits = [load_splits(p) for p in a.inputs]
    ranked, counts, leading = rank_training_tokens(ck, (train for train, _ in splits))
    held = scored_counts((held for _, held in splits), ck.config.vocab_size)
    path = write_ranking(a.into, ranked, counts)
    sizes = [n for n in (4096, 8192, 16384, 24576, 32768) if n < ranked.numel()]
    report = {"ranked": int(ranked.numel()), "leading": leading, "inputs": a.inputs,
              "counted_tokens": int(counts.sum()), "held_out_tokens": int(held.sum()),
              "held_out_coverage": coverage(held, ranked, sizes)}
    print(f"{path}: {ranked.numel():,} tokens ranked ({len(leading)} special first) from "
          f"{int(counts.sum()):,} scored training tokens")
    for n, share in report["held_out_coverage"].items():
        print(f"  first {n:>6,}: {100 * share:6.2f} % of the held-out documents' scored tokens")
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen", help="sample one shard's documents",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--target", default="smollm2-135m")
    g.add_argument("--out", required=True, help="the shard's data.safetensors")
    g.add_argument("--shard", type=parse_shard, default=(0, 1), help="I/N")
    g.add_argument("--data", default="selfinstruct,multiturn,docinstruct,pysrc")
    g.add_argument("--selfinstruct-samples", type=int, default=2048, help="total, all shards")
    g.add_argument("--selfinstruct-openers", choices=("none", "tasks"), default="tasks",
                   help="first words of the self-instruct user turns: kinds of tasks, or none")
    g.add_argument("--multiturn-samples", type=int, default=512, help="total, all shards")
    g.add_argument("--docinstruct-samples", type=int, default=512, help="total, all shards")
    g.add_argument("--random-samples", type=int, default=256, help="total, all shards")
    g.add_argument("--random-len", type=int, default=128)
    g.add_argument("--pysrc-tokens", type=int, default=4_000_000, help="shard 0 makes them")
    g.add_argument("--eval-samples", type=int, default=64,
                   help="held-out documents per source, total over all shards")
    g.add_argument("--text-root", action="append")
    g.add_argument("--user-max-tokens", type=int, default=96)
    g.add_argument("--answer-max-tokens", type=int, default=320)
    g.add_argument("--greedy-answers", type=unit_fraction, default=0.0,
                   help="fraction of training answers decoded greedily (the rest at T = 0.7)")
    g.add_argument("--gen-batch", type=int, default=None,
                   help="sequences sampled at once (GPU 1024, CPU 16)")
    g.add_argument("--sampler-graphs", action="store_true", default=False,
                   help="run the sampler's decode steps as captured CUDA graphs (the same "
                        "samples; opt-in until measured on a GPU)")
    g.add_argument("--time-budget", type=float, default=None,
                   help="seconds of sampling: then rows keep what they have and later batches "
                        "are skipped (the data is smaller, never late)")
    g.add_argument("--seed", type=int, default=0, help="base seed (the same for all shards)")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto", choices=("auto", *DTYPES))
    g.add_argument("--samples-jsonl", default=None, help="write requests and answers here")
    g.set_defaults(func=gen_main)
    m = sub.add_parser("merge", help="merge shard files into one")
    m.add_argument("--out", required=True)
    m.add_argument("inputs", nargs="+")
    m.set_defaults(func=merge_main)
    v = sub.add_parser("vocab", help="rank the target's tokens into a draft's "
                                     "draft_vocab.safetensors",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    v.add_argument("--target", default="smollm2-135m")
    v.add_argument("--into", required=True, help="the draft's directory")
    v.add_argument("inputs", nargs="+", help="data files (gen / merge outputs)")
    v.set_defaults(func=vocab_main)
    return p


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    main()
