"""Holding Ctrl-C back while a few steps that must happen together run.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Where the
main process and the spawned leader keep a count in step (a request queued and counted, a result
taken off the queue and counted), an interrupt between the two steps leaves them out of step:
the next call would take the interrupted call's answer as its own, or wait for an answer that
already came. :func:`held_interrupt` delays the interrupt to the end of such a block.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def held_interrupt() -> Iterator[None]:
    """Run the block with SIGINT held back, then deliver it (if one came) to the handler that
    was in place before, e.g. as ``KeyboardInterrupt`` once the block is over.

    Keep the block short and never blocking for long: a Ctrl-C waits for it. Signals reach only
    the main thread, so elsewhere (and where SIGINT's handler was not set from Python) the block
    just runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # set outside Python: it cannot be put back
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            # through the restored handler, as if it had come now (KeyboardInterrupt, or
            # whatever the caller installed)
            signal.raise_signal(signal.SIGINT)
