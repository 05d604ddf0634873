"""What each rank is about to run, on disk, so that any death of a rank is named afterwards.

Before a backend's check, each setup, each row and its close, every rank writes
RUN/inflight/rank<N>.json (fsynced): the step, what it is ("setup of mscclpp:auto (bf16)") and
the row it stands for. faulthandler writes a fatal signal's traceback (SIGSEGV, SIGABRT, SIGBUS,
SIGFPE, SIGILL) to rank<N>.fatal and a SIGTERM's or SIGINT's to rank<N>.signals from inside the
signal handler, so both are there even when no Python code can run any more. A rank that ends
cleanly removes its files; one that raises while its peers may be waiting in a collective marks
its record "raised"; a watchdog that fires marks it "hang".

Two readers use the records:
- a live rank's watchdog (peer_stop): a peer that died, hung or raised while this rank waits in
  a collective it never joins ends the row promptly, with the right status, instead of a hang;
- the next look at the dir after every process is gone (postmortem: the --nproc driver, a
  --resume, the analysis commands): the record nobody turned into a row becomes one, `crashed`
  (rank, signal, phase), `hang` or `error`.

Ranks that do not see the results dir (other nodes without a shared filesystem) keep no record.
Only the standard library and commbench.results: the analysis half reads these files too.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from commbench.errors import TERMINATED_EXIT, ResultsUnwritable, Terminated, UsageError
from commbench.launch_env import under_torchrun
from commbench.results import CRASHED, ERROR, HANG, STRANDED, Measurement, RunDir, write_whole
from commbench.results.rundir import release_all
from commbench.results.validate import loads_json, row_problem
from commbench.waits import waits

INFLIGHT_DIR = "inflight"
CRASH_LOGS_DIR = "crash-logs"

# What happened in the step: still running, an exception, or HANG (the watchdog fired).
RUNNING, RAISED = "running", "raised"
# How the process ended through Python: after recording a stop; after its peers or a signal
# stopped it; or ERROR, a failure of its own (results unwritable, a bug), said on a line of its own.
ENDED, LEFT = "ended", "left"
# Records written before the step and exit used the row statuses' words.
_OLD_WORDS = {"hung": HANG, "failed": ERROR}

# faulthandler's first line for each fatal signal it catches.
_FATAL_SIGNALS = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
                  "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
_SWEEP_THREAD = "/sweep/engine.py"   # a frame of it marks the thread that runs the sweep
# Signals that stop a rank from outside: torchrun passes on the one it got (SIGHUP included).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def waits_for_peers(path: str, name: str) -> bool:
    """A frame where a rank waits for its peers, not its own work: a torch.distributed collective,
    or a device synchronize (a kernel that waits for a peer's flag holds it there)."""
    path = path.replace("\\", "/")
    return "/torch/distributed/" in path or (name == "synchronize" and "/torch/" in path)


@dataclass
class Record:
    """One rank's step, as written before the step runs."""

    rank: int
    pid: int
    host: str
    step: int
    phase: str                  # check, setup, row or close
    what: str                   # "setup of x (fp32)", "x 16K fp32 eager": the watchdog's words
    row: Measurement            # the row of the cell this step stands for (its status set when recorded)
    started: float
    deadline: float | None      # when this step's watchdog should have fired
    state: str = RUNNING
    detail: str | None = None   # the exception (raised) or the watchdog's reason (hung)
    exit: str | None = None     # ENDED, LEFT or ERROR, when the process ended through Python
    exit_detail: str | None = None
    exit_at: float | None = None
    marked_at: float | None = None  # when the state last changed (raised, hung): which rank failed first
    # A watchdog that ran out of time: where the rank waited for its peers (in a collective or a
    # device synchronize; None: its own code was stuck), and the rank its stop names, once known.
    waiting_in: str | None = None
    blamed: int | None = None
    # Read from the rank's side files, never written into the record:
    fatal: str | None = field(default=None, compare=False)          # faulthandler's fatal dump
    signalled_at: float | None = field(default=None, compare=False)  # when SIGTERM/SIGINT/SIGHUP arrived
    signals: str | None = field(default=None, compare=False)        # every thread's stack when it did

    def to_json(self) -> str:
        data = {**vars(self), "row": self.row.to_dict()}   # the row as measurements.jsonl holds it
        del data["fatal"], data["signalled_at"], data["signals"]
        return json.dumps(data, sort_keys=True, default=str)

    @property
    def signal_name(self) -> str | None:
        first = (self.fatal or "").strip().splitlines()[:1]
        return _FATAL_SIGNALS.get(first[0].removeprefix("Fatal Python error: ").strip()) if first else None

    def fault_frame(self) -> str | None:
        """The innermost frame of the thread that took the fatal signal: 'file.py:120 in setup'."""
        text = (self.fatal or "").split("Current thread", 1)
        match = _FRAME_RE.search(text[1]) if len(text) == 2 else None
        return f"{match.group(1).rsplit('/', 1)[-1]}:{match.group(2)} in {match.group(3)}" if match else None

    def stopped_where(self) -> tuple[str, bool] | None:
        """Where the sweep's thread was when a stop signal came (the driver's or torchrun's kill),
        from the stacks faulthandler wrote then: (its innermost frames, whether it waited for its
        peers there); None without such a dump."""
        for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", self.signals or ""):
            frames = _FRAME_RE.findall(block)   # innermost first
            if any(path.endswith(_SWEEP_THREAD) for path, _, _ in frames):
                shown = " <- ".join(f"{path.rsplit('/', 1)[-1]}:{line} in {name}" for path, line, name in frames[:3])
                return shown, any(waits_for_peers(path, name) for path, _, name in frames)
        return None


@dataclass
class Stop:
    """What ended a step: a row to record (status hang, crashed or error), or status None when
    another process records it (or nothing is to be recorded) and this one only leaves."""

    status: str | None
    reason: str = ""
    failed_rank: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    template: Measurement | None = None   # the row of the record it came from, when one did

    def row(self, template: Measurement | None = None) -> Measurement:
        """The row this stop stands for: its own record's, else `template` (this rank's step)."""
        base = self.template or template
        assert base is not None, "a stop from no record stands for the row of this rank's step"
        assert self.status is not None, "LEAVE records nothing"
        return replace(base, status=self.status, reason=self.reason, failed_rank=self.failed_rank,
                       extra={**base.extra, **self.extra}, timestamp=time.time())


LEAVE = Stop(None)


def _files(records_dir: Path, rank: int) -> tuple[Path, Path, Path]:
    return (records_dir / f"rank{rank}.json", records_dir / f"rank{rank}.fatal",
            records_dir / f"rank{rank}.signals")


class Recorder:
    """This rank's record and signal traces; every method is a no-op without a records dir. Under
    a launcher (torchrun, srun) it also watches the launcher: see watch_launcher."""

    def __init__(self, run_dir: Path | None, rank: int):
        self.rank = rank
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.dir = self.run_dir / INFLIGHT_DIR if self.run_dir is not None else None
        self.record: Record | None = None
        self._handles: list[Any] = []
        self._had_faulthandler = faulthandler.is_enabled()
        self._lock = threading.Lock()   # the launcher's watch writes the record too
        if under_torchrun():
            watch_launcher(self)
        if self.dir is None:
            return
        self.dir.mkdir(exist_ok=True)
        self.path, fatal_path, signals_path = _files(self.dir, rank)
        fatal, signals = open(fatal_path, "w"), open(signals_path, "w")
        self._handles = [fatal, signals]
        faulthandler.enable(file=fatal, all_threads=True)
        # SIGTERM (and SIGHUP, which torchrun passes on when it gets one) ends this rank through
        # Python (Terminated) where it can; the trace in .signals says it was stopped from
        # outside even when it could not. Without it SIGHUP killed the rank without a trace,
        # read afterwards as a crash of the backend it was running.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_terminated)
        for sig in STOP_SIGNALS:
            faulthandler.register(sig, file=signals, all_threads=True, chain=True)

    def begin(self, step: int, phase: str, what: str, row: Measurement, timeout_s: float | None) -> None:
        if self.dir is None:
            return
        now = time.time()
        self.record = Record(rank=self.rank, pid=os.getpid(), host=socket.gethostname(), step=step, phase=phase,
                             what=what, row=row, started=now,
                             deadline=now + timeout_s if timeout_s is not None and math.isfinite(timeout_s) else None)
        self._write()

    def mark(self, state: str, detail: str | None, waiting_in: str | None = None, blamed: int | None = None) -> None:
        """What happened in the step: RAISED (detail: the exception) or HANG (the reason; where
        this rank waited for its peers, if it did; the rank the stop names, once known)."""
        with self._lock:
            if self.record is not None:
                self.record.state, self.record.detail, self.record.marked_at = state, detail, time.time()
                self.record.waiting_in, self.record.blamed = waiting_in, blamed
                self._write()

    def conclude(self, stop: Stop) -> None:
        """The hang this rank's watchdog ends the step with: its reason and the rank it names
        (where this rank waited, if it did, stays)."""
        waiting_in = self.record.waiting_in if self.record is not None else None
        self.mark(HANG, stop.reason, waiting_in, stop.failed_rank)

    def leave(self, how: str, detail: str | None = None) -> None:
        """The process is ending without finishing (any thread may say so): keep the record, say
        how (the first word stays: the launcher's end, say, before the Terminated it caused)."""
        with self._lock:
            if self.record is not None and self.record.exit is None:
                self.record.exit, self.record.exit_detail, self.record.exit_at = how, detail, time.time()
                self._write()

    def close(self) -> None:
        """A clean end (finished, Ctrl-C, bad input): nothing in flight, no files left."""
        self._unhook()
        if self.dir is not None:
            for path in _files(self.dir, self.rank):
                path.unlink(missing_ok=True)
            try:
                self.dir.rmdir()   # the last rank to end takes the folder with it
            except OSError:
                pass
        self.record = None

    def _write(self) -> None:
        assert self.record is not None
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(self.record.to_json())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except OSError:  # a full disk: the rows say what they can; a record is a courtesy
            pass

    def _unhook(self) -> None:
        if not self._handles:
            return
        for sig in STOP_SIGNALS:
            faulthandler.unregister(sig)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        faulthandler.disable()
        if self._had_faulthandler:
            faulthandler.enable()
        for handle in self._handles:
            handle.close()
        self._handles = []


def _raise_terminated(signum: int, frame: Any) -> None:
    # Once: a second SIGTERM (or torchrun's SIGKILL) ends the process at once.
    signal.signal(signum, signal.SIG_DFL)
    raise Terminated(signum)


# ---------------------------------------------------------------- the launcher

_launcher_pid: int | None = None   # the process that started this rank, while it is watched


def launcher_gone() -> bool:
    """This rank's launcher (torchrun, srun) has ended: the rank is an orphan, and nothing it
    measures or records now is a result (its peers' store went with torchrun: the next backend's
    setup fails with a Broken pipe, which is no reason to skip it)."""
    return _launcher_pid is not None and os.getppid() != _launcher_pid


def watch_launcher(recorder: Recorder) -> None:
    """End this rank when its launcher ends, however it ended. torchrun starts its workers in
    sessions of their own, so a kill of torchrun or of its process group (kill -9 included) left
    the ranks measuring on: the dead run's lock refused a resume, and their rows of `skipped`
    stood in for measurements. A thread waits on the launcher's process (a pidfd: at once, no
    polling); when it goes, the record says so (LEFT), SIGTERM unwinds the sweep as torchrun's
    own would (run.json interrupted, the lock released), and if the sweep is held where no
    Python runs, the process leaves after waits().kill_wait_s."""
    global _launcher_pid
    if _launcher_pid is not None:
        return
    _launcher_pid = os.getppid()
    threading.Thread(target=_watch, args=(recorder, _launcher_pid), name="commbench-launcher-watch",
                     daemon=True).start()


def _watch(recorder: Recorder, pid: int) -> None:
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):   # no pidfd (an old kernel): look once a second
        handle = None
    if handle is not None and os.getppid() == pid:   # opened before it ended, not a reused pid
        poller = select.poll()   # not select(): a rank's descriptors run past FD_SETSIZE
        poller.register(handle, select.POLLIN)
        poller.poll()
    while os.getppid() == pid:
        time.sleep(1.0)
    recorder.leave(LEFT, f"its launcher (pid {pid}) ended")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(waits().kill_wait_s)
    release_all()   # os._exit runs no atexit: the run dir's lock file goes here
    os._exit(TERMINATED_EXIT)


