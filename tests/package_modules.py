"""The package's modules by dotted name, for tests that import each one on its own."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ssdlib")

# Optional dependencies (the serve extra, the test extra, the compiled extension): a module that
# needs one that is not installed is skipped, not failed.
OPTIONAL = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "transformers",
            "triton", "ssdlib._C")


def package_modules() -> list[str]:
    """Every module of ssdlib (packages by their own name), sorted by path."""
    names = []
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, ROOT).replace(os.sep, ".")
        for f in sorted(filenames):
            if f.endswith(".py"):
                names.append(rel if f == "__init__.py" else f"{rel}.{f[:-3]}")
    return names
