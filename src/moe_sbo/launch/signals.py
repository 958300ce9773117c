"""Holding back SIGINT and SIGTERM for a stretch of code that must not be cut in the middle, then
delivering them. Imports no torch: the command line uses it around its own imports of torch.

The hard part is where a signal may land. Cut between forking a rank and recording its pid, an
interrupt leaves a process the launcher cannot stop; landing while torch or Triton load their native
libraries, it can abort the process (SIGABRT) instead of unwinding. Held, the signal reaches the
handlers in place before once the stretch is over (Ctrl-C still raises, a moment later).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the body runs, then the first of them delivered to the
    handlers in place before. Off the main thread (where Python cannot set handlers) it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in DEFERRED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])