# ---------------------------------------------------------------- reading records

def read_records(run_dir: Path) -> list[Record]:
    """Every rank's record in the dir, with its fatal dump and signal time (unreadable ones skipped)."""
    records_dir = Path(run_dir) / INFLIGHT_DIR
    out = []
    for path in sorted(records_dir.glob("rank*.json")):
        try:
            data = loads_json(_text(path) or "", str(path))
            row = data.pop("row", None) if isinstance(data, dict) else None
            # Written by a rank of this tool, but read from a dir that may come from anyone.
            if not isinstance(row, dict) or row_problem(row):
                continue
            record = Record(**data, row=Measurement.from_dict(row))
            record.state = _OLD_WORDS.get(record.state, record.state)
            record.exit = _OLD_WORDS.get(record.exit or "", record.exit)
        except (OSError, ValueError, TypeError, UsageError):  # torn by a death mid-write: nothing to say
            continue
        if (type(record.rank) is not int or not isinstance(record.waiting_in, (str, type(None)))
                or not isinstance(record.blamed, (int, type(None))) or isinstance(record.blamed, bool)):
            continue
        _, fatal_path, signals_path = _files(records_dir, record.rank)
        record.fatal = _text(fatal_path)
        record.signals = _text(signals_path)
        record.signalled_at = signals_path.stat().st_mtime if record.signals else None
        out.append(record)
    return sorted(out, key=lambda r: r.rank)


