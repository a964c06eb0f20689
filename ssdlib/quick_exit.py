"""Leaving a one-shot command as soon as its work is written.

When ``ssdlib.generate`` or the batch tool returns, everything the user asked for is on stdout or
on disk; what the interpreter still does, freeing every module and object (torch's included) and
the CUDA context one by one, is time the user waits for nothing (0.3-1 s on a 2-core CPU).
:func:`quick_exit` runs the exit handlers (logging, multiprocessing, anything registered with
:mod:`atexit`), flushes the standard streams and ends the process with the code. Where other
threads still run, or ``SSDLIB_QUICK_EXIT=0``, it exits the ordinary way instead.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from ssdlib import env


def quick_exit(code: int | None) -> NoReturn:
    code = 0 if code is None else code
    if not env.flag("SSDLIB_QUICK_EXIT") or threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)
