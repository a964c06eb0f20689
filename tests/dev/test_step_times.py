"""dev/step_times.py: every hot-path step timed (on CPU here: the GPU's graph column stays
empty), and a clear refusal when CUDA is asked for and missing."""

import json

import pytest
import torch

from dev.hot_path_steps import hot_path_steps, torch_attention_backend
from dev.step_times import main


def test_every_step_timed_on_cpu(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "times.json"
    assert main(["--target", tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
                 "--fan-out-budget", "6", "--device", "cpu", "--dtype", "float32",
                 "--iters", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    names = list(res["steps"])
    assert names[0] == "target verify forward" and len(names) == 17
    for name, r in res["steps"].items():
        assert r["eager_ms"] > 0 and r["graph_ms"] is None
        if name.startswith("speculator round"):
            assert r["details"]["build"] > 0 and f"# {name}: commit" in printed
        assert f"| {name} | {r['eager_ms']:.3f} |" in printed


def test_steps_compute_what_the_engine_computes(tiny_dirs):
    """The acceptance step reads the verify forward's logits; the build fills the cache."""
    with torch_attention_backend(), torch.inference_mode():
        steps, meta = hot_path_steps(tiny_dirs["smol_heads"], tiny_dirs["smol_heads_draft"],
                                     1, 3, 6)
        logits = steps["target verify forward"].fn()
        assert logits.shape == (1, 4, meta["vocab"])
        accepted = steps["acceptance, greedy"].fn()
        assert accepted is not None
        builds = [s for n, s in steps.items() if n.startswith("speculator build")]
        assert all(not s.capturable for s in builds)  # they replay the engine's own graphs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_cuda_without_cuda(capsys):
    assert main(["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_speculator_rounds_drive_hits_and_misses(tiny_dirs, temperature):
    """The in-process driver's OUTCOMEs reach the speculator as the leader's would: hits it
    counts (and continues the branch of), misses it drafts just in time; rows are admitted
    afresh before they outgrow max_len."""
    from ssdlib.loading import load_checkpoint
    from ssdlib.sampling import SamplingParams
    from dev.speculator_rounds import SpeculatorRounds

    target = load_checkpoint(tiny_dirs["smol_heads"])
    draft = load_checkpoint(tiny_dirs["smol_heads_draft"])
    r = SpeculatorRounds(draft, target.config.vocab_size, "cpu", torch.float32, 2, 3, 6,
                         SamplingParams(temperature=temperature), p_hit=0.6, max_len=64,
                         prompt_len=8)
    for _ in range(30):
        r.round()
    spec = r.spec
    assert 0 < r.hits < r.rounds
    assert spec.hits == r.hits and spec.lookups == r.rounds  # every round's rows were built
    assert spec.reused > 0  # hit rows continued their branch's KV
    assert all(len(row.tokens) < 64 for row in spec.rows.values())
    if temperature > 0:
        assert r.link.spec.q is not None  # a sampled exchange answers with q
    phases = r.phases_ms()  # the speculator's own round timer ran
    assert set(phases) == {"commit", "fallback", "send", "build", "push"}
    assert phases["build"] > 0


def test_the_feature_drafts_proposal_reads_the_kept_features(tiny_dirs, tmp_path):
    """With a feature draft the verify keeps its kind of features and SD's proposal with it is
    a step: after the verify forward, the proposal drafts K tokens of the vocabulary."""
    from tests.engine.test_feature_draft_sd import _feature_draft

    fd = _feature_draft(tiny_dirs["smol_heads"], tmp_path / "fd")
    with torch_attention_backend(), torch.inference_mode():
        steps, meta = hot_path_steps(tiny_dirs["smol_heads"], tiny_dirs["smol_heads_draft"],
                                     1, 3, 6, feature_draft=fd)
        kept = [n for n in steps if n.startswith("target verify forward, ")]
        assert kept == ["target verify forward, last_prenorm features kept"]
        steps[kept[0]].fn()
        steps["SD draft proposal, engine path (3 tokens)"].fn()  # sets the rows up
        tokens = steps["SD feature draft proposal, engine path (3 tokens)"].fn()
        assert tokens.shape == (1, 3) and int(tokens.max()) < meta["vocab"]
        # the speculator's: a commit, the build's two parts, and the build they make up
        steps["speculator feature commit (4 positions)"].fn()
        steps["speculator feature build: chain (3 positions, one forward)"].fn()
        cache_tokens = steps["speculator feature build: tree (3 depths, 6 rows)"].fn()
        parts = cache_tokens[:1].clone()
        cache_tokens.zero_()
        steps["speculator feature build, greedy, engine path"].fn()
        assert parts.shape == (1, 6, 3) and torch.equal(cache_tokens[:1], parts)
