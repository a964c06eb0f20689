"""The stream placement of the SSD speculator (in the leader's process, ``LocalLink``): the same
round code as the rank placement, so the exactness tests run both (test_speculative_exact.py);
here what is particular to it. GPU tests skip without CUDA."""

import os

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.distributed.host_cpu import available_cores, cpu_speculator_placement
from ssdlib.engine_config import EngineConfig
from ssdlib.errors import ConfigError

GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
PROMPTS = [[1, 5, 9, 11], [1, 7, 3]]


def cuda(test):
    """A GPU test (``-m gpu``), skipped without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="needs a CUDA GPU")(test))


def test_auto_placement_and_world_size(tiny_dirs):
    kw = dict(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"], mode="ssd")
    assert EngineConfig(**kw, speculator_placement="stream").world_size == 1
    assert EngineConfig(**kw, speculator_placement="rank").world_size == 2
    assert EngineConfig(**kw, tp=2, speculator_placement="stream").world_size == 2
    # CPU: a process of its own where every rank has a core (tests/distributed/test_rank_threads)
    assert EngineConfig(**kw).placement == cpu_speculator_placement(
        1, None, available_cores(), os.environ.get("OMP_NUM_THREADS"))
    cfg = EngineConfig(**kw)
    cfg.check_world_size(2)  # torchrun with tp + 1 ranks decides an auto placement
    assert cfg.placement == "rank"
    with pytest.raises(ConfigError, match="speculator-placement"):
        EngineConfig(**kw, speculator_placement="gpu")


@pytest.mark.parametrize("step", ["finish_round", "build_chained"])
def test_a_speculator_error_is_the_jobs_error(tiny_dirs, monkeypatch, step):
    """An exception inside the in-process speculator (a plain round's build, or a chained
    round's) ends the generate call with that error; the Generator closes cleanly."""
    from ssdlib.engine.speculator.speculator import Speculator

    def broken(self, *args):
        raise RuntimeError("speculator exploded")

    gen = Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                    mode="ssd", k=3, max_len=64, speculator_placement="stream")
    # broken once built: on a GPU the constructor's warm-up runs rounds of its own
    monkeypatch.setattr(Speculator, step, broken)
    try:
        with pytest.raises(Exception, match="speculator exploded"):
            gen.generate(PROMPTS, GREEDY)
    finally:
        gen.close()


def test_chained_rounds_only_for_small_greedy_batches(tiny_dirs, monkeypatch):
    """Chained rounds run while a batch has at most SSDLIB_CHAIN_MAX_ROWS rows: above it every
    round goes through the host, and the rows that remain once the others end run chained (the
    tokens equal AR's either way)."""
    monkeypatch.setenv("SSDLIB_CHAIN_MAX_ROWS", "1")
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=24, ignore_eos=True)]
    with Generator(target=tiny_dirs["smol_heads"], max_batch=2, max_len=128) as g:
        ar = [o.token_ids for o in g.generate(PROMPTS, params)]
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode="ssd", k=3, max_batch=2, max_len=128,
                   speculator_placement="stream") as g:
        outs = g.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == ar
    assert outs[0].metrics.get("chained_rounds", 0) == 0  # never alone in the batch
    assert outs[1].metrics["chained_rounds"] > 0  # alone once the first ended


def _ar_and_chained(tiny_dirs, prompts, params, ar_params=None, warm: bool = False,
                    fan_out: str = "auto", **kw):
    """(AR's tokens, SSD's outputs, SSD's run metrics) of one batch of ``prompts``, SSD with the
    stream placement (``ar_params``: AR's, default ``params``; ``warm``: SSD runs the first
    three prompts once before, so that a GPU captures its steps first; ``fan_out``: SSD's)."""
    kw = dict(target=tiny_dirs["smol_heads"], max_len=128, **kw)
    with Generator(**kw) as g:
        ar = [o.token_ids for o in g.generate(prompts, ar_params or params)]
    with Generator(draft=tiny_dirs["smol_heads_draft"], mode="ssd", k=3, fan_out=fan_out,
                   speculator_placement="stream", **kw) as g:
        if warm:
            g.generate(prompts[:3], params[:3])
        outs = g.generate(prompts, params)
        return ar, outs, g.last_run_metrics


