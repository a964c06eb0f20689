"""Where compiled kernels persist between starts: the user's cache directory for ssdlib.

torch.compile (inductor) and triton keep what they compile on disk and reuse it when the same
kernel is compiled again; their defaults are a per-user folder under /tmp (inductor) and
``~/.triton`` (triton), the first of which many machines empty on reboot. The engine points
both into ``<cache>/inductor`` and ``<cache>/triton`` before anything compiles, where
``<cache>`` is, first found: the ``--cache-dir`` flag (``Generator(cache_dir=...)``),
``$SSDLIB_CACHE_DIR``, ``$XDG_CACHE_HOME/ssdlib``, ``~/.cache/ssdlib``. A variable the user has
set (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) is left as it is.
"""

from __future__ import annotations

import os

from ssdlib import env
# the environment variables this module reads, and the ones it sets for the compilers
CACHE_DIR_ENV = "SSDLIB_CACHE_DIR"
COMPILER_CACHE_ENVS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def cache_dir(override: str | None = None) -> str:
    """ssdlib's cache directory (see the module doc); nothing is created."""
    if override:
        return os.path.abspath(os.path.expanduser(override))
    mine = env.text(CACHE_DIR_ENV)
    if mine:
        return os.path.abspath(os.path.expanduser(mine))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "ssdlib")


def use_compile_cache(override: str | None = None) -> dict[str, str]:
    """Point inductor's and triton's caches into :func:`cache_dir` where the user has not set
    them. Call it before the first torch.compile of the process (spawned ranks inherit the
    variables). Returns the variables it set, by name."""
    root = cache_dir(override)
    chosen = {}
    for name, sub in COMPILER_CACHE_ENVS.items():
        if not os.environ.get(name):
            os.environ[name] = chosen[name] = os.path.join(root, sub)
    return chosen
