"""The server's life: ``/health`` answers 503 (and requests 503 "warming_up") until the warm-up
ends; the warm-up leaves no step for real requests to capture; SIGTERM lets the requests in
flight finish, stops every rank (mode ssd with the speculator on a rank of its own) and exits 0
with no process and no semaphore left; past ``--shutdown-timeout`` (SIGINT, 0 s) a stream is
cancelled and still ends cleanly.

The first two run the app on a thread of the test process; the others run
``python -m ssdlib.serve`` as a process (tiny chat model of tests/serve/live_server.py)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ssdlib import Generator, SamplingParams  # noqa: E402
from ssdlib.ops.graph_pool import capture_count  # noqa: E402
from ssdlib.serve.warmup import mixed_batch, run_warmup  # noqa: E402
from tests.rank_helpers import child_pids  # noqa: E402
from tests.serve.live_server import (MAX_LEN, PROMPT, ROOT, LiveServer, _engine,  # noqa: E402,F401
                                     _free_port, _wait_for, _wait_healthy, models)

IN_FLIGHT_TOKENS = 300


def test_health_is_503_until_the_warm_up_ends(models):
    release, called = threading.Event(), []

    def warmup(stop):  # the real one is fast on a CPU: this one ends when the test says
        called.append(stop)
        assert release.wait(60)

    server = LiveServer(_engine(models, "ar", max_batch=2), warmup=warmup)
    try:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "starting"}
        with pytest.raises(openai.APIStatusError) as e:
            server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "warming_up"
        time.sleep(0.5)  # the engine does not start serving on its own meanwhile
        assert httpx.get(server.url + "/health").status_code == 503
        assert len(called) == 1 and called[0]() is False  # no stop was asked for
        release.set()
        _wait_for(lambda: httpx.get(server.url + "/health").status_code == 200)
        done = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                                  temperature=0, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
    finally:
        release.set()
        server.close()


def _serving_load(gen, prompts) -> None:
    """What a server's clients send: every batch size up to max_batch, greedy, sampled and
    both in one batch."""
    rows = gen.cfg.max_batch
    for n in range(1, rows + 1):
        for params in ([SamplingParams(max_new_tokens=12)] * n,
                       [SamplingParams(max_new_tokens=12, temperature=0.8, seed=n)] * n,
                       mixed_batch(n, gen.cfg.k)):
            gen.generate(prompts[:n], params[:n])


def test_the_warm_up_leaves_no_step_to_capture(models, monkeypatch):
    """On the captured-step path (forced on the CPU, every bucket at a step's first use as on
    a GPU), requests after the server's warm-up capture nothing; after the engine's warm-up
    alone a mixed batch still does (what this test would miss if the server added nothing)."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    # the warm-up's prompt length (16 ids): a prompt's length makes shapes of its own (the
    # prefill's, the draft's catch-up over it), which this warm-up does not vary
    prompts = [[1 + (i + j) % 7 for j in range(16)] for i in range(4)]
    with _engine(models, "sd", max_batch=4, start=False) as gen:
        gen.start(warm=False)
        run_warmup(gen)
        before = capture_count()
        _serving_load(gen, prompts)
        assert capture_count() == before
    with _engine(models, "sd", max_batch=4, start=False) as gen:
        gen.start(warm=False)
        gen.warm_up()
        before = capture_count()
        gen.generate(prompts, mixed_batch(4, gen.cfg.k))
        assert capture_count() > before


def _serve(models, *args, sigint=False):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssdlib.serve", "--target", models[0], "--max-len", str(MAX_LEN),
         "--port", str(port), "--threads", "1", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # SIGINT as a terminal's foreground job has it (a background job inherits it ignored)
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sigint else None)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url)
    return proc, url


def _stream(url: str, max_tokens: int, out: list, first: threading.Event) -> None:
    """A greedy streamed completion; ``out`` gets its data payloads, "[DONE]" included."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                first.set()


def _gone(pids) -> bool:
    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return not any(alive(p) for p in pids)


def _check_clean_stderr(err: str, url: str) -> None:
    assert f"ssdlib server ready: listening on {url}" in err, err
    for word in ("leaked", "resource_tracker", "Traceback"):
        assert word not in err, err


def test_sigterm_lets_requests_finish_then_stops_every_rank(models):
    proc, url = _serve(models, "--draft", models[1], "--mode", "ssd", "--k", "3",
                       "--speculator-placement", "rank", "--shutdown-timeout", "60")
    try:
        children = child_pids(proc.pid)
        assert len(child_pids(proc.pid, spawned_ranks_only=True)) == 2, children
        outs, threads, firsts = [], [], []
        for _ in range(2):
            outs.append([])
            firsts.append(threading.Event())
            threads.append(threading.Thread(target=_stream, daemon=True,
                                            args=(url, IN_FLIGHT_TOKENS, outs[-1], firsts[-1])))
            threads[-1].start()
        assert all(f.wait(60) for f in firsts)
        proc.send_signal(signal.SIGTERM)
        # stopping: the health check and a new request get 503 while the two run on
        _wait_for(lambda: httpx.get(url + "/health").status_code == 503)
        assert httpx.get(url + "/health").json() == {"status": "stopping"}
        late = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        for t in threads:
            t.join(120)
        for out in outs:
            assert out[-1] == "[DONE]"
            assert json.loads(out[-2])["usage"]["completion_tokens"] == IN_FLIGHT_TOKENS
            assert json.loads(out[-3])["choices"][0]["finish_reason"] == "length"
        _exits_clean(proc, children, url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exits_clean(proc, children, url) -> None:
    """The server exits 0, leaves no child process and says nothing alarming."""
    assert proc.wait(60) == 0
    _wait_for(lambda: _gone(children))
    _check_clean_stderr(proc.communicate()[1], url)


def test_sigint_past_the_grace_period_cancels_and_ends_streams_cleanly(models):
    proc, url = _serve(models, "--shutdown-timeout", "0", sigint=True)
    try:
        children = child_pids(proc.pid)
        out, first = [], threading.Event()
        t = threading.Thread(target=_stream, args=(url, MAX_LEN - 64, out, first), daemon=True)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGINT)
        t.join(60)
        assert not t.is_alive()
        assert out[-1] == "[DONE]"
        usage = json.loads(out[-2])["usage"]
        assert 0 < usage["completion_tokens"] < MAX_LEN - 64  # cut short, not finished
        assert json.loads(out[-3])["choices"][0]["finish_reason"] == "abort"
        _exits_clean(proc, children, url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
