"""Start-up apart from the run: the capture plan, the warm-up, compile auto, the compile cache.

On CPU the GPU's captured-step code path (``SSDLIB_STEP_GRAPHS``) registers every step in an
EagerPool, so what a run would capture is counted by wrapping ``GraphPool.capture``.
"""

import json
import os

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.engine.runner import compile_cache
from ssdlib.engine.runner.compiled import COMPILE_MIN_STEPS, compile_setting, resolve_compile
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError
from ssdlib.generator import is_phase_key
from ssdlib.ops import graph_pool

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture
def captured(monkeypatch):
    """Every step key registered in any graph pool of this process, in order."""
    keys = []
    register = graph_pool.GraphPool.capture

    def capture(self, key, fn):
        keys.append(key)
        return register(self, key, fn)

    monkeypatch.setattr(graph_pool.GraphPool, "capture", capture)
    return keys


def test_capture_count_counts_registrations():
    before = graph_pool.capture_count()
    pool = graph_pool.EagerPool()
    pool.capture(("a", 1), lambda: None)
    pool.capture(("a", 2), lambda: None)
    with pytest.raises(ValueError):  # a key registered twice is refused, and not counted
        pool.capture(("a", 1), lambda: None)
    assert graph_pool.capture_count() - before == 2


@pytest.mark.parametrize("prompts,max_batch,buckets", [(1, 8, {1}), (3, 8, {1, 2, 4}),
                                                       (12, 4, {1, 2, 4})])
def test_cli_captures_the_buckets_of_its_prompts_only(tiny_dirs, tmp_path, monkeypatch, captured,
                                                      prompts, max_batch, buckets):
    """The CLI with N prompts and --max-batch M captures the batch buckets up to min(N, M) (on
    the all-buckets policy of CUDA), all before the timed run."""
    from ssdlib.generate import main

    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    metrics, lines = tmp_path / "m.json", tmp_path / "prompts.jsonl"
    # token ids (the tiny checkpoints have no tokenizer), lengths 3-6
    lines.write_text("".join(json.dumps({"prompt_ids": list(range(1 + i % 3, 5 + i % 4))}) + "\n"
                             for i in range(prompts)))
    args = ["--target", tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
            "--mode", "sd", "--k", "3", "--device", "cpu", "--max-len", "96",
            "--max-batch", str(max_batch), "--max-new-tokens", "8", "--no-stream",
            "--prompts-file", str(lines), "--metrics-json", str(metrics)]
    assert main(args) == 0
    assert {key[1] for key in captured} == buckets  # every step key has its bucket second
    run = json.loads(metrics.read_text())["run"]
    if prompts <= max_batch:  # the warm-up ran them all (later admissions may bring new shapes)
        assert run["captured_in_run"] == 0
    assert run["ready_s"] >= run["load_s"] > 0 and run["decode_tok_s"] > 0


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_generate_after_warm_up_captures_nothing(tiny_dirs, monkeypatch, captured, mode):
    """CUDA's capture policy (every bucket at a step's first use, eager-all on CPU): a run of
    the prompts the warm-up was given captures nothing, though its batch shrinks (SD / SSD
    rows finish in different rounds)."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    # (the speculator in this process, where the counter sees its captures)
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode=mode, k=3, max_batch=3, max_len=96, start=False,
                   speculator_placement="stream") as g:
        g.start(PROMPTS, GREEDY)
        warm = len(captured)
        assert warm > 0 and g.warm_up_s > 0
        outs = g.generate(PROMPTS, GREEDY)
        assert captured[warm:] == [] and g.last_run_metrics["captured_in_run"] == 0
        assert all(len(o.token_ids) == 24 for o in outs)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_adaptive_k_after_warm_up_captures_nothing(tiny_dirs, monkeypatch, captured, mode):
    """Adaptive K picks any K in 0 .. k per round (a random draft: rounds at K = 0, probes,
    the draft's catch-up after them): the warm-up's sweep has run every shape it can pick."""
    from tests.tiny import make_tiny_llama

    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    draft = make_tiny_llama(str(tiny_dirs["smol_heads"]) + "-random-draft", "smol_heads", seed=5)
    with Generator(target=tiny_dirs["smol_heads"], draft=draft, mode=mode, k=3, max_batch=3,
                   max_len=96, start=False, speculator_placement="stream") as g:
        g.start(PROMPTS, GREEDY)
        warm = len(captured)
        outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=48, ignore_eos=True))
        assert captured[warm:] == [] and g.last_run_metrics["captured_in_run"] == 0
    assert sum(o.metrics["k0_rounds"] for o in outs) > 0 or mode == "ssd"


def test_without_warm_up_the_run_captures(tiny_dirs, monkeypatch, captured):
    """The counter the tests above read sees captures inside a run when there was no warm-up."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")
    with Generator(target=tiny_dirs["smol_heads"], max_batch=3, max_len=96, start=False) as g:
        g.start(warm=False)
        assert captured == [] and g.ready_s == g.load_s
        g.generate(PROMPTS, GREEDY)
        assert g.last_run_metrics["captured_in_run"] == len(captured) > 0