_MAX_RECORD_BYTES = 1 << 20   # a record, a fatal dump, a signal's stacks: a few KB each


def _text(path: Path) -> str | None:
    """A record file's text, '' or None when there is none; a run dir may come from anyone, so
    only a regular file is read (a FIFO would block), and at most a MiB of it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = handle.read(_MAX_RECORD_BYTES)
    return data.decode("utf-8", errors="replace").strip() or None


def is_alive(record: Record) -> bool | None:
    """Is the record's process still running? None when it ran on another host."""
    if record.host != socket.gethostname():
        return None
    try:
        proc_stat = Path(f"/proc/{record.pid}/stat").read_text()
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes()
    except OSError:
        return False
    # A zombie is dead; a reused pid is someone else.
    return proc_stat.rsplit(")", 1)[-1].split()[0] != "Z" and b"commbench" in cmdline


def _died_without_trace(record: Record) -> bool:
    """Gone while running its step, with no fatal dump, no stop signal and no Python exit:
    SIGKILL (the kernel's OOM killer, kill -9) or an exit from native code."""
    return record.state == RUNNING and record.exit is None and not record.fatal and record.signalled_at is None


def _crashed(record: Record, run_dir: Path | None) -> Stop:
    """The crashed stop of a dead rank; its fatal dump is kept in run_dir (None: a reader, who
    writes nothing)."""
    signal_name = record.signal_name
    how = f"died ({signal_name})" if signal_name else "died without a trace (SIGKILL: the OOM killer or kill -9?)"
    extra = {"signal": signal_name, "phase": record.phase, "fault_frame": record.fault_frame(),
             "fault_log": keep_fault_log(run_dir, record) if run_dir is not None else None}
    return Stop(CRASHED, f"rank {record.rank} {how} during {record.what}", record.rank,
                {k: v for k, v in extra.items() if v is not None}, record.row)


