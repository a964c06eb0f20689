"""GPU micro-benchmark: the argmax and the top-k over a vocabulary row as the hot path meets them
(bf16 logits, shapes of a verify, a tree depth and a build's candidates), torch's kernels against
ssdlib's Triton ones (``ssdlib/ops/triton_row_top.py``), each timed as one CUDA graph of 20
calls: ``python dev/gpu_micro_argmax.py [--vocab 49152]``."""

from __future__ import annotations

import argparse

import torch

from step_times import time_graph  # dev/, beside this script (puts the checkout on the path)

from ssdlib.ops.triton_row_top import row_top


def graph_us(fn, reps: int = 20, iters: int = 50) -> float:
    """us a call of ``fn``, ``reps`` calls captured in one CUDA graph (step_times.time_graph)."""
    return time_graph(lambda: [fn() for _ in range(reps)], iters, torch.device("cuda")) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    torch.manual_seed(0)
    print("shape | argmax: torch, triton (us) | top-17: torch, triton (us)")
    for shape in [(1, 1), (1, 4), (1, 16), (8, 4), (8, 16)]:
        x = torch.randn(*shape, args.vocab, device="cuda", dtype=torch.bfloat16)
        rows = x.view(-1, args.vocab)
        assert torch.equal(row_top(rows, 1)[:, 0], rows.argmax(-1)), shape
        print(shape, f"{graph_us(lambda: x.argmax(-1)):.1f}, {graph_us(lambda: row_top(rows, 1)):.1f}",
              f"| {graph_us(lambda: x.topk(17, dim=-1)):.1f}, "
              f"{graph_us(lambda: row_top(rows, 17)):.1f}")

if __name__ == "__main__":
    main()
