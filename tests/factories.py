"""Test data made in one place: a row with what a test changes, and a results directory.

    row(backend="p2p:auto", latency_us=4.2)            # an ok, checked 4 KiB bf16 graph row
    row(tokens=8, hidden=7168, op=FUSED_OP)            # message_bytes follows the shape
    write_run(tmp_path / "run", [row(), row(world_size=8)], host="box")
    write_run(tmp_path / "copy", like=COMMITTED_RUN, provenance=None)   # a committed run, one field changed
    write_run(path, rows, backend_facts=backend_facts(["nccl", "p2p:fused"], 8))   # what those backends declare

A test names only what it is about; everything else is a plausible, valid default.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Iterable

from commbench.ops import ALLREDUCE, FUSED_OP
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


def backend_facts(names: Iterable[str], world_size: int) -> dict[str, Any]:
    """run.json's backend_facts for these variants as a sweep records them, from the backends
    themselves (imports them, and so torch)."""
    from commbench import backends
    from commbench.sweep.command import backend_facts as facts_of

    return {b.name: facts_of(b, world_size) for b in backends.expand(list(names), backends.Options(), on_gpu=True)}


def graph_trace(path: Path, kernel: str, steps: int = 3, calls: int = 4, rank: int = 0, world_size: int = 2) -> None:
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
    path.write_text(json.dumps({"distributedInfo": {"rank": rank, "world_size": world_size}, "traceEvents": events}))


# A hand-made 8-rank run on the recorded H200 NVLink box with GLM-5's decode shapes (hidden 6144,
# bf16): FlashInfer's fused kernel (what vLLM and SGLang run by default there), the unfused
# baseline, commbench's own fused kernel (p2p:fused, no engine runs it) and two plain allreduce
# variants, us per call by tokens. A fixture (its run.json says so), never a measurement.
FUSED_HIDDEN = 6144
FUSED_US = {"flashinfer:fused_oneshot": {1: 6.68, 8: 11.80}, "flashinfer:fused_twoshot": {64: 35.0},
            "unfused:best": {1: 15.62, 8: 21.38, 64: 30.0}}
STAND_IN_US = {"p2p:fused": {1: 4.00, 8: 6.00, 64: 20.0}}
PLAIN_US = {"flashinfer:trtllm_oneshot": {1: 4.0, 8: 8.0, 64: 30.0}, "sglang:auto": {1: 3.0, 8: 6.0, 64: 20.0}}
H200_NVLINK = Path(__file__).parent / "fixtures" / "snapshots" / "h200-nvlink-8x.json"


def fused_run(path: Path, stand_ins: bool = True) -> Path:
    """The GLM-5 fused run above at `path`; without `stand_ins`, the same run less p2p:fused. Two
    more p2p:fused rows test shape matching: 6 tokens of hidden 7168 (the bytes of 7 tokens of
    6144) and one whose bytes (8 tokens') disagree with its shape (2 tokens)."""
    def fused(backend: str, tokens: int, us: float, hidden: int = FUSED_HIDDEN, **more: Any) -> Measurement:
        return row(backend=backend, op=FUSED_OP, world_size=8, tokens=tokens, hidden=hidden, latency_us=us, **more)

    rows = [fused(b, t, us) for b, by in FUSED_US.items() for t, us in by.items()]
    rows += [row(backend=b, world_size=8, message_bytes=t * FUSED_HIDDEN * 2, latency_us=us)
             for b, by in PLAIN_US.items() for t, us in by.items()]
    names = [*FUSED_US, *PLAIN_US]
    if stand_ins:
        rows += [fused(b, t, us) for b, by in STAND_IN_US.items() for t, us in by.items()]
        rows += [fused("p2p:fused", 6, 1.0, hidden=7168),
                 fused("p2p:fused", 2, 0.5, message_bytes=8 * FUSED_HIDDEN * 2)]
        names += list(STAND_IN_US)
    return write_run(path, rows, run_id="fused-glm5", provenance="fixture", world_size=8, host="h200-box",
                     snapshot=json.loads(H200_NVLINK.read_text()), backend_facts=backend_facts(names, 8))

