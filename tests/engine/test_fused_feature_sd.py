"""SD with a fused feature draft (EAGLE-3's features: three target layers' outputs) on a tiny
4-layer target (CPU, fp32): the target keeps, per slot, the chosen layers' outputs concatenated
(equal to a plain forward's layer outputs), the drafter conditions them through the draft's fuse
and proposes what a cache-free rollout does, greedy SD equals AR (eager, on the captured-step
path, and with the target over two TP ranks), and a buffer of another width is refused."""

import pytest
import torch

from ssdlib import Generator, SamplingParams
from ssdlib.engine.batching import prefill
from ssdlib.engine.feature_drafter import FeatureDrafter
from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.errors import CheckpointError
from ssdlib.loading.feature_draft import save_feature_draft
from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.feature_spec import FeatureSpec
from ssdlib.ops.graph_pool import EagerPool
from tests.engine.test_speculative_exact import GREEDY, PROMPTS, explain_mismatch
from tests.tiny import make_tiny_llama
from tests.feature_helpers import Seq, frozen_target, runner_and_draft
from tools.distill.feature_train import init_feature_draft

SPEC = FeatureSpec.fused(4)  # layers 1, 2, 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, fused draft dir): a 4-layer target with SmolLM2's head counts, and a fused
    draft whose fuse mixes all three layers."""
    root = tmp_path_factory.mktemp("fused_sd")
    target = make_tiny_llama(str(root / "t"), "smol_heads", scale=2.0, num_hidden_layers=4)
    _, model = frozen_target(target)
    draft = FeatureDraft.for_target(model, 1, feature=SPEC)
    init_feature_draft(draft, model, 0)
    with torch.no_grad():
        draft.fuse.weight.add_(torch.randn(draft.fuse.weight.shape,
                                           generator=torch.Generator().manual_seed(1)) * 0.1)
    save_feature_draft(draft, str(root / "d"), torch.float32)
    return target, str(root / "d")


@pytest.fixture(scope="module")
def ar_reference(pair):
    with Generator(target=pair[0], max_batch=4, max_len=128) as g:
        return [o.token_ids for o in g.generate(PROMPTS, GREEDY)]


def check_equal(target_dir, ref, outs):
    for p, r, o in zip(PROMPTS, ref, outs):
        if r != o.token_ids:
            explain_mismatch(target_dir, p, r, o.token_ids)


def reference_features(model, tokens) -> torch.Tensor:
    """The fused layers' outputs of a plain forward over ``tokens``, concatenated: [L, 3H]."""
    seen = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda m, inp, out, i=i: seen.__setitem__(i, out)) for i in SPEC.layers]
    try:
        with torch.no_grad():
            model.forward_full(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i] for i in SPEC.layers], dim=-1)[0]


def rollout(model, draft, tokens, k, chosen=None):
    """A cache-free rollout: the target's fused features of every committed position but the
    last, conditioned, then the draft's own h; (tokens, q) of k steps (along ``chosen`` tokens
    when given, else greedy)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        feats = draft.condition(model.forward_full_features(ids, SPEC.layers)[1][:, :-1])
        nxt, out, qs = ids[:, 1:], [], []
        for j in range(k):
            logits, hidden = draft.forward_full(feats, nxt)
            qs.append(torch.softmax(logits[0, -1].float(), -1))
            tok = logits[0, -1].argmax().view(1, 1) if chosen is None else chosen[j].view(1, 1)
            out.append(int(tok))
            feats, nxt = torch.cat([feats, hidden[:, -1:]], 1), torch.cat([nxt, tok], 1)
    return out, qs


@pytest.mark.parametrize("batch,adaptive,tp", [(1, False, 1), (4, False, 1), (3, True, 1),
                                               (2, False, 2)])
def test_sd_with_a_fused_feature_draft_equals_ar(pair, ar_reference, batch, adaptive, tp):
    with Generator(target=pair[0], draft=pair[1], mode="sd", k=4, max_batch=batch, tp=tp,
                   max_len=128, adaptive_k=adaptive) as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(pair[0], ar_reference, outs)
    assert run["tokens_per_round"] >= 1.0


@pytest.mark.parametrize("tp,placement", [(1, "stream"), (2, "stream"), (1, "rank")])
def test_ssd_with_a_fused_feature_draft_equals_ar(pair, ar_reference, tp, placement):
    """SSD's speculator with a fused feature draft: the OUTCOMEs carry the target's [3H]
    features (gathered on verifier rank 0 at TP 2; over the link on a speculator rank)."""
    with Generator(target=pair[0], draft=pair[1], mode="ssd", k=3, max_batch=3, tp=tp,
                   max_len=128, speculator_placement=placement) as g:
        outs = g.generate(PROMPTS, GREEDY)
        run = g.last_run_metrics
    check_equal(pair[0], ar_reference, outs)
    assert run["tokens_per_round"] > 1.0


def test_the_kept_fused_features_and_the_proposal_match_references(pair):
    """The target runner keeps [slots, len, 3H]: after a prefill, every committed position's
    fused features as a plain forward's layer outputs; a sampled proposal's q equals a cache-free
    rollout's over the conditioned features (its own h past them)."""
    ck, model, runner, draft = runner_and_draft(*pair, 2, features=SPEC)
    assert runner.cache.features.shape[-1] == 3 * ck.config.hidden_size
    assert runner.cache.feature_layers == (1, 2, 3)
    drafter = FeatureDrafter(draft, runner.cache.features, 3, runner.cache.max_len,
                             ck.config.vocab_size, draws=3)
    seqs = [Seq(i, PROMPTS[i] + [7, 8 + i, 9], SamplingParams(temperature=1.0, seed=i))
            for i in range(2)]
    for s in seqs:
        drafter.reset(s.slot)
    prefill(runner, seqs)
    for s in seqs:
        got = runner.cache.features[s.slot, :len(s.tokens)]
        assert torch.allclose(got, reference_features(model, s.tokens), atol=1e-5)
    tokens, q = drafter.propose(seqs, 3)
    for i, s in enumerate(seqs):
        _, qs = rollout(model, draft, s.tokens, 3, chosen=tokens[i])
        for j in range(3):
            assert torch.allclose(q[i, j], qs[j], atol=1e-5), (i, j)


