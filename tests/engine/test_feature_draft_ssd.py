"""SSD with a feature draft (EAGLE-style): the speculator commits the target's features each
OUTCOME carries and self-conditions on its own where they do not exist yet.

Against an oracle (a target whose next feature the oracle draft computes exactly from (token,
feature), so its own h is the target's next feature and self-conditioning is exact too): the jit
draft and every cached branch equal the target's greedy continuation of the outcome it assumes,
which holds only if features, tokens and the draft's own features meet at the right positions
(in the chain over the speculation under verification and in the tree). In the engine (tiny
models, CPU): greedy SSD equals AR, sampled SSD keeps the target's distribution, the placements
where the target's features are not at hand are refused."""

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.engine.speculator.feature_build import FeatureCacheBuilder
from ssdlib.engine.speculator.feature_spec_draft import FeatureSpecDraft
from ssdlib.engine.speculator.spec_cache import SpeculationCache
from ssdlib.engine.speculator.spec_row import SpecRow
from ssdlib.errors import ConfigError
from ssdlib.ops.graph_pool import EagerPool
# the tiny pair and AR's tokens on it, as the SD tests use them
from tests.engine.test_feature_draft_sd import _feature_draft, ar_reference, feature_draft  # noqa: F401
from tests.engine.test_chained_sampling import N_SEQS, NEW, TEMPERATURE, TOP_P
from tests.engine.test_chained_sampling import PROMPT as SAMPLED_PROMPT
from tests.engine.test_chained_sampling import pit_values, uniform_p_value
from tests.engine.test_speculative_exact import GREEDY, PROMPTS, check_equal
from tests.feature_helpers import counting_backend, fresh_dynamo
from tests.feature_oracle import FUSED_LAYERS, V, PreviousTokenTarget, oracle_draft

K = 3
FAN = [2, 2, 1, 2]  # branches per fork k = 0..K


def _features(target, tokens, fused):
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return target.forward_full_features(ids, FUSED_LAYERS if fused else None)[1][0]


def _greedy(target, tokens, n):
    """The target's greedy continuation of ``tokens``, n tokens."""
    out = list(tokens)
    for _ in range(n):
        with torch.no_grad():
            logits, _ = target.forward_full_features(torch.tensor([out]))
        out.append(int(logits[0, -1].argmax()))
    return out[len(tokens):]


def _commit(drafter, target, row, start, fused):
    """The leader's OUTCOME features: positions [start, L - 1) of the row."""
    feats = _features(target, row.tokens, fused)[start:len(row.tokens) - 1]
    drafter.commit_features([row], [start], [feats.shape[0]], feats.unsqueeze(0))


@pytest.mark.parametrize("fused,captured,compiled", [(False, False, False), (True, False, False),
                                                     (False, True, False), (False, True, True)])
def test_jit_drafts_and_cached_branches_follow_the_target_with_an_oracle(fused, captured,
                                                                        compiled):
    """``captured``: the captured steps' code path (commits padded to K + 1 positions, batch
    buckets, ghost rows), run eagerly; ``compiled``: the steps of fixed shape through the
    draft's layers under torch.compile (a backend that runs the traced graph and counts)."""
    target = PreviousTokenTarget()
    draft = oracle_draft(target, fused=fused)
    # (compiled: no warm-up run under the capture rules' dispatch mode, inside which dynamo
    # runs a frame eagerly from then on)
    pool = EagerPool(warmup=0 if compiled else 1) if captured else None
    runs: list = []
    with fresh_dynamo():
        _oracle_rounds(target, draft, fused, pool, runs, compiled)


