"""The results directory: run.json, measurements.jsonl (append + flush per row), measurements.csv.

Schema version 3 (versions 1 and 2 are read and migrated). One row per (backend variant, message size, dtype, mode, env setting).
Everything downstream (report, floor, recommend, qualify, compare) reads only these files.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from commbench.errors import ResultsUnwritable, UsageError
from commbench.files import read_text

SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)   # older rows are migrated on read (migrate_row)
RUN_FILE = "run.json"
ROWS_FILE = "measurements.jsonl"
CSV_FILE = "measurements.csv"

# Row status values. Only "ok" rows carry a trustworthy latency.
OK = "ok"
WRONG = "wrong"          # #wrong > 0 (wrong_kind says noop / stale / values)
HANG = "hang"            # the watchdog fired
CRASHED = "crashed"      # a rank's process died (signal, OOM kill, abort) during setup or a row
ERROR = "error"          # setup passed but a call raised
SKIPPED = "skipped"      # the backend cannot run here (reason says which rank and why)
NO_WORK = "no_work"      # nothing was communicated (world size 1, or a graph that captured no work)
STATUSES = (OK, WRONG, HANG, CRASHED, ERROR, SKIPPED, NO_WORK)
# extra key on an error row whose raising rank left its peers inside a collective it never
# joined: the processes had to end, and the backend is not run again in this results dir.
STRANDED = "stranded_peers"
# extra "check" of a sweep row under -c 0. Its inputs were still prepared and its calls timed as
# usual; only no output was read back, so a backend that wrote nothing, stale or wrong sums would
# time like a correct one.
CHECK_OFF = ("off (-c 0): no output was checked; a no-op or wrong backend would look as fast, "
             "so no analysis trusts this row")
# Environment variables run.json records (every one that starts so).
ENV_PREFIXES = ("NCCL_", "TORCH_", "MSCCLPP_", "CUDA_", "NVSHMEM_", "COMMBENCH_", "FLASHINFER_")


@dataclass
class Measurement:
    """One row of measurements.jsonl. Times in microseconds, bandwidths in GB/s (1e9)."""

    backend: str
    mode: str                       # "eager" | "graph"
    dtype: str                      # "bf16" | "fp16" | "fp32"
    message_bytes: int
    world_size: int
    status: str
    count: int = 0                  # elements per rank
    nodes: int = 1
    op: str = "allreduce"           # or e.g. "allreduce_residual_rmsnorm"
    tokens: int | None = None       # model-shape sweeps: tokens x hidden
    hidden: int | None = None
    iterations: int = 0             # timed calls (eager) or timed replays (graph) per pass
    ops_per_graph: int = 1          # calls captured per CUDA graph (1 in eager)
    latency_us: float | None = None          # headline: loop total / calls, max over ranks
    latency_rank_mean_us: float | None = None  # the same, mean over ranks (nccl-tests -a 1)
    jitter_samples: int = 0                  # jitter pass: one timer per call (eager) or replay
    jitter_p10_us: float | None = None
    jitter_p50_us: float | None = None
    jitter_p90_us: float | None = None
    jitter_p99_us: float | None = None
    jitter_min_us: float | None = None
    jitter_max_us: float | None = None
    algbw_gbps: float | None = None          # from latency_us
    busbw_gbps: float | None = None          # algbw x the op's bus factor (None: the op has none)
    checked_calls: int = 0              # calls per rank whose output was checked (both passes)
    wrong_elements: int | None = None   # nccl-tests' #wrong over every checked call, summed over ranks
    wrong_kind: str | None = None       # the first wrong call's: unwritten, noop, stale or values
    first_wrong_call: int | None = None  # its index among the checked calls of failed_rank
    ranks_identical: bool | None = None  # every rank's checked outputs bit-identical
    reason: str | None = None           # why skipped / error / hang / no_work
    failed_rank: int | None = None
    emulation: dict[str, Any] | None = None   # ranks sharing GPUs: {gpus, ranks, mps, sm_percent}
    requested: dict[str, str] = field(default_factory=dict)   # what the variant asked its library for
    observed: dict[str, Any] = field(default_factory=dict)    # what the library said it did, same keys
    setting_applied: str | None = None   # honoured / ignored / coincided: what became of the request
    unsafe: str | None = None            # e.g. LL128 forced without NVLink
    env_setting: dict[str, str] = field(default_factory=dict)  # process-level knobs (driver runs)
    extra: dict[str, Any] = field(default_factory=dict)        # backend-specific facts
    schema: int = SCHEMA_VERSION
    timestamp: float = 0.0

    def key(self) -> tuple:
        return row_key(self.backend, self.mode, self.dtype, self.message_bytes, self.env_setting,
                       self.tokens, self.hidden, self.op)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Measurement":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in migrate_row(data).items() if k in names})


# Version 1 and 2 rows spelled what was asked of NCCL, and what it did, as columns of their own.
_NCCL_COLUMNS = {"nccl_proto_requested": ("requested", "NCCL_PROTO"), "nccl_algo_requested": ("requested", "NCCL_ALGO"),
                 "nccl_proto_used": ("observed", "NCCL_PROTO"), "nccl_algo_used": ("observed", "NCCL_ALGO")}


def migrate_row(data: dict[str, Any]) -> dict[str, Any]:
    """Older rows read as the current schema (the migration notes are in docs/results.md).

    1 -> 2: the p50 of per-call samples stands for the headline (that is how version 1 reported
    it), the percentiles become the jitter fields, one call was checked (after the timed loop),
    and setting_applied True/False becomes honoured/ignored.
    2 -> 3: the nccl_* columns move into the generic requested / observed dicts.
    """
    version = data.get("schema")
    if version == SCHEMA_VERSION:
        return data
    out = dict(data)
    if version == 1:
        for stat in ("p10", "p50", "p90", "p99", "min", "max"):
            out[f"jitter_{stat}_us"] = out.pop(f"latency_{stat}_us", None)
        out["latency_us"] = out["jitter_p50_us"]
        out["jitter_samples"] = out.get("iterations", 0) if out["latency_us"] is not None else 0
        out["checked_calls"] = 1 if out.get("wrong_elements") is not None else 0
        applied = out.get("setting_applied")
        out["setting_applied"] = None if applied is None else ("honoured" if applied else "ignored")
    for column, (target, key) in _NCCL_COLUMNS.items():
        value = out.pop(column, None)
        if value is not None:
            out.setdefault(target, {})[key] = value
    out["schema"] = SCHEMA_VERSION
    return out


def is_checked(row: Measurement) -> bool:
    """Whether its outputs were checked: #wrong is N/A after nccl-tests -c 0 or a sweep's -c 0."""
    return row.wrong_elements is not None


