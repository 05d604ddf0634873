"""The one owner of a run directory: run.json, measurements.jsonl (append + flush per row),
measurements.csv, its subfolders, and the lock a sweep holds on it.

    run = RunDir.create(root)            # results/<YYYYmmdd-HHMMSS-host>[-N]/
    run = RunDir(path)                   # an existing one
    run.lock() ... run.release()         # a sweep or resume: one at a time, the holder named
    run.info() / run.write_info(info) / run.update_info(**fields)   # run.json as a RunInfo
    run.append(row)                      # durable before it returns (RowsWriter for many)
    run.read_rows()                      # streamed, each line checked at the boundary (validate.py)
    run.write_csv() / run.subdir("crash-logs")

Writes never follow a symlink out of the directory: a file name inside it that is a symlink is
replaced, not written through.
"""

from __future__ import annotations

import atexit
import csv
import fcntl
import io
import json
import os
import socket
import time
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence, TextIO

from commbench.errors import ResultsUnwritable, UsageError, write_advice
from commbench.files import open_input, read_text
from commbench.results.compact import CompactRows
from commbench.results.info import RunInfo
from commbench.results.schema import CSV_COLUMNS, READABLE_SCHEMAS, SCHEMA_VERSION, Measurement
from commbench.results.validate import MAX_RUN_INFO_BYTES, info_problem, loads_json, parse_row

RUN_FILE = "run.json"
ROWS_FILE = "measurements.jsonl"
CSV_FILE = "measurements.csv"
TORN_FILE = ROWS_FILE + ".torn"   # fragments cut from the end of measurements.jsonl, kept
LOCK_FILE = ".commbench.lock"    # "<pid> <host>" of the sweep holding the run dir, while it does
# Set by the --nproc driver for its children: "<run dir>\n<driver pid>". The driver holds the
# lock for the whole run; a child whose driver holds it does not take it again (it could not:
# flock would refuse it, and waiting would deadlock the driver, which waits for the child).
LOCK_HOLDER_VAR = "COMMBENCH_RUN_LOCK_HOLDER"


def unwritable(path: Path, exc: OSError) -> ResultsUnwritable:
    # The same command again continues: a sweep with --resume DIR (its own hint says so), an
    # import of the same files completes its import. What to do first depends on why: a full
    # disk wants room, a refused write (EACCES, a read-only mount) wants the place writable.
    return ResultsUnwritable(f"cannot write {path}: {exc.strerror or exc} (errno {exc.errno}); every row "
                             f"written before it is intact: {write_advice(exc)}"
                             + (f" with --resume {path.parent}" if _is_sweep(path.parent) else ""))


