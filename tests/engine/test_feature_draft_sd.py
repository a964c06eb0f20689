"""SD with a feature draft (EAGLE-style) in the engine, on tiny models (CPU): the target keeps
every fed position's features per slot (equal to a reference forward), the drafter proposes what
a cache-free rollout of the draft proposes from those features, greedy SD equals AR, sampled SD
keeps the target's distribution, and a feature draft is refused where it cannot run."""

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.engine.batching import prefill
from ssdlib.engine.feature_drafter import FeatureDrafter
from ssdlib.engine.runner.model_runner import use_slot_kernel
from ssdlib.errors import ConfigError
from ssdlib.loading.feature_draft import save_feature_draft
from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.llama import LlamaDecoderLayer
from ssdlib.ops.graph_pool import EagerPool, make_graph_pool
from tests.engine.test_speculative_exact import (GREEDY, PROMPTS, check_equal, exact_joint,
                                                 sample_pairs)
from tests.feature_helpers import (Seq, counting_backend, fresh_dynamo, frozen_target,
                                   runner_and_draft)
from tests.speculative.spec_stats import chi2_test
from tools.distill.feature_train import init_feature_draft


def _feature_draft(target_dir, out, seed=0, layers=1):
    _, model = frozen_target(target_dir)
    draft = FeatureDraft.for_target(model, layers)
    init_feature_draft(draft, model, seed)
    save_feature_draft(draft, str(out), torch.float32)
    return str(out)


@pytest.fixture(scope="module")
def feature_draft(tiny_dirs, tmp_path_factory):
    return _feature_draft(tiny_dirs["smol_heads"], tmp_path_factory.mktemp("fd") / "draft")


@pytest.fixture(scope="module")
def ar_reference(tiny_dirs):
    with Generator(target=tiny_dirs["smol_heads"], max_batch=4, max_len=128) as g:
        return [o.token_ids for o in g.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("batch,adaptive", [(1, False), (4, False), (3, True)])
def test_sd_with_a_feature_draft_equals_ar(tiny_dirs, ar_reference, feature_draft, batch,
                                           adaptive):
    with Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode="sd", k=4,
                   max_batch=batch, max_len=128, adaptive_k=adaptive) as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(tiny_dirs, ar_reference, outs)
    assert run["tokens_per_round"] >= 1.0


def test_the_targets_features_and_the_drafts_proposal_match_references(tiny_dirs,
                                                                        feature_draft):
    """After a generation the target's feature buffer holds, for every committed position but
    the last, the reference forward's features; a proposal from there equals a cache-free
    rollout of the draft over those features (its own h standing in past them)."""
    target_dir = tiny_dirs["smol_heads"]
    with Generator(target=target_dir, draft=feature_draft, mode="sd", k=3, max_batch=2,
                   max_len=128, adaptive_k=False) as gen:
        outs = gen.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, ignore_eos=True))

    ck, model, runner, draft = runner_and_draft(target_dir, feature_draft, 2)
    drafter = FeatureDrafter(draft, runner.cache.features, 3, runner.cache.max_len,
                             ck.config.vocab_size, draws=3)
    # sampled at T = 1: q is the draft's softmax
    seqs = [Seq(i, PROMPTS[i] + outs[i].token_ids, SamplingParams(temperature=1.0, seed=i))
            for i in range(2)]
    for s in seqs:
        drafter.reset(s.slot)
    prefill(runner, seqs)  # the target over every committed token: its features per position
    for s in seqs:
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            want = model.forward_full_features(ids)[1][0]
        got = runner.cache.features[s.slot, :len(s.tokens)]
        assert torch.allclose(got, want, atol=1e-5)
    tokens, q = drafter.propose(seqs, 3)
    assert q.shape == (2, 3, ck.config.vocab_size)
    for i, s in enumerate(seqs):
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            feats = model.forward_full_features(ids)[1][:, :-1]  # f_0 .. f_{L-2}
            nxt = ids[:, 1:]
            for j in range(3):  # the reference rollout, along the drafter's own tokens
                logits, hidden = draft.forward_full(feats, nxt)
                want = torch.softmax(logits[0, -1].float(), -1)
                assert torch.allclose(q[i, j], want, atol=1e-5), (i, j)
                tok = tokens[i, j].view(1, 1)
                feats = torch.cat([feats, hidden[:, -1:]], dim=1)
                nxt = torch.cat([nxt, tok], dim=1)


@pytest.mark.parametrize("temperature,top_p,captured", [(1.0, 1.0, False), (0.8, 0.9, False),
                                                         (0.8, 0.9, True)])
