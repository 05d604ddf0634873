"""What the engine's NCCL log says NCCL ran for the trace's NCCL allreduces (`attribute --nccl-log`).

NCCL's kernel names do not tell the protocol (nccl#1595, #2196), but its INFO log does, per call:
with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,COLL comm rank 0 logs the algorithm and
protocol (or the symmetric kernel) it planned for each collective, and every rank logs each call
with its count, datatype and nranks (topology/nccl_log.py reads both, with the NCCL source lines).
The log is matched to the trace by message size only: it carries no timestamps to match calls by.
"""

from __future__ import annotations

import io
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from commbench.analysis.attribution import Call, RankResult
from commbench.errors import UsageError
from commbench.files import open_input
from commbench.topology.nccl_log import NCCL_LINE_MARKS, LoggedAllreduce, logged_allreduces
from commbench.units import format_bytes

# The library the NCCL backend modules' TRACE_KERNELS name (backends/nccl/backend.py, symm.py):
# "NCCL", "NCCL <= 2.18", "NCCL (one rank)", "NCCL symmetric"; never "ambiguous: ...".
LIBRARY_PREFIX = "NCCL"
HOW_TO_LOG = "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,COLL"
NOT_IN_LOG = "not in the log"
BINARY_PROBE_BYTES = 65536


@dataclass
class NcclLog:
    """The allreduce lines of one or more NCCL INFO logs."""

    files: list[str]
    # Counted, not kept: an engine's log holds a line per call, millions in a long run.
    choices: Counter[tuple[int, int | None, str]] = field(default_factory=Counter)  # (bytes, nranks, choice)
    calls: Counter[tuple[int | None, int]] = field(default_factory=Counter)         # (bytes, nranks)


@dataclass
class LogLine:
    """One (library, size) of the trace's NCCL allreduces with what the log shows for that size."""

    library: str
    message_bytes: int | None
    trace_calls: int
    choices: dict[str, int]          # "Ring/LL" or "symmetric AllReduce_AGxLL_R" -> logged calls
    said: str                        # the choices as text, or why there are none


def _lines(path: Path) -> Iterator[str]:
    """The file's lines, streamed (an engine's log with COLL lines grows with every call)."""
    try:
        with open_input(path, "an NCCL log") as raw:
            if b"\0" in raw.read(BINARY_PROBE_BYTES):
                raise UsageError(f"{path}: binary file, not an NCCL log")
            raw.seek(0)
            yield from io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    except UsageError as exc:   # the file named with its flag
        raise UsageError(f"--nccl-log {exc}") from None
    except OSError as exc:
        raise UsageError(f"--nccl-log {path}: cannot read ({exc.strerror})") from None


def _nccl_only(lines: Iterator[str], seen: Counter[str]) -> Iterator[str]:
    """The lines NCCL's logger wrote (an engine's log interleaves its own), counted in seen."""
    for line in lines:
        seen["lines"] += 1
        if any(mark in line for mark in NCCL_LINE_MARKS):
            seen["nccl"] += 1
            yield line


def read_nccl_logs(paths: list[Path]) -> NcclLog:
    """Every allreduce line of the logs; a file that is no NCCL log (empty, binary, no line from
    NCCL's logger) raises UsageError."""
    log = NcclLog([str(p) for p in paths])
    for path in paths:
        seen: Counter[str] = Counter()
        for item in logged_allreduces(_nccl_only(_lines(path), seen)):
            if isinstance(item, LoggedAllreduce):
                log.choices[(item.message_bytes, item.nranks, item.choice)] += 1
            else:
                log.calls[(item.message_bytes, item.nranks)] += 1
        if not seen["lines"]:
            raise UsageError(f"--nccl-log {path}: empty file, not an NCCL log")
        if not seen["nccl"]:
            raise UsageError(f"--nccl-log {path}: not an NCCL log (no 'NCCL INFO' line; "
                             f"run the engine with {HOW_TO_LOG})")
    return log


def _is_nccl(call: Call) -> bool:
    return call.library.startswith(LIBRARY_PREFIX)


def _all_calls(results: list[RankResult]) -> Iterator[Call]:
    for r in results:
        yield from (c for s in r.steps for c in s.calls)
        yield from r.outside_allreduce


def has_nccl(results: list[RankResult]) -> bool:
    """Whether the trace ran an NCCL allreduce (whose protocol the log would tell)."""
    return any(_is_nccl(c) for c in _all_calls(results))


def _said(log: NcclLog, message_bytes: int | None, world_size: int | None) -> tuple[dict[str, int], str]:
    if message_bytes is None:
        return {}, "size unknown: cannot be matched with the log (give --hidden and --batch)"
    # A choice NCCL paired with a call of another communicator size is another group's (a DP or
    # PP communicator beside the TP one); an unpaired one (no COLL line) is kept.
    choices: Counter[str] = Counter()
    for (size, nranks, choice), n in log.choices.items():
        if size == message_bytes and (world_size is None or nranks in (None, world_size)):
            choices[choice] += n
    if choices:
        return dict(choices), ", ".join(f"{name} x{n}" for name, n in choices.most_common())
    calls = {nranks: n for (size, nranks), n in log.calls.items() if size == message_bytes}
    if calls and set(calls) == {1}:
        return {}, f"{NOT_IN_LOG}: {calls[1]} calls on one rank (NCCL runs them locally, choosing nothing)"
    if calls:
        return {}, (f"{NOT_IN_LOG}: {sum(calls.values())} calls logged, no choice (NCCL logs its choice on comm "
                    "rank 0 only, with TUNING: give rank 0's log)")
    return {}, NOT_IN_LOG


def log_lines(log: NcclLog, results: list[RankResult], world_size: int | None) -> list[LogLine]:
    """Per (library, size) of the trace's NCCL allreduces, in and outside steps, what the log shows."""
    counts: dict[tuple[str, int | None], int] = defaultdict(int)
    for call in _all_calls(results):
        if _is_nccl(call):
            counts[(call.library, call.message_bytes)] += 1
    lines = []
    for (library, size), n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        choices, said = _said(log, size, world_size)
        lines.append(LogLine(library, size, n, choices, said))
    return lines


def log_text(log: NcclLog, lines: list[LogLine]) -> list[str]:
    """The section's lines: what was read, then one line per (library, size)."""
    sizes = {size for size, _, _ in log.choices}
    out = [f"NCCL's log ({', '.join(log.files)}): {log.choices.total()} allreduce choices at "
           f"{len(sizes)} size{'' if len(sizes) == 1 else 's'}, {log.calls.total()} calls logged"]
    if not log.choices and not log.calls:
        out.append(f"  no allreduce line: was NCCL logging with {HOW_TO_LOG}?")
    if not lines:
        out.append("  the trace has no NCCL allreduce")
    for line in lines:
        size = format_bytes(line.message_bytes) if line.message_bytes is not None else "unknown size"
        out.append(f"  {line.library} at {size} ({line.trace_calls} calls in the trace): {line.said}")
    return out
