"""Reading profiler traces: PyTorch/kineto Chrome-trace JSON (.json, .json.gz) and Nsight Systems
sqlite exports, into the few records `commbench attribute` needs.

Chrome traces are streamed: the top-level object is walked key by key and each element of
"traceEvents" is decoded on its own (json's raw_decode over a sliding buffer), so memory holds
the kept records, never the document. Kept are GPU kernels, memcpy/memset (busy time), the
launch calls that link kernels to host threads (cudaLaunchKernel, cudaGraphLaunch, ...), the
host ops that carry a collective's size, and step annotations. Event layout from kineto's
output_json.cpp: kernels are ph "X", cat "kernel", pid = device, tid = stream, ts/dur in us, args
"correlation", "stream", "graph id" (CUDA >= 12); c10d's record_param_comms carries "In msg
nelems", "dtype", "Group size" (facts gathered in docs/attribute.md).

Nsight Systems exports (`nsys export --type sqlite`) are read with sqlite3: CUPTI_ACTIVITY_KIND_KERNEL
(start/end in ns, deviceId, streamId, correlationId, graphId where recorded, names as StringIds),
CUPTI_ACTIVITY_KIND_RUNTIME for launches, NVTX_EVENTS for annotations. One process = one rank.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import sqlite3
import statistics
import sys
import zlib
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from commbench.errors import UsageError
from commbench.files import check_input, open_input
from commbench.results.text import clean_text
from commbench.results.validate import MAX_COUNT, MAX_NESTING, MAX_WORLD_SIZE, depth
from commbench.units import MAX_MESSAGE_BYTES

CHUNK_CHARS = 1 << 20
# A single event larger than this is no trace event: the file is not a trace. White space is
# bounded the same way: more of it in one run is no trace either (a gzip of 2 GB of blanks is
# 2 MB), and it is refused once this much is skipped, not after the whole of it.
MAX_EVENT_CHARS = 64 << 20
MAX_BLANK_CHARS = MAX_EVENT_CHARS
# Times in us: any profiler clock (kineto's epoch microseconds are 1.8e15 in 2026) is inside
# +-1e17 us (3,000 years); a duration of more is no measured span. Ids fit a signed 64-bit int.
MAX_TIME_US = 1e17
# A kernel this far from the middle of its file's kernels is no kernel of that profile.
MAX_TRACE_SPAN_DAYS = 7
MAX_TRACE_SPAN_US = MAX_TRACE_SPAN_DAYS * 86400e6
MAX_ID = (1 << 63) - 1
SQLITE_MAGIC = b"SQLite format 3\0"
GZIP_MAGIC = b"\x1f\x8b"
_BLANK = re.compile(r"[ \t\r\n]*")
_DIGITS = re.compile(r"[0-9]{1,19}")
_LISTED_EVENTS = 5

GPU_BUSY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_NAME = re.compile(r"Launch|cudaGraphLaunch|cuGraphLaunch", re.IGNORECASE)
# Top-level key commbench's own traces carry (recorded by scripts/record-traces.py, constructed
# test data): what the trace is. Profilers never write it; a user's trace is described as given.
PROVENANCE_KEY = "commbench_provenance"
# Host ops worth keeping: the ones that carry a collective's size (c10d's record_param_comms,
# any op whose name says allreduce, with its recorded input shapes).
COLLECTIVE_OP = re.compile(r"record_param_comms|all_?reduce|allreduce", re.IGNORECASE)
DTYPE_BYTES = {"float": 4, "float32": 4, "fp32": 4, "c10::bfloat16": 2, "bfloat16": 2, "bf16": 2,
               "c10::half": 2, "half": 2, "float16": 2, "fp16": 2, "double": 8, "float64": 8,
               "int": 4, "int32": 4, "long int": 8, "int64": 8, "unsigned char": 1, "uint8": 1,
               "signed char": 1, "int8": 1, "c10::float8_e4m3fn": 1, "float8_e4m3fn": 1}


@dataclass(slots=True)
class Kernel:
    name: str
    ts_us: float
    dur_us: float
    device: int
    stream: int
    correlation: int | None
    graph_id: int | None
    is_kernel: bool = True     # False: a memcpy/memset (busy time, never an allreduce)

    @property
    def end_us(self) -> float:
        return self.ts_us + self.dur_us


@dataclass(slots=True)
class HostSpan:
    """A host-side interval: a launch call, a collective op or a step annotation."""
    name: str
    ts_us: float
    dur_us: float
    thread: int
    correlation: int | None = None
    message_bytes: int | None = None

    @property
    def end_us(self) -> float:
        return self.ts_us + self.dur_us


class Launches:
    """A trace's launch calls by correlation id, held as columns: about 36 bytes a launch, where a
    HostSpan in a dict was about 260 (a trace has one launch per kernel). get() makes the
    HostSpan of one when asked. Of two launches with one correlation id the later is kept, as a
    dict would keep it."""

    def __init__(self) -> None:
        self._correlations, self._threads, self._names = array("q"), array("q"), array("I")
        self._starts_us, self._durations_us = array("d"), array("d")
        self._name_list: list[str] = []
        self._name_index: dict[str, int] = {}
        self._in_order = True

    def add(self, name: str, ts_us: float, dur_us: float, thread: int, correlation: int) -> None:
        if self._correlations and correlation < self._correlations[-1]:
            self._in_order = False
        index = self._name_index.get(name)
        if index is None:
            index = self._name_index[name] = len(self._name_list)
            self._name_list.append(name)
        self._correlations.append(correlation)
        self._threads.append(thread)
        self._names.append(index)
        self._starts_us.append(ts_us)
        self._durations_us.append(dur_us)

    def get(self, correlation: int) -> HostSpan | None:
        if not self._in_order:
            self._sort()
        i = bisect_right(self._correlations, correlation) - 1   # the last of equal ids: the later launch
        if i < 0 or self._correlations[i] != correlation:
            return None
        return HostSpan(self._name_list[self._names[i]], self._starts_us[i], self._durations_us[i], self._threads[i],
                        correlation)

    def _sort(self) -> None:
        order = sorted(range(len(self._correlations)), key=self._correlations.__getitem__)   # stable
        for name in ("_correlations", "_threads", "_names", "_starts_us", "_durations_us"):
            column = getattr(self, name)
            setattr(self, name, array(column.typecode, [column[i] for i in order]))
        self._in_order = True

    def __len__(self) -> int:
        return len(self._correlations)


@dataclass
class RankTrace:
    source: str
    rank: int | None
    world_size: int | None
    comm_backend: str | None
    trace_format: str                     # "kineto" | "nsys"
    kernels: list[Kernel] = field(default_factory=list)
    launches: Launches = field(default_factory=Launches)           # correlation -> launch call
    collective_ops: list[HostSpan] = field(default_factory=list)
    annotations: list[HostSpan] = field(default_factory=list)
    gpu_annotations: list[HostSpan] = field(default_factory=list)  # thread = device
    device_name: str | None = None
    provenance: str | None = None         # what the file says it is (PROVENANCE_KEY)


class BadEvent(Exception):
    """An event (or an nsys row) with a field of the wrong type or range: dropped, and named."""


class Dropped:
    """The events of one file that failed their check: counted, the first few named."""

    def __init__(self, origin: str, unit: str):
        self.origin, self.unit = origin, unit
        self.count = 0
        self.named: list[str] = []

    def add(self, index: int | str, why: str) -> None:
        """One dropped: its index in the file (or a name for it) and why."""
        self.count += 1
        if len(self.named) < _LISTED_EVENTS:
            self.named.append(f"{self.unit if isinstance(index, int) else ''} {index} ({why})".strip())

    def warn(self) -> None:
        if not self.count:
            return
        more = [f"{self.count - len(self.named)} more"] if self.count > len(self.named) else []
        print(f"commbench: warning: {self.origin}: dropped {self.count} {self.unit}(s) that fail their check: "
              + "; ".join(self.named + more), file=sys.stderr)


def _short(value: Any) -> str:
    text = clean_text(repr(value))
    return text if len(text) <= 40 else text[:37] + "..."


def _time_us(value: Any, name: str, low: float = -MAX_TIME_US, scale: float = 1.0) -> float:
    """A time or duration in us (value / scale): a finite number from low to MAX_TIME_US."""
    if value.__class__ not in (int, float):
        raise BadEvent(f"{name} is {_short(value)}, not a number")
    us = value / scale
    if not low <= us <= MAX_TIME_US:   # NaN fails both
        raise BadEvent(f"{name} is {_short(value)}, not a {'duration' if low == 0 else 'time'} in range")
    return float(us)


def _whole(value: Any, name: str, text_is_none: bool = False) -> int | None:
    """An id or count: a whole number (as a JSON number or its digits) within 64 bits; None when
    absent. text_is_none: other text is no number but no error (kineto's named threads)."""
    if value is None:
        return None
    kind = value.__class__
    if kind is int:
        if -MAX_ID <= value <= MAX_ID:
            return value
    elif kind is float:
        if value.is_integer() and -MAX_ID <= value <= MAX_ID:   # False for inf and nan
            return int(value)
    elif kind is str:
        if _DIGITS.fullmatch(value) and int(value) <= MAX_ID:
            return int(value)
        if text_is_none:
            return None
    raise BadEvent(f"{name} is {_short(value)}, not a whole number")


def _count(value: Any, name: str) -> int | None:
    number = _whole(value, name)
    if number is not None and not 0 <= number <= MAX_COUNT:
        raise BadEvent(f"{name} is {_short(value)}, not a count >= 0")
    return number


def _message_bytes(count: int, size: int) -> int:
    if count * size > MAX_MESSAGE_BYTES:
        raise BadEvent(f"a message of {count} x {size} bytes, more than any rank sends")
    return count * size


def collective_bytes(args: dict[str, Any]) -> int | None:
    """Message size a host op recorded: record_param_comms' element count and dtype, else the
    first input's shape and type (record_shapes=True)."""
    nelems = _count(args.get("In msg nelems"), "In msg nelems")
    dtype = args.get("dtype")
    if nelems is not None and isinstance(dtype, str) and dtype.lower() in DTYPE_BYTES:
        return _message_bytes(nelems, DTYPE_BYTES[dtype.lower()])
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and dims and isinstance(dims[0], list) and isinstance(types, list) and types:
        size = DTYPE_BYTES.get(types[0].lower()) if isinstance(types[0], str) else None
        if size and dims[0] and all(d.__class__ is int for d in dims[0]):
            count = 1
            for d in dims[0]:
                if not 0 <= d <= MAX_COUNT:
                    raise BadEvent(f"Input Dims holds {_short(d)}, not a count >= 0")
                count = min(count * d, MAX_COUNT + 1)   # stays a small int however many dims
            return _message_bytes(count, size)
    return None


class _Scanner:
    """Just enough of a streaming JSON reader for a Chrome trace's top level."""

    def __init__(self, stream: IO[str], origin: str):
        self.stream, self.origin = stream, origin
        self.buf, self.pos, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()
        self.brackets = 0    # the brackets in the last value read: only many of them can nest deep

    def _fill(self) -> bool:
        data = self.stream.read(CHUNK_CHARS)
        if not data:
            self.eof = True
            return False
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ('' at the end); white space is skipped a
        buffer at a time, and a run of more than MAX_BLANK_CHARS of it refuses the file."""
        blank = 0
        while True:
            end = _BLANK.match(self.buf, self.pos).end()
            blank += end - self.pos
            self.pos = end
            if blank > MAX_BLANK_CHARS:
                raise self.broken(f"more than {MAX_BLANK_CHARS >> 20} MB of white space in a row")
            if self.pos < len(self.buf) or not self._fill():
                return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def expect(self, chars: str) -> str:
        ch = self.peek()
        if not ch or ch not in chars:
            raise self.broken(f"expected {' or '.join(repr(c) for c in chars)}")
        self.pos += 1
        return ch

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
                # A number at the buffer's end may continue in the next chunk.
                if end < len(self.buf) or self.eof:
                    self.brackets = self.buf.count("{", self.pos, end) + self.buf.count("[", self.pos, end)
                    self.pos = end
                    return obj
            except json.JSONDecodeError:
                if self.eof:
                    raise self.broken("a value does not parse") from None
            except RecursionError:
                raise self.broken(f"a value nested deeper than {MAX_NESTING} levels") from None
            if len(self.buf) - self.pos > MAX_EVENT_CHARS:
                raise self.broken("one value is larger than 64 MB")
            self._fill()   # at the end of the file this sets eof, and the next try decides

    def broken(self, why: str) -> UsageError:
        where = "at the end (truncated?)" if self.eof else "in the file"
        return UsageError(f"{self.origin}: not a Chrome trace JSON ({why} {where})")


def scan_chrome(stream: IO[str], origin: str, on_event: Callable[[dict[str, Any], int], None]) -> dict[str, Any]:
    """Calls on_event(event, brackets in it) for every trace event; returns the other top-level
    keys (small values)."""
    sc = _Scanner(stream, origin)
    first = sc.peek()
    if first == "[":          # the bare-array form of the Chrome trace format
        _scan_array(sc, on_event)
        return {}
    if first != "{":
        raise UsageError(f"{origin}: not a Chrome trace JSON (it does not start with '{{' or '[')")
    sc.expect("{")
    meta: dict[str, Any] = {}
    saw_events = False
    if sc.peek() == "}":
        sc.pos += 1
    else:
        while True:
            key = sc.value()
            if not isinstance(key, str):
                raise sc.broken("a key is not a string")
            sc.expect(":")
            if key == "traceEvents":
                if sc.peek() != "[":
                    raise sc.broken("traceEvents is not a list")
                _scan_array(sc, on_event)
                saw_events = True
            else:
                meta[key] = sc.value()
                if sc.brackets > MAX_NESTING and depth(meta[key]) > MAX_NESTING:
                    raise sc.broken(f"{clean_text(key)[:40]} nested deeper than {MAX_NESTING} levels")
            if sc.expect(",}") == "}":
                break
    if not saw_events:
        raise UsageError(f"{origin}: not a profiler trace (no traceEvents)")
    return meta


def _scan_array(sc: _Scanner, on_event: Callable[[dict[str, Any], int], None]) -> None:
    sc.expect("[")
    if sc.peek() == "]":
        sc.pos += 1
        return
    while True:
        event = sc.value()
        if isinstance(event, dict):
            on_event(event, sc.brackets)
        if sc.expect(",]") == "]":
            return


class _ChromeCollector:
    """Keeps what attribute needs from each event, every field checked where it is read; names
    are cleaned and interned (traces repeat them), as are thread ids."""

    def __init__(self, trace: RankTrace, dropped: Dropped):
        self.trace, self.dropped = trace, dropped
        self.names: dict[str, str] = {}
        self.ints: dict[int, int] = {}
        self.index = -1

    def __call__(self, ev: dict[str, Any], brackets: int) -> None:
        self.index += 1
        if ev.get("ph") != "X":
            return
        try:
            if brackets > MAX_NESTING and depth(ev) > MAX_NESTING:
                raise BadEvent(f"nested deeper than {MAX_NESTING} levels")
            self._keep(ev)
        except BadEvent as bad:
            self.dropped.add(self.index, str(bad))

    def _name(self, raw: Any) -> str:
        if not isinstance(raw, str):
            raise BadEvent(f"name is {_short(raw)}, not text")
        name = self.names.get(raw)
        if name is None:
            name = self.names[raw] = sys.intern(clean_text(raw))
        return name

    def _shared(self, number: int | None) -> int:
        number = number or 0
        return self.ints.setdefault(number, number)

    def _keep(self, ev: dict[str, Any]) -> None:
        cat = ev.get("cat")
        if cat not in GPU_BUSY_CATS and cat not in _HOST_CATS:
            return
        raw = ev.get("name")
        wanted = _WANTED_NAME.get(cat)   # host events of these categories are kept by name only
        if wanted is not None and isinstance(raw, str) and not wanted.search(raw):
            return
        name = self._name(raw)
        ts, dur = _time_us(ev.get("ts"), "ts"), _time_us(ev.get("dur"), "dur", low=0.0)
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        tid = self._shared(_whole(ev.get("tid"), "tid", text_is_none=True))
        pid = self._shared(_whole(ev.get("pid"), "pid", text_is_none=True))
        if cat in GPU_BUSY_CATS:
            stream = _whole(args.get("stream"), "stream")
            self.trace.kernels.append(Kernel(
                name, ts, dur, pid, tid if stream is None else self._shared(stream),
                _whole(args.get("correlation"), "correlation"), _whole(args.get("graph id"), "graph id"),
                cat == "kernel"))
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = _whole(args.get("correlation"), "correlation")
            if corr is not None:
                self.trace.launches.add(name, ts, dur, tid, corr)
        elif cat == "cpu_op":
            self.trace.collective_ops.append(HostSpan(name, ts, dur, tid, message_bytes=collective_bytes(args)))
        elif cat == "user_annotation":
            # ProcessGroup's own "nccl:all_reduce" range carries the shapes too (checked before
            # anything of the event is kept)
            collective = HostSpan(name, ts, dur, tid, message_bytes=collective_bytes(args)) \
                if COLLECTIVE_OP.search(name) else None
            self.trace.annotations.append(HostSpan(name, ts, dur, tid))
            if collective is not None:
                self.trace.collective_ops.append(collective)
        elif cat == "gpu_user_annotation":
            self.trace.gpu_annotations.append(HostSpan(name, ts, dur, pid))


_HOST_CATS = ("cuda_runtime", "cuda_driver", "cpu_op", "user_annotation", "gpu_user_annotation")
_WANTED_NAME = {"cuda_runtime": LAUNCH_NAME, "cuda_driver": LAUNCH_NAME, "cpu_op": COLLECTIVE_OP}


def _text_stream(raw: IO[bytes]) -> IO[str]:
    head = raw.read(2)
    raw.seek(0)
    binary: IO[bytes] = gzip.GzipFile(fileobj=raw, mode="rb") if head == GZIP_MAGIC else raw  # type: ignore[assignment]
    return io.TextIOWrapper(binary, encoding="utf-8")


def read_chrome(path: Path, raw: IO[bytes]) -> RankTrace:
    trace = RankTrace(str(path), None, None, None, "kineto")
    dropped = Dropped(str(path), "event")
    try:
        with _text_stream(raw) as stream:
            meta = scan_chrome(stream, str(path), _ChromeCollector(trace, dropped))
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise UsageError(f"{path}: truncated or corrupt gzip ({clean_text(str(exc))})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a profiler trace (not UTF-8 text)") from None
    _drop_far_kernels(trace, dropped)
    dropped.warn()
    _read_meta(trace, meta, path)
    return trace


def _read_meta(trace: RankTrace, meta: dict[str, Any], path: Path) -> None:
    """The file-level facts: a wrong rank or world size is a wrong file, refused."""
    info = meta.get("distributedInfo")
    if isinstance(info, dict):
        try:
            world = _whole(info.get("world_size"), "distributedInfo world_size")
            rank = _whole(info.get("rank"), "distributedInfo rank")
        except BadEvent as bad:
            raise UsageError(f"{path}: {bad}") from None
        if world is not None and not 1 <= world <= MAX_WORLD_SIZE:
            raise UsageError(f"{path}: distributedInfo world_size is {world}, not a number of ranks from 1 to "
                             f"{MAX_WORLD_SIZE}")
        if rank is not None and not 0 <= rank < (world or MAX_WORLD_SIZE):
            raise UsageError(f"{path}: distributedInfo rank is {rank}, not a rank of world size {world}")
        trace.rank, trace.world_size = rank, world
        backend = info.get("backend")
        trace.comm_backend = clean_text(backend)[:64] if isinstance(backend, str) else None
    if isinstance(meta.get(PROVENANCE_KEY), str):
        trace.provenance = clean_text(meta[PROVENANCE_KEY])[:2000]
    props = meta.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        name = props[0].get("name")
        trace.device_name = clean_text(name)[:200] or None if isinstance(name, str) else None


def _drop_far_kernels(trace: RankTrace, dropped: Dropped) -> None:
    """Kernels (and copies) that start more than MAX_TRACE_SPAN_US from the median start of the
    file's kernels are dropped and named: a profile spans seconds to hours, so one at 2^62 ns
    among kernels at 10^9 ns is a broken value, not a step of a 146,000-year wall."""
    if len(trace.kernels) < 3:
        return
    middle = statistics.median_low([k.ts_us for k in trace.kernels])
    near = [k for k in trace.kernels if abs(k.ts_us - middle) <= MAX_TRACE_SPAN_US]
    if len(near) == len(trace.kernels):
        return
    for k in trace.kernels:
        if abs(k.ts_us - middle) > MAX_TRACE_SPAN_US:
            dropped.add(f"kernel {_short(k.name)}", f"starts at {k.ts_us:.6g} us, more than {MAX_TRACE_SPAN_DAYS} "
                                                    f"days from the median kernel's {middle:.6g} us")
    trace.kernels = near


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _pid_of(tid: int) -> int:
    return (tid >> 24) << 24   # nsys globalTid carries the globalPid's bits


class _NsysRows:
    """Rows of one nsys table, each checked where it is read; a bad one dropped and named."""

    def __init__(self, dropped: Dropped, table: str):
        self.dropped, self.table = dropped, table

    def read(self, rows: Iterator[tuple[Any, ...]], keep: Callable[..., None]) -> None:
        for index, row in enumerate(rows):
            try:
                keep(*row)
            except BadEvent as bad:
                self.dropped.add(index, f"{self.table}: {bad}")


def _span_us(start: Any, end: Any) -> tuple[float, float]:
    """(start, duration) in us of an nsys row's start and end in ns; end before start is no span."""
    start_us = _time_us(start, "start", scale=1e3)
    end_us = _time_us(end, "end", scale=1e3)
    if end_us < start_us:
        raise BadEvent(f"end {_short(end)} is before start {_short(start)}")
    return start_us, end_us - start_us


def read_nsys(path: Path) -> list[RankTrace]:
    """One RankTrace per process (globalPid) that ran kernels, in pid order."""
    check_input(path, "a profiler trace")
    try:
        # A URI built from the path, quoted: "t?mode=rwc&x=.sqlite" or "t#.sqlite" is a file name,
        # never a query string that opens another file, or creates one.
        db = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{path}: not a readable Nsight Systems export ({clean_text(str(exc))})") from None
    dropped = Dropped(str(path), "row")
    try:
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables or "StringIds" not in tables:
            raise UsageError(f"{path}: no GPU kernels in this Nsight Systems export (no CUPTI_ACTIVITY_KIND_KERNEL)")
        strings = {key: sys.intern(clean_text(value)) for key, value in db.execute("SELECT id, value FROM StringIds")
                   if isinstance(value, str) and key.__class__ is int}

        def name_of(name_id: Any, what: str) -> str:
            name = strings.get(name_id) if name_id.__class__ is int else None
            if name is None:
                raise BadEvent(f"{what} {_short(name_id)} names no string")
            return name

        cols = _columns(db, "CUPTI_ACTIVITY_KIND_KERNEL")
        name_col = "demangledName" if "demangledName" in cols else "shortName"
        graph_col = "graphId" if "graphId" in cols else "NULL"
        pid_col = "globalPid" if "globalPid" in cols else "0"
        by_pid: dict[int, RankTrace] = {}

        def kernel(pid: Any, start: Any, end: Any, dev: Any, stream: Any, corr: Any, name_id: Any,
                   graph: Any) -> None:
            ts_us, dur_us = _span_us(start, end)
            pid, dev, stream = _whole(pid, "globalPid"), _whole(dev, "deviceId"), _whole(stream, "streamId")
            name = name_of(name_id, name_col)
            trace = by_pid.setdefault(pid or 0, RankTrace(str(path), None, None, None, "nsys"))
            trace.kernels.append(Kernel(name, ts_us, dur_us, dev or 0, stream or 0, _whole(corr, "correlationId"),
                                        _whole(graph, "graphId") or None))

        _NsysRows(dropped, "kernel").read(db.execute(
            f"SELECT {pid_col}, start, end, deviceId, streamId, correlationId, {name_col}, {graph_col} "
            "FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start"), kernel)
        one = next(iter(by_pid.values())) if len(by_pid) == 1 else None

        def launch(start: Any, end: Any, tid: Any, corr: Any, name_id: Any) -> None:
            name = strings.get(name_id, "") if name_id.__class__ is int else ""
            if not LAUNCH_NAME.search(name):
                return
            ts_us, dur_us = _span_us(start, end)
            tid, corr = _whole(tid, "globalTid") or 0, _whole(corr, "correlationId")
            trace = by_pid.get(_pid_of(tid)) or one
            if trace is not None and corr is not None:
                trace.launches.add(name, ts_us, dur_us, tid, corr)

        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            tid_col = "globalTid" if "globalTid" in _columns(db, "CUPTI_ACTIVITY_KIND_RUNTIME") else "0"
            _NsysRows(dropped, "runtime").read(db.execute(
                f"SELECT start, end, {tid_col}, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME"), launch)

        def annotation(start: Any, end: Any, tid: Any, name: Any) -> None:
            if not isinstance(name, str) or not name:
                return
            ts_us, dur_us = _span_us(start, end)
            tid = _whole(tid, "globalTid") or 0
            trace = by_pid.get(_pid_of(tid)) or one
            if trace is not None:
                trace.annotations.append(HostSpan(clean_text(name), ts_us, dur_us, tid))

        if "NVTX_EVENTS" in tables:
            ncols = _columns(db, "NVTX_EVENTS")
            text = "COALESCE(text, (SELECT value FROM StringIds WHERE id = textId))" if "textId" in ncols else "text"
            _NsysRows(dropped, "NVTX").read(db.execute(
                f"SELECT start, end, globalTid, {text} FROM NVTX_EVENTS WHERE end IS NOT NULL"), annotation)
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{path}: not a readable Nsight Systems export ({clean_text(str(exc))})") from None
    finally:
        db.close()
    for trace in by_pid.values():
        _drop_far_kernels(trace, dropped)
    dropped.warn()
    if not any(trace.kernels for trace in by_pid.values()):
        raise UsageError(f"{path}: no kernel row of this Nsight Systems export passed its check "
                         f"({dropped.count} dropped)")
    traces = [by_pid[pid] for pid in sorted(by_pid) if by_pid[pid].kernels]
    if len(traces) > 1:
        for rank, trace in enumerate(traces):
            trace.rank, trace.world_size = rank, len(traces)
    return traces


def read_trace(path: Path) -> list[RankTrace]:
    """The ranks one file holds (a kineto file: one, or one per device in a merged file)."""
    with open_input(path, "a profiler trace") as raw:
        head = raw.read(len(SQLITE_MAGIC))
        if head != SQLITE_MAGIC:
            raw.seek(0)
            trace = read_chrome(path, raw)
    if head == SQLITE_MAGIC:
        return read_nsys(path)
    devices = sorted({k.device for k in trace.kernels})
    if trace.rank is None and len(devices) > 1:
        return _split_by_device(trace, devices)
    return [trace]


def _split_by_device(trace: RankTrace, devices: list[int]) -> list[RankTrace]:
    """A merged trace without rank info: one rank per device (its launches and host ops are
    shared), split in one pass over the kernels."""
    ranks = {device: RankTrace(trace.source, rank, len(devices), trace.comm_backend, trace.trace_format,
                               [], trace.launches, trace.collective_ops, trace.annotations, [],
                               trace.device_name, trace.provenance)
             for rank, device in enumerate(devices)}
    for kernel in trace.kernels:
        ranks[kernel.device].kernels.append(kernel)
    for annotation in trace.gpu_annotations:
        if annotation.thread in ranks:
            ranks[annotation.thread].gpu_annotations.append(annotation)
    return list(ranks.values())
