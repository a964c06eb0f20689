"""tools/distill/confidence.py on a tiny chat target (CPU): the target as its own draft agrees
everywhere, a noisy copy less, and the buckets partition the answer positions."""

import gzip
import json

import pytest

from tests.tiny import make_noisy_draft
from tests.tiny_chat import make_tiny_chat_model
from tools.distill.confidence import BUCKETS, main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("conf")
    target = make_tiny_chat_model(str(root / "target"))
    noisy = make_noisy_draft(target, str(root / "noisy"), 0.5)
    he = root / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    '''add one'''\n"}) + "\n")
    return target, noisy, str(he), root


def test_agreement_by_target_confidence(setup, capsys):
    target, noisy, he, root = setup
    r = main(["--target", target, "--draft", target, "--draft", noisy, "--humaneval", he,
              "--n-prompts", "3", "--max-new-tokens", "12", "--json", str(root / "c.json")])
    assert set(r["sets"]) == {"chat", "humaneval"}
    for s in r["sets"].values():
        assert s["positions"] > 0
        same, other = s["drafts"][target], s["drafts"][noisy]
        assert same["agreement"] == 1.0 and same["acceptance"] == pytest.approx(1.0, abs=1e-5)
        assert other["agreement"] < 1.0 and other["acceptance"] < 0.999
        for d in (same, other):
            buckets = d["buckets"]
            assert len(buckets) == len(BUCKETS) - 1
            assert sum(b["positions"] for b in buckets) == s["positions"]
            assert sum(b["share"] for b in buckets) == pytest.approx(1.0)
            # the overall agreement is the position-weighted mean of the buckets'
            mean = sum(b["agreement"] * b["positions"] for b in buckets if b["positions"])
            assert mean / s["positions"] == pytest.approx(d["agreement"])
    assert json.load(open(root / "c.json"))["sets"]["chat"]["positions"] == r["sets"]["chat"][
        "positions"]
    assert "| target p_max |" in capsys.readouterr().out
