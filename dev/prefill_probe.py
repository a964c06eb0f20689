"""Where a long prompt's admission goes on a GPU: the target's and the draft's prefill by prompt
length, and the attention inside them (masked SDPA as the engine runs it against causal flash).

    python dev/prefill_probe.py [--target smollm2-135m] [--draft smollm2-135m-draft]
        [--lengths 512,2048,6144] [--iters 5]

Each figure is the mean ms of ``--iters`` calls after two warm-up calls (CUDA events).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ssdlib.engine.runner.model_runner import ModelRunner
    from ssdlib.loading.checkpoint import load_checkpoint
    from ssdlib.loading.draft import load_draft

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--lengths", default="512,2048,6144")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    lengths = [int(x) for x in args.lengths.split(",")]
    target_ck = load_checkpoint(args.target)
    draft_ck = load_draft(args.draft, target_ck)
    runners = {
        "target": ModelRunner(target_ck, None, dev, torch.bfloat16, 2, 8192, cuda_graphs=True,
                              compile=False),
        "draft": ModelRunner(draft_ck, None, dev, torch.bfloat16, 2, 8192, cuda_graphs=True,
                             compile=False),
    }
    print("| model | prompt tokens | prefill ms | from position | tokens fed |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name, r in runners.items():
            window = r.config.sliding_window
            for n in lengths:
                ids = torch.randint(0, 1000, (1, n))
                starts = [0]
                if window and name == "draft":
                    starts.append(max(0, n - r.config.num_hidden_layers * (window - 1)))
                for st in starts:
                    sub, pos = ids[:, st:], torch.arange(st, n).view(1, -1)
                    ms = timed(lambda: r.forward(sub, pos, torch.tensor([0]),
                                                 torch.tensor([[n - st - 1]])), args.iters)
                    print(f"| {name} | {n} | {ms:.2f} | {st} | {n - st} |")
        print()
        print("| attention of one layer, heads 9, head_dim 64 | tokens | ms |")
        print("|---|---|---|")
        for n in lengths:
            q = torch.randn(1, 9, n, 64, device=dev, dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().view(1, 1, n, n)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                ms_masked = timed(lambda: sdpa(q, k, v, attn_mask=mask), args.iters)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ms_flash = timed(lambda: sdpa(q, k, v, is_causal=True), args.iters)
            ms_mask = timed(lambda: torch.arange(n, device=dev).view(1, 1, -1)
                            < torch.arange(n, device=dev).view(1, -1, 1) + 1, args.iters)
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                masked = sdpa(q, k, v, attn_mask=mask)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                flash = sdpa(q, k, v, is_causal=True)
            diff = (masked.float() - flash.float()).abs().max().item()
            print(f"| masked, memory-efficient | {n} | {ms_masked:.3f} (max diff to flash "
                  f"{diff:.2e}) |")
            print(f"| causal, flash | {n} | {ms_flash:.3f} |")
            print(f"| building the mask | {n} | {ms_mask:.3f} |")


if __name__ == "__main__":
    main()
