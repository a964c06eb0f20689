"""Read a Chrome trace written by ``SSDLIB_PROFILE`` (``ssdlib/profiling.py``): where the rounds'
wall time goes.

    python dev/trace_report.py DIR/ssd-leader.trace.json.gz [--round N] [--marker NAME]

Rounds are cut at each host call named ``--marker`` (default ``cudaGraphLaunch``: the leader's
verify replay, one a round; the speculator's rounds start at its frame receive,
``c10d::recv_``). Prints the rounds' period (median, p10, p90), their sum against the trace's
span, the periods longer than ``--long`` × the median with the host ops that fill them (an
admission's prefill, for instance), and with ``--round N`` that round's top-level host ops
(offset and duration, ms) and the GPU's busy stretches.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict

HOST = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> tuple[list[dict], list[dict]]:
    """-> (top-level host events of the main thread, device events), each sorted by start."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    host = sorted((e for e in events if e.get("cat") in HOST and e.get("tid") == e.get("pid")),
                  key=lambda e: (e["ts"], -e["dur"]))
    top, end = [], float("-inf")
    for e in host:  # outermost calls only: nested ops are inside their parent's duration
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    device = sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"])
    return top, device


def busy(device: list[dict], start: float, end: float, gap_us: float = 5.0) -> list[tuple]:
    """The device's busy stretches overlapping [start, end): (start, end, kernels) in µs."""
    out: list[list] = []
    for e in device:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b < start or a >= end:
            continue
        if out and a <= out[-1][1] + gap_us:
            out[-1][1] = max(out[-1][1], b)
            out[-1][2] += 1
        else:
            out.append([a, b, 1])
    return [tuple(x) for x in out]


def report(top: list[dict], device: list[dict], marker: str, long: float = 2.0,
           detail: int | None = None) -> list[str]:
    cuts = [e["ts"] for e in top if e["name"] == marker]
    if len(cuts) < 2:
        return [f"fewer than 2 '{marker}' calls: no rounds"]
    periods = sorted(b - a for a, b in zip(cuts, cuts[1:]))
    n = len(periods)
    med = periods[n // 2]
    span = top[-1]["ts"] + top[-1]["dur"] - top[0]["ts"]
    lines = [f"rounds {n}: period median {med / 1e3:.3f} ms, p10 {periods[n // 10] / 1e3:.3f}, "
             f"p90 {periods[9 * n // 10] / 1e3:.3f}; sum {sum(periods) / 1e3:.1f} ms of a "
             f"{span / 1e3:.1f} ms trace"]
    for a, b in zip(cuts, cuts[1:]):
        if b - a > long * med:
            own = defaultdict(float)
            for e in top:
                if a <= e["ts"] < b:
                    own[e["name"]] += e["dur"]
            worst = sorted(own.items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"  long round at {(a - top[0]['ts']) / 1e3:.1f} ms: "
                         f"{(b - a) / 1e3:.2f} ms; " + ", ".join(
                             f"{name} {d / 1e3:.2f}" for name, d in worst))
    if detail is not None and 0 <= detail < len(cuts) - 1:
        a, b = cuts[detail], cuts[detail + 1]
        lines.append(f"round {detail}: {(b - a) / 1e3:.3f} ms (offset ms, duration ms, host op)")
        lines += [f"  {(e['ts'] - a) / 1e3:8.3f} {e['dur'] / 1e3:7.3f} {e['name'][:70]}"
                  for e in top if a <= e["ts"] < b]
        lines.append("  GPU busy (offset ms, length ms, kernels): " + ", ".join(
            f"({(s - a) / 1e3:.3f}, {(f - s) / 1e3:.3f}, {k})" for s, f, k in busy(device, a, b)))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--marker", default="cudaGraphLaunch")
    p.add_argument("--round", type=int, default=None)
    p.add_argument("--long", type=float, default=2.0)
    args = p.parse_args(argv)
    top, device = load(args.trace)
    for line in report(top, device, args.marker, args.long, args.round):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
