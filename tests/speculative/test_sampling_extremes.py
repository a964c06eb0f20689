"""Extreme sampling parameters (0, subnormal, 1e-300, huge, NaN/inf) never produce a NaN, an
out-of-range token or a crash: each is either one clear ConfigError or a valid output, in every
mode (ar, sd, ssd; greedy and sampled rows in one batch) and through the Generator.

Below GREEDY_BELOW a temperature means greedy; top_p always keeps the most likely token."""

import math
import random

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.errors import ConfigError
from ssdlib.sampling import GREEDY_BELOW, SamplingTensors, target_distributions, target_probs
from ssdlib.engine.sampler import sample_tokens

TINY = 5e-324  # the smallest subnormal float64
EXTREME_TEMPERATURES = [0.0, TINY, 1e-300, 1e-39, 1e-8, GREEDY_BELOW * 0.999, GREEDY_BELOW,
                        1e-3, 0.7, 1.0, 2.0, 1e6, 1e30, 1e300, float("inf"), float("nan"), -1.0,
                        -TINY]
EXTREME_TOP_P = [TINY, 1e-300, 1e-39, 1e-8, 0.5, 1.0, 0.0, 1.0 + 1e-12, float("nan"), -1.0]
EXTREME_TOP_K = [0, 1, 2, 10**6, 2**63, 10**40, -1]


def _params_or_error(**kw):
    try:
        return SamplingParams(max_new_tokens=3, ignore_eos=True, **kw)
    except ConfigError as e:
        assert str(e)  # one clear message
        return None


def test_tiny_temperature_is_greedy():
    for t in (TINY, 1e-300, 1e-39, GREEDY_BELOW / 2):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


@pytest.mark.parametrize("bad", [dict(temperature=float("nan")), dict(temperature=float("inf")),
                                 dict(temperature=-1e-300), dict(top_p=0.0),
                                 dict(top_p=float("nan")), dict(max_new_tokens=True),
                                 dict(top_k=True), dict(seed=1.5), dict(temperature=True),
                                 dict(stop=5), dict(stop=None), dict(stop=[""]),
                                 dict(ignore_eos="yes"), dict(ignore_eos=1)])
