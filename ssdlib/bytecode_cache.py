"""Python bytecode kept in ssdlib's cache directory where the install keeps none.

An interpreter run with ``PYTHONDONTWRITEBYTECODE=1`` (usual in container images), or whose
packages sit in a folder it cannot write, compiles every module it imports from source at every
start when the install shipped no bytecode. For torch and what it imports that is seconds of
each start (8.5 s of the one-prompt CLI's 22.5 s on a warm start, measured on one H200 machine
whose image sets the variable). Where torch has no bytecode for this interpreter beside its sources
and Python would write none there, :func:`enable` (called by ``ssdlib/__init__.py`` before torch
is imported) points Python's bytecode cache at ``<cache>/pycache`` (``sys.pycache_prefix``, what
``PYTHONPYCACHEPREFIX`` sets) and lets Python write there: the first start compiles as before,
the next ones load. No source folder is written. The ranks a job spawns inherit the prefix.

``SSDLIB_BYTECODE_CACHE=0`` turns it off; a ``PYTHONPYCACHEPREFIX`` of the user's wins.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from ssdlib import env
from ssdlib.cache_dir import cache_dir
from ssdlib.errors import ConfigError

PREFIX_ENV = "PYTHONPYCACHEPREFIX"


def has_bytecode(source: str) -> bool:
    """Whether the bytecode of ``source`` for this interpreter sits beside it (__pycache__)."""
    try:  # (called while sys.pycache_prefix is unset: the path beside the source)
        return os.path.exists(importlib.util.cache_from_source(source))
    except (NotImplementedError, ValueError):  # no cache tag: leave Python as it is
        return True


def enable(package: str = "torch") -> str | None:
    """Keep bytecode under ``<cache>/pycache`` when ``package`` (found without importing it)
    has none beside its sources and none would be written there (module doc). Returns the
    prefix in use, or None where Python is left as it is. Reads its switches only then: an
    install with bytecode reads none at import."""
    if sys.pycache_prefix is not None:  # the user's prefix, or ours inherited by a rank
        ours = _prefix()
        if ours is None or sys.pycache_prefix != ours:
            return None
        sys.dont_write_bytecode = False  # the rank writes what only it imports
        return ours
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or has_bytecode(spec.origin):
        return None
    if not sys.dont_write_bytecode and os.access(os.path.dirname(spec.origin), os.W_OK):
        return None  # Python writes it beside the sources itself
    prefix = _prefix()
    if prefix is None:
        return None
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError:
        return None
    if not os.access(prefix, os.W_OK):
        return None
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    os.environ[PREFIX_ENV] = prefix  # spawned ranks find it before their first import
    return prefix


def _prefix() -> str | None:
    """``<cache>/pycache``, or None when switched off (or a switch is malformed: that is
    reported where the switch is used, not at import)."""
    try:
        if not env.flag("SSDLIB_BYTECODE_CACHE"):
            return None
        return os.path.join(cache_dir(), "pycache")
    except ConfigError:
        return None
