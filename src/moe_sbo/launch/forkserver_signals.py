"""Imported first by the rank launcher's fork server (``workers.worker_context``'s preload list), and
only there: from here on the server, and every rank it forks, ignore SIGINT.

A terminal's Ctrl-C reaches the whole process group. The launcher alone must handle it (it stops the
ranks, ``LocalRanks.stop``); the server, which then spends a second or two importing torch, would
otherwise die with a traceback, and a rank half-way through starting would print one. The server
starts with SIGINT blocked (``workers.start_forkserver``), which covers its interpreter's start-up
before this import: a Ctrl-C from then is held until here, where ignoring SIGINT discards it, and
the server and its ranks then run with SIGINT unblocked and ignored.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
if hasattr(signal, "pthread_sigmask"):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