def test_sd_sampling_with_a_feature_draft_keeps_the_targets_distribution(tmp_path, monkeypatch,
                                                                          temperature, top_p,
                                                                          captured):
    """(captured: the proposals through the captured-step path, eager replays on the CPU)"""
    from tests.tiny import make_tiny_llama

    if captured:
        monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")

    t = make_tiny_llama(str(tmp_path / "t"), "gqa", scale=12.0, vocab_size=8)
    d = _feature_draft(t, tmp_path / "d", seed=1)
    with Generator(target=t, draft=d, mode="sd", k=3, max_batch=1000, max_len=32,
                   adaptive_k=False) as g:  # it drafts every round, and is often rejected
        counts = sample_pairs(g, temperature, top_p)
        assert g.last_run_metrics["acceptance_rate"] < 0.98
    assert chi2_test(counts, exact_joint(t, temperature, top_p)) > 1e-3


def test_a_feature_draft_is_refused_where_it_cannot_run(tiny_dirs, feature_draft):
    with pytest.raises(ConfigError, match="feature draft.*leader"):
        Generator(target=tiny_dirs["smol_heads"], draft=feature_draft, mode="sd", k=3,
                  draft_placement="separate")


def test_features_are_kept_on_the_captured_step_path(tiny_dirs, ar_reference, feature_draft,
                                                     monkeypatch):
    """The target's captured-step code path (run eagerly on the CPU, every batch bucket, padded
    rows into the scratch slot) keeps the features as the eager path does: SD with the feature
    draft equals AR, and the engine's feature buffer holds the reference forward's features of
    the committed positions."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    target_dir = tiny_dirs["smol_heads"]
    _, model = frozen_target(target_dir)
    with Generator(target=target_dir, draft=feature_draft, mode="sd", k=3, max_batch=4,
                   max_len=128, adaptive_k=False) as g:
        outs = g.generate(PROMPTS, GREEDY)
        check_equal(tiny_dirs, ar_reference, outs)
        # one prompt alone in slot 0: its committed positions' features, as the reference's
        out = g.generate([PROMPTS[0]], GREEDY)[0]
        features = g._runtime.leader.loop.target.runner.cache.features
    tokens = PROMPTS[0] + out.token_ids
    with torch.no_grad():
        want = model.forward_full_features(torch.tensor([tokens]))[1][0]
    n = len(tokens) - 1  # the last token is committed, not fed yet
    assert torch.allclose(features[0, :n], want[:n], atol=1e-4)


def test_the_captured_greedy_chain_proposes_what_the_eager_chain_does(tiny_dirs,
                                                                       feature_draft):
    """Greedy proposals through a graph pool (eager replays here; 3 rows in bucket 4, a ghost
    row) equal the eager drafter's and a cache-free rollout's: a round whose rows fit no
    captured proposal (the eager feed, then the captured chain), one with every row within
    K_max + 1 unfed tokens (feed and chain as one captured proposal), and one after rounds at
    K = 0 (each row far behind: fed eagerly up to its last position but one, then the captured
    proposal)."""
    ck, model, runner, draft = runner_and_draft(tiny_dirs["smol_heads"], feature_draft, 4)

    def rollout(tokens, k):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            feats = model.forward_full_features(ids)[1][:, :-1]
            nxt, out = ids[:, 1:], []
            for _ in range(k):
                logits, hidden = draft.forward_full(feats, nxt)
                tok = logits[0, -1].argmax().view(1, 1)
                out.append(int(tok))
                feats, nxt = torch.cat([feats, hidden[:, -1:]], 1), torch.cat([nxt, tok], 1)
        return out

    pool = EagerPool(warmup=1)
    drafters = [FeatureDrafter(draft, runner.cache.features, 5, runner.cache.max_len,
                               ck.config.vocab_size, draws=4, pool=p) for p in (None, pool)]
    seqs = [Seq(i, PROMPTS[i] + [1 + i, 2, 3 + i]) for i in range(3)]
    for d in drafters:
        for s in seqs:
            d.reset(s.slot)
    fits = drafters[1]._feed_inputs
    replayed = []
    replay = pool.replay
    pool.replay = lambda key: replayed.append(key[0]) or replay(key)
    for round_ in range(3):
        replayed.clear()
        prefill(runner, seqs)  # the target's features of every committed position
        # round 0: no row fits a captured proposal (as at the cache's end)
        drafters[1]._feed_inputs = (lambda *a: None) if round_ == 0 else fits
        proposals = []
        for d in drafters:
            tokens, q = d.propose(seqs, 4, want_q=False)
            assert q is None and tokens.shape == (3, 4)
            proposals.append(tokens.tolist())
        assert proposals[0] == proposals[1], round_
        for i, s in enumerate(seqs):
            assert proposals[1][i] == rollout(s.tokens, 4), (round_, i)
        kinds = {key[0] for key in pool.keys()}
        assert kinds == ({"feature_chain"} if round_ == 0 else
                         {"feature_chain", "feature_proposal"})
        # one replay a proposal: the chain after the eager feed, then the whole proposal (in
        # round 2 after the eager catch-up)
        assert replayed == (["feature_chain"] if round_ == 0 else ["feature_proposal"]), round_
        for i, s in enumerate(seqs):  # the round commits 2 drafts and a bonus token, and
            # after round 1 three rounds at K = 0 commit a token each (the draft falls behind)
            s.tokens = s.tokens + proposals[0][i][:2] + [7 + i] + ([5, 6, 7] if round_ else [])


def test_a_compiled_drafter_proposes_what_the_plain_one_does(tiny_dirs, feature_draft):
    """Proposals with the draft's layers under torch.compile (``compile_backend``; here a
    backend that runs the traced graph and counts, through the captured steps' code path)
    equal the plain eager drafter's over three rounds, and the captured steps ran the compiled
    layers (the admission's feed of a whole prompt runs the plain draft)."""
    with fresh_dynamo():
        ck, _, runner, draft = runner_and_draft(tiny_dirs["smol_heads"], feature_draft, 4)
        runs: list = []
        # (no warm-up run under the capture rules' dispatch mode: dynamo runs a frame eagerly
        # from then on)
        drafters = [FeatureDrafter(draft, runner.cache.features, 5, runner.cache.max_len,
                                   ck.config.vocab_size, draws=4, pool=pool,
                                   compile_backend=backend)
                    for pool, backend in ((None, None), (EagerPool(), counting_backend(runs)))]
        assert drafters[0].step_draft is draft and drafters[1].step_draft is not draft
        # the compiled view shares the draft's weights; the draft keeps its plain layers
        assert all(type(m) is LlamaDecoderLayer for m in draft.layers)
        assert drafters[1].step_draft.fc is draft.fc
        assert not any(type(m) is LlamaDecoderLayer for m in drafters[1].step_draft.layers)
        seqs = [Seq(i, PROMPTS[i] + [1 + i, 2, 3 + i]) for i in range(3)]
        for d in drafters:
            for s in seqs:
                d.reset(s.slot)
        trial = len(runs)
        for round_ in range(3):
            prefill(runner, seqs)
            proposals = [d.propose(seqs, 4, want_q=False)[0].tolist() for d in drafters]
            assert proposals[0] == proposals[1], round_
            for i, s in enumerate(seqs):
                s.tokens = s.tokens + proposals[0][i][:2] + [7 + i]
        assert len(runs) > trial + 3 * 3  # each round's chain steps at least


def _drafter_pair(ck, runner, draft, pool, dev="cpu"):
    """An eager drafter and one through ``pool`` (the in-place attention kernel where it runs),
    beside the target ``runner``."""
    dev = torch.device(dev)
    return [FeatureDrafter(draft, runner.cache.features, 5, runner.cache.max_len,
                           ck.config.vocab_size, draws=4, pool=p,
                           use_kernel=use_slot_kernel(dev) and p is not None)
            for p in (None, pool)]


def _check_sampled_proposals(runner, drafters, pool, atol=1e-6, rtol=1e-5):
    """Two rounds of sampled proposals for 3 rows (bucket 4: a ghost row; a greedy row among
    sampling ones, top-p on one), each one captured proposal, the first with rows far behind
    (fed eagerly up to their last position but one first): both drafters draw the same tokens
    with the same q from the same streams."""
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2)]
    runs = [[Seq(i, PROMPTS[i] + [1 + i, 2, 3 + i], params[i]) for i in range(3)]
            for _ in drafters]
    for d, seqs in zip(drafters, runs):
        for s in seqs:
            d.reset(s.slot)
    for round_ in range(2):
        prefill(runner, runs[0])  # the target's features of every committed position
        out = [d.propose(seqs, 4) for d, seqs in zip(drafters, runs)]
        assert torch.equal(out[0][0], out[1][0]), round_
        torch.testing.assert_close(out[0][1], out[1][1], atol=atol, rtol=rtol)
        assert torch.equal(out[1][1][1].argmax(-1), out[1][0][1])  # the greedy row: one-hot q
        kinds = {key[0] for key in pool.keys()}
        assert "feature_sampled_proposal" in kinds
        for seqs in runs:  # the round commits 2 drafts and a bonus token
            for i, s in enumerate(seqs):
                s.tokens = s.tokens + out[0][0][i, :2].tolist() + [7 + i]