def _head(path: Path) -> str:
    """The first KiB of a small file, '' when there is none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(1024)
    except OSError:
        return ""


def _is_sweep(run_dir: Path) -> bool:
    try:
        return RunDir(run_dir).info().source is None
    except (UsageError, OSError):
        return False


@contextmanager
def whole_file(path: Path) -> Iterator[TextIO]:
    """A handle on a temporary beside `path` that replaces it when the block ends, so that no
    reader ever sees half of it; a symlink at `path` is replaced, never written through."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)   # a symlink planted at the temporary's name is not followed
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with open(fd, "w", encoding="utf-8", newline="") as handle:
            yield handle
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ResultsUnwritable(f"cannot write {path}: {exc.strerror or exc} (errno {exc.errno}); "
                                f"{write_advice(exc)}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_whole(path: Path, text: str | Iterable[str]) -> None:
    """Write a file (its text, or its text in chunks) whole, as whole_file does."""
    with whole_file(path) as handle:
        handle.writelines([text] if isinstance(text, str) else text)


def open_append(path: Path, binary: bool = False) -> Any:
    """`path` opened for appending, refusing a symlink (O_NOFOLLOW)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    return open(fd, "ab") if binary else open(fd, "a", encoding="utf-8")


@dataclass
class RowsRead:
    """What measurements.jsonl held: the rows, every line that is not one (number, why), and
    the lines whose key an earlier line had (the later row is the one kept)."""

    rows: Sequence[Measurement]   # CompactRows when read from a file
    unreadable: list[tuple[int, str]] = field(default_factory=list)
    torn_tail: bool = False     # the last line has no newline: a row being written, or cut short
    duplicates: list[tuple[int, int]] = field(default_factory=list)   # (earlier line, later line)

    def problems_line(self, path: Path) -> str | None:
        """One line naming the lines that were skipped, for a reader who counts rows."""
        if not self.unreadable and not self.torn_tail:
            return None
        parts = [f"line {number} ({why})" for number, why in self.unreadable[:_LISTED_LINES]]
        if len(self.unreadable) > _LISTED_LINES:
            parts.append(f"{len(self.unreadable) - _LISTED_LINES} more")
        if self.torn_tail:
            parts.append("an incomplete last line (a row being written, or cut short)")
        count = len(self.unreadable) + self.torn_tail
        return f"{path}: skipped {count} line(s) that are not rows: " + "; ".join(parts)

    def duplicates_line(self, path: Path) -> str | None:
        if not self.duplicates:
            return None
        parts = [f"line {later} repeats line {earlier}" for earlier, later in self.duplicates[:_LISTED_LINES]]
        if len(self.duplicates) > _LISTED_LINES:
            parts.append(f"{len(self.duplicates) - _LISTED_LINES} more")
        return (f"{path}: {len(self.duplicates)} duplicate key(s) (same backend, op, size, dtype, mode, setting): "
                + "; ".join(parts) + "; the row written last is used")


_LISTED_LINES = 5


class RowsWriter:
    """Appends rows to measurements.jsonl and makes each durable before returning."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ROWS_FILE
        # A torn last line (a full disk, a crash mid-write) would swallow the next row.
        self.repaired = repair_torn_tail(self.path)
        try:
            self._file = open_append(self.path)
        except OSError as exc:
            raise _unopenable(self.path, exc) from None

    def append(self, row: Measurement | str, sync: bool = True) -> None:
        """Write one row (or its json_line); durable before returning unless sync is False (a
        batch: sync() after)."""
        try:
            self._file.write(row if isinstance(row, str) else json_line(row))
            if sync:
                self.sync()
        except OSError as exc:
            raise unwritable(self.path, exc) from None

    def sync(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise unwritable(self.path, exc) from None

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self._file.close()
        except OSError:  # what was left in the buffer: append() already said why it failed
            pass


def _unopenable(path: Path, exc: OSError, what: str = "a rows file") -> Exception:
    """Why a file of the rows cannot be opened: bad input when it is no file (a directory, a
    symlink: commbench writes only inside the run dir), else the disk's fault."""
    if path.is_symlink() or path.is_dir():
        return UsageError(f"{path}: {'a symlink' if path.is_symlink() else 'a directory'}, not {what}")
    return unwritable(path, exc)


def repair_torn_tail(path: Path) -> str | None:
    """Cut a last line that has no newline (a write cut short) off the rows file, keeping the
    fragment in measurements.jsonl.torn; returns the line that says so, None when whole."""
    if path.is_dir() or path.is_symlink():
        raise _unopenable(path, OSError())
    if not path.exists():
        return None
    with open_input(path, "a rows file") as handle:   # a FIFO or a device is refused, never read
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return None
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return None
        # Only the tail is read: the file may be large.
        start = max(0, size - (1 << 20))
        handle.seek(start)
        tail = handle.read()
    keep = start + tail.rfind(b"\n") + 1 if b"\n" in tail else start
    torn_path = path.with_name(TORN_FILE)
    try:   # the fragments' file is written as the rows are: never through a symlink
        torn = open_append(torn_path, binary=True)
    except OSError as exc:
        raise _unopenable(torn_path, exc, "the file of torn rows commbench keeps") from None
    try:
        with torn:
            torn.write(tail[keep - start:] + b"\n")
    except OSError as exc:
        raise unwritable(torn_path, exc) from None
    try:
        with open(path, "r+b") as handle:
            handle.truncate(keep)
            os.fsync(handle.fileno())
    except OSError as exc:
        raise unwritable(path, exc) from None
    return (f"{path.name} ended in a torn line ({size - keep} bytes without a newline: a write was cut "
            f"short); moved it to {TORN_FILE}, and that row is measured again")


def json_line(row: Measurement) -> str:
    """The row's line of measurements.jsonl (keys sorted), newline included."""
    return json.dumps(row.to_dict(), sort_keys=True) + "\n"


def csv_line(row: Measurement) -> str:
    """The row's line of measurements.csv (CSV_COLUMNS; its dicts as sorted JSON text)."""
    data = row.to_dict()
    values = [data[name] for name in CSV_COLUMNS]
    for index in _CSV_JSON_COLUMNS:
        values[index] = json.dumps(values[index], sort_keys=True) if values[index] else ""
    _CSV_WRITER.writerow(values)
    text = _CSV_BUFFER.getvalue()
    _CSV_BUFFER.seek(0)
    _CSV_BUFFER.truncate()
    return text


_CSV_JSON_COLUMNS = (CSV_COLUMNS.index("env_setting"), CSV_COLUMNS.index("extra"))
_CSV_BUFFER = io.StringIO()
_CSV_WRITER = csv.writer(_CSV_BUFFER)


class Lines(NamedTuple):
    """A row already encoded, as json_line and csv_line give it (an import encodes rows of one
    shape from a template: appending them needs no Measurement)."""

    json: str
    csv: str


class _CsvRows:
    """measurements.csv's header and rows, written to a handle as they come."""

    def __init__(self, handle: TextIO):
        self._handle = handle
        csv.writer(handle).writerow(CSV_COLUMNS)

    def add(self, row: Measurement | str) -> None:
        """One row, or its csv_line."""
        self._handle.write(row if isinstance(row, str) else csv_line(row))


IDENTITY_EXTRA = ("source_sha256", "nccl_tests_cycle", "nccl_version_loaded")


class _Identities:
    """What makes two rows the same measurement: the key (the cell: backend, op, dtype, size,
    tokens, hidden, mode, env setting), the world size, for imported nccl-tests rows the file and
    -N cycle they came from (each cycle is a measurement of its own), and the NCCL the row loaded
    (analysis keys curves by it too). Extra values come from a file anyone may have written:
    compared as text.

    As one int: the number of the identity less the size (numbered as first seen: a run has one
    per backend, setting and shape), shifted left 64 bits, plus the size. A key held per row costs
    an int, not the ~0.5 KB of a tuple; the cell's fields come from cell_but_size (key() makes
    two frozen dataclasses a row)."""

    def __init__(self) -> None:
        self._numbers: dict[tuple, int] = {}

    def of(self, row: Measurement) -> int:
        rest = (*row.cell_but_size(), row.world_size, *[repr(row.extra.get(name)) for name in IDENTITY_EXTRA])
        number = self._numbers.setdefault(rest, len(self._numbers))
        return number << 64 | int(row.message_bytes)


class RunDir:
    """A results directory and everything written into it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock: int | None = None   # the directory descriptor holding the flock

    @classmethod
    def create(cls, root: Path) -> "RunDir":
        """results/<YYYYmmdd-HHMMSS-host>[-N]/, created; never reuses an existing folder."""
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + socket.gethostname().split(".")[0]
        path = Path(root) / run_id
        suffix = 1
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                path = Path(root) / f"{run_id}-{suffix}"
                suffix += 1
            except OSError as exc:   # a symlink loop, a file on the way, no space
                raise UsageError(f"--out {root}: cannot create a run dir there ({exc.strerror})") from None
        return cls(path.resolve())

    # ---------------------------------------------------------------- run.json

    def has_info(self) -> bool:
        return (self.path / RUN_FILE).exists()

    def info(self) -> RunInfo:
        """run.json, checked: bad input (exit 2) when it is missing, no JSON object, of a schema
        this commbench does not read, or has a field of the wrong type."""
        path = self.path / RUN_FILE
        if not path.exists():
            raise UsageError(f"{self.path}: not a commbench results dir (no {RUN_FILE})")
        if path.is_file() and path.stat().st_size > MAX_RUN_INFO_BYTES:
            raise UsageError(f"{path}: larger than {MAX_RUN_INFO_BYTES >> 20} MiB; not a run.json commbench writes")
        info = loads_json(read_text(path, "a commbench run.json"), str(path))
        if not isinstance(info, dict):
            raise UsageError(f"{path}: a JSON {type(info).__name__}, not a commbench run.json (an object)")
        if info.get("schema") not in READABLE_SCHEMAS:
            raise UsageError(f"{self.path}: results of schema version {info.get('schema')}, "
                             f"this commbench reads versions {', '.join(map(str, READABLE_SCHEMAS))}")
        problem = info_problem(info)
        if problem:
            raise UsageError(f"{path}: {problem}")
        return RunInfo.from_dict(info)

    def info_or_new(self) -> RunInfo:
        """run.json, or an empty RunInfo where none was written yet."""
        return self.info() if self.has_info() else RunInfo()

    def write_info(self, info: RunInfo) -> None:
        written = replace(info, schema=SCHEMA_VERSION)
        write_whole(self.path / RUN_FILE, json.dumps(written.to_dict(), indent=2, sort_keys=True, default=str))

    def update_info(self, **fields: Any) -> None:
        """Set fields of run.json (a value None removes the field; a name RunInfo has no field
        for is a TypeError)."""
        self.write_info(replace(self.info(), **fields))

    # ---------------------------------------------------------------- rows

    def writer(self) -> RowsWriter:
        return RowsWriter(self.path)

    def append(self, *rows: Measurement) -> None:
        self.append_all(rows)

    def append_all(self, rows: Iterable[Measurement | Lines], on_row: Callable[[Measurement | Lines], None] | None = None,
                   with_csv: bool = False) -> None:
        """Append rows, or rows already encoded (Lines), streamed: an iterator is never held
        whole; durable on return with one fsync for the batch (an import of 10^5 rows would spend
        minutes in fsync per row); on_row sees each row once it is written. with_csv:
        measurements.csv is rewritten in the same pass (the rows already there, then these), so
        that no large batch is read back."""
        writer = RowsWriter(self.path)
        try:
            if not with_csv:
                self._append(writer, rows, on_row, None)
                return
            with whole_file(self.path / CSV_FILE) as handle:
                table = _CsvRows(handle)
                for _, row, _ in self.iter_lines():
                    if row is not None:
                        table.add(row)
                self._append(writer, rows, on_row, table)
        finally:
            writer.close()

    @staticmethod
    def _append(writer: RowsWriter, rows: Iterable[Measurement | Lines],
                on_row: Callable[[Measurement | Lines], None] | None, table: _CsvRows | None) -> None:
        for row in rows:
            encoded = isinstance(row, Lines)
            writer.append(row.json if encoded else row, sync=False)
            if table is not None:
                table.add(row.csv if encoded else row)
            if on_row is not None:
                on_row(row)
        writer.sync()

    def iter_lines(self) -> Iterator[tuple[int, Measurement | None, str | None]]:
        """(line number, row or None, why not) for every non-blank complete line, streamed;
        a last line without its newline comes as (number, None, None)."""
        path = self.path / ROWS_FILE
        if not path.exists():
            return
        if path.is_dir():
            raise UsageError(f"{path}: a directory, not a rows file")
        with open_input(path, "a rows file") as handle:   # a FIFO would block, a device never end
            for number, line in enumerate(handle, start=1):
                if not line.endswith(b"\n"):
                    if line.strip():
                        yield number, None, None
                    return
                if line.strip():
                    row, why = parse_row(line)
                    yield number, row, why

    def read_rows(self) -> RowsRead:
        """Every row (one per key: the one written last), every line that is not one, and the
        duplicate keys; never raises on content. The rows are held compactly (CompactRows): a
        key costs ~0.3 KB while reading, ~0.2 KB after, however many rows repeat it."""
        read = RowsRead(CompactRows())
        identities = _Identities()
        by_key: dict[int, int] = {}     # the row's identity: its position
        line_of = array("q")            # a position's line number
        for number, row, why in self.iter_lines():
            if row is None and why is None:
                read.torn_tail = True
            elif row is None:
                read.unreadable.append((number, why or ""))
            else:
                key = identities.of(row)
                if key in by_key:
                    position = by_key.pop(key)
                    read.duplicates.append((line_of[position], number))
                    read.rows.drop(position)
                by_key[key] = read.rows.add(row)
                line_of.append(number)
        read.rows.finish()
        return read

    def rows(self) -> list[Measurement]:
        return list(self.read_rows().rows)

    def write_csv(self, rows: Iterable[Measurement] | None = None) -> Path:
        """measurements.csv: `rows`, or every row of measurements.jsonl as written (streamed)."""
        source = rows if rows is not None else (row for _, row, _ in self.iter_lines() if row is not None)
        path = self.path / CSV_FILE
        with whole_file(path) as handle:
            table = _CsvRows(handle)
            for row in source:
                table.add(row)
        return path

    def subdir(self, name: str) -> Path:
        """RUN/<name>/, created; a symlink there (out of the dir) is refused."""
        path = self.path / name
        if path.is_symlink():
            raise UsageError(f"{path}: a symlink; commbench writes only inside the run dir")
        path.mkdir(exist_ok=True)
        return path

    # ---------------------------------------------------------------- the lock

    def lock(self, busy: str = "another commbench sweep is running in it") -> "RunDir":
        """Hold the run dir for one sweep or resume (until release() or the process ends);
        a second one is refused with the holder's pid and host (`busy` says what holds it: a
        fleet build locks its fleet folder the same way). A child of the --nproc driver that
        holds it takes nothing.

        The lock is an flock on the directory itself, so the kernel drops it with its holder
        (kill -9 included) and no lock file is left to go stale; LOCK_FILE only names the holder
        while it holds, and goes with release()."""
        if _driver_holds(self.path):
            return self
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise UsageError(f"{self.path}: cannot open the run dir to lock it ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = _head(self.path / LOCK_FILE).split()
            who = f"pid {holder[0]} on {holder[1]}" if len(holder) >= 2 else "another process"
            raise UsageError(f"{self.path}: {busy} ({who}); wait for it to end, or stop it") from None
        self._lock = fd
        if not _HELD:
            atexit.register(release_all)   # an error that ends the process: the file goes too
        _HELD.append(self)
        try:
            write_whole(self.path / LOCK_FILE, f"{os.getpid()} {socket.gethostname()}\n")
        except ResultsUnwritable as exc:
            self.release()
            raise UsageError(f"{self.path}: not writable ({exc})") from None
        return self

    def release(self) -> None:
        if self._lock is not None:
            (self.path / LOCK_FILE).unlink(missing_ok=True)   # before the lock goes: a holder's file is its own
            os.close(self._lock)   # closing the descriptor drops the flock
            self._lock = None
            if self in _HELD:
                _HELD.remove(self)

    def holder_env(self) -> dict[str, str]:
        """What the driver hands its children: it holds this dir's lock for them."""
        return {LOCK_HOLDER_VAR: f"{self.path.resolve()}\n{os.getpid()}"}


# The run dirs this process holds: their lock files go with it however it ends (atexit for an
# error, release_all before a watchdog's os._exit); only SIGKILL leaves one, which the next
# lock overwrites (the flock, not the file, is the lock).
_HELD: list[RunDir] = []


def release_all() -> None:
    for run in list(_HELD):
        run.release()


def _driver_holds(path: Path) -> bool:
    """This process is a child of the --nproc driver that holds `path`'s lock (and is alive)."""
    value = os.environ.get(LOCK_HOLDER_VAR, "")
    held, _, pid = value.partition("\n")
    if not held or Path(held) != path.resolve() or not pid.isdigit():
        return False
    recorded = _head(path / LOCK_FILE).split()
    return bool(recorded) and recorded[0] == pid and Path(f"/proc/{pid}").exists()
