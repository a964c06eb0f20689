"""SD and SSD are exact: greedy output equals AR token for token, and sampled output has the
target's distribution (chi-square against the distribution computed by enumeration).

SD with tp=1 runs in this process; SSD (and SD with tp=2) spawn their ranks (CPU, gloo).
"""

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.sampling import target_probs
from tests.speculative.spec_stats import chi2_test

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [40, 41], [3, 9, 27, 81]]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ar_reference(tiny_dirs):
    with Generator(target=tiny_dirs["smol_heads"], max_batch=4, max_len=128) as g:
        return [o.token_ids for o in g.generate(PROMPTS, GREEDY)]


def explain_mismatch(target_dir, prompt, ref, out):
    """A mismatch is only acceptable as a near tie (top-2 logit gap < 1e-4) at the divergence."""
    from ssdlib.loading import load_checkpoint
    from ssdlib.models.llama import LlamaForCausalLM

    i = next(j for j, (a, b) in enumerate(zip(ref, out)) if a != b)
    ck = load_checkpoint(target_dir)
    m = LlamaForCausalLM(ck.config, None, 256)
    m.load_weights(ck.weights)
    with torch.no_grad():
        logits = m.forward_full(torch.tensor([prompt + ref[:i]]))[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < 1e-4, f"greedy mismatch at token {i} with top-2 gap {gap} (not a near tie)"


def check_equal(tiny_dirs, ref, outs):
    for p, r, o in zip(PROMPTS, ref, outs):
        if r != o.token_ids:
            explain_mismatch(tiny_dirs["smol_heads"], p, r, o.token_ids)


@pytest.mark.parametrize("draft,batch,tp", [("smol_heads_draft", 1, 1), ("smol_heads_draft", 4, 1),
                                           ("smol_heads_bad_draft", 3, 1),
                                           ("smol_heads_draft", 2, 2)])
def test_sd_greedy_equals_ar(tiny_dirs, ar_reference, draft, batch, tp):
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs[draft], mode="sd", k=4, tp=tp,
                   max_batch=batch, max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)
    # (a sequence that adaptive K never let draft, the bad draft's, has no acceptance rate)
    rates = [o.metrics.get("acceptance_rate") for o in outs]
    assert all(r is None or 0 <= r <= 1 for r in rates)
    assert any(r is not None for r in rates) or draft == "smol_heads_bad_draft"


def test_sd_with_draft_on_its_own_rank(tiny_dirs, ar_reference):
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"], mode="sd",
                   draft_placement="separate", k=4, max_batch=2, max_len=128,
                   adaptive_k=False) as g:  # K = 4 every round: speculation happens
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(tiny_dirs, ar_reference, outs)
    assert run["tokens_per_round"] > 1.5 and "hit_rate" not in run


def test_sd_acceptance_is_one_when_draft_is_target(tiny_dirs, ar_reference):
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads"], mode="sd", k=4,
                   max_batch=4, max_len=128, adaptive_k=False) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)
    assert all(o.metrics["mean_accepted"] > 3.0 for o in outs)


@pytest.mark.parametrize("placement", ["stream", "stream-plain", "rank"])
@pytest.mark.parametrize("fallback,fan_out,draft,batch,tp", [
    ("jit", "all-accepted:4", "smol_heads_draft", 2, 1),
    ("ngram", "auto", "smol_heads_draft", 1, 1),
    ("random", "3,2,2,1,4", "smol_heads_draft", 3, 1),
    ("auto", "auto", "smol_heads_bad_draft", 4, 2),
    ("jit", "auto", "smol_heads_draft", 2, 4),  # rank placement: world 5, TP 4 + speculator
])
def test_ssd_greedy_equals_ar(tiny_dirs, ar_reference, fallback, fan_out, draft, batch, tp,
                              placement, monkeypatch):
    """Greedy SSD == AR: the rank placement, the stream placement in chained rounds (the
    default for greedy rows) and in plain rounds (``SSDLIB_CHAINED_ROUNDS=0``)."""
    chained = placement == "stream" and tp == 1  # (chained rounds: a target on one rank)
    if placement == "stream-plain":
        monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")
        placement = "stream"
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs[draft], mode="ssd", k=4,
                   tp=tp, max_batch=batch, max_len=128, fallback=fallback, fan_out=fan_out,
                   speculator_placement=placement) as g:
        assert g.cfg.world_size == tp + (placement == "rank")
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)
    hits = sum(o.metrics.get("hits", 0) for o in outs)
    lookups = sum(o.metrics.get("lookups", 0) for o in outs)
    assert 0 < hits < lookups, "both cache hits and misses must occur in this test"
    used = set().union(*(o.metrics.get("fallbacks", {}).keys() for o in outs))
    if chained:  # a chained round's miss: an n-gram proposal, or placeholder tokens ("none")
        assert used <= {"ngram", "none"} and used, used
        assert all(o.metrics["chained_rounds"] > 0 for o in outs)
    else:
        # a hit's speculation is continued from its drafted branch, not recomputed
        assert outs[0].metrics["branch_kv_reused_frac"] > 0.5
        assert not any(o.metrics.get("chained_rounds") for o in outs)
    if fallback != "auto" and not chained:
        assert used <= {fallback, "random"} and used, used  # ngram falls back to random
    # every verified round is counted under the source of its speculation: a sequence's
    # first, the cache (one round per hit) or the fallback that answered a miss
    for o in outs:
        by_source = o.metrics["accepted_by_source"]
        assert sum(r for r, _ in by_source.values()) == o.metrics["rounds"]
        assert sum(a for _, a in by_source.values()) == o.metrics["accepted"]


