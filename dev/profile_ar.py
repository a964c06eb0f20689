"""Host-side profile of the AR decode loop (one in-process rank): where the Python time between
two captured-graph replays goes. Prints cProfile's top functions by own time.

    python dev/profile_ar.py [--target smollm2-135m] [--device cuda] [--tokens 256] [--top 40]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ssdlib import Generator, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    prompt = "Write a Python function that checks whether a number is prime."
    with Generator(args.target, mode="ar", device=args.device, dtype=args.dtype) as gen:
        gen.generate([prompt], params, chat=True)  # warm-up: captures the steps
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        gen.generate([prompt], params, chat=True)
        prof.disable()
        wall = time.perf_counter() - t0
        run = gen.last_run_metrics
    rounds = run.get("rounds", 0)
    print(f"rounds {rounds}, wall {wall:.3f} s, {1e3 * wall / max(rounds, 1):.3f} ms per round; "
          f"phases (ms/round): " + ", ".join(
              f"{k[:-2]} {1e3 * v / max(rounds, 1):.3f}" for k, v in run.items()
              if k in ("verify_s", "host_s")))
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
