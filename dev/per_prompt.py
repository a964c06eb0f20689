"""Per-prompt wall time of one engine mode, two passes (lab tool: which prompts are slow, and
whether only in the first pass, as a first use that the warm-up did not meet would be).

    python dev/per_prompt.py --mode ssd --draft ssdlib/assets/smollm2-135m-eagle \
        --temperature 0.7 --humaneval HumanEval.jsonl.gz --n-prompts 16

Prints, per prompt and pass: tokens, wall ms, and the speculator's phase ms per round it
answered (SSD), from ``Generator.last_run_metrics``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ssdlib import Generator, SamplingParams  # noqa: E402
from tools.bench import encode_prompts, humaneval_prompts, sync  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--mode", default="ssd")
    p.add_argument("--draft", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--humaneval", default=None)
    p.add_argument("--n-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    ids = encode_prompts(args.target, humaneval_prompts(args.humaneval, args.n_prompts), True)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    kw = dict(target=args.target, mode=args.mode, device=args.device, k=args.k, max_batch=1)
    if args.draft:
        kw["draft"] = args.draft
    with Generator(**kw) as gen:
        gen.generate(ids[:1], params)
        for n in range(args.passes):
            for i, prompt in enumerate(ids):
                t0 = time.perf_counter()
                out = gen.generate([prompt], params)[0]
                sync(args.device)
                ms = 1e3 * (time.perf_counter() - t0)
                spec = gen.last_run_metrics.get("speculator_ms_per_round", {})
                print(f"pass {n} prompt {i:2d} len {len(prompt):4d} tokens "
                      f"{out.metrics['tokens']:3d} wall {ms:8.1f} ms  spec "
                      + " ".join(f"{k} {v:.1f}" for k, v in spec.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
