"""The OpenAI-compatible server (ssdlib.serve) against live sockets, with the official ``openai``
client: greedy answers equal Generator.generate (modes ar, sd, ssd), requests join a running
batch, a client that disconnects frees its slot, every error status, /metrics parses.

Servers run uvicorn on a thread of the test process (one per mode, tiny chat model); one test
runs ``python -m ssdlib.serve`` as a process and kills a rank under it. The server and models
the tests share: tests/serve/live_server.py."""

import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prom_parser = pytest.importorskip("prometheus_client.parser")

from ssdlib import Generator, SamplingParams  # noqa: E402
from tests.serve.live_server import (KEY, LONG, MAX_LEN, PROMPT, ROOT,  # noqa: E402,F401
                                     LiveServer, _engine, _free_port, _wait_for, _wait_healthy,
                                     models)

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
N = 12


@pytest.fixture(scope="module")
def reference(models):
    """Greedy answers of Generator.generate (mode ar) for the prompts the tests send."""
    with Generator(target=models[0], max_len=MAX_LEN, max_batch=4) as g:
        p = SamplingParams(max_new_tokens=N)
        return {"chat": g.generate([{"messages": MESSAGES}], p)[0],
                "text": g.generate([PROMPT], p)[0],
                "long": g.generate([PROMPT], SamplingParams(max_new_tokens=24, ignore_eos=True))[0],
                "seeded": g.generate([PROMPT], SamplingParams(max_new_tokens=N, temperature=0.9,
                                                              seed=7, ignore_eos=True))[0]}


@pytest.fixture(scope="module")
def ar_server(models):
    s = LiveServer(_engine(models, "ar", max_batch=2), max_queue=1, api_key=KEY)
    yield s
    s.close()


def _check_greedy(server, reference):
    c = server.client()
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N,
                                     temperature=0)
    assert chat.choices[0].message.content == reference["chat"].text
    assert chat.choices[0].finish_reason == {"eos": "stop"}.get(reference["chat"].finish_reason,
                                                                reference["chat"].finish_reason)
    assert chat.usage.prompt_tokens == reference["chat"].prompt_tokens
    assert chat.usage.completion_tokens == len(reference["chat"].token_ids)
    pieces = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(pieces)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        reference["chat"].text
    assert chunks[-1].usage.completion_tokens == len(reference["chat"].token_ids)
    done = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0)
    assert done.choices[0].text == reference["text"].text
    assert done.usage.prompt_tokens == reference["text"].prompt_tokens
    streamed = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == reference["text"].text


def _check_cancel_mid_batch(server, reference):
    """Two requests run; one client leaves after its first chunk; the other ends unchanged."""
    c = server.client()
    stay = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                stream=True, extra_body={"ignore_eos": True})
    leave = c.completions.create(model="tiny", prompt="abc", max_tokens=LONG, temperature=0,
                                 stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stay))
    next(iter(leave))
    leave.response.close()
    text = first.choices[0].text + "".join(ch.choices[0].text for ch in stay)
    assert text == reference["long"].text
    _wait_for(lambda: server.metrics().get("ssdlib_requests_total[cancelled]", 0) >= 1)


def test_ar_greedy_equals_generate(ar_server, reference):
    _check_greedy(ar_server, reference)
    seeded = ar_server.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0.9, seed=7,
        extra_body={"ignore_eos": True})
    assert seeded.choices[0].text == reference["seeded"].text
    assert [m.id for m in ar_server.client().models.list().data] == ["tiny"]


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_speculative_greedy_equals_generate(models, reference, mode):
    server = LiveServer(_engine(models, mode, max_batch=2))
    try:
        _check_greedy(server, reference)
        _check_cancel_mid_batch(server, reference)
        _check_greedy(server, reference)  # the engine (and the speculator) still agree
        m = server.metrics()
        assert 0 <= m["ssdlib_acceptance_rate"] <= 1
        if mode == "ssd":
            assert 0 <= m["ssdlib_ssd_cache_hit_rate"] <= 1
    finally:
        server.close()


