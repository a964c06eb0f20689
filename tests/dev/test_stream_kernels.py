"""dev/stream_kernels.py on a small synthetic trace: replays grouped by stream and kernel
count, their span and busy time, and a kernel's duration alone against beside another
stream's kernels."""

import gzip
import json

from dev.stream_kernels import load, report


def _trace(path):
    ev = []

    def kernel(name, ts, dur, stream, corr):
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                   "args": {"stream": stream, "correlation": corr}})

    for i in range(4):  # the verify: two kernels 10 µs apart, a build beside it in rounds 2, 3
        t, corr = i * 1000, 100 + i
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t - 5,
                   "dur": 4, "args": {"correlation": corr}})
        slow = 1.5 if i >= 2 else 1.0
        kernel("gemm", t, 100 * slow, 7, corr)
        kernel("norm", t + 100 * slow + 10, 20, 7, corr)
        if i >= 2:
            kernel("build", t, 200, 9, 200 + i)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)


def test_groups_and_contention(tmp_path):
    path = str(tmp_path / "t.trace.json.gz")
    _trace(path)
    lines = report(*load(path), top=5, min_count=2)
    head = [x for x in lines if x.startswith("stream 7")]
    assert head == ["stream 7, cudaGraphLaunch, 2 kernels: 4 replays; span median 0.155 ms "
                    "(p10 0.130), busy 0.145 ms, another stream busy 58% of the span"]
    gemm = next(x for x in lines if x.endswith("| gemm"))
    assert "alone   100.0 us x  0.5" in gemm and "beside   150.0 us x  0.5" in gemm
    norm = next(x for x in lines if x.endswith("| norm"))
    assert "alone    20.0 us x  0.5" in norm and "beside    20.0 us x  0.5" in norm
    assert any(x.startswith("stream 9, ?, 1 kernels: 2 replays") for x in lines)
