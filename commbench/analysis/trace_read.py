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
import json
import re
import sqlite3
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from commbench.errors import UsageError

CHUNK_CHARS = 1 << 20
# A single event larger than this is no trace event: the file is not a trace.
MAX_EVENT_CHARS = 64 << 20
SQLITE_MAGIC = b"SQLite format 3\0"
GZIP_MAGIC = b"\x1f\x8b"

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


@dataclass
class RankTrace:
    source: str
    rank: int | None
    world_size: int | None
    comm_backend: str | None
    trace_format: str                     # "kineto" | "nsys"
    kernels: list[Kernel] = field(default_factory=list)
    launches: dict[int, HostSpan] = field(default_factory=dict)    # correlation -> launch call
    collective_ops: list[HostSpan] = field(default_factory=list)
    annotations: list[HostSpan] = field(default_factory=list)
    gpu_annotations: list[HostSpan] = field(default_factory=list)  # thread = device
    device_name: str | None = None
    provenance: str | None = None         # what the file says it is (PROVENANCE_KEY)


def open_text(path: Path) -> IO[str]:
    with path.open("rb") as raw:
        head = raw.read(2)
    if head == GZIP_MAGIC:
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


class _Scanner:
    """Just enough of a streaming JSON reader for a Chrome trace's top level."""

    def __init__(self, stream: IO[str], origin: str):
        self.stream, self.origin = stream, origin
        self.buf, self.pos, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()

    def _fill(self) -> bool:
        data = self.stream.read(CHUNK_CHARS)
        if not data:
            self.eof = True
            return False
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        return True

    def peek(self) -> str:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
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
                    self.pos = end
                    return obj
            except json.JSONDecodeError:
                if self.eof:
                    raise self.broken("a value does not parse") from None
            if len(self.buf) - self.pos > MAX_EVENT_CHARS:
                raise self.broken("one value is larger than 64 MB")
            self._fill()   # at the end of the file this sets eof, and the next try decides

    def broken(self, why: str) -> UsageError:
        where = "at the end (truncated?)" if self.eof else "in the file"
        return UsageError(f"{self.origin}: not a Chrome trace JSON ({why} {where})")