def test_bad_values_are_clear_errors(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_large_ints_are_normalised_without_changing_meaning():
    p = SamplingParams(top_k=10**40, seed=-5)
    assert p.top_k == 2**31 - 1 and 0 <= p.seed < 2**63 - 1
    # the same stream: RowStream.from_seed takes the same modulus
    from ssdlib.speculative.rng import RowStream
    assert RowStream.from_seed(-5, 3).key == RowStream.from_seed(p.seed, 3).key


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    for top_p in (TINY, 1e-300, 1e-39, 1e-8):
        probs = target_probs(logits, 1.0, top_p=top_p)
        assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
        batched = target_distributions(
            logits, SamplingTensors.from_params([SamplingParams(temperature=1.0, top_p=top_p)]))
        assert torch.equal(batched, probs)


def test_random_and_extreme_parameters_give_valid_distributions():
    """A batch of rows with random and extreme parameters over logits with extreme values:
    every distribution is finite and sums to 1, every drawn token is in the vocabulary."""
    rng = random.Random(0)
    vocab = 50
    for trial in range(40):
        params = []
        while len(params) < 6:
            p = _params_or_error(temperature=rng.choice(EXTREME_TEMPERATURES),
                                 top_p=rng.choice(EXTREME_TOP_P), top_k=rng.choice(EXTREME_TOP_K),
                                 seed=rng.choice([None, 0, -1, 2**64, 7]))
            if p is not None:
                params.append(p)
        logits = torch.randn(len(params), vocab) * rng.choice([1.0, 30.0, 1e4])
        probs = target_distributions(logits, SamplingTensors.from_params(params))
        assert torch.isfinite(probs).all(), (trial, params)
        assert torch.allclose(probs.sum(-1), torch.ones(len(params)), atol=1e-5)
        rows = [_Row(p, i) for i, p in enumerate(params)]
        tokens = sample_tokens(logits, rows)
        assert ((tokens >= 0) & (tokens < vocab)).all()
        for i, p in enumerate(params):
            if p.greedy:
                assert tokens[i] == logits[i].argmax()


class _Row:
    def __init__(self, params, index):
        from ssdlib.speculative.rng import RowStream
        self.params = params
        self.stream = RowStream.from_seed(params.seed if params.seed is not None else 1, index)


# -- through the engine ---------------------------------------------------------------------

EXTREME_REQUESTS = [dict(temperature=1e-300), dict(temperature=1e-39), dict(temperature=TINY),
                    dict(temperature=1.0, top_p=1e-300), dict(temperature=1e-39, top_p=1e-39),
                    dict(temperature=1e30), dict(temperature=0.7, top_k=10**30),
                    dict(temperature=0.7, top_p=1e-8, seed=2**70), dict(temperature=0.0)]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_extreme_parameters_through_every_mode(tiny_dirs, mode):
    kw = {} if mode == "ar" else dict(draft=tiny_dirs["smol_heads_draft"], k=3)
    with Generator(target=tiny_dirs["smol_heads"], mode=mode, max_len=64, max_batch=4,
                   **kw) as gen:
        params = [SamplingParams(max_new_tokens=6, ignore_eos=True, **r) for r in EXTREME_REQUESTS]
        prompts = [[1, 5 + i, 9, 11] for i in range(len(params))]
        outs = gen.generate(prompts, params)
        vocab = gen.model_config.vocab_size
        for out, p in zip(outs, params):
            assert len(out.token_ids) == 6 and all(0 <= t < vocab for t in out.token_ids)
        # the tiny temperatures decode exactly like greedy
        greedy = gen.generate(prompts[:3], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in greedy]
        # and the Generator still serves a normal request afterwards
        assert len(gen.generate([[1, 5, 9]], SamplingParams(max_new_tokens=2, ignore_eos=True,
                                                            temperature=0.7, seed=1))) == 1


def test_no_value_reaches_the_engine_as_nan():
    assert all(math.isfinite(SamplingParams(**r).temperature) for r in EXTREME_REQUESTS)


# -- the CLI and the batch tool ---------------------------------------------------------------

def _run(module_or_script, *args, timeout=300):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable] + (["-m", module_or_script] if "/" not in module_or_script
                              else [module_or_script])
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout,
                          cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("flags,ok", [(["--temperature", "1e-300"], True),
                                      (["--temperature", "1", "--top-p", "1e-300"], True),
                                      (["--temperature", "nan"], False),
                                      (["--temperature", "inf"], False)])
def test_cli_extreme_sampling(tiny_dirs, tmp_path, flags, ok):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    res = _run("ssdlib.generate", "--target", tiny_dirs["smol_heads"], "--draft",
               tiny_dirs["smol_heads_draft"], "--mode", "ssd", "--max-len", "64",
               "--max-new-tokens", "4", "--prompts-file", str(prompts), *flags)
    assert "Traceback" not in res.stderr, res.stderr
    if ok:
        assert res.returncode == 0, res.stderr
    else:
        assert res.returncode != 0 and "temperature" in res.stderr


def test_batch_extreme_sampling_records(tiny_dirs, tmp_path):
    """Hostile sampling fields are per-record: each record gets an output or one error, the
    run exits 0, and a normal record beside them completes."""
    import json

    records = [{"id": "t300", "temperature": 1e-300}, {"id": "t39", "temperature": 1e-39},
               {"id": "p300", "temperature": 1.0, "top_p": 1e-300},
               {"id": "nan", "temperature": float("nan")},
               {"id": "inf", "temperature": float("inf")},
               {"id": "k", "temperature": 0.5, "top_k": 10**30},
               {"id": "seed", "temperature": 0.5, "seed": -(2**80)},
               {"id": "plain"}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(dict(r, prompt_ids=[5, 6, 7])) + "\n" for r in records))
    res = _run("tools/batch_generate.py", "--target", tiny_dirs["smol_heads"], "--draft",
               tiny_dirs["smol_heads_draft"], "--mode", "ssd", "--input", str(inp), "--output",
               str(out), "--max-batch", "4", "--max-len", "64", "--max-new-tokens", "4")
    assert res.returncode == 0, res.stderr
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(got) == [r["id"] for r in records]
    for rid in ("nan", "inf"):
        assert "temperature" in got[rid]["error"]
    for rid in ("t300", "t39", "p300", "k", "seed", "plain"):
        assert len(got[rid]["token_ids"]) == 4, got[rid]
