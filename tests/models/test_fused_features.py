"""Fused features (EAGLE-3): the spec and its checks, the target's fused features (the chosen
layers' outputs before any final norm, concatenated: equal to a plain forward's layer outputs),
the draft's ``fuse`` (stored, and applied by ``condition`` to the target's features only), and an
oracle draft showing that the fused feature F_t reaches the draft at position t."""

import pytest
import torch

from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.feature_spec import (FUSED, LAST_PRENORM, FeatureSpec,
                                        default_fused_layers)
from ssdlib.models.llama import LlamaForCausalLM
from tests.feature_helpers import frozen_target
from tests.models.test_feature_draft import feature_oracle
from tests.tiny import make_tiny_llama
from tools.distill.feature_train import init_feature_draft

LAYERS = 4  # the default fused layers of a 4-layer target: 1, 2, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_llama(str(tmp_path_factory.mktemp("fused") / "t"), "gqa", scale=2.0,
                           num_hidden_layers=LAYERS)
    return frozen_target(path, 128)[1]


def random_ids(vocab, shape, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def layer_outputs(model: LlamaForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every decoder layer's output in a plain forward (hooks; the reference)."""
    seen = []
    hooks = [layer.register_forward_hook(lambda m, i, out: seen.append(out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model.forward_full(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_the_spec_defaults_round_trips_and_widths():
    assert default_fused_layers(30) == (1, 15, 29)
    spec = FeatureSpec.fused(LAYERS)
    assert spec == FeatureSpec(FUSED, (1, 2, 3)) and spec.width(64) == 192
    assert spec.target_layers(LAYERS) == (1, 2, 3)
    assert spec.to_config() == {"feature": "fused", "layers": [1, 2, 3]}
    assert FeatureSpec.from_config(spec.to_config()) == spec
    last = FeatureSpec()
    assert last.kind == LAST_PRENORM and last.width(64) == 64
    assert last.target_layers(LAYERS) == (LAYERS - 1,)
    assert last.to_config() == {"feature": "last_prenorm"}
    assert FeatureSpec.from_config({"feature": "last_prenorm"}) == last


@pytest.mark.parametrize("make,match", [
    (lambda: FeatureSpec(FUSED, (1, 1, 3)), "increasing"),
    (lambda: FeatureSpec(FUSED, (3, 2, 1)), "increasing"),
    (lambda: FeatureSpec(FUSED, (-1, 2, 3)), ">= 0"),
    (lambda: FeatureSpec(FUSED, (1, 2)), "3 target layers"),
    (lambda: FeatureSpec(FUSED, (1, 2, 3, 4)), "3 target layers"),
    (lambda: FeatureSpec(FUSED, (1, "2", 3)), "integers"),
    (lambda: FeatureSpec(FUSED, (True, 2, 3)), "integers"),
    (lambda: FeatureSpec(FUSED, 3), "integers"),
    (lambda: FeatureSpec(FUSED), "integers"),
    (lambda: FeatureSpec(LAST_PRENORM, (1, 2, 3)), "name no layers"),
    (lambda: FeatureSpec("mean"), "unknown feature kind"),
    (lambda: FeatureSpec.fused(LAYERS, (1, 2, 4)), "target has 4 decoder layers"),
    (lambda: FeatureSpec.fused(3), "no default fused layers"),
    (lambda: FeatureSpec.from_config({"feature": "fused"}), "need \"layers\""),
    (lambda: FeatureSpec.from_config({"feature": "mean"}), "ssdlib serves"),
])
def test_bad_specs_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_targets_fused_features_are_the_chosen_layers_outputs(target):
    ids = random_ids(target.config.vocab_size, (2, 20))
    outs = layer_outputs(target, ids)
    with torch.no_grad():
        logits, fused = target.forward_full_features(ids, (0, 2, 3))
        default_logits, last = target.forward_full_features(ids)
    assert fused.shape == (2, 20, 3 * target.config.hidden_size)
    assert torch.equal(fused, torch.cat([outs[0], outs[2], outs[3]], dim=-1))
    assert torch.equal(last, outs[-1])  # the default: the last layer alone, as before
    assert torch.equal(logits, default_logits)
    with pytest.raises(ValueError, match="model has layers 0..3"):
        target.forward_full_features(ids, (1, 2, 4))


def test_the_fused_draft_stores_fuse_and_conditions_only_target_features(target):
    h = target.config.hidden_size
    draft = FeatureDraft.for_target(target, 1, feature=FeatureSpec.fused(LAYERS))
    init_feature_draft(draft, target, seed=0)
    assert draft.feature_width == 3 * h
    stored = draft.stored_tensors()
    assert stored["fuse.weight"].shape == (h, 3 * h)
    plain = FeatureDraft.for_target(target, 1)
    assert set(stored) == set(plain.stored_tensors()) | {"fuse.weight"}
    assert sum(t.numel() for t in stored.values()) == sum(p.numel() for p in draft.parameters())
    # a fresh fuse passes the highest layer's output through
    ids = random_ids(target.config.vocab_size, (1, 12), seed=1)
    with torch.no_grad():
        features = target.forward_full_features(ids, draft.feature.layers)[1]
        assert torch.equal(draft.condition(features), features[..., -h:])
        draft.fuse.weight.normal_(0, 0.05)
        assert torch.allclose(draft.condition(features), features @ draft.fuse.weight.T)
        last = target.forward_full_features(ids)[1]
        assert plain.condition(last) is last  # last_prenorm: as it is
    with pytest.raises(ValueError, match="width 192, got width 64"):
        draft.condition(last)
    with pytest.raises(ValueError, match="target has 4 decoder layers"):
        FeatureDraft.for_target(target, 1, feature=FeatureSpec(FUSED, (1, 2, 7)))


def test_the_fused_feature_t_reaches_position_t(target):
    """An oracle: fc passes its feature through and every layer is the identity, so h_t is the
    conditioned feature g_t = fuse(F_t). With a random fuse, h_t equals fuse applied to the
    reference layer outputs at t (all three parts at their own position); with fuse selecting
    the last layer, the logits at t are the target's at t (not a neighbour's)."""
    draft = feature_oracle(target, FeatureSpec.fused(LAYERS))
    ids = random_ids(target.config.vocab_size, (2, 20), seed=2)
    outs = layer_outputs(target, ids)
    reference = torch.cat([outs[i] for i in draft.feature.layers], dim=-1)[:, :-1]
    with torch.no_grad():
        t_logits, features = target.forward_full_features(ids, draft.feature.layers)
        logits, hidden = draft.forward_full(draft.condition(features[:, :-1]), ids[:, 1:])
        assert torch.equal(hidden, outs[-1][:, :-1])  # fresh fuse: the last layer's output
        assert torch.equal(logits, t_logits[:, :-1])
        assert not torch.allclose(logits, t_logits[:, 1:])
        draft.fuse.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
        hidden = draft.forward_full(draft.condition(features[:, :-1]), ids[:, 1:])[1]
    assert torch.allclose(hidden, reference @ draft.fuse.weight.T, atol=1e-5)
