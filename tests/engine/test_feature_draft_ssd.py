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
from ssdlib.engine.speculator.feature_build import JIT, NONE, FeatureCacheBuilder
from ssdlib.engine.speculator.feature_spec_draft import FeatureSpecDraft
from ssdlib.engine.speculator.outcomes import Answer
from ssdlib.engine.speculator.spec_cache import SpeculationCache
from ssdlib.engine.speculator.spec_row import SpecRow
from ssdlib.errors import ConfigError
from ssdlib.ops.graph_pool import EagerPool
from ssdlib.speculative.acceptance import QKind
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


def _exact_forks(cache, row, target, fan, limit: int = K) -> dict[int, bool]:
    """Per fork k: whether its branches assume the target's top F_k tokens after s_1..s_k
    (other than s_{k+1} where k < ``limit``, the tokens verified), as an oracle draft's
    candidates are, and each branch is the target's greedy continuation of the outcome it
    assumes."""
    exact = {}
    for k, f in enumerate(fan):
        before = row.tokens + row.sent[:k]
        with torch.no_grad():
            logits = target.forward_full_features(torch.tensor([before]))[0][0, -1]
        top = [t for t in logits.argsort(descending=True).tolist()
               if k >= limit or t != row.sent[k]][:f]
        js = [j for j in range(cache.B) if int(cache.fork[1, j]) == k]
        keys = [int(cache.bonus[1, j]) for j in js]
        exact[k] = keys == top and all(
            cache.tokens[1, j].tolist() == _greedy(target, before + [t], K)
            for j, t in zip(js, keys))
    return exact


def _check_branches(cache, row, target):
    """Every fork of the cache is exact (``_exact_forks``)."""
    exact = _exact_forks(cache, row, target, FAN)
    assert all(exact.values()), exact


def _answer(row, tokens, hit: bool, branch: int = 0, kind=QKind.DENSE):
    """The speculator's record of its answer to the row's outcome (``outcomes.Answer``)."""
    Answer(torch.tensor([tokens]), torch.tensor([int(kind)]), torch.tensor([hit]),
           torch.tensor([branch]), None).record([row], "ngram")


def _jit_drafted_row(target, draft, fused, pool, backend=None):
    """(drafter, cache, builder, row): an oracle pair's speculator whose row holds a jit
    draft's speculation, sent and answered (a miss), its prompt's features committed."""
    B = sum(FAN)
    drafter = FeatureSpecDraft(draft, 3, 64, V, B * K, "cpu", torch.float32, draws=K, pool=pool,
                               compile_backend=backend)
    cache = SpeculationCache(3, B, K, V, torch.device("cpu"))
    builder = FeatureCacheBuilder(drafter, cache, V, saguaro_c=1.0, pool=pool)
    prompt = [5, 17, 3, 42, 8, 11]
    row = SpecRow(1, prompt + _greedy(target, prompt, 1), SamplingParams(), 0,
                  torch.device("cpu"))
    drafter.prefill([row])
    _commit(drafter, target, row, 0, fused)  # after the admission: the prompt's features
    tokens, _ = drafter.propose([row], K, want_q=False)  # a jit draft
    assert tokens[0].tolist() == _greedy(target, row.tokens, K)
    _answer(row, tokens[0].tolist(), hit=False)
    return drafter, cache, builder, row


def _oracle_rounds(target, draft, fused, pool, runs, compiled):
    """A jit draft's round, then rounds answered from the cache (the branch of an outcome
    that accepts s_1 and rejects s_2 for another candidate): the chain reads the jit draft's,
    then the hit branch's own features (an oracle's h is the target's next feature, so a
    feature from the wrong depth or branch gives a wrong candidate or branch)."""
    B = sum(FAN)
    drafter, cache, builder, row = _jit_drafted_row(
        target, draft, fused, pool, counting_backend(runs) if compiled else None)
    assert (drafter.step_draft is not draft) == compiled
    assert bool(runs) == compiled  # the compile's trial step and the jit draft's ran compiled
    assert builder.source(row) == JIT
    for round_ in range(3):
        assert builder.build([row], FAN, sampling=False) == 0
        _check_branches(cache, row, target)
        # outcome (1, t): s_1 accepted, t another candidate than s_2 in the cache
        j = next(j for j in range(B) if int(cache.fork[1, j]) == 1)
        bonus, branch = int(cache.bonus[1, j]), cache.tokens[1, j].tolist()
        assert bonus != row.sent[1], round_
        n = len(row.tokens)
        row.commit(1, bonus)
        _commit(drafter, target, row, n - 1, fused)  # positions n - 1 and n: k + 1 of them
        _answer(row, branch, hit=True, branch=j)
        assert builder.source(row) == j, round_
    # each round's chain, tree depths and commit (and the first jit draft) ran compiled layers
    assert len(runs) > (K - 1 + 3 * (1 + K + 1) if compiled else -1)