def stops_backend(row: Measurement) -> bool:
    """A row after which its backend does not run again in this results dir: it hung, crashed,
    or raised on one rank while its peers waited in a collective (the processes had to end)."""
    return row.status in (HANG, CRASHED) or (row.status == ERROR and bool(row.extra.get(STRANDED)))


def row_key(backend: str, mode: str, dtype: str, message_bytes: int, env_setting: dict[str, str] | None,
            tokens: int | None = None, hidden: int | None = None, op: str = "allreduce") -> tuple:
    env = tuple(sorted((env_setting or {}).items()))
    return (backend, mode, dtype, int(message_bytes), env, tokens, hidden, op)


CSV_COLUMNS = [f.name for f in dataclasses.fields(Measurement)]


class ResultsWriter:
    """Appends rows to measurements.jsonl and makes each durable before returning."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ROWS_FILE
        # A torn last line (a full disk, a crash mid-write) would swallow the next row.
        self.repaired = repair_torn_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, row: Measurement) -> None:
        try:
            self._file.write(json.dumps(row.to_dict(), sort_keys=True) + "\n")
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


def unwritable(path: Path, exc: OSError) -> ResultsUnwritable:
    return ResultsUnwritable(f"cannot write {path}: {exc.strerror or exc} (errno {exc.errno}); every row "
                             f"written before it is intact: make room and repeat the command with "
                             f"--resume {path.parent}")


TORN_FILE = ROWS_FILE + ".torn"   # fragments cut from the end of measurements.jsonl, kept


def repair_torn_tail(path: Path) -> str | None:
    """Cut a last line that has no newline (a write cut short) off the rows file, keeping the
    fragment in measurements.jsonl.torn; returns the line that says so, None when whole."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None
    if not data or data.endswith(b"\n"):
        return None
    keep = data.rfind(b"\n") + 1
    try:
        with open(path.with_name(TORN_FILE), "ab") as torn:
            torn.write(data[keep:] + b"\n")
        with open(path, "r+b") as handle:
            handle.truncate(keep)
            os.fsync(handle.fileno())
    except OSError as exc:
        raise unwritable(path, exc) from None
    return (f"{path.name} ended in a torn line ({len(data) - keep} bytes without a newline: a write was cut "
            f"short); moved it to {TORN_FILE}, and that row is measured again")


