"""A feature draft on disk: it stores only fc, its layers and its norm, loads back beside its
target as the same function, and a target it does not fit (width, vocabulary, tokenizer) is
refused with one line."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ssdlib.errors import CheckpointError
from ssdlib.loading import load_checkpoint
from ssdlib.loading.feature_draft import (FEATURE_DRAFT_KEY, check_max_mb, load_feature_draft,
                                          save_feature_draft, stored_mb, tokenizer_source)
from ssdlib.models.feature_draft import FeatureDraft
from tests.feature_helpers import frozen_target
from tests.tiny import make_tiny_llama
from tests.tiny_chat import make_tiny_chat_model
from tools.distill.feature_train import init_feature_draft


def build(path):
    return frozen_target(path, 64)


def new_draft(target, layers=1, seed=0):
    draft = FeatureDraft.for_target(target, layers)
    init_feature_draft(draft, target, seed)
    return draft.eval()


def outputs(draft, target, seed=0):
    ids = torch.randint(0, target.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        features = target.forward_full_features(ids)[1]
        return draft.forward_full(features[:, :-1], ids[:, 1:])


def test_round_trip(tiny_dirs, tmp_path):
    ck, target = build(tiny_dirs["gqa"])
    draft = new_draft(target, layers=2)
    size = save_feature_draft(draft, str(tmp_path / "f32"), torch.float32)
    assert size == os.path.getsize(tmp_path / "f32" / "model.safetensors")
    for directory, model in ((tmp_path / "f32", None), (tmp_path / "f32", target)):
        loaded = load_feature_draft(str(directory), ck, target_model=model)
        assert not any(p.requires_grad for p in loaded.parameters())
        for a, b in zip(outputs(draft, target), outputs(loaded, target)):
            assert torch.equal(a, b)

    save_feature_draft(draft, str(tmp_path / "f16"))  # float16 by default
    tensors = load_file(str(tmp_path / "f16" / "model.safetensors"))
    assert set(tensors) == set(draft.stored_tensors())
    assert all(t.dtype == torch.float16 for t in tensors.values())
    with open(tmp_path / "f16" / "config.json") as f:
        config = json.load(f)
    assert config[FEATURE_DRAFT_KEY] == {"target_hidden_size": 64, "feature": "last_prenorm"}
    assert config["ssdlib_embedding_from_target"] is True
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    assert config["torch_dtype"] == "float16"
    loaded = load_feature_draft(str(tmp_path / "f16"), ck)
    for a, b in zip(outputs(draft, target), outputs(loaded, target)):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_size_limit(tiny_dirs, tmp_path):
    _, target = build(tiny_dirs["gqa"])
    draft = new_draft(target)
    mb = stored_mb(draft, torch.float16)
    assert mb == pytest.approx(sum(p.numel() for p in draft.parameters()) * 2 / 1e6)
    assert check_max_mb(draft, torch.float16, mb * 1.01) == mb
    with pytest.raises(CheckpointError, match="more than the limit"):
        check_max_mb(draft, torch.float16, mb * 0.99)
    with pytest.raises(CheckpointError, match="exceeds the limit"):
        save_feature_draft(draft, str(tmp_path / "big"), max_mb=mb * 0.5)
    assert not os.listdir(tmp_path / "big")  # nothing left behind


def refusal(directory, target_ck) -> str:
    with pytest.raises(CheckpointError) as e:
        load_feature_draft(str(directory), target_ck)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_mismatched_targets_are_refused_in_one_line(tiny_dirs, tmp_path):
    ck, target = build(tiny_dirs["gqa"])
    save_feature_draft(new_draft(target), str(tmp_path / "draft"))
    narrower = load_checkpoint(tiny_dirs["llama3_tied"])  # hidden 48
    assert "reads features of width 64" in refusal(tmp_path / "draft", narrower)
    more_tokens = load_checkpoint(make_tiny_llama(str(tmp_path / "v101"), "gqa", vocab_size=101))
    assert "vocab" in refusal(tmp_path / "draft", more_tokens)
    # a plain Llama directory is not a feature draft
    assert "not a feature draft" in refusal(tiny_dirs["gqa"], ck)


def test_tokenizer_is_named_and_checked(tmp_path):
    """A draft naming its target's tokenizer (tokenizer_source.json, as the shipped draft) loads
    beside it and is refused beside a target whose token ids mean something else."""
    target_dir = make_tiny_chat_model(str(tmp_path / "target"))
    ck, target = build(target_dir)
    ref = tokenizer_source(target_dir, ck)
    save_feature_draft(new_draft(target), str(tmp_path / "draft"), tokenizer_ref=ref)
    with open(tmp_path / "draft" / "tokenizer_source.json") as f:
        assert json.load(f) == ref
    load_feature_draft(str(tmp_path / "draft"), ck)

    other_dir = make_tiny_chat_model(str(tmp_path / "other"))
    path = os.path.join(other_dir, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids swapped: another tokenizer
    with open(path, "w") as f:
        json.dump(tok, f)
    assert "different tokenizers" in refusal(tmp_path / "draft", load_checkpoint(other_dir))
