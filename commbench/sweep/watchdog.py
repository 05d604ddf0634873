"""A per-region watchdog: a region that cannot finish becomes a row on disk and a clean exit.

A rank stuck in a collective or a spinning kernel cannot be unblocked from Python. So when the
time limit passes, or sooner when a peer's in-flight record says why this rank waits in vain
(a peer that died, hung, or raised while this rank is in a collective it never joins), the
watchdog runs `on_stop` (rank 0 writes the row and flushes the results) and ends the process
with STOP_EXIT. torchrun then stops the other ranks; the --nproc driver resumes the run
without that backend.

It looks at the peers only once a region has lasted waits().poll_after_s, then every poll_s (a
second): a short row never shares the GIL with it, and a long one loses a few hundred microseconds
per second.
A region that runs out of time is named with where its thread was (the innermost WHERE_FRAMES
Python frames), so a hang inside a library says which of its steps never returned; `blame`
(the engine's) then names the rank that hung: a rank that waits in a collective or a device
synchronize for a peer that never came is not the one (it used to report itself).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Callable

from commbench.errors import STOP_EXIT
from commbench.inflight import HANG, Stop, waits_for_peers
from commbench.results.rundir import release_all
from commbench.waits import waits

WHERE_FRAMES = 3


def where(frame: FrameType | None, depth: int = WHERE_FRAMES) -> str | None:
    """The innermost `depth` Python frames from `frame` outwards, written as a crash's frame is
    (inflight.Record.fault_frame): "tuning.py:748 in get_valid_tactics <- autotuner.py:3083 in ..."."""
    parts = []
    while frame is not None and len(parts) < depth:
        parts.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(parts) or None


def waiting_in(frame: FrameType | None) -> bool:
    """Is the thread waiting for its peers (in a torch.distributed collective or a device
    synchronize, anywhere up its stack), rather than stuck in code of its own?"""
    while frame is not None:
        if waits_for_peers(frame.f_code.co_filename, frame.f_code.co_name):
            return True
        frame = frame.f_back
    return False


# (the reason so far, where the thread was, whether it waited for its peers there) -> the stop
Blame = Callable[[str, "str | None", bool], Stop]


class Watchdog:
    def __init__(self, timeout_s: float, what: str, on_stop: Callable[[Stop, bool], None],
                 peers: Callable[[], Stop | None] | None = None, who: str = "this rank",
                 blame: Blame | None = None):
        self.timeout_s = timeout_s
        self.who = who           # names the region's process in a hang's reason ("rank 0")
        self.what = what
        self.on_stop = on_stop   # (stop, this rank's own time limit passed)
        self.peers = peers or (lambda: None)
        self.blame = blame       # names the rank that hung, from where each rank was (None: this one)
        self._done = threading.Event()
        self._lock = threading.Lock()   # a region ends either normally or by the watchdog, never both
        self._finished = False
        self._thread: threading.Thread | None = None
        self._watched: int | None = None    # the thread that runs the region

    def _watch(self) -> None:
        start = time.monotonic()
        poll_after_s, poll_s = waits().poll_after_s, waits().poll_s
        while True:
            elapsed = time.monotonic() - start
            if elapsed >= self.timeout_s:
                break
            pause = poll_s if elapsed >= poll_after_s else poll_after_s - elapsed
            if self._done.wait(min(pause, self.timeout_s - elapsed)):
                return
            if time.monotonic() - start >= poll_after_s:
                stop = self.peers()
                if stop is not None:
                    self._fire(self._waited(stop), timed_out=False)
                    return
        stop = self.peers()
        self._fire(self._waited(stop) if stop is not None else self._hang(), timed_out=stop is None)

    def _waited(self, stop: Stop) -> Stop:
        """A peer's hang, as this rank saw it: where this rank waited for it, if it did."""
        frame = sys._current_frames().get(self._watched) if self._watched is not None else None
        if stop.status != HANG or not waiting_in(frame):
            return stop
        return replace(stop, reason=f"{stop.reason}; {self.who} waited for it in {where(frame)}")

    def _hang(self) -> Stop:
        """This rank's time ran out: where its thread was, and (blame) which rank that makes hung:
        a rank waiting in a collective for a peer that never came is not the one."""
        reason = f"no progress within {self.timeout_s:g} s during {self.what}"
        frame = sys._current_frames().get(self._watched) if self._watched is not None else None
        stuck, waiting = where(frame), waiting_in(frame)
        if self.blame is not None:
            return self.blame(reason, stuck, waiting)
        return Stop(HANG, reason if stuck is None else f"{reason}; {self.who} was in {stuck}")

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
                release_all()   # os._exit runs no atexit: the run dir's lock file goes here
                os._exit(STOP_EXIT)

    def __enter__(self) -> "Watchdog":
        self._watched = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="commbench-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._finished = True
        self._done.set()