# ---- adaptive K: the policy's choices, and per-row limits forced by a schedule ----------------
@pytest.fixture
def prior_costs(monkeypatch):
    """The policy decides on its cost priors (a draft step = 1/4 verify): on a CPU a tiny draft
    costs as much as its target, and measured costs would make K = 0 right for any draft."""
    from ssdlib.speculative.adaptive_k import StepCosts

    monkeypatch.setattr(StepCosts, "observe_draft", lambda *a: None)
    monkeypatch.setattr(StepCosts, "observe_round", lambda *a: None)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A draft with random weights of its own (its greedy tokens rarely agree with the
    target's)."""
    from tests.tiny import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("random_draft")), "smol_heads", seed=5)


def test_adaptive_k_falls_to_zero_with_a_random_draft(tiny_dirs, ar_reference, random_draft,
                                                      prior_costs):
    with Generator(target=tiny_dirs["smol_heads"], draft=random_draft, mode="sd", k=4,
                   max_batch=4, max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(tiny_dirs, ar_reference, outs)
    assert all(o.metrics["k0_rounds"] > o.metrics["rounds"] / 2 for o in outs)
    assert run["mean_k"] < 1.5 and run["k0_rounds"] == sum(o.metrics["k0_rounds"] for o in outs)
    assert all(o.metrics["k_alpha"] < 0.5 for o in outs)  # from the prior, 0.9
    assert "round_ms_by_k" in run["k_costs"]


def test_adaptive_k_keeps_k_max_when_the_draft_is_the_target(tiny_dirs, ar_reference,
                                                             prior_costs):
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads"], mode="sd", k=4,
                   max_batch=4, max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)
    assert all(o.metrics["mean_k"] == 4 and o.metrics["k0_rounds"] == 0 for o in outs)
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)


# row s of the n-th choice gets SCHEDULE[(s + n) % 12]: rows of one round differ, and rounds at
# K = 0 for up to four rows in a row (an AR step of the batch, the draft caught up after it), at
# K_max and in between follow one another
SCHEDULE = "4,0,0,0,0,2,0,0,0,0,1,3"


@pytest.mark.parametrize("mode,kw,batch", [
    ("sd", {}, 4), ("sd", {"draft_placement": "separate"}, 2),
    ("ssd", {"speculator_placement": "stream", "fallback": "jit"}, 3),
    ("ssd", {"speculator_placement": "rank", "fallback": "ngram"}, 2)])
def test_greedy_equals_ar_with_per_row_limits(tiny_dirs, ar_reference, monkeypatch, mode, kw,
                                              batch):
    monkeypatch.setenv("SSDLIB_K_SCHEDULE", SCHEDULE)
    with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                   mode=mode, k=4, max_batch=batch, max_len=128, **kw) as g:
        outs = g.generate(PROMPTS, GREEDY)
    check_equal(tiny_dirs, ar_reference, outs)
    for o in outs:
        assert 0 < o.metrics["k0_rounds"] < o.metrics["rounds"] and 0 < o.metrics["mean_k"] < 4
        assert o.metrics["tried"] <= o.metrics["drafted"] <= 4 * o.metrics["rounds"]
        # the round-by-round K: runs of [K, rounds] adding up to the rounds, K from the schedule
        runs = o.metrics["k_runs"]
        assert sum(n for _, n in runs) == o.metrics["rounds"]
        assert sum(k * n for k, n in runs) == o.metrics["drafted"]
        assert sum(n for k, n in runs if k == 0) == o.metrics["k0_rounds"]
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))


