"""The speculator's sampled cache build is captured once per shape, not once per fan-out
allocation: its body reads the fan-out only through Saguaro's sigma_{F,C}, the identity at
C = 1 (the default), so the estimator's allocation moving between rounds must not capture a
new graph (a capture costs tens of ms on the GPU; a two-prompt T = 0.7 run saw 4 allocations
and 13 changes in 239 builds). Run on CPU through the GPU's captured-step path
(``SSDLIB_STEP_GRAPHS=eager``: an EagerPool registers each key as a capture would)."""

import itertools

import pytest
import torch

from ssdlib.engine.speculator.tree_build import build_key
from ssdlib.loading import load_checkpoint
from ssdlib.sampling import SamplingFacts, SamplingParams
from dev.speculator_rounds import SpeculatorRounds

FACTS = SamplingFacts(any_greedy=False, any_sampled=True, max_top_k=0, any_top_p=False)


def test_build_key_keeps_the_fan_out_only_where_it_matters():
    a, b = (4, 4, 3, 5), (6, 4, 2, 4)
    assert build_key(1, 64, None, a, 1.0) == build_key(1, 64, None, b, 0.5)  # greedy
    assert build_key(1, 64, FACTS, a, 1.0) == build_key(1, 64, FACTS, b, 1.0)
    assert build_key(1, 64, FACTS, a, 0.5) != build_key(1, 64, FACTS, b, 0.5)
    assert build_key(1, 64, FACTS, a, 0.5) == build_key(1, 64, FACTS, a, 0.5)
    assert build_key(1, 64, FACTS, a, 1.0) != build_key(2, 64, FACTS, a, 1.0)


@pytest.mark.parametrize("c,expected", [(1.0, 1), (0.5, 2)])
def test_sampled_builds_over_two_allocations(tiny_dirs, monkeypatch, c, expected):
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")
    ck = load_checkpoint(tiny_dirs["smol_heads_draft"])
    rounds = SpeculatorRounds(ck, ck.config.vocab_size, "cpu", torch.float32, b=1, k=3,
                              budget=8, params=SamplingParams(temperature=0.7, seed=3),
                              max_len=128, prompt_len=8)
    spec = rounds.spec.cache  # the speculator's CacheRole: its builder and fan-out
    spec.builder.saguaro_c = c  # from here on (the admission's first build used C = 1)
    allocations = itertools.cycle([[2, 2, 2, 2], [3, 2, 1, 2]])  # each round a new one
    monkeypatch.setattr(spec, "fanout", lambda limit=None: next(allocations))
    for _ in range(6):
        rounds.round()
    pool = spec.builder.tree_step.pool
    sampled = [k for k in pool._fns if k[0] == "tree_build_sampled" and k[4] == c]
    assert len(sampled) == expected