@dataclass
class RowsRead:
    """What measurements.jsonl held: the rows, and every line that is not one (number, why)."""

    rows: list[Measurement]
    unreadable: list[tuple[int, str]] = field(default_factory=list)
    torn_tail: bool = False     # the last line has no newline: a row being written, or cut short

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


_LISTED_LINES = 5


def _fits(value: Any, annotation: str) -> bool:
    """Does a JSON value fit a Measurement field's annotation (e.g. 'float | None')?"""
    kinds = {part.strip().split("[")[0] for part in annotation.split("|")}
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return bool(kinds & {"int", "float"})
    if isinstance(value, float):
        return "float" in kinds and math.isfinite(value)
    return (isinstance(value, str) and "str" in kinds) or (isinstance(value, dict) and "dict" in kinds)


_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(Measurement)}
_REQUIRED = [f.name for f in dataclasses.fields(Measurement)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def row_problem(data: Any) -> str | None:
    """Why a parsed line is not a row of a readable schema (after migration); None when it is."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("schema") not in READABLE_SCHEMAS:
        return f"schema {data.get('schema')!r}; this commbench reads {', '.join(map(str, READABLE_SCHEMAS))}"
    data = migrate_row(data)
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        return f"no {', '.join(missing)}"
    wrong = [name for name, annotation in _FIELD_TYPES.items() if name in data and not _fits(data[name], annotation)]
    if wrong:
        return f"{wrong[0]} is {data[wrong[0]]!r}"
    if data["status"] not in STATUSES:
        return f"unknown status {data['status']!r}"
    return None


def read_rows_checked(run_dir: Path) -> RowsRead:
    """Every row of measurements.jsonl and every line that is not one; never raises on content."""
    path = Path(run_dir) / ROWS_FILE
    if not path.exists():
        return RowsRead([])
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    read = RowsRead([], torn_tail=bool(lines[-1].strip()))
    for number, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            read.unreadable.append((number, "not JSON"))
            continue
        problem = row_problem(data)
        if problem:
            read.unreadable.append((number, problem))
        else:
            read.rows.append(Measurement.from_dict(data))
    return read


def read_rows(run_dir: Path) -> list[Measurement]:
    """Every complete row (read_rows_checked also says what was skipped)."""
    return read_rows_checked(run_dir).rows


def write_csv(run_dir: Path, rows: Iterable[Measurement] | None = None) -> Path:
    run_dir = Path(run_dir)
    rows = read_rows(run_dir) if rows is None else list(rows)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for row in rows:
        data = row.to_dict()
        data["env_setting"] = json.dumps(data["env_setting"], sort_keys=True) if data["env_setting"] else ""
        data["extra"] = json.dumps(data["extra"], sort_keys=True) if data["extra"] else ""
        writer.writerow(data)
    path = run_dir / CSV_FILE
    write_whole(path, text.getvalue())
    return path


def write_whole(path: Path, text: str) -> None:
    """Write a file through a temporary beside it, so that no reader ever sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise unwritable(path, exc) from None


def new_run_dir(root: Path) -> Path:
    """results/<YYYYmmdd-HHMMSS-host>[-N]/, created; never reuses an existing folder."""
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + socket.gethostname().split(".")[0]
    path = Path(root) / run_id
    suffix = 1
    while path.exists():
        path = Path(root) / f"{run_id}-{suffix}"
        suffix += 1
    path.mkdir(parents=True)
    return path.resolve()


def write_run_info(run_dir: Path, info: dict[str, Any]) -> None:
    write_whole(Path(run_dir) / RUN_FILE,
                json.dumps({"schema": SCHEMA_VERSION, **info}, indent=2, sort_keys=True, default=str))


def read_run_info(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_FILE
    if not path.exists():
        raise UsageError(f"{run_dir}: not a commbench results dir (no {RUN_FILE})")
    try:
        info = json.loads(read_text(path, "a commbench run.json"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(info, dict):
        raise UsageError(f"{path}: a JSON {type(info).__name__}, not a commbench run.json (an object)")
    if info.get("schema") not in READABLE_SCHEMAS:
        raise UsageError(f"{run_dir}: results of schema version {info.get('schema')}, "
                         f"this commbench reads versions {', '.join(map(str, READABLE_SCHEMAS))}")
    return info


# What a resume must share with the run it continues: the same machine, ranks and plan, or its
# rows would join curves measured under something else. Timeouts may change (a longer one after
# a hang is the usual reason to resume).
IDENTITY_KEYS = ("schema", "host", "world_size", "nodes", "device_type", "gpus", "emulation", "plan")
MEASURED_PLAN_KEYS = ("message_bytes", "shapes", "dtypes", "modes", "warmup", "iterations", "graph_ops",
                      "graph_replays")
_GPU_KEYS = ("host", "device", "name", "uuid", "pci_bus_id")


def resume_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What makes `current` (keys of IDENTITY_KEYS) another run than the one run.json records;
    empty when they agree or no sweep has written the dir yet (a new dir, the driver's stub)."""
    if "world_size" not in recorded:
        return []
    out = []
    for key in IDENTITY_KEYS:
        if key not in current:
            continue
        here, there = current[key], recorded.get(key)
        if key == "plan":
            out += [f"plan {name} {here.get(name)} here, {(there or {}).get(name)} in the run"
                    for name in MEASURED_PLAN_KEYS if here.get(name) != (there or {}).get(name)]
        elif key == "gpus":
            out += _gpu_differences(here, there)
        elif here != there:
            out.append(f"{key.replace('_', ' ')} {here} here, {there} in the run")
    return out


def refuse_other_run(run_dir: Path, recorded: dict[str, Any], current: dict[str, Any]) -> None:
    """Bad input when `--resume run_dir` would continue another run than `current` (the
    differences named); nothing when it is the same run."""
    differences = resume_differences(recorded, current)
    if differences:
        raise UsageError(f"--resume {run_dir}: not the run this command would make ({'; '.join(differences)}); "
                         "leave out --resume to start a new one")


def _gpu_differences(here: list[dict[str, Any]], there: Any) -> list[str]:
    def describe(gpus: Any) -> list[str]:
        return [" ".join(str(g.get(k)) for k in _GPU_KEYS if g.get(k)) for g in gpus or [] if isinstance(g, dict)]

    mine, theirs = describe(here), describe(there)
    if len(mine) != len(theirs):
        return [f"GPUs: {len(mine)} rank(s) here, {len(theirs)} in the run"]
    return [f"GPU of rank {rank}: {a} here, {b} in the run" for rank, (a, b) in enumerate(zip(mine, theirs))
            if a != b][:1]


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if not sorted_values:
        raise ValueError("no samples")
    position = (len(sorted_values) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def describe_setting(values: dict[str, Any]) -> str:
    """{'NCCL_PROTO': 'LL', 'NCCL_ALGO': 'Ring'} -> 'NCCL_ALGO=Ring NCCL_PROTO=LL'."""
    return " ".join(f"{k}={v}" for k, v in sorted(values.items())) or "nothing recorded"


def describe_emulation(emulation: dict[str, Any]) -> str:
    """One line for a run whose ranks shared GPUs: what its rows measure and what they do not."""
    share = emulation.get("sm_percent")
    how = (f"concurrently under MPS{f', {share:g}% of the SMs each' if share else ''}" if emulation.get("mps")
           else "taking turns on it (time slicing, no MPS)" if emulation.get("mps") is False
           else "with MPS unknown")
    return (f"emulated: {emulation.get('ranks')} ranks on {emulation.get('gpus')} GPU(s), {how}; these rows "
            "measure the protocol with no fabric between the ranks, not NVLink or PCIe")


@dataclass
class Run:
    """A results directory loaded for analysis."""

    path: Path
    info: dict[str, Any]
    rows: list[Measurement]

    def ok_rows(self) -> Iterator[Measurement]:
        return (r for r in self.rows if r.status == OK)

    @property
    def emulation(self) -> dict[str, Any] | None:
        """How the ranks shared GPUs, when they did (run.json, else any row that says so)."""
        recorded = self.info.get("emulation")
        if isinstance(recorded, dict):
            return recorded
        return next((r.emulation for r in self.rows if isinstance(r.emulation, dict)), None)

    def emulation_line(self) -> str | None:
        return describe_emulation(self.emulation) if self.emulation else None
