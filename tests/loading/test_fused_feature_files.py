"""A fused feature draft on disk: config.json names its kind and layers, model.safetensors adds
``fuse.weight``, it loads back as the same function, its size counts fuse, and a config or a
target it does not fit (layers, width, kind, a missing fuse) is refused in one line."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ssdlib.errors import CheckpointError
from ssdlib.loading import load_checkpoint
from ssdlib.loading.feature_draft import (FEATURE_DRAFT_KEY, feature_spec_for,
                                          load_feature_draft, save_feature_draft, stored_mb)
from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.feature_spec import FeatureSpec
from tests.feature_helpers import frozen_target
from tests.tiny import make_tiny_llama
from tools.distill.feature_train import init_feature_draft


def build(path):
    return frozen_target(path, 64)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer target as wide as the "gqa" tiny one (hidden 64, vocabulary 97)."""
    return build(make_tiny_llama(str(tmp_path_factory.mktemp("fused") / "t4"), "gqa",
                                 scale=2.0, num_hidden_layers=4))


def fused_draft(model, layers=None, seed=0):
    draft = FeatureDraft.for_target(model, 1, feature=FeatureSpec.fused(4, layers))
    init_feature_draft(draft, model, seed)
    with torch.no_grad():  # every part of the fused feature matters
        draft.fuse.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    return draft.eval()


def outputs(draft, model, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        features = model.forward_full_features(ids, draft.feature.layers)[1]
        return draft.forward_full(draft.condition(features[:, :-1]), ids[:, 1:])


def test_round_trip(target, tmp_path):
    ck, model = target
    draft = fused_draft(model, layers=(0, 2, 3))
    save_feature_draft(draft, str(tmp_path / "d"), torch.float32)
    with open(tmp_path / "d" / "config.json") as f:
        assert json.load(f)[FEATURE_DRAFT_KEY] == {"target_hidden_size": 64, "feature": "fused",
                                                   "layers": [0, 2, 3]}
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert tensors["fuse.weight"].shape == (64, 192)
    assert set(tensors) == set(draft.stored_tensors())
    assert feature_spec_for(str(tmp_path / "d"), ck) == FeatureSpec("fused", (0, 2, 3))
    for model_arg in (None, model):
        loaded = load_feature_draft(str(tmp_path / "d"), ck, target_model=model_arg)
        assert loaded.feature == draft.feature
        for a, b in zip(outputs(draft, model), outputs(loaded, model)):
            assert torch.equal(a, b)


def test_the_size_counts_fuse(target):
    _, model = target
    plain = FeatureDraft.for_target(model, 1)
    mb, plain_mb = stored_mb(fused_draft(model), torch.float16), stored_mb(plain, torch.float16)
    assert mb - plain_mb == pytest.approx(64 * 192 * 2 / 1e6)


def edited(tmp_path, source, name, **entry):
    """A copy of the draft directory ``source`` whose feature entry is updated with ``entry``
    (a None value removes its key)."""
    out = tmp_path / name
    out.mkdir()
    for f in os.listdir(source):
        with open(os.path.join(source, f), "rb") as src, open(out / f, "wb") as dst:
            dst.write(src.read())
    with open(out / "config.json") as f:
        config = json.load(f)
    for key, value in entry.items():
        if value is None:
            config[FEATURE_DRAFT_KEY].pop(key, None)
        else:
            config[FEATURE_DRAFT_KEY][key] = value
    with open(out / "config.json", "w") as f:
        json.dump(config, f)
    return out


def refusal(directory, target_ck) -> str:
    with pytest.raises(CheckpointError) as e:
        load_feature_draft(str(directory), target_ck)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_configs_and_mismatched_targets_are_refused_in_one_line(target, tiny_dirs,
                                                                     tmp_path):
    ck, model = target
    good = tmp_path / "good"
    save_feature_draft(fused_draft(model), str(good))
    for name, entry, match in (
            ("equal", {"layers": [1, 1, 3]}, "must be increasing"),
            ("two", {"layers": [1, 3]}, "read 3 target layers"),
            ("text", {"layers": [1, "2", 3]}, "given as integers"),
            ("bool", {"layers": [True, 2, 3]}, "given as integers"),
            ("none", {"layers": None}, "need \"layers\""),
            ("kind", {"feature": "mean"}, "ssdlib serves 'last_prenorm' and 'fused'"),
            ("far", {"layers": [1, 2, 9]}, "layers [1, 2, 9] but the target"),
            ("wide", {"target_hidden_size": 128}, "width 128")):
        directory = edited(tmp_path, good, name, **entry)
        message = refusal(directory, ck)
        assert match in message, (name, message)
        if name not in ("far", "wide"):  # the config's own faults name its entry
            assert f"(config.json {FEATURE_DRAFT_KEY})" in message, (name, message)
        if name != "wide":  # what the target's runner reads first refuses alike
            with pytest.raises(CheckpointError, match="feature draft"):
                feature_spec_for(str(directory), ck)
    # beside a target of its width with fewer layers (the "gqa" tiny target has 2)
    shallow = load_checkpoint(tiny_dirs["gqa"])
    assert "has 2 decoder layers (0..1): it runs only beside the target it was trained for" in \
        refusal(good, shallow)
    # a last_prenorm draft naming layers, and a fused config without its fuse tensor
    plain = tmp_path / "plain"
    save_feature_draft(FeatureDraft.for_target(model, 1), str(plain))
    assert "name no layers" in refusal(edited(tmp_path, plain, "named", layers=[1, 2, 3]), ck)
    no_fuse = edited(tmp_path, plain, "no_fuse", feature="fused", layers=[1, 2, 3])
    assert "fuse.weight" in refusal(no_fuse, ck)
    # a fuse of the wrong width
    narrow = edited(tmp_path, good, "narrow")
    tensors = load_file(str(narrow / "model.safetensors"))
    tensors["fuse.weight"] = tensors["fuse.weight"][:, :128].contiguous()
    save_file(tensors, str(narrow / "model.safetensors"))
    assert "tensor fuse.weight: shape (64, 128)" in refusal(narrow, ck)


def test_a_last_prenorm_draft_loads_as_before(target, tmp_path):
    ck, model = target
    draft = FeatureDraft.for_target(model, 1)
    init_feature_draft(draft, model, 0)
    save_feature_draft(draft, str(tmp_path / "d"))
    with open(tmp_path / "d" / "config.json") as f:
        assert json.load(f)[FEATURE_DRAFT_KEY] == {"target_hidden_size": 64,
                                                   "feature": "last_prenorm"}
    loaded = load_feature_draft(str(tmp_path / "d"), ck)
    assert loaded.feature == FeatureSpec() and loaded.fuse is None
    assert "fuse.weight" not in load_file(str(tmp_path / "d" / "model.safetensors"))