def _first_raised(records: Iterable[Record]) -> Record | None:
    """Of ranks that raised, the one that raised first: a peer's exception after it (gloo's
    "connection closed by peer" once the first rank left) followed from it. Unknown times last."""
    def when(record: Record) -> tuple[float, int]:
        at = record.marked_at
        return (at if isinstance(at, (int, float)) and math.isfinite(at) else math.inf, record.rank)

    return min((r for r in records if r.state == RAISED), key=when, default=None)


def _stranded(record: Record) -> Stop:
    return Stop(ERROR, f"rank {record.rank}: {record.detail}; it left its peers inside a collective it never "
                       "joined", record.rank, {STRANDED: True}, record.row)


def keep_fault_log(run_dir: Path, record: Record) -> str | None:
    """Copy a fatal dump to RUN/crash-logs/ (the traceback of every thread); its relative path."""
    if not record.fatal:
        return None
    name = f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(record.started))}-rank{int(record.rank)}.txt"
    try:
        write_whole(RunDir(run_dir).subdir(CRASH_LOGS_DIR) / name, f"{record.what}\n\n{record.fatal}\n")
    except (OSError, UsageError, ResultsUnwritable):   # a symlink out, a full disk: the row says the rest
        return None
    return f"{CRASH_LOGS_DIR}/{name}"


