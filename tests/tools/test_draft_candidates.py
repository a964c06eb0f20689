"""tools/distill/candidates.py: the SD speedup prediction, the report table, the probe-line
parser and the packed candidate tar (the shipped draft asset's layout)."""

import json
import os
import tarfile

import pytest

from tests.tiny_chat import make_tiny_chat_model
from tools.distill import candidates as C


def test_expected_tokens_and_speedup():
    assert C.expected_tokens(0.0, 5) == 1.0
    assert C.expected_tokens(1.0, 5) == 6.0
    assert C.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # a = 0.5, K = 2, c = 0.1: 1.75 tokens for 1.2 target steps
    assert C.speedup(0.5, 0.1, 2) == pytest.approx(1.75 / 1.2)
    k, s = C.best_k(0.5, 0.1)
    assert s == max(C.speedup(0.5, 0.1, kk) for kk in range(1, 9)) and k == 2
    assert C.best_k(0.0, 0.1) == (1, pytest.approx(1 / 1.1))  # a useless draft: smallest K
    assert C.best_k(0.95, 0.01)[0] == 8  # a cheap, good draft: the largest K
    # cheaper drafts never predict less
    assert C.best_k(0.6, 0.05)[1] > C.best_k(0.6, 0.2)[1]


def test_parse_bench_line_and_shape():
    line = ("draft d128 L6                b=1 s=1: eager   1.234 ms  graph   0.210 ms  "
            "weights   0.01 GB  bw-floor  0.003 ms")
    assert C.parse_bench_line(line) == {"eager_ms": 1.234, "graph_ms": 0.21}
    with pytest.raises(ValueError):
        C.parse_bench_line("nothing")
    cfg = {"num_hidden_layers": 6, "hidden_size": 128, "intermediate_size": 512,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "vocab_size": 49152}
    assert C.shape_of(cfg) == C.CURRENT_DRAFT_SHAPE


def test_report_and_table(tmp_path):
    d = tmp_path / "s1"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 1, "hidden_size": 576, "intermediate_size": 1536,
         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "vocab_size": 49152}))
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    evals = tmp_path / "evals"
    evals.mkdir()
    rows = [{"set": "chat", "temperature": 0.0, "a_p": 0.7, "mean_accepted": 2.5},
            {"set": "humaneval", "temperature": 0.7, "a_p": 0.5, "mean_accepted": 1.5}]
    (evals / "s1.json").write_text(json.dumps(rows))
    probe = {"target": {"graph_ms": 2.0}, "s1": {"graph_ms": 0.2, "eager_ms": 0.5}}
    res = C.build_report({"s1": str(d), "gone": str(tmp_path / "missing")}, str(evals), probe)
    s1 = res["s1"]
    assert s1["c"] == pytest.approx(0.1) and s1["shape"] == [1, 576, 1536, 9, 3, 64, 49152]
    k, s = C.best_k(0.7, 0.1)
    assert s1["rows"][0]["best_k"] == k and s1["rows"][0]["speedup"] == pytest.approx(s)
    assert "error" in res["gone"] and res["gone"]["rows"] == []
    text = C.table(res)
    lines = text.splitlines()
    assert lines[0].startswith("| candidate | MB | step ms | c | chat T=0: a_p / speedup (K)")
    assert f"0.700 / {s:.2f} ({k})" in lines[2] and lines[2].startswith("| s1 | 0.00 | 0.200 |")
    assert lines[3].startswith("| gone | - | - | - | - | -")


def test_pack_matches_the_asset_layout(tmp_path):
    target = make_tiny_chat_model(str(tmp_path / "target"))
    draft = make_tiny_chat_model(str(tmp_path / "draft"), seed=1)  # has the tokenizer files
    (tmp_path / "draft" / "distill.json").write_text("{}")
    (tmp_path / "draft" / "last.pt").write_bytes(b"state")
    out = str(tmp_path / "cand_x.tar")
    info = C.pack(draft, out, same_as="tiny-target", target=target)
    with tarfile.open(out) as tar:
        names = sorted(tar.getnames())
        ref = json.load(tar.extractfile("tokenizer_source.json"))
    assert names == sorted(["config.json", "model.safetensors", "distill.json",
                            "tokenizer_source.json"]) == info["files"]
    from ssdlib.loading import load_checkpoint
    assert ref == {"same_as": "tiny-target",
                   "fingerprint": load_checkpoint(target).tokenizer.fingerprint()}
    with pytest.raises(ValueError):
        C.pack(draft, str(tmp_path / "big.tar"), target=target, max_bytes=1000)
    assert not os.path.exists(tmp_path / "big.tar")


def test_cli_errors_are_one_line(tmp_path, capsys):
    """A missing floor probe and a candidate over the size limit end the command with one
    message naming the problem, not a traceback."""
    with pytest.raises(SystemExit) as e:
        C.main(["probe", "--probe", str(tmp_path / "nope.py"), "--out", str(tmp_path / "p.json")])
    assert "nope.py: no such file" in str(e.value.code)
    target = make_tiny_chat_model(str(tmp_path / "target"))
    draft = make_tiny_chat_model(str(tmp_path / "draft"), seed=1)
    big = "x" * (17 * 2**20)
    (tmp_path / "draft" / "distill.json").write_text(json.dumps({"pad": big}))
    with pytest.raises(SystemExit) as e:
        C.main(["pack", "--dir", draft, "--out", str(tmp_path / "c.tar"), "--target", target,
                "--same-as", "tiny-target"])
    assert str(e.value.code).startswith("not packed: ") and "MiB > 16.00 MiB" in str(e.value.code)
    assert not os.path.exists(tmp_path / "c.tar")
