"""Host cost of the driver calls a round makes, on this machine (µs per call, host clock)."""
import time
import torch

def per_call(fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6

x = torch.zeros(16, device="cuda")
ev = torch.cuda.Event(enable_timing=True)
host = torch.zeros(64, dtype=torch.int64, pin_memory=True)
dev = torch.zeros(64, dtype=torch.int64, device="cuda")
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s): x.add_(1)
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(g): x.add_(1)
print(f"event record {per_call(ev.record):.1f} us")
print(f"kernel launch (x.add_) {per_call(lambda: x.add_(1)):.1f} us")
print(f"H2D pinned copy 512 B {per_call(lambda: dev.copy_(host, non_blocking=True)):.1f} us")
print(f"graph replay (1 kernel) {per_call(g.replay):.1f} us")
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
def pair():
    a.record(); b.record(); b.synchronize(); a.elapsed_time(b)
print(f"2 records + sync + elapsed_time {per_call(pair, 500):.1f} us")
print(f"D2H .tolist() of 4 ints {per_call(lambda: dev[:4].tolist(), 500):.1f} us")

# Which host-to-device copies wait for the stream to drain: each is timed on the host right
# after queueing ~2 ms of GPU work (torch.cuda._sleep); ~2000 us means the call waited.
def behind_busy(fn, n=20):
    torch.cuda._sleep(1_000)
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        torch.cuda._sleep(4_000_000)  # a busy stretch (11.6 ms measured on the H200)
        t0 = time.perf_counter(); fn(); t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) * 1e6)
    return sorted(out)[n // 2]

t0 = time.perf_counter(); torch.cuda._sleep(4_000_000); torch.cuda.synchronize()
print(f"(the busy stretch: {1e6 * (time.perf_counter() - t0):.0f} us)")
pageable = torch.zeros(64, dtype=torch.int64)
print(f"behind busy: pageable .to(cuda, non_blocking=True) {behind_busy(lambda: pageable.to('cuda', non_blocking=True)):.0f} us")
print(f"behind busy: torch.tensor(list).to(cuda, non_blocking=True) {behind_busy(lambda: torch.tensor([1, 2, 3], dtype=torch.int64).to('cuda', non_blocking=True)):.0f} us")
print(f"behind busy: torch.tensor(list, device=cuda) {behind_busy(lambda: torch.tensor([1, 2, 3], device='cuda')):.0f} us")
print(f"behind busy: pinned copy_ non_blocking {behind_busy(lambda: dev.copy_(host, non_blocking=True)):.0f} us")
print(f"behind busy: pageable copy_ non_blocking {behind_busy(lambda: dev.copy_(pageable, non_blocking=True)):.0f} us")
print(f"behind busy: kernel launch {behind_busy(lambda: x.add_(1)):.0f} us")