def _oracle_rounds(target, draft, fused, pool, runs, compiled):
    B = sum(FAN)
    drafter = FeatureSpecDraft(draft, 3, 64, V, B * K, "cpu", torch.float32, draws=K, pool=pool,
                               compile_backend=counting_backend(runs) if compiled else None)
    assert (drafter.step_draft is not draft) == compiled
    assert len(runs) == compiled  # the compile's trial step
    cache = SpeculationCache(3, B, K, V, torch.device("cpu"))
    builder = FeatureCacheBuilder(drafter, cache, V, saguaro_c=1.0, pool=pool)
    prompt = [5, 17, 3, 42, 8, 11]
    row = SpecRow(1, prompt + _greedy(target, prompt, 1), SamplingParams(), 0,
                  torch.device("cpu"))
    drafter.prefill([row])
    _commit(drafter, target, row, 0, fused)  # after the admission: the prompt's features
    for round_ in range(3):
        tokens, _ = drafter.propose([row], K, want_q=False)  # a jit draft
        assert tokens[0].tolist() == _greedy(target, row.tokens, K), round_
        # the speculation in flight: the greedy one with its second token wrong, so that
        # outcomes fork before, at and after the mistake
        sent = _greedy(target, row.tokens, K)
        sent[1] = (sent[1] + 1) % V
        row.sent = sent
        assert builder.build([row], FAN, sampling=False) == 0
        for j in range(B):
            k, t = int(cache.fork[1, j]), int(cache.bonus[1, j])
            assume = row.tokens + sent[:k] + [t]
            assert cache.tokens[1, j].tolist() == _greedy(target, assume, K), (round_, j, k, t)
        # the verifier accepts s_1 and rejects s_2: bonus = the target's token there
        n = len(row.tokens)
        bonus = _greedy(target, row.tokens + sent[:1], 1)[0]
        assert cache.ready[1] and any(int(cache.fork[1, j]) == 1 and
                                      int(cache.bonus[1, j]) == bonus for j in range(B))
        row.commit(1, bonus)
        _commit(drafter, target, row, n - 1, fused)  # positions n - 1 and n: k + 1 of them
    # each round's jit draft, chain, tree depths and commit ran the compiled layers
    assert len(runs) > (3 * (K - 1 + K + K + 1) if compiled else -1)


def test_an_admission_commits_through_sdpa_and_a_round_through_the_kernel():
    """The eager commit (an admission's prompt: any number of positions) attends through SDPA,
    never the slot kernel, whose launch parameters follow the query count (a kernel variant
    compiled per new prompt length, in the middle of a run); a round's captured commit (K + 1
    positions, one shape) keeps the kernel. The commits' results are those of the same draft
    without the kernel (CPU: the kernel's path is its reference)."""
    target = PreviousTokenTarget()
    draft = oracle_draft(target)
    flags = []

    class Recording(torch.nn.Module):  # the draft, recording its forwards' attention path
        def __init__(self):
            super().__init__()
            self.inner = draft
            self.config = draft.config
            self.kv_heads_local = draft.kv_heads_local

        def condition(self, feats):
            return draft.condition(feats)

        def forward(self, ids, feats, cache, meta, index=None):
            flags.append(meta.use_kernel)
            meta.kernel_backend = "torch"  # the kernel's reference (CPU)
            return draft(ids, feats, cache, meta, index)

    drafter = FeatureSpecDraft(Recording(), 3, 64, V, 4 * K, "cpu", torch.float32, draws=K,
                               use_kernel=True, pool=EagerPool(warmup=1))
    plain = FeatureSpecDraft(draft, 3, 64, V, 4 * K, "cpu", torch.float32, draws=K)
    prompt = [5, 17, 3, 42, 8, 11, 9, 30, 2]
    rows = [SpecRow(1, prompt + _greedy(target, prompt, 1), SamplingParams(), 0,
                    torch.device("cpu")) for _ in range(2)]
    for d, row in zip((drafter, plain), rows):
        d.prefill([row])
        _commit(d, target, row, 0, False)  # the prompt: 9 positions > K + 1
    assert flags == [False]
    for d, row in zip((drafter, plain), rows):
        n = len(row.tokens)
        row.commit(1, _greedy(target, row.tokens, 1)[0])
        _commit(d, target, row, n - 1, False)  # a round: k + 1 = 2 positions, captured
    assert flags[1:] and all(flags[1:])
    torch.testing.assert_close(drafter.last_logits[1], plain.last_logits[1])