def test_metrics_carry_ready_s_apart_from_decode(tiny_dirs, monkeypatch):
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")
    with Generator(target=tiny_dirs["smol_heads"], max_batch=3, max_len=96) as g:
        g.generate(PROMPTS, GREEDY)
        m = g.last_run_metrics
    assert m["ready_s"] == pytest.approx(m["load_s"] + m["warm_up_s"])
    assert m["warm_up_s"] > 0 and m["decode_tok_s"] > 0
    # decode_tok_s is the call's own: its decode tokens over its wall time after the first token
    assert m["decode_tok_s"] == pytest.approx((m["tokens"] - 3) / (m["wall_s"] - m["ttft_s"]))
    assert not any(is_phase_key(k) for k in ("ready_s", "load_s", "warm_up_s"))


def test_cpu_without_captured_steps_skips_the_warm_up(tiny_dirs, monkeypatch, captured):
    monkeypatch.delenv("SSDLIB_STEP_GRAPHS", raising=False)
    with Generator(target=tiny_dirs["smol_heads"], max_batch=2, max_len=96) as g:
        assert g.warm_up_s == 0.0 and g.ready_s == g.load_s and captured == []


def test_compile_setting_and_auto_rule():
    assert [compile_setting(v) for v in ("auto", "on", "off", "ON", None, True, False)] == \
        [None, True, False, True, None, True, False]
    with pytest.raises(ValueError):
        compile_setting("maybe")
    assert EngineConfig(compile="off").compile is False and EngineConfig(compile="auto").compile \
        is None and EngineConfig(compile=True).compile is True
    with pytest.raises(ConfigError, match="--compile"):
        EngineConfig(compile="yes")
    # given settings stay; an unknown workload (a server) keeps auto, i.e. compile where it can
    assert resolve_compile(True, 1, 16) is True and resolve_compile(False, 10**6, 10**6) is False
    assert resolve_compile(None) is None
    # one prompt of 128 tokens: 128 steps, no compile; the threshold counts sequential steps
    assert resolve_compile(None, 1, 128, 8) is False
    assert resolve_compile(None, 1000, 256, 8) is None  # 125 batches * 256 = 32,000 steps
    n = COMPILE_MIN_STEPS // 100
    assert resolve_compile(None, n, 100, 1) is None and resolve_compile(None, n - 1, 100, 1) \
        is False
    assert resolve_compile(None, 8 * n, 100, 8) is None  # 8 rows a step: the same steps
    assert resolve_compile(None, 8 * n - 8, 100, 8) is False


def test_cli_compile_flags():
    import argparse

    from ssdlib.cli_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert [p.parse_args(a).compile for a in ([], ["--compile"], ["--compile", "off"],
                                             ["--no-compile"], ["--compile=on"])] == \
        ["auto", "on", "off", "off", "on"]
    a = p.parse_args(["--cache-dir", "/x/y"])
    assert engine_kwargs(a)["cache_dir"] == "/x/y" and engine_kwargs(a)["compile"] == "auto"


def test_cache_dir_resolution(monkeypatch, tmp_path):
    for name in ("SSDLIB_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "ssdlib")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == str(tmp_path / "xdg" / "ssdlib")
    monkeypatch.setenv("SSDLIB_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == str(tmp_path / "mine")
    assert compile_cache.cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")


def test_compile_cache_env_is_set_unless_the_user_set_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SSDLIB_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/triton")
    chosen = compile_cache.use_compile_cache()
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c" / "inductor")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/triton"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert compile_cache.use_compile_cache(str(tmp_path / "flag")) == \
        {"TRITON_CACHE_DIR": str(tmp_path / "flag" / "triton")}  # inductor's is set by now


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_cuda_run_after_warm_up_neither_captures_nor_compiles(tiny_dirs, monkeypatch, tmp_path,
                                                               mode):
    from ssdlib.generator import _compile_count

    monkeypatch.delenv("SSDLIB_STEP_GRAPHS", raising=False)
    monkeypatch.setenv("SSDLIB_CACHE_DIR", str(tmp_path / "cache"))
    # prompts longer than EXACT_STEP_QUERIES take the prefill graphs, whatever their lengths
    prompts = [list(range(1, 13)), list(range(3, 20)), list(range(2, 40))]
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode=mode, k=3, device="cuda", dtype="float32", max_batch=4, max_len=256,
                   compile="on", start=False) as g:
        g.start(prompts, GREEDY)
        compiled = _compile_count()
        assert compiled > 0  # the warm-up compiled the steps
        g.generate([p[1:] for p in prompts], GREEDY)  # other lengths, same batch
        assert g.last_run_metrics["captured_in_run"] == 0 and _compile_count() == compiled


@pytest.mark.parametrize("k,budget", [(5, 16), (3, 8)])
def test_every_budget_arm_is_captured_for_both_chained_caches(tiny_dirs, monkeypatch, captured,
                                                              k, budget):
    """With two budget arms (K = 5 and 16 branches: 16 and 8; K = 3 and 8: 8 and 4) the tuner's
    probe builds each arm into both of chained rounds' caches during the warm-up, so the arm it
    holds afterwards captures nothing in the run (one build per arm paired each arm with one
    cache only)."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode="ssd", k=k, max_batch=3, max_len=96, start=False,
                   fan_out_budget=budget, speculator_placement="stream") as g:
        g.start(PROMPTS, GREEDY)
        warm = len(captured)
        chained = {c for c in captured[:warm] if c[0] == "tree_chain"}
        assert {(c[2], c[4]) for c in chained} >= {(p, n) for p in (0, 1)
                                                    for n in (budget, budget // 2)}
        g.generate(PROMPTS, GREEDY)
        assert captured[warm:] == []
