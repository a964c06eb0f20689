"""A wheel built from this checkout carries the shipped drafts (every file under ssdlib/assets),
and the build says nothing alarming about them: a plain ``pip install .`` gets the default draft
that ``python -m ssdlib.generate`` loads."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.package_modules import PACKAGE, ROOT

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import setuptools"], capture_output=True).returncode,
    reason="building a wheel needs setuptools")


def _asset_files() -> list[str]:
    assets = os.path.join(PACKAGE, "assets")
    found = []
    for dirpath, dirnames, filenames in os.walk(assets):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        found += [os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/")
                  for f in filenames if not f.endswith(".pyc")]
    return sorted(found)


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory):
    """The wheel of a copy of the checkout (the build writes beside setup.py: the checkout's own
    build record stays as it is), without the extension."""
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("ssdlib", "csrc"):
        shutil.copytree(os.path.join(ROOT, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_status.json"))
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, SSDLIB_SKIP_EXT="1", PIP_NO_INDEX="1")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(src)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheels = list(out.glob("ssdlib-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], r.stdout + r.stderr


def test_the_wheel_carries_every_shipped_draft_file(built_wheel):
    wheel, _ = built_wheel
    files = _asset_files()
    assert "ssdlib/assets/smollm2-135m-draft/model.safetensors" in files  # the scan finds them
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = [f for f in files if f not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_the_build_warns_of_no_ignored_package(built_wheel):
    _, log = built_wheel
    assert "absent from the `packages` configuration" not in log, log[-3000:]