def scan_chrome(stream: IO[str], origin: str, on_event: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Calls on_event for every trace event; returns the other top-level keys (small values)."""
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
            if sc.expect(",}") == "}":
                break
    if not saw_events:
        raise UsageError(f"{origin}: not a profiler trace (no traceEvents)")
    return meta


def _scan_array(sc: _Scanner, on_event: Callable[[dict[str, Any]], None]) -> None:
    sc.expect("[")
    if sc.peek() == "]":
        sc.pos += 1
        return
    while True:
        event = sc.value()
        if isinstance(event, dict):
            on_event(event)
        if sc.expect(",]") == "]":
            return


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def collective_bytes(args: dict[str, Any]) -> int | None:
    """Message size a host op recorded: record_param_comms' element count and dtype, else the
    first input's shape and type (record_shapes=True)."""
    nelems = _int(args.get("In msg nelems"))
    dtype = str(args.get("dtype", "")).lower()
    if nelems is not None and dtype in DTYPE_BYTES:
        return nelems * DTYPE_BYTES[dtype]
    dims, types = args.get("Input Dims"), args.get("Input type")
    if isinstance(dims, list) and dims and isinstance(dims[0], list) and isinstance(types, list) and types:
        size = DTYPE_BYTES.get(str(types[0]).lower())
        if size and dims[0] and all(isinstance(d, int) for d in dims[0]):
            count = 1
            for d in dims[0]:
                count *= d
            return count * size
    return None


class _ChromeCollector:
    """Keeps what attribute needs from each event; names are interned (traces repeat them)."""

    def __init__(self, trace: RankTrace):
        self.trace = trace
        self.names: dict[str, str] = {}

    def __call__(self, ev: dict[str, Any]) -> None:
        if ev.get("ph") != "X":
            return
        cat, name = ev.get("cat"), ev.get("name")
        ts, dur = ev.get("ts"), ev.get("dur")
        if not isinstance(name, str) or not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            return
        name = self.names.setdefault(name, name)
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        tid = _int(ev.get("tid")) or 0
        if cat in GPU_BUSY_CATS:
            stream = _int(args.get("stream"))
            self.trace.kernels.append(Kernel(
                name, float(ts), float(dur), _int(ev.get("pid")) or 0, tid if stream is None else stream,
                _int(args.get("correlation")), _int(args.get("graph id")), cat == "kernel"))
        elif cat in ("cuda_runtime", "cuda_driver") and LAUNCH_NAME.search(name):
            corr = _int(args.get("correlation"))
            if corr is not None:
                self.trace.launches[corr] = HostSpan(name, float(ts), float(dur), tid, corr)
        elif cat == "cpu_op" and COLLECTIVE_OP.search(name):
            self.trace.collective_ops.append(HostSpan(name, float(ts), float(dur), tid,
                                                      message_bytes=collective_bytes(args)))
        elif cat == "user_annotation":
            self.trace.annotations.append(HostSpan(name, float(ts), float(dur), tid))
            if COLLECTIVE_OP.search(name):   # ProcessGroup's own "nccl:all_reduce" range, with shapes
                self.trace.collective_ops.append(HostSpan(name, float(ts), float(dur), tid,
                                                          message_bytes=collective_bytes(args)))
        elif cat == "gpu_user_annotation":
            self.trace.gpu_annotations.append(HostSpan(name, float(ts), float(dur), _int(ev.get("pid")) or 0))


def read_chrome(path: Path) -> RankTrace:
    trace = RankTrace(str(path), None, None, None, "kineto")
    try:
        with open_text(path) as stream:
            meta = scan_chrome(stream, str(path), _ChromeCollector(trace))
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise UsageError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a profiler trace (not UTF-8 text)") from None
    info = meta.get("distributedInfo")
    if isinstance(info, dict):
        trace.rank, trace.world_size = _int(info.get("rank")), _int(info.get("world_size"))
        trace.comm_backend = str(info["backend"]) if "backend" in info else None
    if isinstance(meta.get(PROVENANCE_KEY), str):
        trace.provenance = meta[PROVENANCE_KEY]
    props = meta.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        trace.device_name = str(props[0].get("name")) if props[0].get("name") else None
    return trace


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def read_nsys(path: Path) -> list[RankTrace]:
    """One RankTrace per process (globalPid) that ran kernels, in pid order."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{path}: not a readable Nsight Systems export ({exc})") from None
    try:
        if "CUPTI_ACTIVITY_KIND_KERNEL" not in tables or "StringIds" not in tables:
            raise UsageError(f"{path}: no GPU kernels in this Nsight Systems export (no CUPTI_ACTIVITY_KIND_KERNEL)")
        strings = dict(db.execute("SELECT id, value FROM StringIds"))
        cols = _columns(db, "CUPTI_ACTIVITY_KIND_KERNEL")
        name_col = "demangledName" if "demangledName" in cols else "shortName"
        graph_col = "graphId" if "graphId" in cols else "NULL"
        pid_col = "globalPid" if "globalPid" in cols else "0"
        by_pid: dict[int, RankTrace] = {}
        for pid, start, end, dev, stream, corr, name_id, graph in db.execute(
                f"SELECT {pid_col}, start, end, deviceId, streamId, correlationId, {name_col}, {graph_col} "
                "FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start"):
            trace = by_pid.setdefault(pid, RankTrace(str(path), None, None, None, "nsys"))
            trace.kernels.append(Kernel(strings.get(name_id, str(name_id)), start / 1e3, (end - start) / 1e3,
                                        dev, stream, corr, graph or None))
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            rcols = _columns(db, "CUPTI_ACTIVITY_KIND_RUNTIME")
            tid_col = "globalTid" if "globalTid" in rcols else "0"
            for start, end, tid, corr, name_id in db.execute(
                    f"SELECT start, end, {tid_col}, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
                name = strings.get(name_id, "")
                if LAUNCH_NAME.search(name):
                    pid = (tid >> 24) << 24 if tid else 0   # nsys globalTid carries the globalPid's bits
                    trace = by_pid.get(pid) or (next(iter(by_pid.values())) if len(by_pid) == 1 else None)
                    if trace is not None:
                        trace.launches[corr] = HostSpan(name, start / 1e3, (end - start) / 1e3, tid, corr)
        if "NVTX_EVENTS" in tables:
            ncols = _columns(db, "NVTX_EVENTS")
            text = "COALESCE(text, (SELECT value FROM StringIds WHERE id = textId))" if "textId" in ncols else "text"
            rows = db.execute(f"SELECT start, end, globalTid, {text} FROM NVTX_EVENTS WHERE end IS NOT NULL")
            for start, end, tid, name in rows:
                for trace in by_pid.values():
                    if name and (len(by_pid) == 1 or (tid >> 24) << 24 in by_pid):
                        trace.annotations.append(HostSpan(str(name), start / 1e3, (end - start) / 1e3, tid))
                        break
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{path}: not a readable Nsight Systems export ({exc})") from None
    finally:
        db.close()
    traces = [by_pid[pid] for pid in sorted(by_pid)]
    if len(traces) > 1:
        for rank, trace in enumerate(traces):
            trace.rank, trace.world_size = rank, len(traces)
    return traces


def read_trace(path: Path) -> list[RankTrace]:
    """The ranks one file holds (a kineto file: one, or one per device in a merged file)."""
    if path.is_dir():
        raise UsageError(f"{path}: is a directory, not a trace file")
    try:
        with path.open("rb") as raw:
            head = raw.read(len(SQLITE_MAGIC))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None
    if head == SQLITE_MAGIC:
        return read_nsys(path)
    trace = read_chrome(path)
    devices = sorted({k.device for k in trace.kernels})
    if trace.rank is None and len(devices) > 1:
        return list(_split_by_device(trace, devices))
    return [trace]


def _split_by_device(trace: RankTrace, devices: list[int]) -> Iterator[RankTrace]:
    """A merged trace without rank info: one rank per device (its launches and host ops are shared)."""
    for rank, device in enumerate(devices):
        yield RankTrace(trace.source, rank, len(devices), trace.comm_backend, trace.trace_format,
                        [k for k in trace.kernels if k.device == device], trace.launches,
                        trace.collective_ops, trace.annotations,
                        [a for a in trace.gpu_annotations if a.thread == device], trace.device_name,
                        trace.provenance)
