"""The opt-in leader profile (SSDLIB_PROFILE): only the chosen call is profiled, and it writes a
readable cProfile dump and a Chrome trace."""

import gzip
import json
import pstats

import torch

from ssdlib.profiling import CallProfiler


def _work():
    x = torch.randn(64, 64)
    for _ in range(3):
        x = x @ x.T / 64
    return x


def test_profiles_only_the_chosen_call(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDLIB_PROFILE", str(tmp_path))
    monkeypatch.setenv("SSDLIB_PROFILE_CALL", "2")
    prof = CallProfiler("ssd")
    with prof.call():
        _work()
    assert list(tmp_path.iterdir()) == []  # call 1: the warm-up, not profiled
    with prof.call():
        _work()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ssd-leader.pstats", "ssd-leader.trace.json.gz"]
    stats = pstats.Stats(str(tmp_path / "ssd-leader.pstats"))
    assert any(fn[2] == "_work" for fn in stats.stats)
    with gzip.open(tmp_path / "ssd-leader.trace.json.gz") as f:
        trace = json.load(f)
    assert any("mm" in e.get("name", "") for e in trace["traceEvents"])
    with prof.call():  # call 3: not profiled again
        _work()
    assert len(list(tmp_path.iterdir())) == 2


def test_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("SSDLIB_PROFILE", raising=False)
    monkeypatch.chdir(tmp_path)
    prof = CallProfiler("ar")
    for _ in range(3):
        with prof.call():
            _work()
    assert list(tmp_path.iterdir()) == []
