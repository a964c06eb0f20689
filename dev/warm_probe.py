"""What a warmed-up engine still does on its first requests: a Generator started as the server
starts it (work unknown), then the same chat prompts run one after another, each with its wall
time, decode tok/s and the steps captured during it.

    python dev/warm_probe.py --mode sd --max-batch 8 --compile auto --runs 3
    python dev/warm_probe.py ... --profile-start 40   # cProfile of the start-up, top 40
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="sd")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--profile-start", type=int, default=0, help="print the top N of a cProfile")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import torch  # noqa: F401 - imported before the clock starts, as any caller has it

    from ssdlib.generator import Generator
    from ssdlib.ops import graph_pool
    from ssdlib.sampling import SamplingParams

    captured: list = []  # keys captured since the last clear (every pool of this process)
    capture = graph_pool.GraphPool.capture

    def recording_capture(self, key, fn):
        if not self.has(key):
            captured.append(repr(key))
        return capture(self, key, fn)
    graph_pool.GraphPool.capture = recording_capture

    with open(os.path.join(ROOT, "tools", "distill", "heldout_chat.jsonl")) as f:
        chats = [json.loads(line)["messages"] for line in f if line.strip()]
    compile_ = {"auto": "auto", "on": True, "off": False}[args.compile]
    prof = cProfile.Profile() if args.profile_start else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    gen = Generator(mode=args.mode, max_batch=args.max_batch, compile=compile_, k=3,
                    log_level="INFO")
    if prof:
        prof.disable()
    report = {"start_s": time.perf_counter() - t0, "load_s": gen.load_s,
              "warm_up_s": gen.warm_up_s, "warm_up_captures": len(captured), "runs": []}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    for i in range(args.runs):
        captured.clear()
        t1 = time.perf_counter()
        out = gen.generate([{"messages": chats[i % len(chats)]}], params, chat=True)
        m = gen.last_run_metrics
        report["runs"].append({"wall_s": time.perf_counter() - t1,
                               "tokens": len(out[0].token_ids),
                               "decode_tok_s": m.get("decode_tok_s"),
                               "captured_in_run": m.get("captured_in_run"),
                               "keys": list(captured)})
    gen.close()
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
