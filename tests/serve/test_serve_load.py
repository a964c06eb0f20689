"""The OpenAI-compatible server under load and on the real model:
16 concurrent clients with prompts and answers of different lengths (tiny chat model) each get
the answer Generator.generate gives for their prompt, with the right usage; SmolLM2 served by
``python -m ssdlib.serve`` (default target, mode sd with the shipped draft) answers a chat
completion from the official ``openai`` client with Generator.generate's greedy text."""

import subprocess
import sys
import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ssdlib import Generator, SamplingParams  # noqa: E402
from tests.serve.live_server import (MAX_LEN, ROOT, LiveServer,  # noqa: E402,F401
                                     _engine, _free_port, _wait_healthy, models)

FINISH = {"eos": "stop"}  # Output.finish_reason -> OpenAI's
CLIENTS = 16


def _request(i: int) -> dict:
    """Client i: chat or text, streamed or not, its own prompt length and max_tokens."""
    text = ("The sea is wide and deep, " * 8)[: 4 + 11 * i]
    return {"chat": i % 2 == 0, "stream": i % 4 in (1, 2), "ignore_eos": i % 3 == 0,
            "prompt": text, "max_tokens": 6 + 9 * ((5 * i) % CLIENTS)}


def _reference(target: str, reqs: list[dict]) -> list:
    prompts = [{"messages": [{"role": "user", "content": r["prompt"]}]} if r["chat"]
               else r["prompt"] for r in reqs]
    params = [SamplingParams(max_new_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"])
              for r in reqs]
    # one intra-op thread: on a busy 2-core machine the main thread's OpenMP team made this
    # tiny batch 100x slower (ms per linear); the answers do not depend on it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Generator(target=target, max_len=MAX_LEN, max_batch=CLIENTS) as g:
            return g.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)


def _call(client, r: dict) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of one request through the openai client."""
    extra = {"ignore_eos": r["ignore_eos"]}
    kw = dict(model="tiny", max_tokens=r["max_tokens"], temperature=0, extra_body=extra)
    if r["stream"]:
        kw.update(stream=True, stream_options={"include_usage": True})
    if r["chat"]:
        res = client.chat.completions.create(
            messages=[{"role": "user", "content": r["prompt"]}], **kw)
        if not r["stream"]:
            return res.choices[0].message.content, res.choices[0].finish_reason, res.usage
        chunks = list(res)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        res = client.completions.create(prompt=r["prompt"], **kw)
        if not r["stream"]:
            return res.choices[0].text, res.choices[0].finish_reason, res.usage
        chunks = list(res)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks
              if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1, finish  # one final chunk carries it
    return text, finish[0], chunks[-1].usage


def test_sixteen_concurrent_clients_of_different_lengths(models):  # noqa: F811 (fixture)
    reqs = [_request(i) for i in range(CLIENTS)]
    ref = _reference(models[0], reqs)
    # 4 slots and a queue of 12: all 16 are accepted, 12 wait and join as slots free up
    server = LiveServer(_engine(models, "ar", max_batch=4), max_queue=CLIENTS - 4)
    try:
        client = server.client()
        go = threading.Barrier(CLIENTS)
        results, errors = {}, {}

        def run(i):
            try:
                go.wait(30)
                results[i] = _call(client, reqs[i])
            except BaseException as e:  # reported below, with the client's index
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert sorted(results) == list(range(CLIENTS)), "a client got no answer"
        for i, (text, finish, usage) in enumerate(results[i] for i in range(CLIENTS)):
            want = ref[i]
            assert text == want.text, (i, reqs[i], text, want.text)
            assert finish == FINISH.get(want.finish_reason, want.finish_reason), (i, finish)
            assert usage.prompt_tokens == want.prompt_tokens, (i, usage)
            assert usage.completion_tokens == len(want.token_ids), (i, usage)
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            if reqs[i]["ignore_eos"]:
                assert usage.completion_tokens == reqs[i]["max_tokens"], (i, usage)
        assert len({r["max_tokens"] for r in reqs}) == CLIENTS
        assert len({u.prompt_tokens for _, _, u in results.values()}) == CLIENTS
        m = server.metrics()
        assert m["ssdlib_requests_running"] == 0 and m["ssdlib_requests_waiting"] == 0
        assert m.get("ssdlib_requests_rejected_total", 0) == 0
    finally:
        server.close()


SMOL_MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]
SMOL_TOKENS = 16


def test_smollm2_server_chat_equals_generate(smollm2_path):
    """``python -m ssdlib.serve --mode sd`` with the default target and its shipped draft; the
    reference (mode ar, in this process) is computed while the server loads."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ssdlib.serve", "--mode", "sd",
                             "--max-batch", "2", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the reference while the server loads: the default target, mode ar
        with Generator(max_batch=1) as g:
            want = g.generate([{"messages": SMOL_MESSAGES}],
                              SamplingParams(max_new_tokens=SMOL_TOKENS))[0]
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        [model] = [m.id for m in c.models.list().data]
        chat = c.chat.completions.create(model=model, messages=SMOL_MESSAGES,
                                         max_tokens=SMOL_TOKENS, temperature=0)
        assert chat.choices[0].message.content == want.text
        assert chat.choices[0].finish_reason == FINISH.get(want.finish_reason,
                                                           want.finish_reason)
        assert chat.usage.prompt_tokens == want.prompt_tokens
        assert chat.usage.completion_tokens == len(want.token_ids)
        assert want.text.strip()  # a real answer, not an empty one
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