@pytest.mark.parametrize("captured", [False, True])
def test_a_shorter_verification_caches_its_all_accepted_outcome(captured):
    """A speculation of K tokens verified to its first one (adaptive K): outcome k = 1 accepts
    it and draws the bonus where s_2 stands, so the build's guesses there start at s_2 (the
    oracle's own next token) instead of skipping it; ``captured``: the captured build's
    inputs (a replay of its bucket, run eagerly)."""
    target = PreviousTokenTarget()
    draft = oracle_draft(target, fused=False)
    pool = EagerPool(warmup=1) if captured else None
    B = sum(FAN)
    _, cache, builder, row = _jit_drafted_row(target, draft, False, pool)
    row.limit = 1
    fan = [B - 3, 3, 0, 0]
    builder.build([row], fan, sampling=False)
    exact = _exact_forks(cache, row, target, fan, limit=1)
    assert all(exact.values()), exact
    first = [int(cache.bonus[1, j]) for j in range(B) if int(cache.fork[1, j]) == 1]
    assert first[0] == row.sent[1]


def test_a_foreign_speculation_is_built_on_the_slots_last_output():
    """A speculation with no features of its own (an n-gram's): the chain pairs the slot's
    last output with each of its tokens, so the outcomes that fork at s_0 or s_1 (whose
    features are the target's or that output) are exact with an oracle, and a later fork
    is not (its pair's feature is a stale one)."""
    target = PreviousTokenTarget()
    drafter = FeatureSpecDraft(oracle_draft(target), 3, 64, V, 8 * K, "cpu", torch.float32,
                               draws=K)
    fan = [2, 2, 2, 2]
    cache = SpeculationCache(3, sum(fan), K, V, torch.device("cpu"))
    builder = FeatureCacheBuilder(drafter, cache, V, saguaro_c=1.0)
    prompt = [5, 17, 3, 42, 8, 11]
    row = SpecRow(1, prompt + _greedy(target, prompt, 1), SamplingParams(), 0,
                  torch.device("cpu"))
    drafter.prefill([row])
    _commit(drafter, target, row, 0, False)
    _answer(row, _greedy(target, row.tokens, K), hit=False, kind=QKind.ONEHOT)
    assert builder.source(row) == NONE
    builder.build([row], fan, sampling=False)
    exact = _exact_forks(cache, row, target, fan)
    assert exact[0] and exact[1] and not exact[2], exact


