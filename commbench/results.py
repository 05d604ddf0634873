"""The results directory: run.json, measurements.jsonl (append + flush per row), measurements.csv.

Schema version 1. One row per (backend variant, message size, dtype, mode, env setting).
Everything downstream (report, floor, recommend, qualify, compare) reads only these files.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from commbench.errors import UsageError

SCHEMA_VERSION = 1
RUN_FILE = "run.json"
ROWS_FILE = "measurements.jsonl"
CSV_FILE = "measurements.csv"

# Row status values. Only "ok" rows carry a trustworthy latency.
OK = "ok"
WRONG = "wrong"          # #wrong > 0 (wrong_kind says noop / stale / values)
HANG = "hang"            # the watchdog fired
ERROR = "error"          # setup passed but a call raised
SKIPPED = "skipped"      # the backend cannot run here (reason says which rank and why)
NO_WORK = "no_work"      # nothing was communicated (world size 1, or a graph that captured no work)
STATUSES = (OK, WRONG, HANG, ERROR, SKIPPED, NO_WORK)


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
    iterations: int = 0
    ops_per_graph: int = 1
    latency_p50_us: float | None = None
    latency_p10_us: float | None = None
    latency_p90_us: float | None = None
    latency_p99_us: float | None = None
    latency_min_us: float | None = None
    latency_max_us: float | None = None
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    wrong_elements: int | None = None   # nccl-tests' #wrong, summed over ranks
    wrong_kind: str | None = None       # "noop" | "stale" | "values"
    reason: str | None = None           # why skipped / error / hang / no_work
    failed_rank: int | None = None
    nccl_proto_requested: str | None = None
    nccl_algo_requested: str | None = None
    nccl_proto_used: str | None = None
    nccl_algo_used: str | None = None
    setting_applied: bool | None = None  # False: NCCL did not use what was requested
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
        return cls(**{k: v for k, v in data.items() if k in names})


def row_key(backend: str, mode: str, dtype: str, message_bytes: int, env_setting: dict[str, str] | None,
            tokens: int | None = None, hidden: int | None = None, op: str = "allreduce") -> tuple:
    env = tuple(sorted((env_setting or {}).items()))
    return (backend, mode, dtype, int(message_bytes), env, tokens, hidden, op)


CSV_COLUMNS = [f.name for f in dataclasses.fields(Measurement)]


class ResultsWriter:
    """Appends rows to measurements.jsonl and makes each durable before returning."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._file = open(self.run_dir / ROWS_FILE, "a", encoding="utf-8")

    def append(self, row: Measurement) -> None:
        self._file.write(json.dumps(row.to_dict(), sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_rows(run_dir: Path) -> list[Measurement]:
    """Every complete row; a torn last line (crash mid-write) is ignored."""
    path = Path(run_dir) / ROWS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if data.get("schema") != SCHEMA_VERSION:
            raise UsageError(f"{path}: row of schema version {data.get('schema')}, "
                             f"this commbench reads version {SCHEMA_VERSION}")
        rows.append(Measurement.from_dict(data))
    return rows


def write_csv(run_dir: Path, rows: Iterable[Measurement] | None = None) -> Path:
    run_dir = Path(run_dir)
    rows = read_rows(run_dir) if rows is None else list(rows)
    path = run_dir / CSV_FILE
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            data = row.to_dict()
            data["env_setting"] = json.dumps(data["env_setting"], sort_keys=True) if data["env_setting"] else ""
            data["extra"] = json.dumps(data["extra"], sort_keys=True) if data["extra"] else ""
            writer.writerow(data)
    tmp.replace(path)
    return path


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
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"schema": SCHEMA_VERSION, **info}, indent=2, sort_keys=True, default=str),
                   encoding="utf-8")
    tmp.replace(path)


def read_run_info(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_FILE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{run_dir}: not a commbench results dir (no {RUN_FILE})") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if info.get("schema") != SCHEMA_VERSION:
        raise UsageError(f"{run_dir}: results of schema version {info.get('schema')}, "
                         f"this commbench reads version {SCHEMA_VERSION}")
    return info


@dataclass
class Run:
    """A results directory loaded for analysis."""

    path: Path
    info: dict[str, Any]
    rows: list[Measurement]

    def ok_rows(self) -> Iterator[Measurement]:
        return (r for r in self.rows if r.status == OK)


def load_run(run_dir: str | Path) -> Run:
    """Load a results dir for offline analysis; bad input raises UsageError (exit 2)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UsageError(f"{run_dir}: no such results directory")
    info = read_run_info(path)
    return Run(path=path, info=info, rows=read_rows(path))
