"""ssdlib.bytecode_cache: bytecode of an install that keeps none goes to the cache directory
(and is loaded from there by the next start); an install with bytecode, the off switch and a
prefix of the user's leave Python as it is. Each case runs in a fresh interpreter."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, code, **env):
    pkg_root = tmp_path / "site"
    if not (pkg_root / "nobc" / "__init__.py").exists():  # (a rewrite would make it stale)
        (pkg_root / "nobc").mkdir(parents=True, exist_ok=True)
        (pkg_root / "nobc" / "__init__.py").write_text("VALUE = 42\n")
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPYCACHEPREFIX", "SSDLIB_BYTECODE_CACHE")}
    environ.update(PYTHONPATH=os.pathsep.join([str(pkg_root), ROOT]),
                   SSDLIB_CACHE_DIR=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1", **env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip(), pkg_root / "nobc"


ENABLE = ("from ssdlib import bytecode_cache as b; p = b.enable('nobc'); import nobc, sys; "
          "print(p, nobc.__cached__, sys.dont_write_bytecode)")


def test_bytecode_of_a_package_without_any_goes_to_the_cache(tmp_path):
    out, pkg = _run(tmp_path, ENABLE)
    prefix, cached, dont_write = out.split()
    assert prefix == str(tmp_path / "cache" / "pycache") and dont_write == "False"
    assert cached.startswith(prefix) and os.path.exists(cached)  # written there ...
    assert not (pkg / "__pycache__").exists()  # ... and not beside the sources
    mtime = os.stat(cached).st_mtime_ns
    out2, _ = _run(tmp_path, ENABLE)  # a second start loads it (not rewritten)
    assert out2 == out and os.stat(cached).st_mtime_ns == mtime


@pytest.mark.parametrize("case", ["off", "user prefix", "has bytecode"])
def test_python_is_left_alone(tmp_path, case):
    env = {}
    if case == "off":
        env["SSDLIB_BYTECODE_CACHE"] = "0"
    elif case == "user prefix":
        env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "mine")
    else:
        (tmp_path / "site" / "nobc" / "__pycache__").mkdir(parents=True)
        tag = sys.implementation.cache_tag
        (tmp_path / "site" / "nobc" / "__pycache__" / f"__init__.{tag}.pyc").write_bytes(b"")
    out, _ = _run(tmp_path, "from ssdlib import bytecode_cache as b; import sys; "
                            "print(b.enable('nobc'), sys.dont_write_bytecode)", **env)
    assert out == "None True"
    assert not (tmp_path / "cache" / "pycache").exists()


def test_a_rank_that_inherits_the_prefix_writes_there_too(tmp_path):
    """A spawned rank starts with PYTHONPYCACHEPREFIX (ours) and PYTHONDONTWRITEBYTECODE=1: it
    writes the bytecode of what only it imports."""
    prefix = tmp_path / "cache" / "pycache"
    out, pkg = _run(tmp_path, ENABLE, PYTHONPYCACHEPREFIX=str(prefix))
    got, cached, dont_write = out.split()
    assert got == str(prefix) and dont_write == "False" and os.path.exists(cached)
    assert not (pkg / "__pycache__").exists()
