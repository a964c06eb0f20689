"""Where compiled kernels persist between starts: the user's cache directory for ssdlib.

torch.compile (inductor) and triton keep what they compile on disk and reuse it when the same
kernel is compiled again; their defaults are a per-user folder under /tmp (inductor) and
``~/.triton`` (triton), the first of which many machines empty on reboot. The engine points
both into ``<cache>/inductor`` and ``<cache>/triton`` before anything compiles, where
``<cache>`` is :func:`ssdlib.cache_dir.cache_dir` (the ``--cache-dir`` flag,
``$SSDLIB_CACHE_DIR``, ``$XDG_CACHE_HOME/ssdlib`` or ``~/.cache/ssdlib``). A variable the user has
set (``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``) is left as it is.
"""

from __future__ import annotations

import os

from ssdlib.cache_dir import CACHE_DIR_ENV, cache_dir

__all__ = ["CACHE_DIR_ENV", "COMPILER_CACHE_ENVS", "cache_dir", "use_compile_cache"]
# the environment variables this module sets for the compilers
COMPILER_CACHE_ENVS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


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
