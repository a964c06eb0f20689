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


def test_warm_up_calls_are_not_counted(tmp_path, monkeypatch):
    """The engine's warm-up calls (however many) neither are profiled nor advance the count:
    call 1 is the first call after them."""
    monkeypatch.setenv("SSDLIB_PROFILE", str(tmp_path))
    monkeypatch.delenv("SSDLIB_PROFILE_CALL", raising=False)  # default: 1
    prof = CallProfiler("sd")
    for _ in range(2):  # a speculative mode's synthetic warm-up: greedy, then sampled rows
        with prof.call(counted=False):
            _work()
    assert list(tmp_path.iterdir()) == []
    with prof.call():
        _work()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sd-leader.trace.json.gz"]


def test_generator_profiles_the_first_call_after_its_warm_up(tiny_dirs, tmp_path, monkeypatch):
    """A Generator whose warm-up runs two batches (synthetic greedy and sampled rows, SD on the
    captured-step path) profiles the caller's first generate call, not a warm-up batch: the
    trace holds the caller's rounds (its draft proposals), and a second call is not profiled."""
    from ssdlib import Generator, SamplingParams

    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")
    monkeypatch.setenv("SSDLIB_PROFILE", str(tmp_path))
    monkeypatch.delenv("SSDLIB_PROFILE_CALL", raising=False)
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode="sd", k=3, max_batch=2, max_len=96) as g:
        assert g.warm_up_s > 0 and list(tmp_path.iterdir()) == []
        g.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
        trace = tmp_path / "sd-leader.trace.json.gz"
        assert trace.exists()
        first = trace.stat().st_mtime_ns
        g.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert trace.stat().st_mtime_ns == first  # call 2: not profiled
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    # the warm-up's sampled batch draws through the sampler; the caller's greedy call does not
    assert not any("searchsorted" in e.get("name", "") for e in events)


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
