"""ssdlib's cache directory: where compiled kernels and bytecode persist between starts.

First found: an explicit override (the ``--cache-dir`` flag, ``Generator(cache_dir=...)``),
``$SSDLIB_CACHE_DIR``, ``$XDG_CACHE_HOME/ssdlib``, ``~/.cache/ssdlib``. Imports nothing heavy:
``ssdlib.bytecode_cache`` reads it before torch is imported.
"""

from __future__ import annotations

import os

from ssdlib import env

CACHE_DIR_ENV = "SSDLIB_CACHE_DIR"


def cache_dir(override: str | None = None) -> str:
    """ssdlib's cache directory (see the module doc); nothing is created."""
    if override:
        return os.path.abspath(os.path.expanduser(override))
    mine = env.text(CACHE_DIR_ENV)
    if mine:
        return os.path.abspath(os.path.expanduser(mine))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "ssdlib")