class PeerWatch:
    """The watchdog's look at the other ranks during one step (see peer_stop)."""

    def __init__(self, run_dir: Path | None, rank: int, step: int, peer_wait_s: float):
        self.run_dir, self.rank, self.step, self.peer_wait_s = run_dir, rank, step, peer_wait_s
        self._raised_seen: dict[int, float] = {}   # rank -> when this rank first saw it raised

    def __call__(self) -> Stop | None:
        if launcher_gone():
            return LEAVE   # no one reads what an orphan records: it only leaves
        if self.run_dir is None:
            return None
        now = time.monotonic()
        records = read_records(self.run_dir)
        dead = {r.rank for r in records if r.rank != self.rank and is_alive(r) is False}
        if dead:
            # A record read before its process was found gone may predate its last write (a
            # watchdog writes "hang" and "ended" just before os._exit) and would read as a death
            # without a trace; read after, it is final.
            records = read_records(self.run_dir)
        for record in records:
            if record.state == RAISED and record.step == self.step:
                self._raised_seen.setdefault(record.rank, now)
        waited = {rank for rank, seen in self._raised_seen.items() if now - seen >= self.peer_wait_s}
        return peer_stop(records, self.rank, self.step, self.run_dir, waited, dead)

    def hang(self, recorder: Recorder, reason: str, where: str | None, waiting: bool, look_s: float) -> Stop:
        """This rank's time ran out in the step: the stop that names the rank that hung.

        A rank whose own code was stuck (not waiting for its peers) is the one: it says so at
        once. A rank that waited in a collective or a synchronize says where, for its peers to
        read, and looks at them for up to `look_s`: a peer whose own code was stuck, a peer
        that died, or one that already named the rank, is the answer. Past that, the peers
        that never reached their watchdog (a thread holding the GIL) are named; where every rank
        waited, each one's place is."""
        me = f"rank {self.rank}"
        place = where or "a place Python cannot see"
        if not waiting:
            return Stop(HANG, f"{reason}; {me} was in {place}", self.rank)
        recorder.mark(HANG, f"{reason}; {me} was waiting in {place}", waiting_in=place)
        deadline = time.monotonic() + look_s
        while True:
            stop = self()
            if stop is not None and stop.status is not None:
                return replace(stop, reason=f"{stop.reason}; {me} waited for it in {place}") \
                    if stop.status == HANG else stop
            if stop is not None or time.monotonic() >= deadline or self.run_dir is None:
                break
            time.sleep(min(0.1, look_s))
        records = [r for r in read_records(self.run_dir) if r.rank != self.rank] if self.run_dir else []
        silent = [r.rank for r in records if r.step == self.step and r.state == RUNNING and r.exit is None]
        if len(silent) == 1:
            return Stop(HANG, f"{reason}; rank {silent[0]} never reached its own watchdog (a thread may have held "
                              f"the GIL); {me} waited for it in {place}", silent[0])
        if silent:
            return Stop(HANG, f"{reason}; ranks {', '.join(map(str, silent))} never reached their own watchdogs (a "
                              f"thread may have held the GIL); {me} waited for them in {place}")
        others = [f"rank {r.rank} in {r.waiting_in}" for r in records if r.step == self.step and r.waiting_in]
        if others:
            return Stop(HANG, f"{reason}; every rank waited for the others: {me} in {place}; " + "; ".join(others))
        # No record of a peer (on a node that does not see the results dir): where this rank was.
        return Stop(HANG, f"{reason}; {me} was waiting for a peer in {place}")


