"""ssdlib.env: one table lists every SSDLIB_* variable the package reads, its accessors parse
and validate at call time, and importing the package reads none of them."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from ssdlib import env
from ssdlib.errors import ConfigError
from tests.package_modules import OPTIONAL, PACKAGE, ROOT, package_modules

NAME = re.compile(r"\bSSDLIB_[A-Z0-9_]*[A-Z0-9]\b")


def _source_names() -> dict[str, str]:
    """Every SSDLIB_* name written in the package's Python source, with one file naming it."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    for name in NAME.findall(fh.read()):
                        found.setdefault(name, os.path.relpath(path, ROOT))
    return found


def test_every_name_in_the_source_is_in_the_table():
    names = _source_names()
    assert "SSDLIB_HOST_TIMES" in names  # the scan finds what it should
    missing = {n: where for n, where in names.items() if n not in {s.name for s in env.SWITCHES}}
    assert not missing, f"add these to ssdlib/env.py SWITCHES: {missing}"


def test_table_is_well_formed():
    names = [s.name for s in env.SWITCHES]
    assert len(names) == len(set(names))
    for s in env.SWITCHES:
        assert s.name.startswith("SSDLIB_") and s.meaning
        assert s.kind in ("flag", "int", "choice", "text", "paths", "window"), s
        assert not s.choices or s.kind == "choice"
        if s.experiment:
            assert s.kind == "flag" and s.default is False, f"{s.name}: experiments are off"
    assert env.switch("SSDLIB_Q_AFTER_BUILD").experiment
    assert "SSDLIB_ASYNC_SENDS" not in names  # measured slower, removed with its code
    assert "SSDLIB_BUILD_ORDER" not in names  # likewise
    for build in ("SSDLIB_SKIP_EXT", "SSDLIB_CUDA_ARCHS", "SSDLIB_BUILD_CPU_EXT"):
        assert env.switch(build).reader == "setup.py"


def test_unknown_name_and_wrong_kind_are_errors():
    with pytest.raises(KeyError, match="SSDLIB_NOPE"):
        env.get("SSDLIB_NOPE")
    with pytest.raises(TypeError, match="SSDLIB_TIME_EVERY"):
        env.flag("SSDLIB_TIME_EVERY")


def test_defaults_when_unset_or_empty(monkeypatch):
    for s in env.SWITCHES:
        monkeypatch.delenv(s.name, raising=False)
    assert {s.name: env.get(s.name) for s in env.SWITCHES} == {
        s.name: s.default for s in env.SWITCHES}
    monkeypatch.setenv("SSDLIB_PREFILL_GRAPHS", "  ")
    assert env.flag("SSDLIB_PREFILL_GRAPHS") is True
    # the default list is a copy: a caller cannot change the table
    env.paths("SSDLIB_MODEL_DIRS").append("x")
    assert env.paths("SSDLIB_MODEL_DIRS") == []


@pytest.mark.parametrize("raw,value", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                       ("0", False), ("false", False), ("No", False),
                                       ("off", False)])
def test_flag_values(monkeypatch, raw, value):
    monkeypatch.setenv("SSDLIB_HOST_TIMES", raw)
    assert env.flag("SSDLIB_HOST_TIMES") is value


def test_values_are_read_at_each_call(monkeypatch):
    monkeypatch.setenv("SSDLIB_TIME_EVERY", "3")
    assert env.integer("SSDLIB_TIME_EVERY") == 3
    monkeypatch.setenv("SSDLIB_TIME_EVERY", "5")
    assert env.integer("SSDLIB_TIME_EVERY") == 5


def test_typed_values(monkeypatch, tmp_path):
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "Eager-All")
    assert env.choice("SSDLIB_STEP_GRAPHS") == "eager-all"
    monkeypatch.setenv("SSDLIB_MODEL_DIRS", os.pathsep.join(["", "a", "", "b"]))
    assert env.paths("SSDLIB_MODEL_DIRS") == ["a", "b"]
    monkeypatch.setenv("SSDLIB_PROFILE_ROUNDS", "0:7")
    assert env.window("SSDLIB_PROFILE_ROUNDS") == (0, 7)
    monkeypatch.setenv("SSDLIB_PROFILE", str(tmp_path))
    assert env.text("SSDLIB_PROFILE") == str(tmp_path)


@pytest.mark.parametrize("name,raw,want", [
    ("SSDLIB_HOST_TIMES", "2", "0 or 1"),
    ("SSDLIB_DISABLE_EXT", "maybe", "0 or 1"),
    ("SSDLIB_Q_AFTER_BUILD", "enable", "0 or 1"),
    ("SSDLIB_TIME_EVERY", "0", "integer >= 1"),
    ("SSDLIB_TIME_EVERY", "x", "integer >= 1"),
    ("SSDLIB_PROFILE_CALL", "1.5", "integer >= 1"),
    ("SSDLIB_STEP_GRAPHS", "yes", "'eager' or 'eager-all'"),
    ("SSDLIB_ATTENTION", "flash", "'torch'"),
    ("SSDLIB_PROFILE_ROUNDS", "200", "W:N"),
    ("SSDLIB_PROFILE_ROUNDS", "5:0", "W:N"),
    ("SSDLIB_PROFILE_ROUNDS", "-1:4", "W:N"),
])
def test_bad_value_is_a_config_error_naming_the_variable(monkeypatch, name, raw, want):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ConfigError, match=re.escape(name)) as info:
        env.get(name)
    assert want in str(info.value) and repr(raw) in str(info.value)


# Run in a fresh process: import every ssdlib module with os.environ replaced by a recording
# copy, then print the SSDLIB_* names that ssdlib's own code read during the imports and those
# read by one accessor call afterwards (which proves the recorder sees the package's reads).
# Reads from other code are not counted: some (wsgiref) copy the whole environment at import.
_IMPORT_ALL = textwrap.dedent("""
    import importlib, json, os, sys
    modules, optional, package = json.loads(sys.argv[1])
    import torch  # its own reads are not ours; loaded before the recorder for speed

    reads = []
    plumbing = (os.__file__, "<frozen")

    class Recording(type(os.environ)):
        def __getitem__(self, key):
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename.startswith(plumbing):
                caller = caller.f_back  # os.getenv, Mapping.get / __contains__
            if caller is not None and caller.f_code.co_filename.startswith(package):
                reads.append(key)
            return super().__getitem__(key)

    e = os.environ
    os.environ = Recording(e._data, e.encodekey, e.decodekey, e.encodevalue, e.decodevalue)
    skipped = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            if not any((getattr(exc, "name", "") or "").startswith(o) for o in optional):
                raise
            skipped.append(module)
    import ssdlib
    assert os.path.dirname(ssdlib.__file__) + os.sep == package, ssdlib.__file__
    at_import = sorted({k for k in reads if k.startswith("SSDLIB_")})
    del reads[:]
    from ssdlib import env
    env.flag("SSDLIB_HOST_TIMES")
    after = sorted({k for k in reads if k.startswith("SSDLIB_")})
    print(json.dumps({"at_import": at_import, "after": after, "skipped": skipped}))
""")


def test_importing_the_package_reads_no_switch():
    args = json.dumps([package_modules(), OPTIONAL, PACKAGE + os.sep])
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL, args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SSDLIB_HOST_TIMES": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["after"] == ["SSDLIB_HOST_TIMES"]  # the recorder sees an accessor's read
    assert result["at_import"] == [], f"read at import: {result['at_import']}"
