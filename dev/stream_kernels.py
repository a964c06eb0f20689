"""Where a graph replay's time goes, stream by stream, in a Chrome trace written by
``SSDLIB_PROFILE`` (``ssdlib/profiling.py``): how long each kind of replay spans on the GPU,
how much of that span its kernels fill, and how much longer its kernels run while another
stream's kernels run beside them.

    python dev/stream_kernels.py DIR/ssd-leader.trace.json.gz [--top 15] [--min-count 20]

A replay is the kernels of one launch (one ``cudaGraphLaunch`` or one eager launch: the
trace's correlation id). Replays are grouped by (stream, kernel count): on the stream
placement the leader's chained step and the speculator's build are separate groups. Per
group: replays, the median span (first kernel's start to the last one's end), the median busy
time (the union of its kernels), the share of its span with another stream's kernel running,
and its kernels by total time, each with its mean duration alone (no other stream's kernel
overlapping it) and beside another stream's kernels.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from bisect import bisect_left
from collections import defaultdict


def load(path: str) -> tuple[list[dict], dict[int, str]]:
    """-> (kernels sorted by start, the host launch call's name by correlation id)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e["name"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    return kernels, launch


def union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class Others:
    """The kernels of the other streams, for 'was another stream busy over [a, b)'."""

    def __init__(self, kernels: list[dict]):
        self.by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for e in kernels:
            self.by_stream[e["args"].get("stream", -1)].append((e["ts"], e["ts"] + e["dur"]))
        # per stream a running max of ends, so that a lookup is a bisect
        self.starts = {s: [a for a, _ in v] for s, v in self.by_stream.items()}
        self.maxend = {}
        for s, v in self.by_stream.items():
            m, out = float("-inf"), []
            for _, b in v:
                m = max(m, b)
                out.append(m)
            self.maxend[s] = out

    def busy_beside(self, stream: int, a: float, b: float) -> float:
        """Time in [a, b) during which some other stream has a kernel running."""
        spans = []
        for s, v in self.by_stream.items():
            if s == stream:
                continue
            i = bisect_left(self.starts[s], b)  # kernels starting before b
            j = i - 1
            while j >= 0 and self.maxend[s][j] > a:
                x, y = v[j]
                if y > a and x < b:
                    spans.append((max(x, a), min(y, b)))
                j -= 1
        return union(spans)


def report(kernels: list[dict], launch: dict[int, str], top: int, min_count: int) -> list[str]:
    others = Others(kernels)
    replays: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in kernels:
        replays[(e["args"].get("stream", -1), e["args"].get("correlation", -1))].append(e)
    groups: dict[tuple, list[list[dict]]] = defaultdict(list)
    for (stream, corr), ks in replays.items():
        groups[(stream, len(ks), launch.get(corr, "?"))].append(ks)
    lines = []
    order = sorted(groups.items(), key=lambda kv: -sum(
        k[-1]["ts"] + k[-1]["dur"] - k[0]["ts"] for k in kv[1]))
    for (stream, n, name), reps in order:
        if len(reps) < min_count:
            continue
        spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in reps]
        busys = [union([(e["ts"], e["ts"] + e["dur"]) for e in r]) for r in reps]
        beside = [others.busy_beside(stream, r[0]["ts"], r[-1]["ts"] + r[-1]["dur"])
                  for r in reps]
        lines.append(f"stream {stream}, {name}, {n} kernels: {len(reps)} replays; span median "
                     f"{statistics.median(spans) / 1e3:.3f} ms (p10 "
                     f"{sorted(spans)[len(spans) // 10] / 1e3:.3f}), busy "
                     f"{statistics.median(busys) / 1e3:.3f} ms, another stream busy "
                     f"{sum(beside) / max(sum(spans), 1e-9):.0%} of the span")
        alone: dict[str, list[float]] = defaultdict(list)
        shared: dict[str, list[float]] = defaultdict(list)
        for r in reps:
            for e in r:
                a, b = e["ts"], e["ts"] + e["dur"]
                side = shared if others.busy_beside(stream, a, b) > 0.5 * e["dur"] else alone
                side[e["name"]].append(e["dur"])
        total = defaultdict(float)
        for d in (alone, shared):
            for k, v in d.items():
                total[k] += sum(v)
        per = len(reps)
        for k in sorted(total, key=lambda k: -total[k])[:top]:
            a, s = alone.get(k, []), shared.get(k, [])
            fa = f"{statistics.mean(a):7.1f} us x{len(a) / per:5.1f}" if a else " " * 16
            fs = f"{statistics.mean(s):7.1f} us x{len(s) / per:5.1f}" if s else ""
            lines.append(f"  {total[k] / per / 1e3:6.3f} ms a replay | alone {fa} | beside "
                         f"{fs} | {k[:90]}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per group")
    ap.add_argument("--min-count", type=int, default=20,
                    help="groups with fewer replays are left out")
    args = ap.parse_args(argv)
    kernels, launch = load(args.trace)
    for line in report(kernels, launch, args.top, args.min_count):
        print(line)


if __name__ == "__main__":
    main()
