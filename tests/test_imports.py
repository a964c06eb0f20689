"""Every ssdlib module imports on its own, first, in a fresh process.

An import circle that works in one order only (``a`` first) fails when ``b`` is imported first;
the test suite, which imports modules in whatever order its files run, would not notice. Here
each module is the first and only ssdlib module a process imports.

One helper process imports the heavy third-party packages once (torch, ...) and forks a child
per module, so each child starts with no ssdlib module loaded but does not pay torch's start-up
again. Where fork is not available each module gets its own ``python -c "import ..."``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.package_modules import OPTIONAL, PACKAGE, ROOT, package_modules

# Third-party packages the helper imports before forking (torch._dynamo alone takes a second).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "gguf", "safetensors",
           "tokenizers", "jinja2")


MODULES = package_modules()

# Imports one module in a fresh process; with "alone", an empty stand-in replaces the top-level
# package: ssdlib/__init__.py imports the public API (nearly every module) in one fixed order,
# which would hide a circle that breaks when the module under test comes first.
_ATTEMPT = textwrap.dedent("""
    import importlib, importlib.util, sys, traceback, types

    def attempt(module, alone, optional):
        try:
            if alone and module != "ssdlib":
                spec = importlib.util.find_spec("ssdlib")
                stub = types.ModuleType("ssdlib")
                stub.__path__ = list(spec.submodule_search_locations)
                stub.__spec__ = spec
                sys.modules["ssdlib"] = stub
            importlib.import_module(module)
            return None
        except ModuleNotFoundError as e:
            if e.name and any(e.name == o or e.name.startswith(o + ".") for o in optional):
                return "skip: needs " + e.name
            return traceback.format_exc()
        except BaseException:
            return traceback.format_exc()
""")

# The helper process: prints {module: null | "skip: ..." | traceback} as JSON.
_SWEEP = _ATTEMPT + textwrap.dedent("""
    import json, os
    modules, preload, optional = json.loads(sys.argv[1])
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert not [m for m in sys.modules if m == "ssdlib" or m.startswith("ssdlib.")]

    def in_child(module, alone):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            outcome = attempt(module, alone, optional)
            with os.fdopen(write, "w") as f:
                json.dump(outcome, f)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        _, status = os.waitpid(pid, 0)
        return json.loads(text) if text else f"child died (status {status})"

    results = {}
    for module in modules:
        results[module] = in_child(module, False) or in_child(module, True)
    print(json.dumps(results))
""")

_SINGLE = _ATTEMPT + textwrap.dedent("""
    outcome = attempt(sys.argv[1], sys.argv[2] == "alone", sys.argv[3].split(","))
    print(outcome or "ok")
""")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def outcomes() -> dict:
    if not hasattr(os, "fork"):
        return {}
    proc = subprocess.run(
        [sys.executable, "-c", _SWEEP, json.dumps([MODULES, PRELOAD, OPTIONAL])],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_module_is_listed():
    assert "ssdlib.loading.checkpoint" in MODULES and "ssdlib.tokenizer.hf_files" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_alone(module, outcomes):
    if outcomes:
        outcome = outcomes[module]
    else:
        outcome = None
        for how in ("plain", "alone"):
            proc = subprocess.run(
                [sys.executable, "-c", _SINGLE, module, how, ",".join(OPTIONAL)],
                cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
            out = proc.stdout.strip() if proc.returncode == 0 else proc.stderr
            outcome = outcome or (None if out == "ok" else out)
    if outcome and outcome.startswith("skip: "):
        pytest.skip(outcome[len("skip: "):])
    assert outcome is None, f"import {module} (first, in a fresh process) failed:\n{outcome}"
