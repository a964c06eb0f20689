"""The target's features and the feature draft's forwards: features are the last decoder layer's
output before the final norm, the cached forward equals the cache-free one step by step, and an
oracle draft shows that feature f_t reaches the draft at position t."""

import pytest
import torch

from ssdlib.engine.runner.kv_cache import KVCache
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.loading import load_checkpoint
from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.feature_spec import FeatureSpec
from ssdlib.models.llama import LlamaForCausalLM
from tools.distill.feature_train import init_feature_draft


def build_target(path, max_len=128):
    ck = load_checkpoint(path)
    model = LlamaForCausalLM(ck.config, None, max_len)
    model.load_weights(ck.weights)
    return model.eval().requires_grad_(False)


def random_ids(vocab, shape, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["gqa", "llama3_tied"])
def test_features_are_the_last_layer_output_before_the_norm(tiny_dirs, name):
    target = build_target(tiny_dirs[name])
    ids = random_ids(target.config.vocab_size, (2, 24))
    seen = []
    hook = target.model.layers[-1].register_forward_hook(lambda m, i, out: seen.append(out))
    try:
        with torch.no_grad():
            logits, features = target.forward_full_features(ids)
    finally:
        hook.remove()
    assert torch.equal(features, seen[0])
    with torch.no_grad():
        assert torch.equal(logits, target.forward_full(ids))
        assert torch.equal(logits, target.lm_head(target.model.norm(features)))


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    target = build_target(tiny_dirs["gqa"])
    draft = FeatureDraft.for_target(target, layers=2)
    init_feature_draft(draft, target, seed=0)
    return target, draft.eval()


def test_embedding_and_head_are_the_targets_and_not_stored(pair):
    target, draft = pair
    assert draft.embed_tokens is target.model.embed_tokens and draft.lm_head is target.lm_head
    layer = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj")
    assert set(draft.stored_tensors()) == {"fc.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2) for name in layer}
    stored = sum(t.numel() for t in draft.stored_tensors().values())
    assert stored == sum(p.numel() for p in draft.parameters())


def test_cached_steps_equal_the_full_forward(pair):
    """Prefill 10 positions, 1-position steps, then a 5-position chunk, in two KV slots (the
    second row two positions later): logits and hidden equal forward_full's."""
    target, draft = pair
    cfg = draft.config
    ids = random_ids(cfg.vocab_size, (2, 31), seed=1)
    with torch.no_grad():
        features = target.forward_full_features(ids)[1]
        ref_logits, ref_hidden = draft.forward_full(features[:, :-1], ids[:, 1:])
    cache = KVCache(cfg.num_hidden_layers, 4, draft.kv_heads_local, 64, cfg.head_dim,
                    torch.float32, "cpu")
    slots = torch.tensor([3, 1])

    def step(start, n):  # positions start..start+n-1 of both rows
        pos = torch.arange(start, start + n).expand(2, n)
        with torch.no_grad():
            return draft(ids[:, start + 1:start + n + 1], features[:, start:start + n], cache,
                         AttentionMetadata.build(pos, slots))

    parts = [step(0, 10)] + [step(t, 1) for t in range(10, 25)] + [step(25, 5)]
    logits = torch.cat([p[0] for p in parts], dim=1)
    hidden = torch.cat([p[1] for p in parts], dim=1)
    assert (logits - ref_logits).abs().max() <= 1e-4
    assert (hidden - ref_hidden).abs().max() <= 1e-5
    # logits_index: both outputs at the asked positions only
    with torch.no_grad():
        pos = torch.arange(30).expand(2, 30)
        out = draft(ids[:, 1:], features[:, :-1], cache, AttentionMetadata.build(pos, slots),
                    logits_index=torch.tensor([[29, 4], [7, 0]]))
    assert out[0].shape == (2, 2, cfg.vocab_size) and out[1].shape == (2, 2, cfg.hidden_size)
    assert (out[1][0, 0] - ref_hidden[0, 29]).abs().max() <= 1e-5
    assert (out[0][1, 0] - ref_logits[1, 7]).abs().max() <= 1e-4


def feature_oracle(target: LlamaForCausalLM, feature: FeatureSpec | None = None) -> FeatureDraft:
    """fc passes the feature through, every layer is the identity (zero output projections), the
    final norm is the target's: h_t = f_t (the conditioned feature, for a ``feature`` kind that
    conditions)."""
    draft = FeatureDraft.for_target(target, layers=1, feature=feature)
    init_feature_draft(draft, target, seed=0)
    h = draft.config.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, h:] = torch.eye(h)
        for layer in draft.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return draft


@pytest.mark.parametrize("name", ["gqa", "llama3_tied"])
def test_feature_t_reaches_position_t(tiny_dirs, name):
    """The oracle's output at t is exactly f_t, so its logits at t are the target's at t (and
    not those of a neighbour): features enter at their own position."""
    target = build_target(tiny_dirs[name])
    draft = feature_oracle(target)
    ids = random_ids(target.config.vocab_size, (2, 20), seed=2)
    with torch.no_grad():
        t_logits, features = target.forward_full_features(ids)
        logits, hidden = draft.forward_full(features[:, :-1], ids[:, 1:])
    assert torch.equal(hidden, features[:, :-1])
    assert torch.equal(logits, t_logits[:, :-1])
    assert not torch.allclose(logits, t_logits[:, 1:])


def test_a_draft_of_another_width_is_refused(tiny_dirs):
    target = build_target(tiny_dirs["gqa"])
    other = build_target(tiny_dirs["llama3_tied"])
    with pytest.raises(ValueError, match="48 wide.*hidden size is 64"):
        FeatureDraft(target.config, other.model.embed_tokens, other.lm_head)