@pytest.mark.parametrize("k", [0, 1, K])
def test_a_chained_build_commits_the_round_it_reads_and_follows_the_target(k):
    """A chained round's build on the device (stream placement): from round r's outcome in the
    chain state (k accepted of the speculation verified from n committed tokens, the bonus), it
    commits positions [n - 1, n + k) with the target's features read from the target's buffer
    (which also holds the rejected tokens' features past them, as a verify leaves it) and the
    tokens from the state's history, then builds the next speculation's outcomes: with the
    oracle every branch is the target's greedy continuation of the outcome it assumes."""
    from ssdlib.distributed.protocol import ChainState
    from ssdlib.engine.speculator.spec_cache import next_speculation

    target = PreviousTokenTarget()
    B = sum(FAN)
    drafter = FeatureSpecDraft(oracle_draft(target), 3, 64, V, B * K, "cpu", torch.float32,
                               draws=K)
    caches = [SpeculationCache(3, B, K, V, torch.device("cpu")) for _ in range(2)]
    buffer = torch.zeros(3, 64, 16)  # the target's: the verified tokens' features
    builder = FeatureCacheBuilder(drafter, caches[0], V, saguaro_c=1.0, target_features=buffer)
    slot, before, p = 1, 0, 1
    tokens0 = [5, 17, 3, 42, 8, 11, 9]  # committed before round r (its n)
    n = len(tokens0)
    row = SpecRow(slot, list(tokens0), SamplingParams(), 0, torch.device("cpu"))
    drafter.prefill([row])
    _commit(drafter, target, row, 0, False)  # the OUTCOMEs before: positions [0, n - 1)
    spec = _greedy(target, tokens0, K)  # round r's speculation: the target's own, one wrong
    if k < K:
        spec[k] = (spec[k] + 1) % V
    bonus = _greedy(target, tokens0 + spec[:k], 1)[0]
    committed = tokens0 + spec[:k] + [bonus]
    buffer[slot, :n + K] = _features(target, tokens0 + spec, False)
    state = ChainState.empty(1, K, 64, "cpu")
    state.real[0] = True
    state.n[before, 0], state.k[before, 0], state.bonus[before, 0] = n, k, bonus
    state.spec[before, 0] = torch.tensor(spec)
    state.history[0, :len(committed)] = torch.tensor(committed)
    assert builder.start_chain([slot]) is None  # greedy
    pos, rank = builder.branch_index(tuple(FAN))
    builder.run_chained(state, 1, p, caches, pos, rank)
    # the commit's output predicts the token after the bonus
    assert int(drafter.last_logits[slot].argmax()) == _greedy(target, committed, 1)[0]
    sent = next_speculation(caches[before], torch.tensor([slot]), state, before, 1)[2][0]
    cache = caches[p]
    assert cache.ready[slot]
    for j in range(B):
        fork, t = int(cache.fork[slot, j]), int(cache.bonus[slot, j])
        assume = committed + sent[:fork].tolist() + [t]
        assert cache.tokens[slot, j].tolist() == _greedy(target, assume, K), (j, fork, t)


def test_features_must_continue_the_rows_fed_positions():
    target = PreviousTokenTarget()
    drafter = FeatureSpecDraft(oracle_draft(target), 2, 64, V, 4 * K, "cpu", torch.float32)
    row = SpecRow(0, [1, 2, 3, 4], SamplingParams(), 0, torch.device("cpu"))
    drafter.prefill([row])
    feats = _features(target, row.tokens, False)
    with pytest.raises(RuntimeError, match="disagree"):
        drafter.commit_features([row], [1], [2], feats[1:3].unsqueeze(0))  # not from 0
    with pytest.raises(RuntimeError, match="have not arrived"):
        drafter.propose([row], K)


@pytest.mark.parametrize("batch", [1, 4])
def test_ssd_with_a_feature_draft_equals_ar(tiny_dirs, ar_reference, feature_draft, batch):
    with Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode="ssd", k=K,
                   max_batch=batch, max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(tiny_dirs, ar_reference, outs)
    assert run["tokens_per_round"] > 1.0


