"""A per-region watchdog: a region that cannot finish becomes a row on disk and a clean exit.

A rank stuck in a collective or a spinning kernel cannot be unblocked from Python. So when the
time limit passes, or sooner when a peer's in-flight record says why this rank waits in vain
(a peer that died, hung, or raised while this rank is in a collective it never joins), the
watchdog runs `on_stop` (rank 0 writes the row and flushes the results) and ends the process
with STOP_EXIT. torchrun then stops the other ranks; the --nproc driver resumes the run
without that backend.

It looks at the peers only once a region has lasted POLL_AFTER_S, once a second: a short row
never shares the GIL with it, and a long one loses a few hundred microseconds per second.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from commbench.errors import STOP_EXIT
from commbench.inflight import HANG, Stop

POLL_AFTER_S = 2.0
POLL_S = 1.0
# How long ranks wait at a vote for a peer that raised, once one did: longer than a backend's
# own bounded wait (p2p gives up on a missing peer after --p2p-timeout-ms, 5 s by default), so
# that such peers come to the vote and the row is an error without ending the processes.
PEER_WAIT_S = 10.0


class Watchdog:
    def __init__(self, timeout_s: float, what: str, on_stop: Callable[[Stop, bool], None],
                 peers: Callable[[], Stop | None] | None = None):
        self.timeout_s = timeout_s
        self.what = what
        self.on_stop = on_stop   # (stop, this rank's own time limit passed)
        self.peers = peers or (lambda: None)
        self._done = threading.Event()
        self._lock = threading.Lock()   # a region ends either normally or by the watchdog, never both
        self._finished = False
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= self.timeout_s:
                break
            pause = POLL_S if elapsed >= POLL_AFTER_S else POLL_AFTER_S - elapsed
            if self._done.wait(min(pause, self.timeout_s - elapsed)):
                return
            if time.monotonic() - start >= POLL_AFTER_S:
                stop = self.peers()
                if stop is not None:
                    self._fire(stop, timed_out=False)
                    return
        stop = self.peers()
        self._fire(stop or Stop(HANG, f"no progress within {self.timeout_s:g} s during {self.what}"),
                   timed_out=stop is None)

    def _fire(self, stop: Stop, timed_out: bool) -> None:
        with self._lock:
            if self._finished:
                return
            try:
                self.on_stop(stop, timed_out)
            except Exception as exc:  # the exit below must happen; say what could not be recorded
                print(f"commbench sweep: the watchdog could not record {stop.status} during {self.what}: "
                      f"{type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(STOP_EXIT)

    def __enter__(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._watch, name="commbench-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._finished = True
        self._done.set()
