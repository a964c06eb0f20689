"""Random and extreme sampling parameters through the HTTP server in every mode (ar, sd, ssd):
each request gets an answer or one OpenAI 400 error, never a crash; afterwards /health is 200 and
a normal request is served. (The same values through the Generator, the CLI and the batch tool:
tests/speculative/test_sampling_extremes.py.)"""

import random

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from tests.serve.live_server import LiveServer, _engine, models  # noqa: E402,F401 (fixture)

VALUES = {"temperature": [0, 5e-324, 1e-300, 1e-39, 1e-6, 0.7, 2.0, 1e30, -1e-300],
          "top_p": [5e-324, 1e-300, 1e-39, 0.5, 1.0, 0.0, 1.5],
          "top_k": [0, 1, 2 ** 62, -1],
          "seed": [None, 0, -(2 ** 70), 2 ** 70]}
BAD_JSON = [b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}',
            b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "top_p": Infinity}',
            b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": -Infinity}']


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_random_extreme_sampling_never_hurts_the_server(models, mode):  # noqa: F811
    rng = random.Random(mode)
    server = LiveServer(_engine(models, mode, max_batch=2), max_queue=8)
    try:
        for i in range(14):
            body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "ignore_eos": True}
            for name, values in VALUES.items():
                value = rng.choice(values)
                if value is not None:
                    body[name] = value
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code in (200, 400), (body, r.status_code, r.text[:300])
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 3, (body, r.json())
            else:
                assert r.json()["error"]["type"] == "invalid_request_error", r.text
        for raw in BAD_JSON:
            r = httpx.post(server.url + "/v1/completions", content=raw, timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
        assert httpx.get(server.url + "/health").status_code == 200
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 2,
                             "temperature": 0.7, "seed": 1, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        server.close()
