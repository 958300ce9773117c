"""Put on ``PYTHONPATH`` by ``test_interrupt.py`` only: makes multiprocessing's fork server stop at a
known point of its start-up, so a test can signal it there (the window a Ctrl-C in a command's first
seconds can hit), instead of hoping a timed signal lands in it.

Python imports this module at start-up in every process of the command; it acts only in the fork
server (started as ``python -c 'from multiprocessing.forkserver import main; ...'``) and only when
``MOE_SBO_TEST_STALL_DIR`` is set. There, the first import of the module named by
``MOE_SBO_TEST_STALL_AT`` writes ``<dir>/stalled`` and waits until ``<dir>/go`` exists (at most a
minute), then goes on importing as usual.
"""

import os
import sys
import time


class _StallAt:
    def __init__(self, name: str, folder: str):
        self.name, self.folder = name, folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        with open(os.path.join(self.folder, "stalling"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(self.folder, "stalling"), os.path.join(self.folder, "stalled"))  # whole, at once
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.folder, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)
        return None  # the usual finders import it


def _in_fork_server() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"from multiprocessing.forkserver import main" in f.read()
    except OSError:
        return False


if os.environ.get("MOE_SBO_TEST_STALL_DIR") and _in_fork_server():
    sys.meta_path.insert(0, _StallAt(os.environ["MOE_SBO_TEST_STALL_AT"], os.environ["MOE_SBO_TEST_STALL_DIR"]))
