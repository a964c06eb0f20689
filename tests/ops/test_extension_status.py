"""Why the extension is missing must be visible: setup.py's build record, the runtime warning,
and ``python -m ssdlib.ops.check_ext``.

The setup.py tests run a copy of setup.py in a temporary tree (so the checkout's own build record
is left alone) with a fake ``torch`` first on PYTHONPATH; ``setup.py --version`` runs the
extension planning without compiling anything. CPU only, a few seconds.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ssdlib.ops._extension as ext

ROOT = Path(__file__).resolve().parents[2]


def run_setup(tmp_path: Path, fake_torch: dict[str, str] | None, **env) -> tuple[subprocess.CompletedProcess, dict]:
    """Run a copy of setup.py in tmp_path/src; ``fake_torch`` maps file names to contents."""
    src = tmp_path / "src"
    (src / "ssdlib").mkdir(parents=True)
    (src / "ssdlib" / "__init__.py").write_text("")
    shutil.copy(ROOT / "setup.py", src / "setup.py")
    full_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}
    if fake_torch is not None:
        fake = tmp_path / "fake"
        for name, text in fake_torch.items():
            (fake / name).parent.mkdir(parents=True, exist_ok=True)
            (fake / name).write_text(text)
        full_env["PYTHONPATH"] = str(fake)
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=src, env=full_env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # a missing extension never fails the install
    assert "0.1.0" in proc.stdout
    return proc, json.loads((src / "ssdlib" / "_build_status.json").read_text())


def test_setup_reports_the_torch_import_error(tmp_path):
    proc, status = run_setup(tmp_path, {
        "torch/__init__.py": "raise ImportError('simulated: libtorch_cuda.so: cannot open shared object file')",
    })
    for text in (proc.stderr, status["reason"]):
        assert "ImportError: simulated: libtorch_cuda.so" in text
        assert sys.executable in text
        assert "python3 -m pip install --no-deps --no-build-isolation -e ." in text
    assert status["result"] == "skipped"
    assert status["python"] == sys.executable and status["prefix"] == sys.prefix


def test_setup_reports_a_cpp_extension_import_error(tmp_path):
    proc, status = run_setup(tmp_path, {
        "torch/__init__.py": "__version__ = '9.9.9'\n",
        "torch/utils/__init__.py": "",
        "torch/utils/cpp_extension.py": "import packaging_that_is_not_there\n",
    })
    for text in (proc.stderr, status["reason"]):
        assert "torch 9.9.9 imports" in text and "torch.utils.cpp_extension does not" in text
        assert "ModuleNotFoundError: No module named 'packaging_that_is_not_there'" in text
    assert status["result"] == "skipped" and status["torch"] == "9.9.9"


def test_setup_records_the_skip_switch(tmp_path):
    _, status = run_setup(tmp_path, None, SSDLIB_SKIP_EXT="1")
    assert status["result"] == "skipped" and "SSDLIB_SKIP_EXT=1" in status["reason"]


@pytest.mark.skipif(torch.version.cuda is not None, reason="CPU torch only")
def test_setup_records_a_torch_without_cuda(tmp_path):
    _, status = run_setup(tmp_path, None, PYTHONPATH=":".join(sys.path))
    assert status["result"] == "skipped" and "without CUDA" in status["reason"]
    assert status["torch"] == torch.__version__


# --- run time ------------------------------------------------------------------------------------


@pytest.fixture
def missing_extension(monkeypatch, tmp_path):
    """ssdlib._C missing, with a build record in tmp_path; returns a function writing the record."""
    path = tmp_path / "_build_status.json"
    monkeypatch.setattr(ext, "BUILD_STATUS_PATH", path)
    monkeypatch.setattr(ext, "_load_result", lambda: (None, "ssdlib._C is not built"))
    monkeypatch.setattr(ext, "_warned", set())
    monkeypatch.delenv("SSDLIB_DISABLE_EXT", raising=False)
    ext.build_status.cache_clear()

    def write(**status):
        path.write_text(json.dumps({"result": "skipped", "reason": "R", "python": "/other/bin/python",
                                    "prefix": sys.prefix, "time": "T", **status}))
        ext.build_status.cache_clear()

    yield write
    ext.build_status.cache_clear()


def test_reason_quotes_the_build_record(missing_extension):
    missing_extension(reason="torch is not importable ...: ImportError: boom")
    reason = ext._unavailable("cuda")
    assert "ssdlib._C is not built" in reason and "ImportError: boom" in reason
    assert "skipped it" in reason and "NOTE" not in reason


def test_reason_names_another_interpreter(missing_extension, tmp_path):
    missing_extension(prefix=str(tmp_path / "other-env"))
    reason = ext._unavailable("cuda")
    assert "NOTE" in reason and "/other/bin/python" in reason and sys.executable in reason


def test_reason_without_a_build_record(missing_extension):
    assert "no build record" in ext._unavailable("cuda")


def test_one_warning_for_every_fallback_of_the_same_cause(missing_extension, monkeypatch):
    missing_extension(reason="because")
    warnings = []
    monkeypatch.setattr(ext.logger, "warning", lambda *args: warnings.append(args[0] % args[1:]))
    cuda = torch.device("cuda")
    assert not ext.use_extension(cuda, "tree_mask")
    assert not ext.use_extension(cuda, "tree_mask_full")
    assert ext.native_graph_pool_class() is None
    assert not ext.use_extension(torch.device("cpu"), "tree_mask")  # CPU: silent
    assert len(warnings) == 1
    assert "because" in warnings[0] and ext.BUILD_COMMAND in warnings[0]
    assert "ssdlib.ops.check_ext" in warnings[0]


def test_diagnose_missing(missing_extension):
    missing_extension(reason="because")
    ok, line = ext.diagnose()
    assert not ok and "\n" not in line
    assert line.startswith("ssdlib._C: MISSING") and "because" in line and ext.BUILD_COMMAND in line


def test_check_ext_command_prints_one_line():
    proc = subprocess.run([sys.executable, "-m", "ssdlib.ops.check_ext"], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ssdlib._C: ")
    assert (proc.returncode == 0) == lines[0].startswith("ssdlib._C: OK")


def test_constant_result_mark_matches_torchs():
    """ssdlib marks use_extension as torch.compiler.assume_constant_result would, without
    importing torch._dynamo: torch's decorator sets exactly this attribute."""
    import torch

    from ssdlib.ops._extension import assume_constant_result, use_extension

    def f():
        return 0

    def g():
        return 0

    assert torch.compiler.assume_constant_result(f).__dict__ == assume_constant_result(g).__dict__
    assert use_extension._dynamo_marked_constant is True


def test_importing_ssdlib_does_not_import_dynamo():
    import subprocess
    import sys

    code = "import sys, ssdlib.generate, ssdlib.generator; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_eager_step_through_the_kernel_path_does_not_import_dynamo():
    """The attention layer calls its kernel directly outside torch.compile: the custom op's
    eager call would import torch._dynamo (seconds of a start that compiles nothing)."""
    import subprocess
    import sys

    code = """
import sys, torch
from ssdlib.layers.attention import AttentionMetadata, CachedAttention
b, s, hq, hkv, hd, L = 2, 3, 4, 2, 8, 16
att = CachedAttention(hq, hkv, hd)
positions = torch.arange(s).repeat(b, 1) + 4
meta = AttentionMetadata(positions, torch.tensor([0, 1]), L, kv_limit=positions + 1,
                         use_kernel=True, kernel_backend="torch")
cache = [torch.zeros(3, hkv, L, hd) for _ in range(2)]
out = att(torch.randn(b, s, hq, hd), torch.randn(b, s, hkv, hd), torch.randn(b, s, hkv, hd),
          *cache, meta)
assert out.shape == (b, s, hq * hd)
print('torch._dynamo' in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