def test_chains_go_on_through_ends_and_admissions(tiny_dirs):
    """Continuous batching in chained rounds: rows that end leave the chain as ghost rows and
    new sequences join it between two rounds, so one chain serves the whole call; the tokens
    equal AR's."""
    prompts = [[1 + i, 5, 9, 11 + i] for i in range(10)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True)
              for n in (5, 17, 9, 30, 3, 12, 20, 7, 1, 14)]
    # (a fixed fan-out: which rows end in the same round, and so the counts, follow the hits)
    ar, outs, run = _ar_and_chained(tiny_dirs, prompts, params, max_batch=3, fan_out="6,4,3,3")
    assert [o.token_ids for o in outs] == ar
    # 10 prompts, 3 at the start; the one of max_new_tokens=1 ends at admission, unjoined
    assert run["chain_counts"] == {"chains": 1, "joins": 6}
    assert run["chained_rounds"] > 0.9 * run["rounds"]
    assert run["speculator_rows_held"] == 0  # every row that ran in the chain has left


def test_chained_rounds_feed_the_fanout_estimates(tiny_dirs, monkeypatch):
    """Each chained round read back tells the speculator its outcomes and lookups
    (``ChainSeen``), with the fan-out of the build whose cache the lookups read: Thm 12's
    a_p and r are estimated from chained rounds too, not only from plain ones."""
    from ssdlib.engine.speculator.speculator import CacheRole

    seen, roles = [], []
    real = CacheRole.observe_chain

    def observe(self, msg):
        seen.append(msg)
        roles.append(self)
        real(self, msg)

    monkeypatch.setattr(CacheRole, "observe_chain", observe)
    prompts = [[1 + i, 5, 9, 11 + i] for i in range(3)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 25, 33)]
    ar, outs, run = _ar_and_chained(tiny_dirs, prompts, params, max_batch=2)
    assert [o.token_ids for o in outs] == ar
    assert seen and all(m.k == 3 for m in seen)
    known = [m for m in seen if m.fan is not None]
    assert len(known) >= len(seen) - run["chain_counts"]["chains"]  # all but chains' first
    assert all(sum(m.fan) in (16, 8, 4) and len(m.fan) == 4 for m in known)
    assert all(0 <= k <= 3 for m in known for k, _, _ in m.lookups)
    hits = [h for m in known for _, h, _ in m.lookups]
    assert any(hits) and not all(hits)
    # the kind of each lookup (fanout.lookup_is_fresh): k = K always fresh, both kinds seen
    assert all(fresh for m in known for k, _, fresh in m.lookups if k == 3)
    kinds = {fresh for m in known for _, _, fresh in m.lookups}
    assert kinds == {True, False}
    est = roles[-1].estimator
    counted = sum(n for n, _ in est.lookups.values())
    assert counted >= len(hits)  # (plain rounds' lookups besides)
    assert est.accepted >= sum(sum(m.accepted) for m in seen)
    # each row's source: the cache's speculations and the misses' apart (the tuner's tokens)
    assert all(len(m.cached) == len(m.accepted) for m in seen)
    acc = roles[-1].chain_acceptance
    assert acc[True][0] + acc[False][0] == sum(sum(m.accepted) for m in seen)
    assert acc[True][0] > 0 and sum(acc[False]) > 0
    assert roles[-1].tokens_a_round(8) is not None
    model = run["fanout_model"]  # the estimator's state in the run metrics
    assert sum(model["allocation"]) == roles[-1].B and model["lookups"]["fresh"] > 0
    assert model["lookups"]["fresh"] + model["lookups"]["rejected"] == counted