# ---- distribution tests ----------------------------------------------------------------------
N_SAMPLES = 2000
PROMPT = [3, 1, 4]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    from tests.tiny import make_small_vocab_pair

    return make_small_vocab_pair(str(tmp_path_factory.mktemp("small_vocab")), 12.0, 0.15)


def exact_joint(target_dir, temperature, top_p):
    """p(t1, t2 | PROMPT) under the AR sampling rule, by enumeration: [V, V]."""
    from ssdlib.loading import load_checkpoint
    from ssdlib.models.llama import LlamaForCausalLM

    ck = load_checkpoint(target_dir)
    m = LlamaForCausalLM(ck.config, None, 64)
    m.load_weights(ck.weights)
    V = ck.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(m.forward_full(torch.tensor([PROMPT]))[0, -1], temperature, 0, top_p)
        seqs = torch.tensor([PROMPT + [t] for t in range(V)])
        p2 = target_probs(m.forward_full(seqs)[:, -1], temperature, 0, top_p)  # [V, V]
    return p1[:, None] * p2


def sample_pairs(gen: Generator, temperature, top_p, seed=0):
    params = SamplingParams(max_new_tokens=2, temperature=temperature, top_p=top_p, seed=seed,
                            ignore_eos=True)
    outs = gen.generate([PROMPT] * N_SAMPLES, params)
    V = gen.model_config.vocab_size
    counts = torch.zeros(V, V)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    return counts


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sd_sampling_distribution(small_vocab, temperature, top_p):
    t, d = small_vocab
    with Generator(target=t, draft=d, mode="sd", k=3, max_batch=1000, max_len=32) as g:
        counts = sample_pairs(g, temperature, top_p)
        assert g.last_run_metrics["acceptance_rate"] < 0.98  # the draft really differs
    assert chi2_test(counts, exact_joint(t, temperature, top_p)) > 1e-3


def test_sd_wrong_verifier_is_detected(small_vocab, monkeypatch):
    """Dropping top-p from the verifier's p must fail the same test (the test has power)."""
    import copy
    import dataclasses

    import ssdlib.engine.leader.verify as verify

    t, d = small_vocab
    real = verify.row_distributions

    def without_top_p(logits, seqs):
        seqs = [copy.copy(q) for q in seqs]
        for q in seqs:
            q.params = dataclasses.replace(q.params, top_p=1.0)
        return real(logits, seqs)

    monkeypatch.setattr(verify, "row_distributions", without_top_p)
    with Generator(target=t, draft=d, mode="sd", k=3, max_batch=1000, max_len=32) as g:
        counts = sample_pairs(g, 0.8, 0.9)
    assert chi2_test(counts, exact_joint(t, 0.8, 0.9)) < 1e-3


@pytest.mark.parametrize("placement", ["stream", "rank"])
@pytest.mark.parametrize("fallback,saguaro_c,batch", [("jit", 0.5, 1000), ("random", 1.0, 1000),
                                                   ("ngram", 0.7, 400)])
def test_ssd_sampling_distribution(small_vocab, fallback, saguaro_c, batch, placement):
    t, d = small_vocab
    with Generator(target=t, draft=d, mode="ssd", k=3, max_batch=batch, max_len=32,
                   fallback=fallback, saguaro_c=saguaro_c, fan_out="2,1,1,2",
                   speculator_placement=placement) as g:
        counts = sample_pairs(g, 0.8, 0.9, seed=1)
    assert chi2_test(counts, exact_joint(t, 0.8, 0.9)) > 1e-3


