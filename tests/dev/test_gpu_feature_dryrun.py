"""dev/gpu_feature.sh dry run on CPU with a tiny chat target: the feature draft's training,
offline evaluation, engine evaluation and bench rows run end to end and leave their results in
$OUT (the script's commands and flags are the ones a GPU run takes, but --device)."""

import gzip
import json
import os
import subprocess
import tarfile

import pytest
import torch

from tests.tiny_chat import make_tiny_chat_model
from tools.distill.data import Docs, save_splits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def docs(n: int, length: int, vocab: int, seed: int) -> Docs:
    g = torch.Generator().manual_seed(seed)
    out = Docs()
    for _ in range(n):
        out.add(torch.randint(3, vocab, (length,), generator=g).tolist(), 0, "pysrc")
    return out


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_gpu_feature_dry_run(tmp_path):
    from ssdlib.loading import load_checkpoint

    target = make_tiny_chat_model(str(tmp_path / "target"))
    vocab = load_checkpoint(target).config.vocab_size
    data = tmp_path / "data.safetensors"
    save_splits(str(data), docs(24, 40, vocab, 0), docs(4, 40, vocab, 1))
    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        for i in range(2):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    '''add one'''\n"}) + "\n")
    fd, out = tmp_path / "fd", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": REPO, "DEVICE": "cpu", "TARGET": target,
           "DATA": str(data), "HUMANEVAL": str(he), "STEPS": "4", "TRAIN_TIMEOUT": "150",
           "TRAIN_FLAGS": "--layers 1 --batch 4 --seq-len 32 --lr 1e-2 --ttt-steps 2",
           "FD": str(fd), "OUT": str(out), "N_CHAT": "2", "MAX_NEW": "8", "POSITIONS": "6",
           "MODES": f"ar,sd:draft={fd}"}
    r = subprocess.run(["bash", "dev/gpu_feature.sh"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    log = (out / "feature.log").read_text() if (out / "feature.log").exists() else ""
    assert r.returncode == 0, log + r.stdout[-3000:] + r.stderr[-3000:]
    assert (fd / "model.safetensors").exists()
    with tarfile.open(out / "feature_draft.tar") as t:
        assert "./model.safetensors" in t.getnames()
    assert "self-conditioned" in log  # the offline table, both views
    assert "| chat | 0 |" in log  # the engine's acceptance table
    bench = json.loads((out / "bench_feature.json").read_text())
    assert [row["mode"] for row in bench["rows"]][:2] == ["ar", f"sd:draft={fd}"]


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_gpu_feature_training_over_two_calls(tmp_path):
    """A run stopped in its first call (here after 2 of 4 steps) goes on in the next with
    RESUME=1, to the end of its schedule."""
    from ssdlib.loading import load_checkpoint

    target = make_tiny_chat_model(str(tmp_path / "target"))
    vocab = load_checkpoint(target).config.vocab_size
    data = tmp_path / "data.safetensors"
    save_splits(str(data), docs(24, 40, vocab, 0), docs(4, 40, vocab, 1))
    fd, out = tmp_path / "fd", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": REPO, "DEVICE": "cpu", "TARGET": target,
           "DATA": str(data), "HUMANEVAL": "unused", "STEPS": "4", "TRAIN_TIMEOUT": "150",
           "TRAIN_FLAGS": "--layers 1 --batch 4 --seq-len 32 --ttt-steps 2 --stop-after-steps 2",
           "FD": str(fd), "OUT": str(out), "TRAIN_ONLY": "1"}
    for resume in ("0", "1"):
        r = subprocess.run(["bash", "dev/gpu_feature.sh"], cwd=REPO,
                           env={**env, "RESUME": resume}, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "feature.log").read_text()
    assert "stopped at step 2 of 4" in log and "resumed at step 2 of 4" in log, log
    report = json.loads((fd / "feature_distill.json").read_text())
    assert report["history"][-1]["step"] == 4 and len(report["commands"]) == 2