@pytest.mark.parametrize("path", ["", "eager"])
def test_tuned_budgets_keep_greedy_ssd_equal_to_ar(tiny_dirs, monkeypatch, path):
    """The tuner's budgets (16, 8 and 4 branches at K = 3) build chained rounds in turn while
    it probes; with every build at the smallest the cache still hits; the tokens equal AR's.
    ``eager``: on the GPU's captured-step path, whose registrations check what a CUDA graph
    capture would refuse (ops/capture_rules.py)."""
    from ssdlib.speculative.fanout_budget import BudgetTuner

    if path:
        monkeypatch.setenv("SSDLIB_STEP_GRAPHS", path)

    prompts = [[1 + i, 5, 9, 11 + i] for i in range(4)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 12, 25, 40)]
    # (the GPU's default budget: a CPU's is 8)
    ar, outs, run = _ar_and_chained(tiny_dirs, prompts, params, max_batch=2, fan_out_budget=16)
    assert [o.token_ids for o in outs] == ar
    assert set(run["chain_budgets"]["builds"]) == {"16", "8", "4"}
    assert run["chain_budgets"]["held"] == 16  # no timings (CPU): the whole budget
    monkeypatch.setattr(BudgetTuner, "next_budget", lambda self: self.arms[-1])
    ar, outs, run = _ar_and_chained(tiny_dirs, prompts, params, max_batch=2, fan_out_budget=16)
    assert [o.token_ids for o in outs] == ar
    assert run["hit_rate"] > 0.2, run["hit_rate"]


def test_a_batch_outgrowing_the_chain_ends_it_and_a_smaller_one_starts_another(tiny_dirs,
                                                                                monkeypatch):
    """With chains of at most 2 rows and 3 slots, admissions grow the batch past the chain
    (it ends; rounds go through the host) and ends shrink it again (a new chain starts); the
    tokens equal AR's throughout. (The second prompt ends at admission, so the first chain
    starts with two rows; the fourth prompt's admission outgrows it.)"""
    monkeypatch.setenv("SSDLIB_CHAIN_MAX_ROWS", "2")
    prompts = [[1 + i, 5, 9, 11 + i] for i in range(8)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True)
              for n in (20, 1, 25, 9, 14, 3, 18, 11)]
    ar, outs, run = _ar_and_chained(tiny_dirs, prompts, params, max_batch=3)
    assert [o.token_ids for o in outs] == ar
    assert run["chain_counts"]["chains"] > 1
    assert 0 < run["chained_rounds"] < run["rounds"]
    assert run["speculator_rows_held"] == 0


def test_a_joining_row_of_another_sampling_kind_ends_the_chain(tiny_dirs):
    """A sampling row cannot join a greedy chain (its graphs are greedy): the chain ends and
    a new one starts with the row; greedy rows still give AR's tokens."""
    prompts = [[1 + i, 5, 9, 11 + i] for i in range(6)]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    params = [greedy, greedy, sampled, greedy, sampled, greedy]
    ar, outs, run = _ar_and_chained(tiny_dirs, prompts, params, ar_params=greedy, max_batch=2)
    assert [o.token_ids for o, p in zip(outs, params) if p is greedy] == \
        [t for t, p in zip(ar, params) if p is greedy]
    assert all(len(o.token_ids) == 12 for o in outs)
    assert run["chain_counts"]["chains"] > 1


def _tokens(tiny_dirs, **kw):
    with Generator(target=tiny_dirs["smol_heads"], max_len=64, max_batch=2, k=3,
                   **kw) as g:
        g.generate(PROMPTS, GREEDY)  # capture (and compile) before the measured call
        outs = g.generate(PROMPTS, GREEDY)
        return [o.token_ids for o in outs], g.last_run_metrics


@cuda
@pytest.mark.parametrize("placement", ["stream", "rank"])
def test_cuda_fp32_greedy_ssd_equals_ar(tiny_dirs, placement):
    ar, _ = _tokens(tiny_dirs, mode="ar", device="cuda", dtype="float32")
    ssd, _ = _tokens(tiny_dirs, mode="ssd", device="cuda", dtype="float32",
                     draft=tiny_dirs["smol_heads_draft"], speculator_placement=placement)
    assert ssd == ar


@cuda
def test_cuda_fp32_chain_through_ends_and_admissions_equals_ar(tiny_dirs):
    """On the GPU (captured steps, two streams): one chain through rows that end and join
    between its rounds, the tokens AR's."""
    prompts = [[1 + i, 5, 9, 11 + i] for i in range(10)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True)
              for n in (5, 17, 9, 30, 3, 12, 20, 7, 2, 14)]
    ar, outs, run = _ar_and_chained(tiny_dirs, prompts, params, warm=True, max_batch=3,
                                    device="cuda", dtype="float32")
    assert [o.token_ids for o in outs] == ar
    assert run["chain_counts"]["joins"] == 7 and run["chain_overlap"]["rounds"] > 0