@pytest.mark.parametrize("placement", ["stream", "stream-plain", "rank"])
def test_ssd_mixed_greedy_and_sampled_rows_with_refill(tiny_dirs, ar_reference, placement,
                                                      monkeypatch):
    """Greedy rows keep their exact output, and accept exactly as much as when run alone, while
    sampled rows join and leave the batch (alone, the stream placement runs them in chained
    rounds, whose misses take other speculations: there only the output is compared). K is
    fixed: adaptive K's timing rounds come at times that depend on the batch's rounds."""
    chained = placement == "stream"
    if placement == "stream-plain":
        monkeypatch.setenv("SSDLIB_CHAINED_ROUNDS", "0")
        placement = "stream"
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    prompts = [PROMPTS[0], [7, 8, 9], PROMPTS[1], [4, 5], [6, 6, 6]]
    params = [greedy, sampled, greedy, sampled, sampled]
    kw = dict(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"], mode="ssd",
              k=4, max_len=128, fallback="jit", speculator_placement=placement,
              adaptive_k=False)
    with Generator(max_batch=2, **kw) as g:
        outs = g.generate(prompts, params)
    with Generator(max_batch=1, **kw) as g:
        alone = g.generate([PROMPTS[0], PROMPTS[1]], greedy)
    assert outs[0].token_ids == ar_reference[0] and outs[2].token_ids == ar_reference[1]
    assert [o.token_ids for o in alone] == ar_reference[:2]
    if not chained:
        assert [outs[0].metrics["accepted"], outs[2].metrics["accepted"]] == \
            [o.metrics["accepted"] for o in alone]
    assert all(len(outs[i].token_ids) == 6 for i in (1, 3, 4))


@pytest.fixture(scope="module")
def close_draft(small_vocab, tmp_path_factory):
    """A draft nearer the small-vocabulary target: most drafts are accepted, so rows often use
    all of their K_i, where the limit decides how t* is drawn."""
    from tests.tiny import make_noisy_draft

    return make_noisy_draft(small_vocab[0], str(tmp_path_factory.mktemp("close_draft")), 0.03)


@pytest.mark.parametrize("mode,kw,schedule", [
    ("sd", {}, "3,0,2,0,1"), ("sd", {}, "0"),
    ("ssd", {"speculator_placement": "stream"}, "3,0,2,0,1"),
    ("ssd", {"speculator_placement": "rank"}, "3,0,2,0,1")])
def test_sampling_distribution_with_per_row_limits(small_vocab, close_draft, monkeypatch, mode,
                                                   kw, schedule):
    """Rows of one verify limited to different K (schedule "0": every round an AR step of the
    target): still the target's distribution."""
    t, d = small_vocab[0], close_draft
    monkeypatch.setenv("SSDLIB_K_SCHEDULE", schedule)
    extra = dict(fallback="jit", fan_out="2,1,1,2") if mode == "ssd" else {}
    with Generator(target=t, draft=d, mode=mode, k=3, max_batch=1000, max_len=32, **extra,
                   **kw) as g:
        counts = sample_pairs(g, 2.0, 1.0, seed=4)  # T = 2: a sharp target spreads its mass
        run = g.last_run_metrics
    assert run["k0_rounds"] > 0
    assert chi2_test(counts, exact_joint(t, 2.0, 1.0)) > 1e-3


def test_per_row_limits_bonus_from_a_residual_is_detected(small_vocab, close_draft, monkeypatch):
    """Power: a row that accepted all of its K_i < K drafts must draw t* from p at K_i; drawing
    it from the residual there (as if draft K_i + 1 had been rejected) must fail the test."""
    import ssdlib.engine.leader.verify as verify
    from ssdlib.speculative.rng import sample_categorical

    t, d = small_vocab[0], close_draft
    real = verify.verify_sampled

    def residual_at_the_limit(tokens, q, p, limits, generators):
        o = real(tokens, q, p, limits, generators)
        rows = torch.arange(len(tokens))
        k = o.accepted
        pos = k.clamp(max=tokens.shape[1] - 1)
        residual = (p[rows, k] - q.at(pos, tokens[rows, pos], p.shape[-1])).clamp_min(0)
        full = (k == o.num_draft) & (k < tokens.shape[1]) & (residual.sum(-1) > 0)
        wrong = sample_categorical(residual + (residual.sum(-1, keepdim=True) == 0),
                                   torch.rand(len(tokens), dtype=torch.float64))
        return type(o)(k, torch.where(full, wrong, o.bonus), o.accepted_mask, o.num_draft)

    monkeypatch.setattr(verify, "verify_sampled", residual_at_the_limit)
    monkeypatch.setenv("SSDLIB_K_SCHEDULE", "3,0,2,0,1")
    with Generator(target=t, draft=d, mode="sd", k=3, max_batch=1000, max_len=32) as g:
        counts = sample_pairs(g, 2.0, 1.0, seed=4)
    assert chi2_test(counts, exact_joint(t, 2.0, 1.0)) < 1e-3
