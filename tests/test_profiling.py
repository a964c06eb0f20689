"""The opt-in leader profile (SSDLIB_PROFILE): only the chosen call is profiled, and it writes a
readable cProfile dump and a Chrome trace."""

import gzip
import json
import pstats

import torch

from ssdlib.profiling import CallProfiler, RoundProfiler


def _work():
    x = torch.randn(64, 64)
    for _ in range(3):
        x = x @ x.T / 64
    return x


def test_profiles_only_the_chosen_call(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDLIB_PROFILE", str(tmp_path))
    monkeypatch.setenv("SSDLIB_PROFILE_CALL", "2")
    monkeypatch.setenv("SSDLIB_PROFILE_PY", "1")
    prof = CallProfiler("ssd")
    with prof.call():
        _work()
    assert list(tmp_path.iterdir()) == []  # call 1: the warm-up, not profiled
    with prof.call():
        _work()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ssd-leader.pstats", "ssd-leader.trace.json.gz"]  # SSDLIB_PROFILE_PY=1
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


def test_round_window(tmp_path, monkeypatch):
    """Rounds 2..3 of a rank are profiled (a trace, no cProfile unless asked); a window cut
    short by the rank's end is written at close."""
    monkeypatch.setenv("SSDLIB_PROFILE", str(tmp_path / "a"))
    monkeypatch.setenv("SSDLIB_PROFILE_ROUNDS", "2:2")
    monkeypatch.delenv("SSDLIB_PROFILE_PY", raising=False)
    prof = RoundProfiler("ssd-speculator")
    for _ in range(6):
        prof.tick()
        _work()
        if prof.rounds == 3:
            assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["ssd-speculator.trace.json.gz"]
    monkeypatch.setenv("SSDLIB_PROFILE", str(tmp_path / "b"))
    monkeypatch.setenv("SSDLIB_PROFILE_ROUNDS", "1:10")
    prof = RoundProfiler("x")
    for _ in range(3):
        prof.tick()
        _work()
    prof.close()
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["x.trace.json.gz"]
