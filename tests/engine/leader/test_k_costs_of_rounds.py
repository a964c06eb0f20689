"""What a verifier round tells adaptive K's cost table: the round without the wait for the
speculator (the speculator drafts K_max whatever K the round verifies)."""

from types import SimpleNamespace

import pytest

from ssdlib.engine.leader.verifier import LinkVerifier


class _Costs:
    def __init__(self):
        self.rounds, self.drafts = [], []

    def observe_round(self, k, seconds, rows=None):
        self.rounds.append((k, seconds, rows))

    def observe_draft(self, seconds, k, rows=None):
        self.drafts.append((seconds, k, rows))


def _read(pushes_cache: bool, phases: dict, ks=(3, 5, 1)):
    costs = _Costs()
    verifier = SimpleNamespace(source=SimpleNamespace(pushes_cache=pushes_cache),
                               policy=SimpleNamespace(costs=costs), _verify_us=0)
    LinkVerifier._read_phases(verifier, phases, ks)
    return verifier, costs


@pytest.mark.parametrize("pushes_cache", [True, False])
def test_the_wait_for_the_speculator_is_not_the_rounds_k(pushes_cache):
    """A miss answered by a jit draft makes the round wait for it; that wait is the miss
    path's, not the verified K's (a cache-pushing speculator builds K_max whatever K), so K's
    cost is the verify, the host and the cache lookup only. A cacheless speculator's wait is
    its draft of the next speculation: the draft's cost."""
    phases = {"verify": 0.050, "wait": 0.040, "host": 0.001, "cache": 0.0005}
    verifier, costs = _read(pushes_cache, phases)
    assert costs.rounds == [(3, pytest.approx(0.0515), 1)]
    assert costs.drafts == ([] if pushes_cache else [(0.040, 5, 1)])
    assert verifier._verify_us == 50_000


def test_an_untimed_round_tells_the_costs_nothing():
    _, costs = _read(True, {"verify": 0.05}, ks=None)
    assert costs.rounds == [] and costs.drafts == []
    _, costs = _read(True, {"wait": 0.05}, ks=(3, 5, 1))  # no verify phase: not a round
    assert costs.rounds == []
