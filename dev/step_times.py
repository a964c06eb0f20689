"""Time each hot-path step on a GPU, eagerly and as one graph replay, and list a step's kernels.

The steps are ``dev/hot_path_steps.py``'s, with the real models' shapes (those
``dev/op_count.py`` counts). For each step:

- eager: mean ms a call from CUDA events around ``--iters`` back-to-back calls (a host-bound
  step is as slow as its launches), and the host's own ms a call (``perf_counter``, before the
  final sync);
- graph: mean ms a replay of the step captured as one CUDA graph (steps that are pure device
  work on static inputs); the speculator's builds run as the speculator runs them (host
  preparation, one copy, the engine pool's captured steps), so their eager time is that path;
- the speculator's round also lists its own phases (commit, fallback, send, build, push: ms a
  round, CUDA events on a GPU), as the SSD bench's ``spec.*`` columns do;
- ``--profile NAME,...`` (substrings of step names): a torch.profiler table of the GPU kernels
  of ``--iters`` calls of each such step, by total GPU time.

    python dev/step_times.py [--target smollm2-135m] [--draft DIR] [--k 3] [--batch 1]
        [--fan-out-budget 16] [--feature-draft DIR] [--dtype bfloat16] [--iters 50] [--profile build,draw] [--json P]

Needs CUDA (``--device cpu`` runs it for the tests: times there are not GPU times).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_eager(fn, iters: int, dev: torch.device) -> tuple[float, float]:
    """(device ms a call, host ms a call) over ``iters`` back-to-back calls after warm-up."""
    for _ in range(3):
        fn()
    _sync(dev)
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / iters
        return ms, ms
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters, host


def time_graph(fn, iters: int, dev: torch.device) -> float | None:
    """ms a replay of ``fn`` captured as one CUDA graph (None off CUDA)."""
    if dev.type != "cuda":
        return None
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def kernel_table(fn, iters: int, dev: torch.device, top: int) -> list[dict]:
    """The GPU kernels of ``iters`` calls of ``fn``, by total time: name, calls a call, us a call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        _sync(dev)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us and e.device_type.name == "CUDA":
            rows.append({"kernel": e.key[:90], "per_call": e.count / iters, "us": us / iters})
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def main(argv=None) -> int:
    from dev.hot_path_steps import add_step_args, hot_path_steps, torch_attention_backend

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--profile", default="", help="comma-separated substrings of step names")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per profiled step")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("step_times: CUDA is not available (--device cpu runs it, without GPU times)",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    results, kernels = {}, {}
    backend = torch_attention_backend() if dev.type == "cpu" else contextlib.nullcontext()
    with backend, torch.inference_mode():
        steps, meta = hot_path_steps(args.target, args.draft, args.batch, args.k,
                                     args.fan_out_budget, args.device, dtype,
                                     feature_draft=args.feature_draft)
        for name, step in steps.items():
            eager, host = time_eager(step.fn, args.iters, dev)
            graph = time_graph(step.fn, args.iters, dev) if step.capturable else None
            results[name] = {"eager_ms": eager, "host_ms": host, "graph_ms": graph}
            if step.details is not None:
                results[name]["details"] = step.details()
        wanted = [w for w in args.profile.split(",") if w]
        if wanted and dev.type == "cuda":
            for name, step in steps.items():
                if any(w in name for w in wanted):
                    kernels[name] = kernel_table(step.fn, args.iters, dev, args.top)
    print(f"# step times: {meta}, {args.iters} calls each")
    print("| step | eager ms (device) | host ms | one graph ms |")
    print("|---|---|---|---|")
    for name, r in results.items():
        g = "–" if r["graph_ms"] is None else f"{r['graph_ms']:.3f}"
        print(f"| {name} | {r['eager_ms']:.3f} | {r['host_ms']:.3f} | {g} |")
    for name, r in results.items():
        if r.get("details"):
            print(f"# {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["details"].items()))
    for name, rows in kernels.items():
        print(f"\n# kernels of '{name}' (a call: count, us; by total GPU time)")
        for r in rows:
            print(f"{r['us']:9.1f} us  x{r['per_call']:.1f}  {r['kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "iters": args.iters, "steps": results,
                       "kernels": kernels}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
