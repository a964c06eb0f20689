"""How much of a big CUDA graph's launch the GPU waits for (``python dev/gpu_micro_launch.py``).

1. A graph of N small kernels: its replay's host time; the GPU time from an event recorded
   before the replay to one after it, when the stream is idle (the launch gap included) and
   when the replay is queued behind busy work (no gap); the same N kernels as P graphs of N/P
   replayed one after another (the GPU starts after the first piece's launch).

On an H200 (600 one-element adds): host 0.010 ms for one graph, 0.046 ms for
eight; the GPU waited 0.007-0.010 ms for any of them: a big graph's launch is not what the
engine's rounds lose (a torch.profiler trace shows ~0.7 ms per launch: its own overhead).
"""
import time

import torch


def graphs_part(n_kernels=600):
    x = torch.zeros(256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())

    def capture(n):
        with torch.cuda.stream(s):
            for _ in range(3):
                x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1)
        return g

    for pieces in (1, 2, 4, 8):
        gs = [capture(n_kernels // pieces) for _ in range(pieces)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def run(busy):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(2_000_000)
            a.record()
            t0 = time.perf_counter()
            for g in gs:
                g.replay()
            host = time.perf_counter() - t0
            b.record()
            b.synchronize()
            return host * 1e3, a.elapsed_time(b)
        for _ in range(5):
            run(False)
        idle = sorted(run(False) for _ in range(30))[15]
        busy = sorted(run(True) for _ in range(30))[15]
        print(f"{n_kernels} kernels as {pieces} graph(s): host {idle[0]:.3f} ms; GPU from "
              f"before the replay: idle stream {idle[1]:.3f} ms, queued behind work "
              f"{busy[1]:.3f} ms (gap {idle[1] - busy[1]:.3f} ms)")


if __name__ == "__main__":
    graphs_part()
