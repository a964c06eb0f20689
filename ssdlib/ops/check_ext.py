"""One-line diagnosis of the compiled extension: ``python3 -m ssdlib.ops.check_ext``.

Prints whether ``ssdlib._C`` imports, with CUDA kernels and GraphPool, and if not, why (the last
install's build record) and how to build it. Exit status 0 when the extension serves this machine
fully (with a visible GPU: CUDA and GraphPool), 1 otherwise.
"""

import sys

from ssdlib.ops._extension import diagnose


def main() -> int:
    ok, line = diagnose()
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