@cuda
def test_cuda_stream_captured_equals_eager(tiny_dirs):
    """The speculator's captured steps on its stream give the eager tokens."""
    kw = dict(mode="ssd", device="cuda", dtype="float32", draft=tiny_dirs["smol_heads_draft"],
              speculator_placement="stream")
    eager, _ = _tokens(tiny_dirs, cuda_graphs=False, **kw)
    captured, metrics = _tokens(tiny_dirs, cuda_graphs=True, **kw)
    assert captured == eager
    assert metrics["stream_overlap"]["rounds"] > 0
    assert metrics["chained_rounds"] > 0 and metrics["chain_overlap"]["rounds"] > 0


@cuda
def test_cuda_plain_rounds_captured_equal_eager(tiny_dirs, monkeypatch):
    """The same without chained rounds (every round through the host)."""
    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")
    kw = dict(mode="ssd", device="cuda", dtype="float32", draft=tiny_dirs["smol_heads_draft"],
              speculator_placement="stream")
    eager, _ = _tokens(tiny_dirs, cuda_graphs=False, **kw)
    captured, metrics = _tokens(tiny_dirs, cuda_graphs=True, **kw)
    assert captured == eager
    assert "chained_rounds" not in metrics


@cuda
def test_cuda_build_overlaps_the_verify(tmp_path, monkeypatch):
    """With a target whose verify takes long enough to matter, the GPU runs the speculator's
    build beside it: part of the build's time is hidden under the verify; each chained round's
    times reach the fan-out budget's tuner, with the budget its build took."""
    from ssdlib.distributed.local_link import LocalLink
    from tests.tiny import make_tiny_llama

    timed = []
    real = LocalLink.observe_build

    def observe(self, budget, build_ms, verify_ms):
        timed.append((budget, build_ms, verify_ms))
        real(self, budget, build_ms, verify_ms)

    monkeypatch.setattr(LocalLink, "observe_build", observe)

    target = make_tiny_llama(str(tmp_path / "t"), "gqa", hidden_size=1024,
                             intermediate_size=4096, num_hidden_layers=12,
                             num_attention_heads=16, num_key_value_heads=4, vocab_size=4096)
    draft = make_tiny_llama(str(tmp_path / "d"), "gqa", seed=1, vocab_size=4096)
    with Generator(target=target, draft=draft, mode="ssd", device="cuda", k=3, max_len=256,
                   max_batch=1, speculator_placement="stream") as g:
        g.generate([[1, 5, 9, 11]], SamplingParams(max_new_tokens=8, ignore_eos=True))
        g.generate([[1, 5, 9, 11]], SamplingParams(max_new_tokens=64, ignore_eos=True))
        run = g.last_run_metrics
    # chained rounds (greedy): the round's verify and the next speculation's build
    chain = run["chain_overlap"]
    assert chain["rounds"] > 0 and chain["build_ms"] > 0 and chain["hidden_ms"] > 0, chain
    assert {b for b, _, _ in timed} == {16, 8, 4}  # the probes: every arm timed
    assert all(build > 0 and verify > 0 for _, build, verify in timed)
    assert run["chain_budgets"]["held"] in (16, 8, 4)


@pytest.mark.parametrize("order,want", [("verifier", (-5, 0)), ("speculator", (0, -5)),
                                        ("equal", (0, 0)), (None, (-5, 0))])
def test_stream_priorities_follow_the_switch(monkeypatch, order, want):
    """SSDLIB_STREAM_PRIORITY picks which side's stream runs first (CUDA: lower is first);
    unset, the verifier's."""
    from ssdlib.distributed.local_link import priorities

    monkeypatch.setattr(torch.cuda.Stream, "priority_range", staticmethod(lambda: (0, -5)),
                        raising=False)
    if order is None:
        monkeypatch.delenv("SSDLIB_STREAM_PRIORITY", raising=False)
    else:
        monkeypatch.setenv("SSDLIB_STREAM_PRIORITY", order)
    assert priorities() == want
