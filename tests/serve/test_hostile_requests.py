"""The OpenAI-compatible server (ssdlib.serve) against hostile or careless clients, on live
sockets: abandoned requests free their slots, a body over the size limit gets 413 without being
read, a huge prompt does not stall other clients, bad fields get OpenAI 400/413 errors (never a
500), extreme sampling values do not hurt the engine, the API key guards every path but
/health (and comes before any body check), and an engine failure's details stay in the log.

The live server runs the tiny chat model (tests/serve/live_server.py); the engine-failure test
serves a stand-in engine that fails on its first request, with a rank traceback in its error."""

import asyncio
import json
import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from ssdlib.errors import RankFailure  # noqa: E402
from ssdlib.prompts import PromptEncoder  # noqa: E402
from ssdlib.serve.guard import RequestGuard  # noqa: E402
from ssdlib.serve.openai_api import MAX_MESSAGES  # noqa: E402
from ssdlib.tokenizer.chat_template import MAX_OUTPUT_CHARS  # noqa: E402
from tests.serve.live_server import (KEY, LONG, PROMPT, LiveServer, _engine,  # noqa: E402,F401
                                     _wait_for, models)

AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(models):  # noqa: F811 (fixture)
    s = LiveServer(_engine(models, "ar", max_batch=2), max_queue=2, api_key=KEY)
    yield s
    s.close()


def _raw_request(server, path: str, body: bytes, headers: dict | None = None) -> socket.socket:
    """An HTTP/1.1 POST written on a raw socket (so the test decides when the client leaves)."""
    head = {"Host": "127.0.0.1", "Content-Type": "application/json",
            "Content-Length": str(len(body)), **AUTH, **(headers or {})}
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\n".encode()
                 + "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode() + b"\r\n" + body)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the response on ``sock`` (read until the server closes it)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:")]
        if sep and length and len(rest) >= length[0]:
            break
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


def _counts(server) -> dict:
    m = server.metrics()
    return {"cancelled": m.get("ssdlib_requests_total[cancelled]", 0),
            "length": m.get("ssdlib_requests_total[length]", 0),
            "in_flight": m["ssdlib_requests_running"] + m["ssdlib_requests_waiting"]}


def test_abandoned_requests_free_their_slots(server):
    """Two non-streaming requests hold both slots and a streaming one waits; all three clients
    leave. Each request is cancelled (none runs on to its LONG tokens) and a new one is
    served. Without the fix the non-streaming ones ran to the end of their tokens."""
    before = _counts(server)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True}
    socks = [_raw_request(server, "/v1/completions", json.dumps(body).encode()),
             _raw_request(server, "/v1/completions", json.dumps(body).encode()),
             _raw_request(server, "/v1/completions", json.dumps({**body, "stream": True}).encode())]
    try:
        _wait_for(lambda: _counts(server)["in_flight"] == 3)
    finally:
        for s in socks:
            s.close()
    _wait_for(lambda: _counts(server)["cancelled"] >= before["cancelled"] + 3)
    after = _counts(server)
    assert after["in_flight"] == 0 and after["length"] == before["length"], (before, after)
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_declared_body_over_the_limit_is_413_unread(server):
    """A Content-Length over the limit is answered at once: the body is never sent here, so a
    server that waited for it would not answer at all."""
    sock = _raw_request(server, "/v1/completions", b"",
                        {"Content-Length": str(100 * 1024 * 1024)})
    try:
        status, body = _read_response(sock)
    finally:
        sock.close()
    assert status == 413 and body["error"]["code"] == "request_too_large", body


