"""A live OpenAI-compatible server for the tests of tests/serve: the tiny chat models it serves
(the ``models`` fixture, imported by the test files that use it), the app on a uvicorn thread
(:class:`LiveServer`), and waiting for a server process to come up."""

import os
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prom_parser = pytest.importorskip("prometheus_client.parser")

from ssdlib import Generator  # noqa: E402
from tests.tiny import make_noisy_draft, make_tiny_llama  # noqa: E402
from tests.tiny_chat import write_char_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "sk-test"
MAX_LEN = 2048  # room for requests that outlive a client (a cancelled one never ends on its own)
LONG = 2000
PROMPT = "The sea"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """create_app(generator) served by uvicorn on a thread, on a real socket."""

    def __init__(self, gen, **kw):
        import uvicorn

        from ssdlib.serve.app import create_app

        self.gen = gen
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(gen, "tiny", **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def client(self, key=KEY) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict:
        # /metrics needs the key on a server that has one (harmless on one that has none)
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        out = {}
        for fam in prom_parser.text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + "".join(f"[{v}]" for v in s.labels.values())
                out[key] = s.value
        return out

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.gen.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    # tests.tiny_chat's model with a longer context
    target = make_tiny_llama(str(root / "target"), "smol_heads", scale=2.0, vocab_size=90,
                             max_position_embeddings=MAX_LEN)
    write_char_tokenizer(target)
    return target, make_noisy_draft(target, str(root / "draft"), 0.03)


def _engine(models, mode, **kw):
    draft = None if mode == "ar" else models[1]
    return Generator(target=models[0], draft=draft, mode=mode, max_len=MAX_LEN, k=3, **kw)


def _wait_for(fn, timeout_s=20.0):
    deadline = time.time() + timeout_s
    while not fn():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _wait_healthy(proc, url: str, timeout_s: float = 90) -> None:
    """Wait until a server subprocess answers /health with 200 (fails if it exits first)."""
    def up():
        assert proc.poll() is None, proc.communicate()
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    _wait_for(up, timeout_s)
