"""Count the device operations of each hot-path step, on any machine (CPU is enough).

On the GPU machine a captured step's time is mostly its kernel count: a session-8 profile found
the draft's tree step bound by ~160 kernels at ~2-3 us each, not by its FLOPs, and every eager op
outside a graph costs ~10-50 us of host time there. This tool runs each step of the engine once
with the real models' shapes and counts the aten operations it dispatches, without a GPU:

- every operation that computes (a kernel on a GPU; an op such as topk or sort may launch a few),
  not views or metadata (``view``, ``slice``, ``expand``, ``detach``, ``empty``, ...);
- the attention op ``ssdlib::slot_attention`` counts as one (the Triton kernel on a GPU; on CPU
  it runs its torch reference, whose inner ops are not counted);
- ``.item()`` reads (``item`` / ``_local_scalar_dense``) are counted apart: host syncs.

    python tools/op_count.py [--target smollm2-135m] [--draft DIR] [--k 3] [--fan-out-budget 16]
        [--batch 1] [--json PATH]

Steps: the target's verify forward (K + 1 queries a row), the greedy and the sampled (T = 0.7)
acceptance after it, the draft's decode step, SD's draft chain (K steps; greedy and sampled), the
speculator's cache build (greedy / sampled; fresh rows and rows continuing a hit) and the
sampled build's per-depth draw alone. A count is a lower bound on kernels, and equal counts of
different ops need not cost the same: compare counts of one step before and after a change,
then measure on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from types import SimpleNamespace

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


def _runner(ck, n_slots: int, tree_len: int):
    from ssdlib.engine.model_runner import ModelRunner

    r = ModelRunner(ck, None, "cpu", torch.float32, n_slots=n_slots, max_len=256,
                    tree_len=tree_len)
    r.use_kernel = True  # the hot path's attention: one slot-attention op a layer
    return r


@contextlib.contextmanager
def torch_attention_backend():
    """Inside: the slot-attention op runs its torch reference (the steps ask for Triton, which
    a CPU lacks); restored after."""
    from ssdlib.ops import slot_attention as sa

    plain = sa.slot_attention

    def on_cpu(*args, backend="triton", **kwargs):
        return plain(*args, backend="torch", **kwargs)
    sa.slot_attention = on_cpu
    try:
        yield
    finally:
        sa.slot_attention = plain


def _rows(b: int, params):
    from ssdlib.speculative.rng import RowStream

    return [SimpleNamespace(params=params, stream=RowStream.from_seed(7, i)) for i in range(b)]


def measure(target: str, draft: str, b: int, K: int, budget: int) -> dict:
    """{step name: OpCounter} for each hot-path step, plus "_meta"."""
    with torch_attention_backend():
        return _measure(target, draft, b, K, budget)


def _measure(target: str, draft: str, b: int, K: int, budget: int) -> dict:
    from ssdlib.engine.cache_builder import CacheBuilder
    from ssdlib.engine.sampled_chain import sampled_chain_body
    from ssdlib.engine.sampler import row_distributions, reserve_streams, sample_branches
    from ssdlib.engine.sampler import sampling_tensors
    from ssdlib.engine.spec_cache import SpeculationCache
    from ssdlib.engine.tree_build import TreeBuildStep
    from ssdlib.layers.attention import AttentionMetadata
    from ssdlib.loading import load_checkpoint
    from ssdlib.sampling import SamplingParams, SamplingTensors
    from ssdlib.speculative.acceptance import DraftQ, verify_greedy, verify_sampled
    from ssdlib.speculative.fanout import geometric_fanout

    out: dict = {}
    hot = SamplingParams(temperature=0.7)
    # -- the target: verify forward, then the acceptance -------------------------------------
    tck = load_checkpoint(target)
    V = tck.config.vocab_size
    tr = _runner(tck, b, 0)
    pos = torch.arange(40, 40 + K + 1).expand(b, K + 1).contiguous()
    slots = torch.arange(b)
    meta = AttentionMetadata(pos, slots, tr.cache.max_len, kv_limit=pos + 1, use_kernel=True)
    ids = torch.randint(0, V, (b, K + 1))
    logits = None

    def verify_fwd():
        nonlocal logits
        logits = tr.step_model(ids, tr.cache, meta)
    out["target verify forward"] = count(verify_fwd)
    drafts = ids[:, 1:]
    out["acceptance, greedy"] = count(lambda: verify_greedy(drafts, logits))
    q = torch.softmax(torch.randn(b, K, V), -1)

    def sampled():
        rows = _rows(b, hot)
        p = row_distributions(logits, rows)
        verify_sampled(drafts, DraftQ.per_row([0] * b, q), p,
                       generators=reserve_streams(rows, K + 1, "cpu"))
    out["acceptance, sampled (T=0.7)"] = count(sampled)
    del tr, logits
    # -- the draft: decode step, SD's chain, the speculator's build ---------------------------
    dck = load_checkpoint(draft)
    fan = tuple(geometric_fanout(budget, K, 0.7, 1.0))
    B = sum(fan)
    dr = _runner(dck, b, B * K)
    dpos = torch.full((b, 1), 40)
    dmeta = AttentionMetadata(dpos, slots, dr.cache.max_len, kv_limit=dpos + 1, use_kernel=True)
    out["draft decode step"] = count(lambda: dr.step_model(torch.zeros(b, 1, dtype=torch.int64),
                                                           dr.cache, dmeta))
    out[f"SD draft chain ({K} steps)"] = count(lambda: dr.chain_body(
        torch.zeros(b, dtype=torch.int64), torch.full((b,), 40), slots, K, V,
        dr.cache.max_len, True))
    hot_rows = [hot] * b
    table = SamplingTensors.host_table(hot_rows)
    streams = torch.tensor([[1, 0]] * b, dtype=torch.int64)
    out[f"SD draft chain, sampled ({K} steps)"] = count(lambda: sampled_chain_body(
        dr, torch.zeros(b, 1, dtype=torch.int64), torch.full((b, 1), 40), slots,
        torch.zeros(b, 1, dtype=torch.int64), K - 1, V, dr.cache.max_len, True, table, streams,
        SamplingTensors.host_facts(hot_rows)))
    C = min(B + 1, V)
    cache = SpeculationCache(b + 1, B, K, V, "cpu")
    top = torch.zeros(b + 1, B, K, C, dtype=torch.int64)
    step = TreeBuildStep(dr, cache, top, C, V)
    index = CacheBuilder._branch_index(SimpleNamespace(_index_cache={}, V=V, K=K,
                                                       device=torch.device("cpu")), fan)
    cand = torch.randint(0, V, (b, K + 1, C))
    sent = torch.randint(0, V, (b, K)).tolist()
    lengths, live = [40] * b, list(range(b))
    for label, reuse, sampled_rows in (("greedy", None, None), ("greedy, hit rows", [0] * b, None),
                                       ("sampled", None, _rows(b, hot)),
                                       ("sampled, hit rows", [0] * b, _rows(b, hot))):
        out[f"speculator build, {label}"] = count(lambda: step.run(
            cand, sent, lengths, live, *index, 48, reuse, sampled_rows, fan, 1.0))
    blog = torch.randn(b, B, V)
    st = sampling_tensors(_rows(b, hot), "cpu")
    u = torch.rand(b, B, dtype=torch.float64)
    out["sampled build's draw, one depth"] = count(lambda: sample_branches(blog, st, u, fan[0],
                                                                           1.0))
    out["_meta"] = {"target": target, "draft": draft, "batch": b, "k": K, "fan_out": list(fan),
                    "vocab": V, "target_layers": tck.config.num_hidden_layers,
                    "draft_layers": dck.config.num_hidden_layers}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fan-out-budget", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=6, help="ops listed per step")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    res = measure(args.target, args.draft, args.batch, args.k, args.fan_out_budget)
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
