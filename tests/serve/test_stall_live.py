"""``python -m ssdlib.serve`` with a rank alive but stuck (SIGSTOP) under it: the request in
flight fails and the server exits non-zero, naming the stall, instead of hanging."""

import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from tests.serve.live_server import (MAX_LEN, PROMPT, ROOT, _free_port,  # noqa: E402,F401
                                     _wait_healthy, models)


def test_cli_exits_nonzero_when_a_rank_is_stuck(models):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssdlib.serve", "--target", models[0], "--draft", models[1],
         "--mode", "ssd", "--k", "3", "--max-len", str(MAX_LEN), "--port", str(port),
         "--speculator-placement", "rank", "--stall-timeout", "3"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = []
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = os.path.basename(models[0])
        assert c.completions.create(model=name, prompt=PROMPT, max_tokens=4,
                                    temperature=0).usage.completion_tokens >= 1
        ranks = [p for p in psutil.Process(proc.pid).children()
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        ranks[-1].send_signal(signal.SIGSTOP)  # alive, and stuck
        stopped.append(ranks[-1])
        errors = []

        def ask():
            try:
                c.completions.create(model=name, prompt=PROMPT, max_tokens=64, temperature=0,
                                     extra_body={"ignore_eos": True})
            except Exception as e:  # noqa: BLE001 - the failure this test expects
                errors.append(e)
        asking = threading.Thread(target=ask)
        asking.start()
        assert proc.wait(90) != 0
        asking.join(30)
        assert errors, "the request in flight did not fail"
        assert "stuck" in proc.communicate()[1]
    finally:
        for p in stopped:
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.Error:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