def _hung(records: list[Record]) -> Stop | None:
    """The hang a watchdog's record names: one that named the rank (its look at the peers ended),
    else one whose own code was stuck. A rank that only waited for its peers is no cause."""
    hung = [r for r in records if r.state == HANG]
    record = (next((r for r in hung if isinstance(r.blamed, int)), None)
              or next((r for r in hung if r.waiting_in is None), None))
    if record is None:
        return None
    blamed = record.blamed if isinstance(record.blamed, int) else record.rank
    return Stop(HANG, record.detail or f"no progress during {record.what}", blamed, template=record.row)


def peer_stop(records: list[Record], me: int, step: int, run_dir: Path, raised: set[int],
              dead_ranks: set[int]) -> Stop | None:
    """Why this rank, waiting in step `step`, will never see it finish; None when no record says.

    A peer that died with a fatal signal or without a trace crashed; a peer whose watchdog
    fired hung; a rank that raised in this step while its peers never came to the vote (those
    in `raised` have been waited for; this rank counts too; of several, the first) stranded
    them, unless a peer failed on its own first (results unwritable). Any other peer that is
    gone was stopped from outside or left through Python, and whoever stopped it or it itself
    reports that: this rank only leaves (LEAVE). `dead_ranks`: the peers found gone before `records` were read.
    """
    dead = [r for r in records if r.rank != me and r.rank in dead_ranks]
    crashed = next((r for r in dead if r.fatal or _died_without_trace(r)), None)
    if crashed is not None:
        return _crashed(crashed, run_dir)
    hung = _hung([r for r in records if r.rank != me])
    if hung is not None:
        return hung
    if any(r.exit == ERROR for r in records if r.rank != me):
        return LEAVE   # what raised after it (a closed connection) followed from its failure
    cause = _first_raised(r for r in records if r.step == step and (r.rank in raised or r in dead))
    if cause is not None:
        return _stranded(cause)
    return LEAVE if dead else None


# ---------------------------------------------------------------- after every process is gone

def postmortem(records: list[Record], run_dir: Path | None, killed_reason: str | None = None) -> Stop | None:
    """The stop that ended a run whose processes are all gone, and the record it belongs to.

    In order: a fatal signal; a death without a trace in a step where a peer raised (the
    exception followed from it); the first exception, which stranded the peers (unless a rank
    failed on its own first: then the exception followed from that); a watchdog that fired; a
    death without a trace; a step still running past its limit when it was stopped from
    outside; `killed_reason` (the driver killed the run) for any step still running.
    A fatal dump is kept in run_dir's crash-logs (run_dir None: a reader, nothing written).
    """
    def first(test: Callable[[Record], bool]) -> Record | None:
        return next((r for r in records if test(r)), None)

    if (record := first(lambda r: bool(r.fatal))) is not None:
        return _crashed(record, run_dir)
    # A rank gone without a trace in the step where a peer raised died first: the peer's
    # exception (gloo's "connection closed by peer") followed from the death, and blaming the
    # survivor would name the wrong rank (kill -9 or the OOM killer on rank 0).
    raised_steps = {r.step for r in records if r.state == RAISED}
    if (record := first(lambda r: _died_without_trace(r) and r.step in raised_steps)) is not None:
        return _crashed(record, run_dir)
    # A rank that failed on its own said so; a peer's exception after it followed from it.
    if (record := _first_raised(records)) is not None and first(lambda r: r.exit == ERROR) is None:
        return _stranded(record)
    if (stop := _hung(records)) is not None:
        return stop
    if (record := first(lambda r: r.state == HANG)) is not None:
        # Every watchdog that fired waited for its peers, and none could look long enough to
        # name one: the ranks still running past their deadline never reached their own.
        silent = [r.rank for r in records if r.state == RUNNING and r.deadline is not None
                  and (r.signalled_at or r.exit_at or time.time()) > r.deadline + 1.0]
        note = (f"; rank {silent[0]} never reached its own watchdog (a thread may have held the GIL)"
                if silent else "")
        return Stop(HANG, (record.detail or f"no progress during {record.what}") + note,
                    silent[0] if len(silent) == 1 else None, template=record.row)
    if (record := first(_died_without_trace)) is not None:
        return _crashed(record, run_dir)
    late = first(lambda r: r.state == RUNNING and r.deadline is not None
                 and (r.signalled_at or r.exit_at or 0) > r.deadline)
    if late is not None:
        blamed, where = _stuck_when_stopped(records)
        return Stop(HANG, f"still in {late.what} past its {late.deadline - late.started:g} s limit when it was "
                          f"stopped from outside{where}", blamed, template=late.row)
    if killed_reason and (record := first(lambda r: r.state == RUNNING)) is not None:
        blamed, where = _stuck_when_stopped(records)
        return Stop(HANG, f"{killed_reason}, during {record.what}{where}", blamed, template=record.row)
    return None