def test_captured_greedy_builds_equal_ar(tiny_dirs, ar_reference, feature_draft, monkeypatch):
    """The captured build's code path (run eagerly on the CPU: batch buckets, ghost rows in the
    scratch slot, the static fan-out index, a warm-up run at each capture) gives AR's tokens."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")
    with Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode="ssd", k=K,
                   max_batch=3, max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_ssd_with_a_feature_draft_equals_ar(tiny_dirs, ar_reference, feature_draft, batch):
    """fp32 on a GPU, the build captured in CUDA graphs: AR's tokens."""
    with Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode="ssd", k=K,
                   max_batch=batch, max_len=128, device="cuda", dtype="float32") as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_cuda_compiled_feature_draft_equals_ar(tiny_dirs, ar_reference, feature_draft, mode,
                                              monkeypatch):
    """fp32 on a GPU with the feature draft's layers compiled by inductor in its captured
    steps (``SSDLIB_FEATURE_COMPILE=1``, compile on): AR's tokens, SD and SSD."""
    monkeypatch.setenv("SSDLIB_FEATURE_COMPILE", "1")
    with Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode=mode, k=K,
                   max_batch=4, max_len=128, device="cuda", dtype="float32",
                   compile=True) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)


def _sampled_pit(tmp_path, saguaro_c: float) -> float:
    """The p-value of whole sampled SSD sequences with a feature draft (jit drafts, cached
    sampled branches: a fan-out wide enough that many rounds are hits; chained rounds unless
    ``SSDLIB_CHAINED_ROUNDS=0``) against the target's law, through the randomized PIT of every
    token (uniform iff the law is right)."""
    from tests.tiny import make_small_vocab_pair

    t, _ = make_small_vocab_pair(str(tmp_path / "pair"), 4.0, 0.5)
    d = _feature_draft(t, tmp_path / "fd", seed=1)
    params = SamplingParams(max_new_tokens=NEW, temperature=TEMPERATURE, top_p=TOP_P, seed=5,
                            ignore_eos=True)
    with Generator(target=t, draft=d, mode="ssd", k=K, max_batch=4, max_len=64,
                   fan_out="4,3,3,4", fallback="jit", saguaro_c=saguaro_c,
                   dtype="float32") as g:
        outs = g.generate([SAMPLED_PROMPT] * N_SEQS, params)
    hits = sum(o.metrics.get("accepted_by_source", {}).get("cache", [0])[0] for o in outs)
    rounds = sum(o.metrics["rounds"] for o in outs)
    assert hits > 0.2 * rounds  # cached sampled branches were verified
    return uniform_p_value(pit_values(t, [o.token_ids for o in outs]))


@pytest.mark.parametrize("saguaro_c,chained", [(1.0, True), (0.5, True), (1.0, False)])
def test_ssd_sampling_with_a_feature_draft_follows_the_target(tmp_path, saguaro_c, chained,
                                                              monkeypatch):
    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "1" if chained else "0")
    assert _sampled_pit(tmp_path, saguaro_c) > 1e-3


@pytest.mark.parametrize("chained", [True, False])
def test_a_wrong_q_of_the_cached_branches_is_detected(tmp_path, monkeypatch, chained):
    """The power test: the build (chained, or through the host) stores a flat q instead of the
    one its branch tokens were drawn from (p ~ 1e-75 through the host in a trial)."""
    import ssdlib.engine.speculator.tree_build as tb  # the sampled builds' draws

    monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "1" if chained else "0")
    real = tb.sample_branches

    def flat_q(*args, **kw):
        tok, q = real(*args, **kw)
        return tok, torch.full_like(q, 1.0 / q.shape[-1])
    monkeypatch.setattr(tb, "sample_branches", flat_q)
    assert _sampled_pit(tmp_path, 1.0) < 1e-6


def test_ssd_with_a_feature_draft_on_a_speculator_rank_equals_ar(tiny_dirs, ar_reference,
                                                                  feature_draft):
    """The rank placement: the features travel over the link (gloo) after each OUTCOME."""
    with Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode="ssd", k=K,
                   max_batch=4, max_len=128, speculator_placement="rank") as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(tiny_dirs, ar_reference, outs)
    assert run["hit_rate"] > 0
