"""A draft's ranked vocabulary (draft_vocab.safetensors) and the engine's --draft-vocab: the file
read and checked, N tokens taken with the end-of-sequence tokens added, and "auto" resolved by
device (a CPU takes the draft's ranking, a GPU the full vocabulary)."""

import shutil

import pytest
import torch
from safetensors.torch import save_file

from ssdlib.engine_config import DEFAULT_DRAFT_VOCAB, EngineConfig, draft_vocab_value
from ssdlib.errors import CheckpointError, ConfigError
from ssdlib.loading.draft_vocab import (DRAFT_VOCAB_FILE, draft_token_ids, ranking_path,
                                        read_ranking, write_ranking)


@pytest.fixture
def ranked_dir(tmp_path):
    write_ranking(str(tmp_path), torch.tensor([5, 2, 9, 0, 7]), torch.tensor([9, 8, 7, 6, 5]))
    return str(tmp_path)


def test_a_ranking_round_trips_and_n_tokens_get_the_eos_tokens(ranked_dir):
    path = ranking_path(ranked_dir)
    assert path is not None and path.endswith(DRAFT_VOCAB_FILE)
    assert read_ranking(path, 10).tolist() == [5, 2, 9, 0, 7]
    assert draft_token_ids(ranked_dir, 3, 10).tolist() == [2, 5, 9]
    assert draft_token_ids(ranked_dir, 3, 10, always=[1, 9]).tolist() == [1, 2, 5, 9]
    with pytest.raises(ConfigError, match="ranks 5 tokens"):
        draft_token_ids(ranked_dir, 6, 10)


def test_no_ranking_is_said_in_one_line(tmp_path):
    assert ranking_path(str(tmp_path)) is None and ranking_path(None) is None
    with pytest.raises(ConfigError, match=f"has no {DRAFT_VOCAB_FILE}"):
        draft_token_ids(str(tmp_path), 4, 10)


@pytest.mark.parametrize("tensors,match", [
    ({"counts": torch.tensor([1])}, "holds 'ranked'"),
    ({"ranked": torch.tensor([1.0, 2.0])}, "holds 'ranked'"),
    ({"ranked": torch.tensor([1, 12])}, r"token id 12 outside \[0, 10\)"),
    ({"ranked": torch.tensor([3, 1, 3])}, "token id 3 twice"),
    ({"ranked": torch.tensor([], dtype=torch.int64)}, "non-empty"),
])
def test_a_bad_ranking_is_refused(tmp_path, tensors, match):
    save_file(tensors, str(tmp_path / DRAFT_VOCAB_FILE))
    with pytest.raises(CheckpointError, match=match):
        read_ranking(str(tmp_path / DRAFT_VOCAB_FILE), 10)


def test_an_unreadable_ranking_is_refused(tmp_path):
    (tmp_path / DRAFT_VOCAB_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="not a readable draft vocabulary"):
        read_ranking(str(tmp_path / DRAFT_VOCAB_FILE), 10)


def test_auto_takes_the_devices_default_for_a_ranked_draft(tiny_dirs, tmp_path, ranked_dir):
    draft = str(tmp_path / "draft")
    shutil.copytree(tiny_dirs["smol_heads_draft"], draft)
    shutil.copy(ranking_path(ranked_dir), draft)
    cfg = EngineConfig(target=tiny_dirs["smol_heads"], draft=draft, mode="sd", device="cpu")
    assert cfg.draft_vocab == DEFAULT_DRAFT_VOCAB["cpu"] == 16384
    plain = EngineConfig(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                         mode="sd", device="cpu")
    assert plain.draft_vocab == "full" and plain.draft_vocab_ids(10, [1]) is None
    assert DEFAULT_DRAFT_VOCAB["cuda"] == "full"
    explicit = EngineConfig(target=tiny_dirs["smol_heads"], draft=draft, mode="ssd",
                            device="cpu", draft_vocab=3)
    assert explicit.draft_vocab_ids(10, [1]).tolist() == [1, 2, 5, 9]
    assert EngineConfig(target=tiny_dirs["smol_heads"], draft=draft, mode="sd", device="cpu",
                        draft_vocab="full").draft_vocab_ids(10, [1]) is None


@pytest.mark.parametrize("value,match", [(0, ">= 1"), (-3, ">= 1"), (2.5, "number of tokens"),
                                         ("some", "auto, full or"), (True, "auto, full or")])
def test_bad_draft_vocab_values_are_refused(tiny_dirs, value, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                     mode="sd", device="cpu", draft_vocab=value)


def test_a_number_needs_a_ranked_draft(tiny_dirs):
    with pytest.raises(ConfigError, match=f"--draft-vocab 100: the draft .* has no "
                                          f"{DRAFT_VOCAB_FILE}"):
        EngineConfig(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                     mode="sd", device="cpu", draft_vocab=100)


def test_the_flags_values():
    assert draft_vocab_value("auto") == "auto" and draft_vocab_value(" full") == "full"
    assert draft_vocab_value("8192") == 8192
    with pytest.raises(ValueError, match="--draft-vocab takes"):
        draft_vocab_value("8k")


def test_a_trained_size_is_read_and_a_bad_one_refused(tiny_dirs, tmp_path, ranked_dir):
    import json

    from ssdlib.loading.draft_vocab import TRAINED_VOCAB_KEY, trained_size

    draft = tmp_path / "draft"
    shutil.copytree(tiny_dirs["smol_heads_draft"], draft)
    shutil.copy(ranking_path(ranked_dir), draft)
    assert trained_size(str(draft)) is None and trained_size(None) is None
    config = json.loads((draft / "config.json").read_text())
    for value, ok in ((4, True), ("4", False), (0, False), (True, False)):
        (draft / "config.json").write_text(json.dumps({**config, TRAINED_VOCAB_KEY: value}))
        if ok:
            assert trained_size(str(draft)) == 4
            cfg = EngineConfig(target=tiny_dirs["smol_heads"], draft=str(draft), mode="sd",
                               device="cpu")
            assert cfg.draft_vocab == 4
        else:
            with pytest.raises(CheckpointError, match=f"{TRAINED_VOCAB_KEY} must be a number"):
                trained_size(str(draft))
