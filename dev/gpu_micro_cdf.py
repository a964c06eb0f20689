"""GPU micro-benchmark: the sampler's CDF, torch's last-dim cumsum vs blocked_cdf, inside a
CUDA graph (the speculator's sampled build and the leader's acceptance replay/launch these)."""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from ssdlib.speculative.rng import blocked_cdf, sample_categorical

def old_sample(probs, u):
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u.double()[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(idx, last).squeeze(-1)

def timed_graph(fn, reps=200):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    for _ in range(10): g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); a.record()
    for _ in range(reps): g.replay()
    b.record(); b.synchronize()
    return a.elapsed_time(b) / reps * 1e3  # us

for n in (1, 4, 16, 128):
    V = 49152
    p = torch.softmax(torch.randn(n, V, device="cuda") * 3, -1)
    u = torch.rand(n, device="cuda", dtype=torch.float64)
    t_cs = timed_graph(lambda: p.double().cumsum(-1))
    t_bl = timed_graph(lambda: blocked_cdf(p.double()))
    t_old = timed_graph(lambda: old_sample(p, u))
    t_new = timed_graph(lambda: sample_categorical(p, u))
    same = torch.equal(old_sample(p, u), sample_categorical(p, u))
    print(f"n={n:4d} V={V}: cumsum {t_cs:7.1f} us, blocked_cdf {t_bl:7.1f} us | sample old {t_old:7.1f} us, new {t_new:7.1f} us, same tokens {same}", flush=True)
