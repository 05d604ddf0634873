"""A per-region watchdog: a hang becomes a `hang` row on disk and a clean process exit.

A rank stuck in a collective or a spinning kernel cannot be unblocked from Python, so when the
time limit passes the watchdog runs `on_hang` (rank 0 writes the hang row and flushes the
results), then ends the process with HANG_EXIT. torchrun then stops the other ranks; the
self-launching driver (`--nproc`) resumes the run without the backend that hung.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

from commbench.errors import HANG_EXIT


class Watchdog:
    def __init__(self, timeout_s: float, what: str, on_hang: Callable[[str], None]):
        self.timeout_s = timeout_s
        self.what = what
        self.on_hang = on_hang
        self._timer: threading.Timer | None = None

    def _fire(self) -> None:
        reason = f"no progress within {self.timeout_s:g} s during {self.what}"
        try:
            self.on_hang(reason)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HANG_EXIT)

    def __enter__(self) -> "Watchdog":
        self._timer = threading.Timer(self.timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
