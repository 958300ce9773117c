"""Imported first by the rank launcher's fork server (``ranks._context``'s preload list), and only
there: from here on the server, and every rank it forks, ignore SIGINT.

A terminal's Ctrl-C reaches the whole process group. The launcher alone must handle it (it stops the
ranks, ``LocalRanks.stop``); the server, which then spends a second or two importing torch, would
otherwise die with a traceback, and a rank half-way through starting would print one. The server
also starts with SIGINT ignored (``ranks._start_forkserver``), which covers its interpreter's
start-up before this import.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
