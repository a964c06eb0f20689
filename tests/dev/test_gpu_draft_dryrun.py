"""dev/gpu_draft.sh dry run on CPU with a tiny chat target: STEP=data (two shards, merged) and
STEP=train (two tiny candidates, their evaluation, the probe failing without CUDA, the report
and the packed tars) run end to end and leave their results in $OUT."""

import gzip
import json
import os
import subprocess
import tarfile

import pytest

from tests.tiny_chat import make_tiny_chat_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = '''def {name}(items, limit):
    """Return the items that are smaller than the limit, in their order.

    Items equal to the limit are left out as well.
    """
    return [x for x in items if x < limit]
'''


def run_step(step, env):
    r = subprocess.run(["bash", "dev/gpu_draft.sh"], cwd=REPO, env={**env, "STEP": step},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_gpu_draft_dry_run(tmp_path):
    target = make_tiny_chat_model(str(tmp_path / "target"))
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"mod{i}.py").write_text(DOC.format(name=f"smaller{i}") * 3)
    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        for i in range(2):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    '''add one'''\n"}) + "\n")
    env = {**os.environ, "PYTHONPATH": REPO, "WORK": str(tmp_path / "work"), "TARGET": target,
           "NGPU": "2", "SI_SAMPLES": "12", "DOC_SAMPLES": "6", "MT_SAMPLES": "16", "PYSRC_TOKENS": "3000",
           "EVAL_SAMPLES": "4", "GEN_BATCH": "8", "DATA_BUDGET": "120",
           "DATA_EXTRA": f"--text-root {texts} --user-max-tokens 40 --answer-max-tokens 24 "
                         "--device cpu",
           "PER_GPU": "1", "STEPS": "4",
           "CANDIDATES": "t1|--hidden 16 --layers 1 --heads 2 --kv-heads 1 --ffn 32 --lr 1e-2\n"
                         "t2|--hidden 32 --layers 2 --heads 2 --kv-heads 1 --ffn 32 --lr 1e-2",
           "TRAIN_COMMON": "--storage-dtype float16 --batch 4 --seq-len 32 --eval-every 4 "
                           "--save-every 4 --eval-batch 8 --device cpu",
           "BASELINE": "", "EVAL_DEVICE": "cpu", "HUMANEVAL": str(he), "EVAL_PROMPTS": "2",
           "EVAL_MAX_NEW": "8", "SAME_AS": target, "PROBE_TIMEOUT": "60"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out1 = tmp_path / "out1"
    run_step("data", {**env, "OUT": str(out1)})
    assert sorted(os.listdir(out1)) == ["data.json", "data.safetensors", "log"]
    data = json.loads((out1 / "data.json").read_text())
    assert set(data["train_by_source"]) == {"selfinstruct", "multiturn", "docinstruct", "pysrc"}
    assert len(data["shards"]) == 2

    # a second data call appends new answers (another seed; no texts, which would repeat)
    out1b = tmp_path / "out1b"
    run_step("data", {**env, "OUT": str(out1b), "DATA_APPEND": "1", "PYSRC_TOKENS": "0",
                      "DOC_SAMPLES": "0",
                      "DATA_EXTRA": env["DATA_EXTRA"] + " --seed 1"})
    more = json.loads((out1b / "data.json").read_text())
    assert len(more["inputs"]) == 3 and more["inputs"][0].endswith("data_prev.safetensors")
    assert more["train_docs"] > data["train_docs"]
    assert more["train_by_source"]["pysrc"] == data["train_by_source"]["pysrc"]
    assert more["train_by_source"]["selfinstruct"] > data["train_by_source"]["selfinstruct"]

    # train on the first call's data only, given as a carried gzip (DATA_PARTS), not on the
    # appended data the work dir holds now
    part = tmp_path / "first.safetensors.gz"
    with open(out1 / "data.safetensors", "rb") as f, gzip.open(part, "wb") as g:
        g.write(f.read())
    out2 = tmp_path / "out2"
    log = run_step("train", {**env, "OUT": str(out2), "DATA_PARTS": str(part)})
    assert f"in {data['train_docs']} documents" in log
    assert f"in {more['train_docs']} documents" not in log
    assert sorted(os.listdir(out2)) == ["cand_t1.tar", "cand_t2.tar", "draft_candidates.json",
                                        "log"]
    res = json.loads((out2 / "draft_candidates.json").read_text())["candidates"]
    assert set(res) == {"t1", "t2"}
    for r in res.values():
        assert [(e["set"], e["temperature"]) for e in r["rows"]] == [
            ("chat", 0.0), ("chat", 0.7), ("humaneval", 0.0), ("humaneval", 0.7)]
        assert r["train_rc"] == 0 and r["train"]["step"] == 4
    with tarfile.open(out2 / "cand_t1.tar") as tar:
        assert sorted(tar.getnames()) == ["MODEL_CARD.md", "config.json", "distill.json",
                                          "model.safetensors", "tokenizer_source.json"]
    for name in ("t1", "t2"):  # ready for gpu_quick.sh's cands presets on the machine
        assert os.path.exists(tmp_path / "work" / "packed" / name / "tokenizer_source.json")
    # TARS_TO_OUT=0: the candidates stay on the machine; the results come back
    out3 = tmp_path / "out3"
    run_step("eval", {**env, "OUT": str(out3), "TARS_TO_OUT": "0"})
    assert sorted(os.listdir(out3)) == ["draft_candidates.json", "log"]
    assert os.path.exists(tmp_path / "work" / "cand_t1.tar")
    log = (out2 / "log").read_text()
    assert "| t1 |" in log and "STEP=train finished (rc 0)" in log

    # TRAIN_ONLY=1: training alone (a later call's STEP=eval evaluates): the candidates are
    # exported, nothing is evaluated, packed or reported
    out5 = tmp_path / "out5"
    log = run_step("train", {**env, "OUT": str(out5), "DATA_PARTS": str(part), "NGPU": "1",
                             "TRAIN_ONLY": "1", "TARS_TO_OUT": "1"})
    assert "t1 finished: rc 0" in log and "t2 finished: rc 0" in log and "eval:" not in log
    assert sorted(os.listdir(out5)) == ["log"]
    for name in ("t1", "t2"):
        assert os.path.exists(tmp_path / "work" / f"cand_{name}" / "config.json")
