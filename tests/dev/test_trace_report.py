"""dev/trace_report.py on a small synthetic Chrome trace: rounds cut at the marker, a long
round named by the host op that fills it, one round's host ops and the GPU's busy stretches."""

import gzip
import json

from dev.trace_report import busy, load, main


def _trace(path):
    ev = []

    def host(name, ts, dur, cat="cpu_op"):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1})

    for i, start in enumerate((0, 1000, 2000, 8000, 9000)):  # round 3 starts late
        host("cudaGraphLaunch", start, 50, "cuda_runtime")
        host("aten::to", start + 100, 600)  # the read-back
        host("aten::item", start + 150, 5)  # nested in the read-back: not top level
        ev.append({"ph": "X", "cat": "kernel", "name": "k", "ts": start + 60, "dur": 300,
                   "pid": 0, "tid": 7})
        ev.append({"ph": "X", "cat": "kernel", "name": "k", "ts": start + 362, "dur": 100,
                   "pid": 0, "tid": 7})
    host("aten::scaled_dot_product_attention", 3000, 4500)  # an admission's prefill
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)


def test_report(tmp_path, capsys):
    path = str(tmp_path / "t.trace.json.gz")
    _trace(path)
    top, device = load(path)
    assert "aten::item" not in [e["name"] for e in top]
    assert busy(device, 0, 1000) == [(60, 462, 2)]  # two kernels 2 µs apart: one stretch
    main([path, "--round", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rounds 4: period median 1.000 ms")
    assert any("long round at 2.0 ms: 6.00 ms; aten::scaled_dot_product_attention 4.50" in x
               for x in out)
    i = out.index("round 1: 1.000 ms (offset ms, duration ms, host op)")
    assert out[i + 1].split() == ["0.000", "0.050", "cudaGraphLaunch"]
    assert out[i + 2].split() == ["0.100", "0.600", "aten::to"]
    assert out[-1].strip() == "GPU busy (offset ms, length ms, kernels): (0.060, 0.402, 2)"
