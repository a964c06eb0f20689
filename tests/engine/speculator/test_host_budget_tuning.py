"""Plain rounds' builds with a tuned fan-out budget (``CacheRole.tune_host_builds``: a speculator
rank on a CPU turns it on): the tuner probes its arms build by build, learns from each build's
time beside the leader's verify, and greedy SSD still equals AR. Run here in the leader's
process (the stream placement without chained rounds: the same plain rounds and builds)."""

from ssdlib import Generator, SamplingParams
from ssdlib.engine.speculator.cache_builder import CacheBuilder
from ssdlib.engine.speculator.speculator import CacheRole
from ssdlib.speculative.fanout_budget import BudgetTuner

PROMPTS = [[5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9]]


def _run(tiny_dirs, monkeypatch, tune: bool):
    builds, observed, roles = [], [], []
    real_build, real_init, real_observe = CacheBuilder.build, CacheRole.__init__, \
        BudgetTuner.observe

    def build(self, rows, fan, sampling):
        builds.append(sum(fan))
        return real_build(self, rows, fan, sampling)

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        roles.append(self)
        if tune:
            assert self.tune_host_builds()

    def observe(self, budget, build_ms, verify_ms):
        observed.append((budget, build_ms, verify_ms))
        real_observe(self, budget, build_ms, verify_ms)

    monkeypatch.setattr(CacheBuilder, "build", build)
    monkeypatch.setattr(CacheRole, "__init__", init)
    monkeypatch.setattr(BudgetTuner, "observe", observe)
    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode="ssd", k=3, max_batch=2, max_len=128, fallback="jit", device="cpu",
                   speculator_placement="stream") as g:
        outs = g.generate(PROMPTS, SamplingParams(max_new_tokens=60, ignore_eos=True))
    return [o.token_ids for o in outs], builds, observed, roles[-1]


def test_tuned_plain_builds_probe_every_arm_and_equal_ar(tiny_dirs, monkeypatch):
    with Generator(target=tiny_dirs["smol_heads"], max_batch=2, max_len=128) as g:
        ar = [o.token_ids for o in g.generate(
            PROMPTS, SamplingParams(max_new_tokens=60, ignore_eos=True))]
    tokens, builds, observed, role = _run(tiny_dirs, monkeypatch, tune=True)
    assert tokens == ar
    arms = role.tuner.arms
    assert arms == [16, 8, 4]  # K = 3: the budget and its halves down to K + 1
    assert set(arms) <= set(builds)  # the probes built with every arm
    # each timed build is observed once, with its own budget, beside a verify time
    assert observed and all(b in arms and ms > 0 and v > 0 for b, ms, v in observed)
    assert len(observed) >= len(builds) - 2  # (the first builds: no verify time yet)


def test_plain_builds_keep_the_whole_budget_untuned(tiny_dirs, monkeypatch):
    _, builds, observed, role = _run(tiny_dirs, monkeypatch, tune=False)
    assert not role.host_tuning
    assert builds and set(builds) == {16} and observed == []
