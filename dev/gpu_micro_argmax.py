"""GPU micro-benchmark: the argmax and the top-k over a vocabulary row as the hot path meets them
(bf16 logits, shapes of a verify, a tree depth and a build's candidates), torch's kernels against
a two-stage Triton argmax, each timed as one CUDA graph of 20 calls:
``python dev/gpu_micro_argmax.py [--vocab 49152]``."""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_max(x_ptr, val_ptr, idx_ptr, V, n_chunks, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * V + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    v, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * n_chunks + chunk, v)
    tl.store(idx_ptr + row * n_chunks + chunk, i + chunk * BLOCK)


@triton.jit
def _merge(val_ptr, idx_ptr, out_ptr, n_chunks, NC: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, NC)
    v = tl.load(val_ptr + row * n_chunks + offs, mask=offs < n_chunks, other=-float("inf"))
    i = tl.load(idx_ptr + row * n_chunks + offs, mask=offs < n_chunks, other=2**31 - 1)
    _, j = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(offs == j, i, 0), axis=0))


def triton_argmax(x: torch.Tensor, block: int = 2048) -> torch.Tensor:
    shape, V = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, V)
    rows, n = x.shape[0], triton.cdiv(V, block)
    val = torch.empty(rows, n, device=x.device, dtype=torch.float32)
    idx = torch.empty(rows, n, device=x.device, dtype=torch.int32)
    out = torch.empty(rows, device=x.device, dtype=torch.int32)
    _chunk_max[(rows, n)](x, val, idx, V, n, BLOCK=block)
    _merge[(rows,)](val, idx, out, n, NC=triton.next_power_of_2(n))
    return out.view(shape).long()


def graph_us(fn, reps: int = 20, iters: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    for _ in range(5):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / (iters * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    torch.manual_seed(0)
    print("shape | torch.argmax us | triton argmax (block 1024 / 2048 / 4096) us | topk(17) us")
    for shape in [(1, 1), (1, 4), (1, 16), (8, 4), (8, 16)]:
        x = torch.randn(*shape, args.vocab, device="cuda", dtype=torch.bfloat16)
        x[..., 7] = x.max() + 1  # a known winner, and a tie further on: the first must win
        x[..., 40000] = x[..., 7]
        ref = x.argmax(-1)
        row = [f"{graph_us(lambda: x.argmax(-1)):.1f}"]
        for block in (1024, 2048, 4096):
            assert torch.equal(triton_argmax(x, block), ref), (shape, block)
            row.append(f"{graph_us(lambda: triton_argmax(x, block)):.1f}")
        row.append(f"{graph_us(lambda: x.topk(17, dim=-1)):.1f}")
        print(shape, " | ".join(row))


if __name__ == "__main__":
    main()