def _stuck_when_stopped(records: list[Record]) -> tuple[int | None, str]:
    """The rank whose own code was stuck when the run was stopped from outside (the driver's
    kill), by the stacks every rank's SIGTERM left: (the rank, '; rank 1 was in ...; rank 0
    waited for it in ...'), or (None, '') where the stacks do not single one out."""
    places = {r.rank: place for r in records if r.state == RUNNING and (place := r.stopped_where()) is not None}
    stuck = [rank for rank, (_, waiting) in places.items() if not waiting]
    if len(stuck) != 1:
        return None, ""
    waiters = "; ".join(f"rank {rank} waited for it in {where}" for rank, (where, waiting) in places.items() if waiting)
    return stuck[0], f"; rank {stuck[0]} was in {places[stuck[0]][0]}" + (f"; {waiters}" if waiters else "")


def _refuse_if_running(records: list[Record], run_dir: Path) -> None:
    live = [r for r in records if is_alive(r)]
    if live:
        raise UsageError(f"{run_dir}: rank {live[0].rank} of a sweep (pid {live[0].pid}) is still running in it; "
                         "wait for it to end, or stop it")


def pending(run_dir: Path) -> str | None:
    """For a reader of the dir: the stop a dead run left in its records and no row holds yet."""
    records = read_records(run_dir)
    if not records or any(is_alive(r) for r in records):
        return None
    stop = postmortem(records, None)
    if stop is None or stop.row().cell in {row.cell for row in RunDir(run_dir).rows()}:
        return None
    return f"{stop.reason}: not in measurements.jsonl yet (commbench sweep --resume {run_dir} records it)"


def recover(run_dir: Path, killed_reason: str | None = None) -> list[str]:
    """Turn the records of a run whose processes are gone into the row they stand for (unless
    one was written) and clear them; the lines that say what was recorded."""
    run_dir = Path(run_dir)
    records = read_records(run_dir)
    lines: list[str] = []
    if records:
        _refuse_if_running(records, run_dir)
        stop = postmortem(records, run_dir, killed_reason)
        if stop is not None and (row := stop.row()).cell not in {r.cell for r in RunDir(run_dir).rows()}:
            RunDir(run_dir).append(row)
            lines.append(f"{stop.reason}: recorded as a {stop.status} row")
    records_dir = run_dir / INFLIGHT_DIR
    if records_dir.is_symlink():   # planted: the next records would be written out of the run dir
        records_dir.unlink()
    elif records_dir.is_dir():
        shutil.rmtree(records_dir, ignore_errors=True)
    return lines


def overdue(run_dir: Path, grace_s: float) -> Record | None:
    """A step still running `grace_s` past its deadline: its watchdog did not fire (the driver asks)."""
    now = time.time()
    return next((r for r in read_records(run_dir) if r.state == RUNNING and r.exit is None
                 and r.deadline is not None and now > r.deadline + grace_s), None)


def stop_line(stop: Stop, backend: str) -> str:
    """The line a user reads when a backend ended the processes."""
    verb = {HANG: "hung", CRASHED: "crashed", ERROR: "failed on one rank"}.get(stop.status or "", "stopped")
    return f"{backend} {verb} ({stop.reason})"

