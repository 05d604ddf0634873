"""Test data made in one place: a row with what a test changes, and a results directory.

    row(backend="p2p:auto", latency_us=4.2)            # an ok, checked 4 KiB bf16 graph row
    row(tokens=8, hidden=7168, op=FUSED_OP)            # message_bytes follows the shape
    write_run(tmp_path / "run", [row(), row(world_size=8)], host="box")
    write_run(tmp_path / "copy", like=COMMITTED_RUN, provenance=None)   # a committed run, one field changed

A test names only what it is about; everything else is a plausible, valid default.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Iterable

from commbench.ops import ALLREDUCE
from commbench.results import OK, ROWS_FILE, Measurement, RunDir, RunInfo
from commbench.units import DTYPE_BYTES

ROW_DEFAULTS: dict[str, Any] = {"backend": "nccl", "op": ALLREDUCE, "mode": "graph", "dtype": "bf16",
                                "message_bytes": 4096, "world_size": 2, "status": OK, "latency_us": 10.0,
                                "wrong_elements": 0}


def row(**changes: Any) -> Measurement:
    """A row: ROW_DEFAULTS with `changes`. Given tokens and hidden without message_bytes, the
    message is that shape's (tokens x hidden elements of the dtype)."""
    fields = {**ROW_DEFAULTS, **changes}
    if "message_bytes" not in changes and changes.get("tokens") and changes.get("hidden"):
        fields["message_bytes"] = changes["tokens"] * changes["hidden"] * DTYPE_BYTES[fields["dtype"]]
    return Measurement(**fields)


def write_run(path: Path, rows: Iterable[Measurement] | None = None, like: Path | None = None,
              **info: Any) -> Path:
    """A results dir at `path`: run.json (`like`'s, else a new one named after the folder) with
    the RunInfo fields in `info` set (None removes one), and measurements.jsonl holding `rows`
    (None: `like`'s rows, or none)."""
    path.mkdir(parents=True)
    run = RunDir(path)
    recorded = RunDir(like).info() if like is not None else RunInfo(run_id=path.name)
    run.write_info(dataclasses.replace(recorded, **info))
    if rows is None and like is not None:
        shutil.copyfile(like / ROWS_FILE, path / ROWS_FILE)
    else:
        run.append_all(rows or [])
    return path


def graph_trace(path: Path, kernel: str, steps: int = 3, calls: int = 4, rank: int = 0) -> None:
    """A minimal kineto trace: per replay, `calls` x (20 us GEMM, 30 us `kernel`)."""
    events, ts = [], 1000.0
    for corr in range(steps):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1,
                       "ts": ts - 50, "dur": 5, "args": {"correlation": corr}})
        for _ in range(calls):
            for name, dur in (("gemm_kernel", 20.0), (kernel, 30.0)):
                events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                               "args": {"stream": 7, "correlation": corr, "graph id": 1}})
                ts += dur + 1
        ts += 1000
    path.write_text(json.dumps({"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}))
