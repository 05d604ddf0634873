"""Run a probe step in a child process with a time limit, reading JSON lines as they come.

A broken fabric can make a peer write or a synchronize never return. The parent never calls
into CUDA for such steps: it starts a child, reads one JSON object per line, and kills the
child's whole process group when the time limit passes. The lines read so far are kept, so a
step that hangs is reported as HANGS with the last thing the child said it was doing.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from commbench.policy import MULTICAST_POLICY_VARS


@dataclass
class ChildResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    timed_out: bool = False
    returncode: int | None = None
    stderr_tail: str = ""
    elapsed_s: float = 0.0

    def last_start(self) -> dict[str, Any] | None:
        """The step the child announced last ('start' record), for HANGS messages."""
        for rec in reversed(self.records):
            if rec.get("kind") == "start":
                return rec
        return None

    def last_started(self) -> str | None:
        rec = self.last_start()
        return str(rec.get("step")) if rec else None

    def failure(self) -> str | None:
        """None when the child exited cleanly, else one line saying how it ended."""
        if self.timed_out:
            where = self.last_started()
            return f"timed out after {self.elapsed_s:.0f} s" + (f" during {where}" if where else "")
        if self.returncode not in (0, None):
            tail = self.stderr_tail.strip().splitlines()
            return f"child exited with status {self.returncode}" + (f": {tail[-1]}" if tail else "")
        return None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment (multicast policy variables included), plus extra."""
    env = dict(os.environ)
    env.update(extra or {})
    for name in MULTICAST_POLICY_VARS:
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def module_argv(module: str, spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", module, json.dumps(spec)]


class Child:
    """One started child; `wait` collects its records until exit or the deadline."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.started = time.monotonic()
        # Own session: on timeout the whole group (the child and anything it started) is killed.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=child_env(env), start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        self._stderr_pump = threading.Thread(target=self._pump_stderr, daemon=True)
        self._stderr_pump.start()

    def _pump_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-40]

    def wait(self, deadline: float) -> ChildResult:
        result = ChildResult()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result.timed_out = True
                self._kill()
                break
            try:
                line = self._lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                break
            line = line.strip()
            if line.startswith("{"):
                try:
                    result.records.append(json.loads(line))
                except json.JSONDecodeError:
                    self._stderr.append(f"unreadable line from child: {line[:200]}\n")
        try:
            result.returncode = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._kill()
            result.returncode = self.proc.wait()
        # The child's last words (a traceback) may still be in the pipe when it has exited.
        self._stderr_pump.join(timeout=2)
        result.elapsed_s = time.monotonic() - self.started
        result.stderr_tail = "".join(self._stderr)
        return result

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_child(module: str, spec: dict[str, Any], timeout_s: float, env: dict[str, str] | None = None) -> ChildResult:
    return Child(module_argv(module, spec), env).wait(time.monotonic() + timeout_s)


def child_main(argv: list[str], run: Callable[[dict[str, Any]], None],
               on_error: Callable[[dict[str, Any], Exception], dict[str, Any]]) -> int:
    """A child's whole life: run its JSON spec; any failure becomes an error record (its fields
    from on_error), never a silent exit; the last record is always "done"."""
    spec = json.loads(argv[1])
    try:
        run(spec)
    except Exception as exc:  # the child's last word
        emit("error", **on_error(spec, exc), detail=f"{type(exc).__name__}: {exc}")
    emit("done")
    return 0


def driver_or_error() -> Any:
    """For children: the CUDA driver binding, or None after emitting why it cannot be had."""
    from commbench.topology.cudadrv import CudaError, Driver

    try:
        return Driver()
    except (OSError, CudaError) as exc:
        emit("error", step="driver", detail=str(exc))
        return None


def emit(kind: str, **fields: Any) -> None:
    """For children: one JSON record per line, flushed at once so a later hang loses nothing."""
    sys.stdout.write(json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()
