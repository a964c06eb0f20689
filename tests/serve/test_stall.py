"""A stuck engine (a rank alive but blocked) fails the server instead of hanging it: the
progress check of ``AsyncEngine`` on a stub session (the live server with a stopped rank:
test_stall_live.py)."""

from types import SimpleNamespace

import pytest

from ssdlib.sampling import SamplingParams
from ssdlib.serve.async_engine import AsyncEngine, EngineFailed, EngineStalled


class StubSession:
    alive = True

    def __init__(self):
        self.requests = []

    def submit(self, request):
        self.requests.append(request)

    def cancel(self, request_id):
        pass


def _engine(stall_timeout_s):
    engine = AsyncEngine(SimpleNamespace(cfg=SimpleNamespace(max_batch=2)),
                         stall_timeout_s=stall_timeout_s)
    engine._session = StubSession()
    return engine


def test_no_delivery_for_the_stall_timeout_fails_every_request():
    engine = _engine(5.0)
    assert not engine.check_progress(now=engine._progress_at + 1e6)  # idle: nothing in flight
    stream = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
    start = engine._progress_at
    assert not engine.check_progress(now=start + 4.9)
    engine._on_event(stream.id, "a", [7])  # a token: the wait starts again
    after = engine._progress_at
    assert after >= start and not engine.check_progress(now=after + 4.9)
    assert engine.check_progress(now=after + 5.1)
    assert isinstance(engine.failure, EngineStalled) and "stuck" in str(engine.failure)
    assert not engine.healthy and engine.in_flight == 0
    queued = [stream._queue.get_nowait() for _ in range(stream._queue.qsize())]
    assert isinstance(queued[-1], EngineFailed)
    with pytest.raises(EngineFailed):
        engine.submit([1], SamplingParams())


def test_without_a_stall_timeout_the_engine_is_never_failed():
    engine = _engine(None)
    engine.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
    assert not engine.check_progress(now=engine._progress_at + 1e9)
    assert engine.failure is None


@pytest.mark.parametrize("bad", [0, -1.0, "10"])
def test_a_stall_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="stall_timeout_s"):
        _engine(bad)


def test_a_busy_spell_counts_from_its_first_request():
    """A request after a long idle spell is not failed at once."""
    engine = _engine(5.0)
    engine._progress_at -= 1000.0  # idle for long
    engine.submit([1], SamplingParams(max_new_tokens=2))
    assert not engine.check_progress()


def test_the_cli_refuses_a_bad_stall_timeout(capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from ssdlib.serve.__main__ import main

    assert main(["--stall-timeout", "-1", "--device", "cpu"]) != 0
    assert "--stall-timeout" in capsys.readouterr().err
