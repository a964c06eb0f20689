"""The speculator's estimated fan-out follows the leader's choice of K: a verification of the
first ``limit`` tokens ends at k <= limit, so the build spends no branch on later positions
(CPU, the stream placement: the speculator runs in this process)."""

import pytest

from ssdlib import Generator, SamplingParams
from ssdlib.engine.speculator.cache_builder import CacheBuilder


def _fans(tiny_dirs, monkeypatch, schedule):
    seen = []
    real = CacheBuilder.build

    def recording(self, rows, fan, sampling):
        seen.append((tuple(fan), tuple(r.limit for r in rows)))
        return real(self, rows, fan, sampling)

    monkeypatch.setattr(CacheBuilder, "build", recording)
    monkeypatch.setenv("SSDLIB_K_SCHEDULE", schedule)
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode="ssd", k=3, max_batch=1, max_len=96, fallback="jit", device="cpu",
                   speculator_placement="stream") as g:
        g.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=24, ignore_eos=True))
    return seen


def test_each_build_allocates_only_outcomes_the_limit_allows(tiny_dirs, monkeypatch):
    seen = _fans(tiny_dirs, monkeypatch, "0,1,3,2")
    assert seen
    limits_seen = set()
    for fan, limits in seen:
        limit = max(3 if x is None else x for x in limits)
        limits_seen.add(limit)
        assert len(fan) == 4 and sum(fan) > 0
        assert not any(fan[limit + 1:]), (fan, limits)  # nothing past the verified limit
        assert fan[limit] > 0  # its all-accepted outcome is cached
    assert {0, 3} <= limits_seen


@pytest.mark.parametrize("path", ["", "eager"])
def test_a_shorter_verification_hits_as_often_as_a_shorter_k(tiny_dirs, monkeypatch, path):
    """Speculations of K = 3 verified to 2 tokens (adaptive K's choice, fixed here) hit the
    cache about as often as speculations of K = 2: the all-accepted outcome's bonus at
    position 2 is often the draft's s_3, which the build must not exclude there (it did, and
    such rounds hit half as often). ``eager``: the captured build's code path (its static
    inputs carry the limits), run eagerly."""
    if path:
        monkeypatch.setenv("SSDLIB_STEP_GRAPHS", path)

    def hit_rate(k, schedule):
        if schedule:
            monkeypatch.setenv("SSDLIB_K_SCHEDULE", schedule)
        else:
            monkeypatch.delenv("SSDLIB_K_SCHEDULE", raising=False)
        with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                       mode="ssd", k=k, adaptive_k=False, max_batch=2, max_len=96,
                       fallback="ngram", device="cpu", speculator_placement="stream") as g:
            g.generate([[5, 6, 7, 8, 9], [3, 1, 4, 1, 5]],
                       SamplingParams(max_new_tokens=40, ignore_eos=True))
            return g.last_run_metrics["hit_rate"]

    short = hit_rate(3, "2")
    native = hit_rate(2, "")
    assert short > 0.5 and short >= native - 0.1, (short, native)
