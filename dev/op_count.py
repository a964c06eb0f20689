"""Count the device operations of each hot-path step, on any machine (CPU is enough).

On a GPU a captured step's time is mostly its kernel count: a profile on an H200 found
the draft's tree step bound by ~160 kernels at ~2-3 us each, not by its FLOPs, and every eager op
outside a graph costs ~10-50 us of host time there. This tool runs each step of the engine once
with the real models' shapes and counts the aten operations it dispatches, without a GPU:

- every operation that computes (a kernel on a GPU; an op such as topk or sort may launch a few),
  not views or metadata (``view``, ``slice``, ``expand``, ``detach``, ``empty``, ...);
- the attention op ``ssdlib::slot_attention`` counts as one (the Triton kernel on a GPU; on CPU
  it runs its torch reference, whose inner ops are not counted);
- ``.item()`` reads (``item`` / ``_local_scalar_dense``) are counted apart: host syncs.

    python dev/op_count.py [--target smollm2-135m] [--draft DIR] [--k 3] [--fan-out-budget 16]
        [--batch 1] [--feature-draft DIR] [--json PATH]

Steps: the target's verify forward (K + 1 queries a row), the greedy and the sampled (T = 0.7)
acceptance after it, the draft's decode step, SD's draft chain (K steps; greedy and sampled), the
speculator's cache build (greedy / sampled; fresh rows and rows continuing a hit) and the
sampled build's per-depth draw alone. A count is a lower bound on kernels, and equal counts of
different ops need not cost the same: compare counts of one step before and after a change,
then measure on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NO_KERNEL = {"empty", "empty_strided", "lift_fresh", "detach", "detach_", "alias",
             "resolve_conj", "resolve_neg", "_unsafe_view", "view", "_reshape_alias",
             "as_strided", "set_", "result_type"}
HOST_READS = {"item", "_local_scalar_dense"}  # (``tolist`` on CPU dispatches no op: not seen)


class OpCounter(TorchDispatchMode):
    """Counts the computing aten ops (and host reads) dispatched inside ``with``."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.host_reads += 1
        elif not func.is_view and name not in NO_KERNEL:
            self.ops[f"{func.namespace}::{name}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count(fn) -> OpCounter:
    counter = OpCounter()
    with torch.inference_mode(), counter:
        fn()
    return counter


def measure(target: str, draft: str, b: int, K: int, budget: int,
            feature_draft: str | None = None) -> dict:
    """{step name: OpCounter} for each hot-path step (``hot_path_steps.py``), plus "_meta"."""
    from dev.hot_path_steps import hot_path_steps, torch_attention_backend

    with torch_attention_backend():
        steps, meta = hot_path_steps(target, draft, b, K, budget,
                                     feature_draft=feature_draft)
        out: dict = {name: count(step.fn) for name, step in steps.items()}
    out["_meta"] = meta
    return out


def main(argv=None) -> int:
    from dev.hot_path_steps import add_step_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap)
    ap.add_argument("--top", type=int, default=6, help="ops listed per step")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # the attention through its custom op, as inside a compiled step: one op, whatever runs it
    from ssdlib.layers import attention
    eager = attention._slot_kernel_eager
    attention._slot_kernel_eager = attention._slot_kernel
    try:
        res = measure(args.target, args.draft, args.batch, args.k, args.fan_out_budget,
                      args.feature_draft)
    finally:
        attention._slot_kernel_eager = eager
    meta = res.pop("_meta")
    print(f"# device ops per step: {meta}")
    print("| step | ops | host reads | most frequent |")
    print("|---|---|---|---|")
    for name, c in res.items():
        common = ", ".join(f"{op.split('::')[-1]} {n}" for op, n in c.ops.most_common(args.top))
        print(f"| {name} | {c.total} | {c.host_reads} | {common} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "steps": {k: {"ops": c.total, "host_reads": c.host_reads,
                                                   "by_op": dict(c.ops)}
                                               for k, c in res.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
