"""The GPU's captured-step code path, run end to end on CPU (``SSDLIB_STEP_GRAPHS=eager``):
StepGraphs' static arena, batch buckets and ghost rows, the draft's greedy and sampled chains,
the speculator's captured build steps, each step run eagerly and once more at its registration
(as a graph pool's warm-up). Outputs stay exact: greedy SD / SSD equal AR token for token and
sampled SD / SSD keep the target's distribution. TP 2 on this path:
``tests/distributed/test_tp.py::test_tp2_on_the_captured_step_path_equals_tp1``."""

import pytest
import torch

from ssdlib import Generator
from tests.engine.test_speculative_exact import (GREEDY, PROMPTS, ar_reference,  # noqa: F401
                                                 check_equal, exact_joint, sample_pairs,
                                                 small_vocab)
from tests.speculative.spec_stats import chi2_test


@pytest.fixture(autouse=True)
def step_graphs(monkeypatch):
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")


def test_cpu_runner_takes_the_step_graph_path(tiny_dirs, monkeypatch):
    from ssdlib.engine.runner.model_runner import ModelRunner
    from ssdlib.errors import ConfigError
    from ssdlib.loading import load_checkpoint
    from ssdlib.ops.graph_pool import EagerPool

    ck = load_checkpoint(tiny_dirs["smol_heads"])
    r = ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64)
    assert isinstance(r.graphs.pool, EagerPool) and r.graphs.pool.warmup == 1
    assert r.prefill_graphs is None and not r.graphs.all_buckets
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    assert ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64).graphs.all_buckets
    monkeypatch.delenv("SSDLIB_STEP_GRAPHS")
    assert ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64).graphs is None
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "yes")
    with pytest.raises(ConfigError, match="SSDLIB_STEP_GRAPHS"):
        ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64)


@pytest.mark.parametrize("mode,fallback,batch,path", [
    ("sd", "jit", 3, "eager"), ("ssd", "jit", 3, "eager"), ("ssd", "ngram", 1, "eager"),
    # the compiled steps' capture policy: every bucket at once, long indexed forwards padded
    ("sd", "jit", 3, "eager-all"), ("ssd", "jit", 3, "eager-all")])
def test_greedy_equals_ar(tiny_dirs, ar_reference, monkeypatch, mode, fallback, batch,
                          path):  # noqa: F811
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", path)
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode=mode, k=4, max_batch=batch, max_len=128, fallback=fallback) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampling_distribution(small_vocab, mode):  # noqa: F811
    t, d = small_vocab
    with Generator(target=t, draft=d, mode=mode, k=3, max_batch=400, max_len=32,
                   fallback="jit", saguaro_c=0.5, fan_out="2,1,1,2") as g:
        counts = sample_pairs(g, 0.8, 0.9, seed=2)
    assert chi2_test(counts, exact_joint(t, 0.8, 0.9)) > 1e-3


def test_padded_prompts_keep_greedy_sd_and_ssd_equal_to_ar(tiny_dirs, monkeypatch):
    """Prompts of 9-15 tokens take the compiled policy's padded forwards (target prefill, the
    draft's prefill and catch-up); greedy SD and SSD still equal AR (run on the plain path)."""
    prompts = [list(range(3, 3 + n)) for n in (9, 11, 15, 10)]
    monkeypatch.delenv("SSDLIB_STEP_GRAPHS")
    with Generator(target=tiny_dirs["smol_heads"], max_batch=3, max_len=128) as g:
        want = [o.token_ids for o in g.generate(prompts, GREEDY)]
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    for mode in ("sd", "ssd"):
        with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                       mode=mode, k=4, max_batch=3, max_len=128, fallback="jit") as g:
            assert [o.token_ids for o in g.generate(prompts, GREEDY)] == want, mode
