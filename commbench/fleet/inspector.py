"""NCCL Inspector JSONL as fleet runs: one run per host and job, one row per collective and size.

NCCL's Inspector profiler plug-in (NVIDIA/nccl ext-profiler/inspector/README.md, output format
v4.0) writes one JSON object per collective per communicator per rank:

    {"header": {"id": COMM, "rank": R, "n_ranks": N, "nnodes": M},
     "metadata": {"inspector_output_format_version": "v4.0", "hostname": H, "pid": P, ...},
     "coll_perf": {"coll": "AllReduce", "coll_sn": S, "coll_msg_size_bytes": B,
                   "coll_exec_time_us": T, "coll_algobw_gbs": A, "coll_busbw_gbs": W, ...}}

into NCCL_INSPECTOR_DUMP_DIR, by default nccl-inspector-<slurm job id>. A collective (one
coll_sn of one communicator) takes its slowest rank's time, as a sweep's headline is the max over
ranks; a row is the median of those over every collective of that kind and size on the host, with
the spread as its jitter fields. Inspector records no dtype, no mode and checks no output, so the
rows say "unknown" for the first two and carry no #wrong: they join the fleet as data, and no
analysis trusts their latency as a checked measurement. Every line is untrusted: a line that is
not a record is counted and named, never raised.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Iterable

from commbench.files import read_lines
from commbench.results import OK, Measurement, percentile
from commbench.results.validate import MAX_LINE_BYTES, MAX_WORLD_SIZE, clean_text

SOURCE = "nccl-inspector"
UNKNOWN = "unknown"
_JOB_DIR = re.compile(r"^nccl-inspector-(.+)$")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_MAX_TIME_US = 1e12


@dataclass
class _Record:
    host: str
    job: str
    comm: str
    rank: int
    n_ranks: int
    nnodes: int
    coll: str
    sn: int
    size: int
    time_us: float
    busbw: float | None
    algbw: float | None
    version: str


@dataclass
class InspectorRun:
    """What one host's records of one job make: its run.json and rows."""

    host: str
    job: str
    info: dict[str, Any]
    rows: list[Measurement]
    files: list[str]


@dataclass
class InspectorRead:
    runs: list[InspectorRun] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)   # one line per file that was not (all) Inspector output


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and _NAME.match(value) else None


def _whole(value: Any, low: int, high: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high else None


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < _MAX_TIME_US
    return float(value) if ok else None


def record(data: Any, job: str) -> _Record | None:
    """One parsed line as a record, or None when it is not one (any field missing or out of range)."""
    if not isinstance(data, dict):
        return None
    head, meta, perf = data.get("header"), data.get("metadata"), data.get("coll_perf")
    if not (isinstance(head, dict) and isinstance(meta, dict) and isinstance(perf, dict)):
        return None
    fields = (_text(meta.get("hostname")), _text(head.get("id")), _whole(head.get("rank"), 0, MAX_WORLD_SIZE),
              _whole(head.get("n_ranks"), 1, MAX_WORLD_SIZE), _whole(head.get("nnodes"), 1, MAX_WORLD_SIZE),
              _text(perf.get("coll")), _whole(perf.get("coll_sn"), 0, 1 << 62),
              _whole(perf.get("coll_msg_size_bytes"), 0, 1 << 62), _number(perf.get("coll_exec_time_us")))
    if any(value is None for value in fields):
        return None
    host, comm, rank, n_ranks, nnodes, coll, sn, size, time_us = fields
    version = _text(meta.get("inspector_output_format_version")) or UNKNOWN
    return _Record(host, job, comm, rank, n_ranks, nnodes, coll, sn, size, time_us,  # type: ignore[arg-type]
                   _number(perf.get("coll_busbw_gbs")), _number(perf.get("coll_algobw_gbs")), version)


def job_of(path: Path) -> str:
    """The job a dump belongs to: its folder's nccl-inspector-<job id> name, else the folder's name."""
    match = _JOB_DIR.match(path.parent.name)
    return clean_text(match.group(1) if match else path.parent.name)[:128] or UNKNOWN


def read_file(path: Path) -> tuple[list[_Record], str | None]:
    """A file's records and, when some lines were not records, one line saying how many."""
    job = job_of(path)
    records, bad, first_bad = [], 0, 0
    for number, line in enumerate(read_lines(path, "NCCL Inspector JSONL"), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line) if len(line) <= MAX_LINE_BYTES else None
        except (ValueError, RecursionError):
            data = None
        found = record(data, job)
        if found is None:
            bad += 1
            first_bad = first_bad or number
        else:
            records.append(found)
    if not records:
        return [], f"{path}: not NCCL Inspector output (no line has header, metadata and coll_perf); skipped"
    if bad:
        return records, f"{path}: skipped {bad} line(s) that are not Inspector records (first: line {first_bad})"
    return records, None


def _row(records: list[_Record], files: list[str]) -> Measurement:
    by_sn: dict[tuple[str, int], float] = defaultdict(float)
    for r in records:   # a collective is done when its slowest rank is
        by_sn[(r.comm, r.sn)] = max(by_sn[(r.comm, r.sn)], r.time_us)
    times = sorted(by_sn.values())
    first = records[0]
    busbw = [r.busbw for r in records if r.busbw is not None]
    algbw = [r.algbw for r in records if r.algbw is not None]
    return Measurement(
        backend="nccl", mode=UNKNOWN, dtype=UNKNOWN, message_bytes=first.size, world_size=first.n_ranks, status=OK,
        nodes=first.nnodes, op=first.coll.lower(), iterations=len(times), latency_us=median(times),
        jitter_samples=len(times), jitter_p10_us=percentile(times, 10), jitter_p50_us=percentile(times, 50),
        jitter_p90_us=percentile(times, 90), jitter_p99_us=percentile(times, 99), jitter_min_us=times[0],
        jitter_max_us=times[-1], busbw_gbps=median(busbw) if busbw else None,
        algbw_gbps=median(algbw) if algbw else None,
        reason="NCCL Inspector records: the application's own calls, outputs not checked",
        extra={"source": f"NCCL Inspector {first.version}", "communicators": sorted({r.comm for r in records})[:16],
               "records": len(records), "collectives": len(times), "files": files[:16]})


def runs_of(paths: Iterable[Path]) -> InspectorRead:
    """Every record of the files, as one run per (host, job)."""
    read = InspectorRead()
    groups: dict[tuple[str, str], list[_Record]] = defaultdict(list)
    files: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in paths:
        records, problem = read_file(path)
        if problem:
            read.problems.append(problem)
        for r in records:
            groups[(r.host, r.job)].append(r)
            files[(r.host, r.job)].add(str(path))
    for (host, job), records in sorted(groups.items()):
        cells: dict[tuple[str, int, int, int], list[_Record]] = defaultdict(list)
        for r in records:
            cells[(r.coll, r.size, r.n_ranks, r.nnodes)].append(r)
        names = sorted(files[(host, job)])
        rows = [_row(cell, names) for _, cell in sorted(cells.items())]
        world = max(r.n_ranks for r in records)
        info = {"run_id": f"inspector-{host}-{job}", "source": SOURCE, "host": host, "world_size": world,
                "nodes": max(r.nnodes for r in records), "backends": ["nccl"],
                "env": {"COMMBENCH_NODE": host, "COMMBENCH_JOB": job}, "finished": time.time(),   # read whole, as an import is finished when written
                "notes": [f"read from NCCL Inspector JSONL ({len(records)} records, {len(files[(host, job)])} file(s)); "
                          "no dtype, mode or output check recorded"]}
        read.runs.append(InspectorRun(host, job, info, rows, names))
    return read