def _guard_run(guard_kw: dict, chunks: list[bytes], headers=()) -> tuple[list, list]:
    """Run a RequestGuard around a recording app on one request whose body comes in ``chunks``
    (no Content-Length, as with chunked encoding), then a disconnect. Returns (what the app
    received, what was sent to the client)."""
    got, sent = [], []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            got.append(message)
            if message["type"] == "http.disconnect":
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)] + [{"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "method": "POST",
             "headers": list(headers)}
    asyncio.run(RequestGuard(app, **guard_kw)(scope, receive, send))
    return got, sent


def test_guard_counts_a_body_without_length():
    chunks = [b"x" * 400, b"y" * 400, b"z" * 400]
    got, sent = _guard_run({"api_key": None, "max_request_bytes": 1000}, chunks)
    assert got == [] and sent[0]["status"] == 413  # the app never saw it
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    # within the limit the app gets the whole body, then the client's own disconnect
    got, sent = _guard_run({"api_key": None, "max_request_bytes": 1200}, chunks)
    assert b"".join(m.get("body", b"") for m in got) == b"".join(chunks)
    assert got[-1] == {"type": "http.disconnect"} and sent[0]["status"] == 200
    # the key is checked before the size
    got, sent = _guard_run({"api_key": KEY, "max_request_bytes": 1000}, chunks)
    assert got == [] and sent[0]["status"] == 401


def test_a_huge_prompt_does_not_stall_other_clients(server):
    """A 4 MB prompt takes seconds to tokenize; /health, polled meanwhile, keeps answering
    quickly (tokenized on the event loop, every poll waited for the whole tokenization)."""
    done = threading.Event()
    polls = []  # (start, seconds)

    def poll():
        with httpx.Client(timeout=60) as c:
            while not done.is_set():
                t = time.perf_counter()
                assert c.get(server.url + "/health").status_code == 200
                polls.append((t, time.perf_counter() - t))
                time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _wait_for(lambda: len(polls) >= 3)
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": "tiny", "prompt": "The sea is wide " * (4_000_000 // 16)})
    t1 = time.perf_counter()
    done.set()
    poller.join(60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded"
    during = [s for t, s in polls if t0 <= t <= t1]
    assert len(during) >= 3, (len(during), t1 - t0)
    assert max(during) < (t1 - t0) / 3, (max(during), t1 - t0)


NAN = b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}'
INF = b'{"model": "tiny", "prompt": "Hi", "top_p": Infinity}'


@pytest.mark.parametrize("status, path, body, param", [
    (400, "chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    (400, "chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages.0.content.0.text"),
    (400, "chat", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                              "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type"),
    (400, "chat", {"messages": [{"role": "hacker", "content": "Hi"}]}, "messages.0.role"),
    (400, "chat", {"messages": USER, "max_tokens": True}, "max_tokens"),
    (400, "chat", {"messages": USER, "n": True}, "n"),
    (400, "chat", {"messages": USER, "temperature": "0.5"}, "temperature"),
    (400, "chat", {"messages": USER, "stop": ["a"] * 17}, "stop"),
    (400, "chat", {"messages": USER * (MAX_MESSAGES + 1)}, None),
    (400, "text", {"prompt": [True, 5]}, "prompt.0"),
    pytest.param(400, "chat", NAN, "temperature", id="nan-temperature"),
    pytest.param(400, "text", INF, "top_p", id="infinite-top_p"),
    (413, "chat", {"messages": [{"role": "user", "content": "a" * (MAX_OUTPUT_CHARS + 1)}]},
     "messages"),
    # fields the engine does not implement, set to change the answer: refused, not ignored
    (400, "chat", {"messages": USER, "logprobs": True, "top_logprobs": 3}, "logprobs"),
    (400, "chat", {"messages": USER, "logit_bias": {"42": 100}}, "logit_bias"),
    (400, "chat", {"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    (400, "chat", {"messages": USER, "tools": [{"type": "function",
                                                "function": {"name": "f"}}]}, "tools"),
    (400, "chat", {"messages": USER, "response_format": {"type": "json_object"}},
     "response_format"),
    (400, "text", {"prompt": "a", "echo": True}, "echo"),
    (400, "text", {"prompt": "a", "best_of": 2}, "best_of"),
    (400, "text", {"prompt": "a", "logprobs": 2}, "logprobs"),
    # a lone surrogate (JSON's "\ud800" escape): not text a tokenizer can take
    (400, "chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    (400, "chat", {"messages": [{"role": "user", "content": [{"type": "text",
                                                              "text": "a\udfff"}]}]},
     "messages.0.content.0.text"),
    (400, "text", {"prompt": ["ok", "\udc00"]}, "prompt"),
])
def test_bad_fields_get_an_openai_error(server, status, path, body, param):
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    if isinstance(body, dict):
        body = json.dumps({"model": "tiny", **body}).encode()
    r = httpx.post(url, content=body, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert err["param"] == param, err
    assert "Traceback" not in r.text


def test_unsupported_fields_at_their_neutral_values_are_served(server):
    """What OpenAI's clients send by default (logprobs false, empty tools, a text response
    format, zero penalties, a user name) changes nothing and is answered."""
    neutral = {"logprobs": False, "top_logprobs": 0, "logit_bias": {}, "tools": [],
               "tool_choice": "auto", "response_format": {"type": "text"},
               "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u", "store": False}
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny", "messages": USER, "max_tokens": 2, **neutral})
    assert r.status_code == 200, r.text[:500]
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "echo": False,
                         "best_of": 1, "suffix": None, "logprobs": None})
    assert r.status_code == 200, r.text[:500]