def test_fused_features_on_the_captured_step_path(pair, ar_reference, monkeypatch):
    """The captured-step code path (run eagerly on the CPU, every batch bucket, ghost rows in
    the scratch slot) keeps the fused features as the eager path does: SD equals AR, and the
    engine's buffer holds the reference of the committed positions (the verified ones)."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    _, model = frozen_target(pair[0])
    with Generator(target=pair[0], draft=pair[1], mode="sd", k=3, max_batch=4, max_len=128,
                   adaptive_k=False) as g:
        check_equal(pair[0], ar_reference, g.generate(PROMPTS, GREEDY))
        out = g.generate([PROMPTS[0]], GREEDY)[0]
        features = g._runtime.leader.loop.target.runner.cache.features
    tokens = PROMPTS[0] + out.token_ids
    n = len(tokens) - 1  # the last token is committed, not fed yet
    assert features.shape[-1] == 3 * 72
    assert torch.allclose(features[0, :n], reference_features(model, tokens)[:n], atol=1e-4)


def test_the_captured_greedy_fused_chain_proposes_what_the_eager_chain_does(pair):
    """Greedy proposals through a graph pool (eager replays; 3 rows in bucket 4) equal the
    eager drafter's and the rollout's, in the first round (rows far behind: an eager feed up
    to their last position but one, then the captured proposal) and the next (feed and chain
    as one captured proposal: the fuse inside it)."""
    ck, model, runner, draft = runner_and_draft(*pair, 4, features=SPEC)
    pool = EagerPool(warmup=1)
    drafters = [FeatureDrafter(draft, runner.cache.features, 5, runner.cache.max_len,
                               ck.config.vocab_size, draws=4, pool=p) for p in (None, pool)]
    seqs = [Seq(i, PROMPTS[i] + [1 + i, 2, 3 + i]) for i in range(3)]
    for d in drafters:
        for s in seqs:
            d.reset(s.slot)
    for round_ in range(2):
        prefill(runner, seqs)
        proposals = [d.propose(seqs, 4, want_q=False)[0].tolist() for d in drafters]
        assert proposals[0] == proposals[1], round_
        for i, s in enumerate(seqs):
            assert proposals[1][i] == rollout(model, draft, s.tokens, 4)[0], (round_, i)
        for i, s in enumerate(seqs):
            s.tokens = s.tokens + proposals[0][i][:2] + [7 + i]
    assert {key[0] for key in pool.keys()} == {"feature_proposal"}


def test_a_feature_buffer_of_another_width_is_refused(pair):
    ck, _, _, draft = runner_and_draft(*pair, 1, features=SPEC)
    plain = ModelRunner(ck, None, "cpu", torch.float32, 1, 64, features=True)
    with pytest.raises(ValueError, match="width 72 but the draft reads fused features of "
                                         "width 216"):
        FeatureDrafter(draft, plain.cache.features, 2, 64, ck.config.vocab_size)
    with pytest.raises(ValueError, match="target has 4 decoder layers"):
        ModelRunner(ck, None, "cpu", torch.float32, 1, 64, features=FeatureSpec("fused",
                                                                                (1, 2, 4)))


def test_a_target_without_the_fused_layers_is_refused(pair, tiny_dirs):
    """The 2-layer tiny target of the same width and vocabulary has no layer 2 or 3: the engine
    refuses the pair in one line before it allocates the target's feature buffer."""
    with pytest.raises(CheckpointError) as e:
        Generator(target=tiny_dirs["smol_heads"], draft=pair[1], mode="sd", k=3, max_len=64)
    assert "reads fused features of layers [1, 2, 3]" in str(e.value)
    assert "has 2 decoder layers" in str(e.value) and "\n" not in str(e.value)