def test_the_one_forward_chain_equals_the_step_by_step_chain_of_a_jit_draft():
    """The build's chain (one forward over the speculation, the jit draft's own features
    paired with its tokens) against its plain reference, the chain drafted a step at a time
    (each step's hidden the next step's feature), on a draft whose layer mixes positions (the
    oracle's with random output projections): the same candidates and hidden states."""
    target = PreviousTokenTarget()
    draft = oracle_draft(target)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in draft.layers:
            layer.self_attn.o_proj.weight.copy_(
                torch.randn(layer.self_attn.o_proj.weight.shape, generator=g) * 0.5)
            layer.mlp.down_proj.weight.copy_(
                torch.randn(layer.mlp.down_proj.weight.shape, generator=g) * 0.5)
    prompt = [5, 17, 3, 42, 8, 11, 9]
    drafters, rows = [], []
    for _ in range(2):
        d = FeatureSpecDraft(draft, 3, 64, V, 4 * K, "cpu", torch.float32, draws=K)
        row = SpecRow(1, list(prompt), SamplingParams(), 0, torch.device("cpu"))
        d.prefill([row])
        _commit(d, target, row, 0, False)
        drafters.append(d)
        rows.append(row)
    tokens = drafters[0].propose([rows[0]], K, want_q=False)[0]
    _answer(rows[0], tokens[0].tolist(), hit=False)
    builder = FeatureCacheBuilder(drafters[0], SpeculationCache(3, 4, K, V, torch.device("cpu")),
                                  V, saguaro_c=1.0)
    slots, first = torch.tensor([1]), torch.tensor([len(prompt) - 1])
    feats = builder.sent_features(slots, torch.tensor([builder.source(rows[0])]), builder.cache)
    cand, H = builder.chain(slots, first, tokens, feats, 64)
    ref = drafters[1]  # the reference: K dependent steps
    logits, hidden = ref.last_logits[slots], ref.last_hidden[slots]
    tops, hs = [logits.topk(builder.C).indices], [hidden]
    for j in range(K):
        logits, hidden = ref.step(tokens[:, j], hidden, first + j, slots, 64)
        tops.append(logits.topk(builder.C).indices)
        hs.append(hidden)
    assert torch.equal(cand, torch.stack(tops, dim=1))
    torch.testing.assert_close(H, torch.stack(hs, dim=1), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(H[:, 1], H[:, 2])  # (the positions differ)


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


@pytest.mark.parametrize("k,hit", [(0, False), (1, False), (K, False), (1, True), (K, True)])
def test_a_chained_build_commits_the_round_it_reads_and_follows_the_target(k, hit):
    """A chained round's build on the device (stream placement): from round r's outcome in the
    chain state (k accepted of the speculation verified from n committed tokens, the bonus), it
    commits positions [n - 1, n + k) with the target's features read from the target's buffer
    (which also holds the rejected tokens' features past them, as a verify leaves it) and the
    tokens from the state's history, then builds the next speculation's outcomes. ``hit``:
    round r's speculation was a jit draft whose cache (built on the host, into the cache of
    parity 0) holds the outcome, and the next speculation is that branch, its features the
    branch's: with the oracle every fork is exact; a miss (a speculation of zeros, no
    features of its own) still gets forks 0 and 1 exact."""
    from types import SimpleNamespace

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
    if hit:
        assert drafter.propose([row], K, want_q=False)[0][0].tolist() == _greedy(
            target, tokens0, K)
        _answer(row, spec, hit=False)  # the jit draft, as sent (its token k changed)
        builder.build([row], FAN, sampling=False)  # into the cache of parity 0
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
    found, _, sent = next_speculation(caches[before], torch.tensor([slot]), state, before, 1)[:3]
    assert bool(found[0]) == hit
    assert caches[p].ready[slot]
    exact = _exact_forks(caches[p], SimpleNamespace(tokens=committed, sent=sent[0].tolist()),
                         target, FAN)
    assert all(exact.values()) if hit else (exact[0] and exact[1]), exact


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
    _commit(drafter, target, row, 0, False)
    with pytest.raises(ValueError, match="at least one token"):
        drafter.propose([row], 0)
    assert drafter.propose([row], 1)[0].shape == (1, 1)


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
    ``SSDLIB_CHAINED_ROUNDS=0``; the speculator in this process, where a test may patch it)
    against the target's law, through the randomized PIT of every token (uniform iff the law
    is right)."""
    from tests.tiny import make_small_vocab_pair

    t, _ = make_small_vocab_pair(str(tmp_path / "pair"), 4.0, 0.5)
    d = _feature_draft(t, tmp_path / "fd", seed=1)
    params = SamplingParams(max_new_tokens=NEW, temperature=TEMPERATURE, top_p=TOP_P, seed=5,
                            ignore_eos=True)
    with Generator(target=t, draft=d, mode="ssd", k=K, max_batch=4, max_len=64,
                   fan_out="4,3,3,4", fallback="jit", saguaro_c=saguaro_c,
                   dtype="float32", speculator_placement="stream") as g:
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
    # (16 branches a row: this weak draft's few hits need them; a CPU's default is 8)
    with Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode="ssd", k=K,
                   max_batch=4, max_len=128, speculator_placement="rank",
                   fan_out_budget=16) as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(tiny_dirs, ar_reference, outs)
    assert run["hit_rate"] > 0


def test_a_build_needs_the_jit_drafts_hidden_states_of_its_k():
    target = PreviousTokenTarget()
    drafter = FeatureSpecDraft(oracle_draft(target), 2, 64, V, 4 * K, "cpu", torch.float32,
                               draws=K - 1)
    with pytest.raises(ValueError, match="draws=2"):
        FeatureCacheBuilder(drafter, SpeculationCache(2, 4, K, V, torch.device("cpu")), V, 1.0)