def _long_stream(client, out: dict, key, started: threading.Event, stop: threading.Event):
    """A LONG greedy stream that runs until ``stop``: out[key] = [text, chunks, finished]."""
    s = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LONG, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    out[key] = rec = ["", 0, False]
    for ch in s:
        rec[0] += ch.choices[0].text
        rec[1] += 1
        rec[2] = rec[2] or ch.choices[0].finish_reason is not None
        started.set()
        if stop.is_set():
            break
    s.response.close()  # the client leaves mid-stream (its slot is freed)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_a_late_request_joins_the_running_batch(models, reference, mode):
    """Three requests of LONG tokens run; a short one sent meanwhile finishes while all three
    are still generating. No timing margin: the long ones cannot end before they are stopped
    (LONG tokens take seconds even here), and each must stream more after the short answer.
    In ssd the short request joins the running chain of rounds and leaves it, and the
    disconnected ones leave it as cancelled rows."""
    server = LiveServer(_engine(models, mode, max_batch=4), max_queue=4)
    try:
        c = server.client()
        before = server.metrics().get("ssdlib_requests_total[cancelled]", 0)
        out, threads, started, stop = {}, [], [], threading.Event()
        for i in range(3):
            started.append(threading.Event())
            threads.append(threading.Thread(target=_long_stream,
                                            args=(c, out, i, started[-1], stop), daemon=True))
            threads[-1].start()
        assert all(e.wait(30) for e in started)
        short = c.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
        at_short = {i: out[i][1] for i in range(3)}
        assert short.usage.completion_tokens == 4 and short.choices[0].finish_reason == "length"
        assert not any(out[i][2] for i in range(3)), "a long request ended first"
        # the long requests are still mid-generation: each streams on after the short answer
        _wait_for(lambda: all(out[i][1] > at_short[i] for i in range(3)))
        assert not any(out[i][2] for i in range(3))
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        want = reference["long"].text  # the first 24 greedy tokens of PROMPT
        for i in range(3):
            text = out[i][0]
            assert text.startswith(want) or want.startswith(text), (i, text, want)
        _wait_for(lambda: server.metrics().get("ssdlib_requests_total[cancelled]", 0)
                  >= before + 3)
        m = server.metrics()
        assert m["ssdlib_requests_running"] == 0 and m["ssdlib_requests_waiting"] == 0
    finally:
        server.close()


def test_disconnect_frees_the_slot_and_full_queue_is_503(ar_server):
    c = ar_server.client()
    before = ar_server.metrics().get("ssdlib_requests_total[cancelled]", 0)
    # three long requests fill both slots and the queue of one
    streams = [c.completions.create(model="tiny", prompt=PROMPT, max_tokens=LONG, temperature=0,
                                    stream=True, extra_body={"ignore_eos": True})
               for _ in range(3)]
    next(iter(streams[0]))
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    assert ar_server.metrics()["ssdlib_requests_rejected_total"] >= 1
    for s in streams:  # the clients go away mid-stream
        s.response.close()
    _wait_for(lambda: ar_server.metrics().get("ssdlib_requests_total[cancelled]", 0) >= before + 3)
    m = ar_server.metrics()
    assert m["ssdlib_requests_running"] == 0 and m["ssdlib_requests_waiting"] == 0
    done = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert done.usage.completion_tokens >= 1


def test_error_statuses(ar_server):
    c = ar_server.client()
    cases = [
        (401, lambda: ar_server.client(key="wrong").models.list()),
        (400, lambda: c.chat.completions.create(model="tiny", messages=MESSAGES, n=2)),
        (400, lambda: c.chat.completions.create(model="tiny", messages=MESSAGES,
                                                temperature=-1)),
        (400, lambda: c.completions.create(model="tiny", prompt=[1, 2, 10_000])),
        (404, lambda: c.completions.create(model="gpt-4", prompt=PROMPT)),
        (413, lambda: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * (MAX_LEN + 10)}])),
    ]
    for status, call in cases:
        with pytest.raises(openai.APIStatusError) as e:
            call()
        assert e.value.status_code == status, (status, e.value)
        assert e.value.body["message"], e.value.body  # an OpenAI error body
    r = httpx.post(ar_server.url + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(ar_server.url + "/v1/nothing",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert httpx.get(ar_server.url + "/health").json() == {"status": "ok"}
    m = ar_server.metrics()  # parsed by prometheus_client
    assert m["ssdlib_generation_tokens_total"] > 0
    assert "ssdlib_generation_tokens_per_second" in m and "ssdlib_requests_waiting" in m


def test_cli_serves_and_exits_nonzero_when_a_rank_dies(models):
    psutil = pytest.importorskip("psutil")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssdlib.serve", "--target", models[0], "--draft", models[1],
         "--mode", "ssd", "--k", "3", "--max-len", str(MAX_LEN), "--port", str(port),
         "--speculator-placement", "rank"],  # two rank processes, one of them to kill
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert c.completions.create(model=os.path.basename(models[0]), prompt=PROMPT,
                                    max_tokens=4, temperature=0).usage.completion_tokens >= 1
        ranks = [p for p in psutil.Process(proc.pid).children()
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        ranks[-1].send_signal(signal.SIGKILL)
        assert proc.wait(60) != 0
        assert "rank" in proc.communicate()[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