def test_extreme_sampling_values_are_served(server):
    """Valid but extreme values reach the engine and come back as answers; the engine lives."""
    for extra in ({"temperature": 1e-300}, {"temperature": 5e-324, "top_p": 5e-324},
                  {"top_k": 2 ** 62, "temperature": 2.0}, {"seed": 2 ** 70, "temperature": 1.0},
                  {"seed": -(2 ** 70), "temperature": 0.5}):
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                             "ignore_eos": True, **extra})
        assert r.status_code == 200, (extra, r.text[:500])
        assert r.json()["usage"]["completion_tokens"] == 2, (extra, r.json())
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_the_api_key_guards_everything_but_health(server):
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200, path
    assert httpx.get(server.url + "/health").status_code == 200
    # no key and a bad body: the key is the first thing checked
    r = httpx.post(server.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 401, r.text
    r = httpx.post(server.url + "/v1/completions", content=b"{not json",
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the body is not")
    r = httpx.post(server.url + "/v1/completions", content=b"[1, 2]",
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


# what a rank's failure carries: its traceback, with the paths of the machine it ran on
RANK_TRACEBACK = ('rank 1 (draft) failed:\nTraceback (most recent call last):\n'
                  '  File "/srv/secret/ssdlib/engine/draft.py", line 12, in run\n'
                  'RuntimeError: CUDA error: an illegal memory access was encountered')


class _FailingGenerator:
    """Stands in for a started Generator whose engine fails on its first request, as a rank
    that raises does: the session reports the rank's error through ``on_failure``."""

    cfg = SimpleNamespace(mode="ar", max_batch=2)
    max_context = 64
    prompts = PromptEncoder(None, vocab_size=90, max_context=64)  # token-id prompts only

    def encode(self, prompt, chat=False):
        return self.prompts.encode(prompt, chat)

    def open_session(self, on_event, on_output, on_failure):
        gen = self

        class Session:
            alive = True

            def submit(self, request):
                self.alive = False
                on_failure(RankFailure(RANK_TRACEBACK, rank=1))

            def cancel(self, index):
                pass

            def stop(self, timeout_s=60.0):
                pass

        gen.session = Session()
        return gen.session

    def close(self):
        pass


def test_engine_failure_details_stay_in_the_log():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("ssdlib.serve.app")
    log.addHandler(handler)
    server = LiveServer(_FailingGenerator())
    try:
        bodies = []
        for stream in (False, True):  # the first request fails the engine; then it is down
            r = httpx.post(server.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": [5, 6, 7], "stream": stream})
            assert r.status_code in (200, 503), r.text
            bodies.append(r.text)
        h = httpx.get(server.url + "/health")
        assert h.status_code == 503
        bodies.append(h.text)
        for text in bodies:
            assert "engine failed" in text, text
            assert "Traceback" not in text and "/srv/secret" not in text, text
        _wait_for(lambda: any("/srv/secret" in r.getMessage() for r in records))
    finally:
        log.removeHandler(handler)
        server.close()


def _raise(*args, **kwargs):
    raise RuntimeError("a bug at /srv/secret/ssdlib/prompts.py")


def test_an_unexpected_error_preparing_a_request_is_its_400():
    """An encoder that raises something other than an SSDError (a bug, say): that request gets
    a 400 naming only the error's type; the engine never sees it and serves on."""
    gen = _FailingGenerator()
    gen.prompts = SimpleNamespace(tokenizer=None, encode=_raise, fits=lambda ids: True)
    server = LiveServer(gen)
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": [5, 6, 7]})
        assert r.status_code == 400, r.text
        assert "RuntimeError" in r.text and "/srv/secret" not in r.text, r.text
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    finally:
        server.close()
