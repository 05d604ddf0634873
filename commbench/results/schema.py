"""The row schema: the cell a row measures, Measurement (a cell plus its outcome), its
statuses, and the migration of older rows.

Schema version 3 (versions 1 and 2 are read and migrated). One row per cell: backend variant,
op, dtype, shape, mode, env setting. No torch and no files here: the run directory (rundir.py)
writes and reads rows, the boundary (validate.py) checks what is read.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

from commbench.ops import ALLREDUCE


SCHEMA_VERSION = 3
READABLE_SCHEMAS = (1, 2, 3)   # older rows are migrated on read (migrate_row)

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
# The variable a child torchrun preloads another NCCL with: a row's env_setting carries it, and
# with it which library the row measured.
PRELOAD_VAR = "LD_PRELOAD"


@dataclass(frozen=True)
class Shape:
    """One planned message: bytes per rank, and the (tokens, hidden) it came from, if any."""

    message_bytes: int
    tokens: int | None = None
    hidden: int | None = None


@dataclass(frozen=True)
class Cell:
    """What one row measures, before any outcome: the plan yields cells, a row is a cell plus its
    outcome, and two rows of one cell are the same measurement (resume skips a cell that has a
    row). Hashable, so sets of cells are what resume and the engine keep."""

    backend: str
    op: str
    dtype: str                                      # "bf16" | "fp16" | "fp32"
    shape: Shape
    mode: str                                       # "eager" | "graph"
    env_setting: tuple[tuple[str, str], ...] = ()   # process-level knobs (driver runs), sorted by name

    @staticmethod
    def setting(env_setting: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
        """A row's env_setting as a cell holds it: sorted pairs, so the order it was written in
        never makes two cells differ."""
        return tuple(sorted((env_setting or {}).items()))

    @property
    def library(self) -> str:
        """The library preloaded in place of the NCCL torch ships ("": torch's own)."""
        return dict(self.env_setting).get(PRELOAD_VAR, "")


@dataclass(slots=True)   # slots: analysis holds 10^5-10^6 rows; a __dict__ each was ~1 KB of them
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
    op: str = ALLREDUCE            # or e.g. FUSED_OP (commbench.ops)
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

    @classmethod
    def of(cls, cell: Cell, world_size: int, status: str, **outcome: Any) -> "Measurement":
        """The row of `cell`: what it measured is the cell's, the rest is `outcome`."""
        return cls(backend=cell.backend, op=cell.op, dtype=cell.dtype, message_bytes=cell.shape.message_bytes,
                   tokens=cell.shape.tokens, hidden=cell.shape.hidden, mode=cell.mode,
                   env_setting=dict(cell.env_setting), world_size=world_size, status=status, **outcome)

    @property
    def cell(self) -> Cell:
        return Cell(self.backend, self.op, self.dtype, Shape(int(self.message_bytes), self.tokens, self.hidden),
                    self.mode, Cell.setting(self.env_setting))

    def cell_but_size(self) -> tuple[Any, ...]:
        """The cell's fields other than the size, as plain values, beside `cell` so that the two
        list the same fields: reading 10^5 rows keys each by this and its size, not a Cell."""
        return (self.backend, self.op, self.dtype, self.tokens, self.hidden, self.mode, Cell.setting(self.env_setting))

    def key(self) -> Cell:
        """What makes two rows of one run the same measurement (RunDir adds the world size and
        an imported row's source): the cell."""
        return self.cell

    def to_dict(self) -> dict[str, Any]:
        # Dicts copied one level: asdict() deep-copies every value, which made writing and
        # reading 10^5 rows take minutes; attrgetter reads every field in one C call.
        data = dict(zip(_FIELD_NAMES, _ALL_FIELDS(self)))
        for name in _DICT_FIELDS:
            value = data[name]
            if isinstance(value, dict):
                data[name] = dict(value)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Measurement":
        data = migrate_row(data)
        if data.keys() <= _FIELD_SET:   # the usual row: no key to drop, no copy to make
            return cls(**data)
        return cls(**{k: v for k, v in data.items() if k in _FIELD_SET})


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Measurement))
_FIELD_SET = frozenset(_FIELD_NAMES)
_ALL_FIELDS = operator.attrgetter(*_FIELD_NAMES)
_DICT_FIELDS = tuple(f.name for f in dataclasses.fields(Measurement) if "dict" in str(f.type))

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


CSV_COLUMNS = [f.name for f in dataclasses.fields(Measurement)]


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