def test_the_captured_sampled_proposal_draws_what_the_eager_one_does(tiny_dirs, feature_draft):
    """Sampled proposals through a graph pool (eager replays here) draw the eager drafter's
    tokens with its q (:func:`_check_sampled_proposals`)."""
    ck, _, runner, draft = runner_and_draft(tiny_dirs["smol_heads"], feature_draft, 4)
    pool = EagerPool(warmup=2)
    _check_sampled_proposals(runner, _drafter_pair(ck, runner, draft, pool), pool)


def test_the_captured_chains_ghost_rows_write_only_to_the_scratch_slot(tiny_dirs, feature_draft):
    """A batch of 4 fills bucket 4; a batch of 3 after it leaves a ghost row, which must write
    to the scratch slot, not to the slot the 4th row had (that row's draft KV is kept)."""
    ck, _, runner, draft = runner_and_draft(tiny_dirs["smol_heads"], feature_draft, 4)
    seqs = [Seq(i, PROMPTS[i] + [1 + i, 2, 3 + i]) for i in range(4)]
    prefill(runner, seqs)
    drafter = FeatureDrafter(draft, runner.cache.features, 5, runner.cache.max_len,
                             ck.config.vocab_size, draws=4, pool=EagerPool(warmup=1))
    for s in seqs:
        drafter.reset(s.slot)
    drafter.propose(seqs, 4, want_q=False)
    kept = drafter.cache.k[:, 3].clone()
    drafter.propose(seqs[:3], 4, want_q=False)
    assert torch.equal(drafter.cache.k[:, 3], kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_captured_feature_proposals_equal_eager_ones_on_cuda(tiny_dirs, feature_draft):
    """On CUDA (fp32): greedy proposals replayed from CUDA graphs (the in-place attention
    kernel where triton is there) equal the eager drafter's, over two rounds; and SD with the
    feature draft equals AR."""
    dev = torch.device("cuda")
    ck, _, runner, draft = runner_and_draft(tiny_dirs["smol_heads"], feature_draft, 4, dev)
    pool = make_graph_pool(dev)
    drafters = _drafter_pair(ck, runner, draft, pool, dev)
    seqs = [Seq(i, PROMPTS[i] + [1 + i, 2, 3 + i]) for i in range(3)]
    for d in drafters:
        for s in seqs:
            d.reset(s.slot)
    for _ in range(2):
        prefill(runner, seqs)
        proposals = [d.propose(seqs, 4, want_q=False)[0].tolist() for d in drafters]
        assert proposals[0] == proposals[1]
        for i, s in enumerate(seqs):
            s.tokens = s.tokens + proposals[0][i][:2] + [7 + i]
    assert len(pool) > 0
    pool.clear()
    runs = []
    for kw in ({"mode": "ar"}, {"mode": "sd", "draft": feature_draft, "k": 3}):
        with Generator(target=tiny_dirs["smol_heads"], device="cuda", dtype="float32",
                       max_batch=4, max_len=128, **kw) as g:
            runs.append([o.token_ids for o in g.generate(PROMPTS, GREEDY)])
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_captured_sampled_feature_proposals_equal_eager_ones_on_cuda(tiny_dirs, feature_draft):
    """On CUDA (fp32): sampled proposals replayed from CUDA graphs draw the eager drafter's
    tokens with its q (:func:`_check_sampled_proposals`)."""
    dev = torch.device("cuda")
    ck, _, runner, draft = runner_and_draft(tiny_dirs["smol_heads"], feature_draft, 4, dev)
    pool = make_graph_pool(dev)
    _check_sampled_proposals(runner, _drafter_pair(ck, runner, draft, pool, dev), pool,
                             atol=1e-5, rtol=1e-4)


def test_a_failed_capture_leaves_the_drafter_eager(tiny_dirs, feature_draft):
    """A pool whose capture fails: one warning, and the proposals are the eager drafter's."""
    import logging

    from ssdlib.engine import feature_drafter

    class Failing(EagerPool):
        def _capture(self, key, fn):
            raise RuntimeError("no graphs here")

    class Records(logging.Handler):  # the module's logger itself (it need not propagate)
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    ck, _, runner, draft = runner_and_draft(tiny_dirs["smol_heads"], feature_draft, 4)
    seqs = [Seq(i, PROMPTS[i] + [1 + i, 2, 3 + i]) for i in range(2)]
    prefill(runner, seqs)
    records = Records()
    feature_drafter.log.addHandler(records)
    try:
        proposals = []
        for pool in (None, Failing()):
            drafter = FeatureDrafter(draft, runner.cache.features, 5, runner.cache.max_len,
                                     ck.config.vocab_size, draws=4, pool=pool)
            for s in seqs:
                drafter.reset(s.slot)
            proposals.append(drafter.propose(seqs, 4, want_q=False)[0].tolist())
            assert drafter.pool is None
    finally:
        feature_drafter.log.removeHandler(records)
    assert proposals[0] == proposals[1]
    assert records.messages == [
        "capturing the feature draft's feature_proposal failed (RuntimeError: no graphs here); "
        "it runs eagerly"]
