"""Reading nccl-tests' `all_reduce_perf` output: its stdout table and its `-J FILE.json` file.

The formats are nccl-tests' own (NVIDIA/nccl-tests v2.19.6, commit a0b82b2, src/util.cu and
src/common.cu); older releases back to 2.17 print the same lines less a few fields:

- text: `# nccl-tests version V nccl-headers=H nccl-library=L`, `# Collective test starting: NAME`,
  `# nThread T nGpus G minBytes B maxBytes E step: F(factor) warmup iters: W iters: N agg iters: M
  validation: C graph: G unalign: U`, optional `# Blocking Enabled: ...`, `# Per-Iteration Report: ...`
  and `# Parallel Init Enabled` lines, one `#  Rank R Group G Pid P on HOST device D [DDDD:BB:DD] NAME`
  line per rank, a column header, one row per size (`%12li  %12li  %8s  %6s  %6s` then per placement
  `  %7s  %6s  %6s  %6g` or `    N/A` in the #wrong column when validation is off, plus
  `i_min i_max i_p99 i_cv%` with -I and a timestamp with -S), and a footer that ends with
  `# Collective test concluded: NAME`.
- JSON (JSON_FILE_VERSION 1-3, rank 0 only): `version`, `start_time`, `args`, `env`, `nccl_version`,
  `config{... devices[one entry per process]}`, `results[{size, count, type, redop, root,
  out_of_place{time|cpu_time, alg_bw, bus_bw, nwrong|null}, in_place{...}, *_per_iter{...},
  actual_iterations}]`, `out_of_bounds`, `average_bus_bandwidth`, `errors`, `end_time`.

The text table does not say how ranks were combined (`-a`); the JSON's `args` do. Neither is
held whole: a first pass reads the header (the JSON's fields) and checks and counts the results,
each later pass parses them from the file again.
Bad input raises UsageError with one line that names the file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator, overload

from commbench.errors import UsageError
from commbench.files import first_character, read_lines
from commbench.json_stream import JsonError, object_events
from commbench.results.text import clean_text
from commbench.results.validate import MAX_COUNT, is_plain_name
from commbench.units import MAX_MESSAGE_BYTES

PROGRAM = "all_reduce_perf"
SOURCE = "nccl-tests"   # run.json source of an imported run (provenance tells imports apart by it)
PLACEMENTS = ("out_of_place", "in_place")

# nccl-tests' getopt string and long options (src/common.cu main): every option takes a value but -h.
_SHORT_WITH_VALUE = set("tgbeifnmwNpIKcodrzyTGCaRxDVJSMu")
_LONG = {"nthreads": "t", "ngpus": "g", "minbytes": "b", "maxbytes": "e", "stepbytes": "i", "stepfactor": "f",
         "iters": "n", "agg_iters": "m", "warmup_iters": "w", "run_cycles": "N", "parallel_init": "p",
         "check": "c", "op": "o", "datatype": "d", "root": "r", "blocking": "z", "stream_null": "y",
         "timeout": "T", "cudagraph": "G", "report_cputime": "C", "report_timestamps": "S",
         "output_file": "J", "average": "a", "local_register": "R", "cta_policy": "x",
         "device_implementation": "D", "device_cta_count": "V", "memory": "M", "unalign": "u",
         "per_iter_timing": "I", "per_iter_skip": "K", "help": "h"}


@dataclass
class PerIteration:
    """`-I 1`: CUDA events per iteration, max over GPUs and processes per iteration (µs, per call)."""

    min_us: float | None
    max_us: float | None
    p99_us: float | None            # nccl-tests' nearest-rank p99
    cv_pct: float | None
    skipped: int = 0
    times_us: list[float] | None = None   # every iteration (JSON only), skipped ones included
    summary: dict[str, float] = field(default_factory=dict)   # JSON's avg/p50/p95/stdev


@dataclass(slots=True)
class Placement:
    """One placement's columns: time (µs), algbw/busbw (GB/s), #wrong (None: N/A, not validated)."""

    time_us: float | None
    algbw_gbps: float | None
    busbw_gbps: float | None
    wrong: int | None
    cputime: bool = False           # -C 1: host time to enqueue, not a latency
    per_iteration: PerIteration | None = None


@dataclass(slots=True)
class ResultRow:
    size_bytes: int
    count: int
    type_name: str
    redop: str
    root: int
    placements: dict[str, Placement]     # "out_of_place" / "in_place"; absent when nccl-tests wrote none
    cycle: int = 0                       # -N: which repetition of the sweep
    where: str = ""                      # "line 17" / "results[3]"
    timestamp: str | None = None         # -S 1


@dataclass
class RankLine:
    rank: int
    group: int
    pid: int
    host: str
    device: int
    pci_bus_id: str
    name: str


@dataclass
class Config:
    nthreads: int
    ngpus: int
    min_bytes: int
    max_bytes: int
    step_factor: int | None
    step_bytes: int | None
    warmup_iters: int
    iters: int
    agg_iters: int
    validation: int
    graph_launches: int
    unalign: int | None = None
    blocking: int | None = None        # text: 0-3 from its line; JSON: only true/false (None when true)
    blocking_text: str | None = None
    per_iter_timing: bool = False
    per_iter_skip: int = 0
    parallel_init: bool = False


@dataclass
class NcclTestsOutput:
    path: Path
    format: str                          # "text" | "json"
    config: Config
    ranks: list[RankLine]                # text: every rank; JSON: the first rank of each process
    results: Sequence[ResultRow]         # StreamedResults: read from the file again on each pass
    complete: bool                       # the footer (text) / end_time (JSON) is there
    program: str | None = None
    nccl_tests_version: str | None = None
    nccl_headers: int | None = None
    nccl_library: int | None = None
    json_version: int | None = None
    args: list[str] | None = None
    env: dict[str, str] | None = None
    start_time: str | None = None
    end_time: str | None = None
    json_companion: str | None = None    # text: "# Writing JSON output to X"
    out_of_bounds: int | None = None
    avg_busbw_gbps: float | None = None
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ends_at: str | None = None           # where a truncated output stops
    # The first result with a value no reader takes (bad_time): (where, why), found by the first
    # pass, so that no other pass is needed to refuse the file.
    bad_time: tuple[str, str] | None = None
    # Lines inside the results table that start like a row but are none (a negative size):
    # (line number, the line), the first few; said when imported, with their count.
    dropped: list[tuple[int, str]] = field(default_factory=list)
    dropped_count: int = 0

    @property
    def processes(self) -> int:
        """MPI processes: JSON lists one device per process; text one line per rank."""
        per_process = self.config.nthreads * self.config.ngpus
        if self.format == "json":
            return max(1, len(self.ranks))
        return max(1, len(self.ranks) // max(1, per_process))

    @property
    def timers(self) -> int:
        """Host timers that -a combines: one per thread of every process (a thread drives -g GPUs)."""
        return self.processes * self.config.nthreads

    def world_size(self) -> int:
        """Ranks of one communicator: nccl-tests splits ranks into groups with NCCL_TESTS_SPLIT."""
        per_process = self.config.nthreads * self.config.ngpus
        if self.format == "json":
            groups = [r.group for r in self.ranks] or [0]
            return groups.count(groups[0]) * per_process
        groups = [r.group for r in self.ranks] or [0]
        return groups.count(groups[0]) if self.ranks else per_process

    def hosts(self) -> list[str]:
        return sorted({r.host for r in self.ranks})

    def options(self) -> dict[str, str]:
        return parse_nccl_tests_args(self.args or [])


# ---------------------------------------------------------------- command-line flags (JSON args)

def strtol(text: str) -> int:
    """C's strtol(text, NULL, 0): leading spaces, a sign, 0x hex or 0 octal, digits until the first non-digit."""
    match = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)
    if not match:
        return 0
    sign, digits = match.groups()
    value = int(digits, 16) if digits[:2].lower() == "0x" else int(digits, 8) if digits.startswith("0") else int(digits)
    return -value if sign == "-" else value


def _long_option(name: str) -> str | None:
    """getopt_long accepts any unambiguous prefix of a long option."""
    if name in _LONG:
        return _LONG[name]
    matches = {short for long, short in _LONG.items() if long.startswith(name)}
    return matches.pop() if len(matches) == 1 else None


def parse_nccl_tests_args(argv: list[str]) -> dict[str, str]:
    """Short option letter -> value, as nccl-tests' getopt_long reads argv (argv[0] is the program)."""
    out: dict[str, str] = {}
    i = 1
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            break
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            short = _long_option(name)
            if short is None or short == "h":
                continue
            if not eq and i < len(argv):
                value, i = argv[i], i + 1
            out[short] = value
        elif arg.startswith("-") and len(arg) > 1 and arg[1] in _SHORT_WITH_VALUE:
            value = arg[2:]
            if not value and i < len(argv):
                value, i = argv[i], i + 1
            out[arg[1]] = value
    return out


# ---------------------------------------------------------------- reading a file

WHAT = "nccl-tests output (its stdout or -J JSON)"


def read_output(path: str | Path, partial: bool = False) -> NcclTestsOutput:
    """Parse one nccl-tests output file (text or JSON). A truncated one is an error unless partial.
    Its rows are not held: its results are read from the file again on each pass (a -J file
    a record at a time, commbench.json_stream)."""
    path = Path(path)
    first = first_character(path, WHAT)
    if not first:
        raise UsageError(f"{path}: empty file, not nccl-tests output")
    out = _parse_json(path, partial) if first == "{" else _parse_text(path)
    if out.program is not None and not out.program.startswith(PROGRAM):
        raise UsageError(f"{path}: output of {out.program}, not {PROGRAM}; only allreduce results are imported")
    if not out.results:
        where = f" (it stops at {out.ends_at})" if out.ends_at else ""
        raise UsageError(f"{path}: nccl-tests output without a single result row{where}")
    if not out.complete and not partial:
        raise UsageError(f"{path}: output ends at {out.ends_at or 'its last line'} before nccl-tests' footer "
                         f"(run cut short?); --partial imports its {len(out.results)} complete row(s)")
    return out


# ---------------------------------------------------------------- text

_VERSION_RE = re.compile(r"^# nccl-tests version (\S+) nccl-headers=(\d+) nccl-library=(\d+)")
_PROGRAM_RE = re.compile(r"^# Collective test starting: (\S+)")
_CONFIG_RE = re.compile(
    r"^# nThread (\d+) nGpus (\d+) minBytes (\d+) maxBytes (\d+) step: (\d+)\((factor|bytes)\) "
    r"warmup iters: (-?\d+) iters: (-?\d+) agg iters: (-?\d+) validation: (-?\d+) graph: (-?\d+)"
    r"(?: unalign: (-?\d+))?")
_RANK_RE = re.compile(r"^#\s+Rank\s+(\d+) Group\s+(\d+) Pid\s+(\d+) on\s+(\S+) device\s+(\d+) \[([^\]]*)\] ?(.*)$")
_ROW_RE = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(-?\d+)(\s.*)?$")
# A line that starts as a row does (a number) but is none: a negative size or count.
_ROW_LIKE_RE = re.compile(r"^\s*[-+]?\d")
_LISTED_DROPPED = 5
# Bytes per element of nccl-tests' types (its test_typenames): size = count x this.
TYPE_BYTES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "half": 2, "float": 4,
              "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1}
_JSON_NOTE_RE = re.compile(r"^# Writing JSON output to (.+)$")
_OOB_RE = re.compile(r"^# Out of bounds values\s*: (\d+)")
_AVG_RE = re.compile(r"^# Avg bus bandwidth\s*: (\S+)")
_CONCLUDED_RE = re.compile(r"^# Collective test concluded: (\S+)")
_FAILURE_RE = re.compile(r"Test (?:NCCL |CUDA )?failure|NCCL WARN|Test timeout")


@dataclass
class _Columns:
    """The table's layout, from its header line."""

    cputime: bool
    per_iteration: bool
    timestamp: bool

    @property
    def per_placement(self) -> int:
        return 8 if self.per_iteration else 4


def _columns(header: str) -> _Columns:
    words = header.lstrip("#").split()
    # Releases before 2.13 printed an "error" column (a deviation) where #wrong is now: not a count.
    if words[:5] != ["size", "count", "type", "redop", "root"] or words.count("#wrong") != 2:
        raise ValueError(header)
    return _Columns(cputime="cputime" in words, per_iteration="i_min" in words, timestamp="timestamp" in words)


def _number(token: str) -> float | None:
    value = float(token)
    if math.isfinite(value):
        return value
    return None if token.lower() in ("nan", "-nan", "inf", "-inf") else value


def bad_time(row: ResultRow) -> tuple[str, str] | None:
    """(where, why) of the first value of a result that no reader of a run dir would take (the
    bounds of commbench.results.validate: a time that is not positive and finite, a bandwidth
    that is negative, a size or count out of range, a type that is no plain name, a count that
    does not fit the size); None when all fit. The first pass finds the first, and the file is
    refused before anything is written: a row the readers skip must not be imported."""
    where = row.where
    if not 1 <= row.size_bytes <= MAX_MESSAGE_BYTES:
        return where, f"size {row.size_bytes} is not a size from 1 to {MAX_MESSAGE_BYTES} bytes"
    if not 0 <= row.count <= MAX_COUNT:
        return where, f"count {row.count} is not a count of elements"
    if not is_plain_name(row.type_name):
        return where, f"type {clean_text(row.type_name)[:40]!r} is not a plain name"
    item = TYPE_BYTES.get(row.type_name)
    if item is not None and row.count and row.count * item != row.size_bytes:
        return where, (f"count {row.count} of {row.type_name} ({item} bytes each) is not size {row.size_bytes}: "
                       "an inconsistent row")
    for name, p in row.placements.items():
        label = name.replace("_", "-")
        if p.time_us is None or not 0 < p.time_us < math.inf:
            return where, f"the {label} time is {'nan' if p.time_us is None else f'{p.time_us:g}'}, not a positive time"
        for what, value in (("algbw", p.algbw_gbps), ("busbw", p.busbw_gbps)):
            if value is None or not 0 <= value <= MAX_COUNT:
                return where, f"the {label} {what} is {'nan' if value is None else f'{value:g}'}, not a bandwidth >= 0"
    return None


def _placement(tokens: list[str], cols: _Columns) -> Placement:
    wrong = None if tokens[3] == "N/A" else int(float(tokens[3]))
    per_iter = None
    if cols.per_iteration:
        values = [_number(t) for t in tokens[4:8]]
        per_iter = PerIteration(min_us=values[0], max_us=values[1], p99_us=values[2], cv_pct=values[3])
    time_us, algbw, busbw = float(tokens[0]), float(tokens[1]), float(tokens[2])
    if not math.isfinite(time_us + algbw + busbw):   # a nan or inf among them: _number says which is what
        time_us, algbw, busbw = _number(tokens[0]), _number(tokens[1]), _number(tokens[2])
    return Placement(time_us, algbw, busbw, wrong, cols.cputime, per_iter)


def _row_from_line(match: re.Match[str], cols: _Columns, where: str) -> ResultRow:
    """One table row from its _ROW_RE match; ValueError when the line is not one whole row of this layout."""
    line = match.string
    size, count, type_name, redop, root, rest = match.groups()
    tokens = (rest or "").split()
    timestamp = None
    if cols.timestamp:
        if len(tokens) < 2:
            raise ValueError(line)
        timestamp, tokens = " ".join(tokens[-2:]), tokens[:-2]
    if len(tokens) != 2 * cols.per_placement:
        raise ValueError(line)
    n = cols.per_placement
    placements = {"out_of_place": _placement(tokens[:n], cols), "in_place": _placement(tokens[n:], cols)}
    return ResultRow(int(size), int(count), type_name, redop, int(root), placements, where=where,
                     timestamp=timestamp)


def _blocking_level(line: str) -> int:
    if "no barrier" in line:
        return 2
    if "outer iteration" in line:
        return 3
    return 1


def _config_from_match(m: re.Match) -> Config:
    step, kind = int(m.group(5)), m.group(6)
    return Config(nthreads=int(m.group(1)), ngpus=int(m.group(2)), min_bytes=int(m.group(3)),
                  max_bytes=int(m.group(4)), step_factor=step if kind == "factor" else None,
                  step_bytes=step if kind == "bytes" else None, warmup_iters=int(m.group(7)),
                  iters=int(m.group(8)), agg_iters=int(m.group(9)), validation=int(m.group(10)),
                  graph_launches=int(m.group(11)),
                  unalign=int(m.group(12)) if m.group(12) is not None else None, blocking=0)


class _TextReader:
    """A line-by-line pass over nccl-tests' stdout; other lines (NCCL's log, warnings) are skipped."""

    def __init__(self, path: Path, on_row: Callable[[ResultRow], None] | None = None):
        self.path = path
        self.on_row = on_row              # each result row as it is parsed; none is kept
        self.row_count = 0
        self.fields: dict[str, Any] = {"errors": [], "notes": []}
        self.config: Config | None = None
        self.ranks: list[RankLine] = []
        self.columns: _Columns | None = None
        self.bad_row: str | None = None
        self.concluded = False
        self.last_line = 0

    def feed(self, number: int, line: str) -> None:
        self.last_line = number
        if self.columns is not None and not line.startswith("#") and (match := _ROW_RE.match(line)):
            self._row(number, match)
        elif line.startswith("#"):
            self._comment(number, line)
        elif _FAILURE_RE.search(line):
            self.fields["errors"].append(line.strip())
        elif self.columns is not None and _ROW_LIKE_RE.match(line):
            self.fields["dropped_count"] = self.fields.get("dropped_count", 0) + 1
            if len(self.fields.setdefault("dropped", [])) < _LISTED_DROPPED:
                self.fields["dropped"].append((number, clean_text(line.strip())[:60]))

    def _row(self, number: int, match: re.Match[str]) -> None:
        if self.bad_row is not None:
            raise UsageError(f"{self.path}: {self.bad_row} is not a whole result row of this table")
        try:
            row = _row_from_line(match, self.columns, f"line {number}")  # type: ignore[arg-type]
        except ValueError:
            self.bad_row = f"line {number}"
            return
        self.row_count += 1
        if self.fields.get("bad_time") is None:
            self.fields["bad_time"] = bad_time(row)
        if self.on_row is not None:
            self.on_row(row)

    def _comment(self, number: int, line: str) -> None:
        line = line.rstrip()
        if (m := _CONFIG_RE.match(line)):
            if self.config is not None:
                raise UsageError(f"{self.path}: line {number} starts a second nccl-tests run in the same file "
                                 "(several jobs wrote into one output?); give one run per file")
            self.config = _config_from_match(m)
        elif (m := _RANK_RE.match(line)):
            rank, group, pid, host, device, bus, name = m.groups()
            self.ranks.append(RankLine(int(rank), int(group), int(pid), host, int(device), bus, name.strip()))
        elif (m := _VERSION_RE.match(line)):
            self.fields.update(nccl_tests_version=m.group(1), nccl_headers=int(m.group(2)),
                               nccl_library=int(m.group(3)))
        elif (m := _PROGRAM_RE.match(line)):
            self.fields["program"] = m.group(1)
        elif (m := _JSON_NOTE_RE.match(line)):
            self.fields["json_companion"] = m.group(1).strip()
        elif line.startswith("# Blocking Enabled") and self.config is not None:
            self.config.blocking, self.config.blocking_text = _blocking_level(line), line[2:].strip()
        elif line.startswith("# Per-Iteration Report") and self.config is not None:
            self.config.per_iter_timing = True
            skip = re.search(r"skips first (\d+) iterations", line)
            self.config.per_iter_skip = int(skip.group(1)) if skip else 0
        elif line.startswith("# Parallel Init Enabled") and self.config is not None:
            self.config.parallel_init = True
        elif line.startswith("# Reducing maxBytes"):
            self.fields["notes"].append(line[2:].strip())
        elif re.match(r"^#\s+size\s+count\s+type", line):
            self._header(number, line)
        elif (m := _OOB_RE.match(line)):
            self.fields["out_of_bounds"] = int(m.group(1))
        elif (m := _AVG_RE.match(line)):
            self.fields["avg_busbw_gbps"] = _number(m.group(1))
        elif _CONCLUDED_RE.match(line):
            self.concluded = True
        elif line.startswith("# error:"):
            self.fields["errors"].append(line[len("# error:"):].strip())

    def _header(self, number: int, line: str) -> None:
        try:
            self.columns = _columns(line)
        except ValueError:
            raise UsageError(f"{self.path}: line {number}: table header of an unknown layout "
                             "(an nccl-tests older than 2.13, or another program)") from None

    def result(self) -> NcclTestsOutput:
        if self.config is None:
            raise UsageError(f"{self.path}: not nccl-tests output (no '# nThread ... nGpus ...' header line)")
        if self.columns is None:
            raise UsageError(f"{self.path}: nccl-tests output without its result table (the run stopped "
                             f"before the first size)")
        if self.bad_row is not None and self.concluded:
            raise UsageError(f"{self.path}: {self.bad_row} is not a whole result row of this table")
        ranks = [r.rank for r in self.ranks]
        if len(set(ranks)) != len(ranks):
            twice = next(r for r in ranks if ranks.count(r) > 1)
            raise UsageError(f"{self.path}: rank {twice} is listed {ranks.count(twice)} times: several separate "
                             "jobs wrote into one output (an all_reduce_perf built without MPI=1 under mpirun?)")
        complete = self.concluded and self.bad_row is None
        ends_at = None if complete else (self.bad_row or f"line {self.last_line}")
        return NcclTestsOutput(path=self.path, format="text", config=self.config, ranks=self.ranks,
                               results=StreamedResults(self.path, self.row_count, _text_rows), complete=complete,
                               ends_at=ends_at, **self.fields)


def _read_text_output(path: Path, on_row: Callable[[ResultRow], None] | None) -> _TextReader:
    reader = _TextReader(path, on_row)
    for number, line in enumerate(read_lines(path, WHAT), start=1):
        reader.feed(number, line)
    return reader


def _parse_text(path: Path) -> NcclTestsOutput:
    return _read_text_output(path, None).result()


def _text_rows(path: Path) -> Iterator[ResultRow]:
    rows: list[ResultRow] = []   # what one line gave: at most a row
    reader = _TextReader(path, rows.append)
    for number, line in enumerate(read_lines(path, WHAT), start=1):
        reader.feed(number, line)
        yield from rows
        rows.clear()


class StreamedResults(Sequence[ResultRow]):
    """An output's result rows, parsed from the file again on each pass, so that a 100 MB log
    (10^6 rows) is never held as rows; the first pass counted them. A file that changed since
    is refused rather than read as something else."""

    def __init__(self, path: Path, count: int, rows: Callable[[Path], Iterator[ResultRow]]):
        self.path = path
        self.count = count
        self._rows = rows   # one pass over the file's rows, not yet numbered in cycles
        self._stamp = _stamp(path)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[ResultRow]:
        if _stamp(self.path) != self._stamp:
            raise self._changed()
        seen, cycles = 0, _CycleCounter()
        for row in self._rows(self.path):
            seen += 1
            if seen > self.count:
                raise self._changed()
            cycles.number(row)
            yield row
        if seen != self.count:
            raise self._changed()

    @overload
    def __getitem__(self, index: int) -> ResultRow: ...
    @overload
    def __getitem__(self, index: slice) -> list[ResultRow]: ...

    def __getitem__(self, index: int | slice) -> ResultRow | list[ResultRow]:
        """One pass to the rows asked for (a checking aid: the importer only iterates)."""
        if isinstance(index, slice):
            start, stop, step = index.indices(self.count)
            return list(islice(self, start, stop, step)) if step > 0 else list(self)[index]
        position = index + self.count if index < 0 else index
        if not 0 <= position < self.count:
            raise IndexError(index)
        return next(islice(self, position, None))

    def _changed(self) -> UsageError:
        return UsageError(f"{self.path}: changed while it was being read (a run still writing it?); "
                          "import it once it is complete")


def _stamp(path: Path) -> tuple[int, int]:
    try:
        info = path.stat()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from None
    return info.st_size, info.st_mtime_ns


@dataclass
class _CycleCounter:
    """-N repeats the size sweep of each (type, op): a size that does not grow starts a new cycle."""

    cycle: int = 0
    previous: ResultRow | None = None

    def number(self, row: ResultRow) -> None:
        previous = self.previous
        if previous is not None and (row.type_name, row.redop) == (previous.type_name, previous.redop):
            if row.size_bytes <= previous.size_bytes:
                self.cycle += 1
        else:
            self.cycle = 0
        row.cycle = self.cycle
        self.previous = row


# ---------------------------------------------------------------- JSON

def _read_json(path: Path, partial: bool) -> tuple[dict[str, Any], int, tuple[str, str] | None, bool]:
    """The first pass over a -J file, streamed (commbench.json_stream): its fields but the results,
    how many results it has (each checked, none held), the first bad time, and whether it is
    whole. A file cut short inside or after its results keeps the fields before them and every
    whole result (as --partial imports it); anything else that is not JSON is bad input."""
    head: dict[str, Any] = {}
    data: dict[str, Any] = {}
    count, first_bad, in_results = 0, None, False
    try:
        for kind, name, value in object_events(path, "results", WHAT):
            if kind == "field":
                data[name] = value
            elif kind == "array":
                head, in_results = dict(data), True
            else:
                row = _json_row(path, name, value)
                count += 1
                first_bad = first_bad or bad_time(row)
    except JsonError as exc:
        where = f"{exc.msg}, line {exc.lineno} column {exc.colno}"
        if not in_results or not isinstance(head.get("config"), dict):
            raise UsageError(f"{path}: not valid JSON ({where}), not nccl-tests -J output") from None
        if not partial:
            raise UsageError(f"{path}: JSON ends early ({where}; run cut short?); --partial imports its {count} "
                             "complete row(s)") from None
        return head, count, first_bad, False
    if not isinstance(data.get("config"), dict) or not in_results:
        raise UsageError(f"{path}: JSON without nccl-tests' 'config' and 'results'; not nccl-tests -J output")
    return data, count, first_bad, True


def _json_rows(path: Path) -> Iterator[ResultRow]:
    """A later pass over a -J file's results: the whole ones the first pass found (a cut-short
    file ends there)."""
    try:
        for kind, index, value in object_events(path, "results", WHAT):
            if kind == "item":
                yield _json_row(path, index, value)
    except JsonError:
        return


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _json_bool(value: Any) -> bool:
    """nccl-tests writes booleans as the strings "true" / "false"."""
    return value is True or value == "true"


def _json_float(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None   # "nan"


def _json_int(value: Any, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{path}: {what} is {value!r}, not a number; not nccl-tests -J output")
    return int(value)


def _json_config(path: Path, config: dict[str, Any]) -> Config:
    def num(key: str, default: int | None = None) -> int:
        if key not in config and default is not None:
            return default
        return _json_int(config.get(key), f"config.{key}", path)
    blocking = config.get("blocking_collectives")
    return Config(nthreads=num("nthreads"), ngpus=num("ngpus"), min_bytes=num("minimum_bytes"),
                  max_bytes=num("maximum_bytes"),
                  step_factor=num("step_factor") if "step_factor" in config else None,
                  step_bytes=num("step_bytes") if "step_bytes" in config else None,
                  warmup_iters=num("warmup_iters"), iters=num("iterations"), agg_iters=num("aggregated_iterations"),
                  validation=num("validation"), graph_launches=num("graph"),
                  blocking=None if _json_bool(blocking) else 0,
                  per_iter_timing=_json_bool(config.get("per_iter_timing")), per_iter_skip=num("per_iter_skip", 0),
                  parallel_init=_json_bool(config.get("parallel_init")))


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _json_rank(entry: Any) -> RankLine:
    e = _dict(entry)
    return RankLine(rank=_int(e.get("rank")), group=_int(e.get("group")), pid=_int(e.get("pid")),
                    host=str(e.get("hostname", "")), device=_int(e.get("device")),
                    pci_bus_id=str(e.get("device_hex", "")), name=str(e.get("device_info", "")).strip())


def _json_per_iteration(value: Any) -> PerIteration | None:
    data = _dict(value)
    if not data:
        return None
    times = data.get("times_us")
    return PerIteration(min_us=_json_float(data.get("min_us")), max_us=_json_float(data.get("max_us")),
                        p99_us=_json_float(data.get("p99_us")), cv_pct=_json_float(data.get("cv_pct")),
                        skipped=_int(data.get("skipped_iterations")),
                        times_us=[t for t in (_json_float(v) for v in times) if t is not None]
                        if isinstance(times, list) else None,
                        summary={k: v for k in ("avg_us", "p50_us", "p95_us", "stdev_us")
                                 if (v := _json_float(data.get(k))) is not None})


def _json_placement(value: Any, per_iter: Any) -> Placement | None:
    data = _dict(value)
    if not data:
        return None   # nccl-tests wrote null (trace replay) or nothing
    cputime = "cpu_time" in data
    wrong = _json_float(data.get("nwrong"))
    return Placement(time_us=_json_float(data.get("cpu_time" if cputime else "time")),
                     algbw_gbps=_json_float(data.get("alg_bw")), busbw_gbps=_json_float(data.get("bus_bw")),
                     wrong=None if data.get("nwrong") is None else int(wrong or 0), cputime=cputime,
                     per_iteration=_json_per_iteration(per_iter))


def _json_row(path: Path, index: int, entry: Any) -> ResultRow:
    e = _dict(entry)
    if "size" not in e or "type" not in e:
        raise UsageError(f"{path}: results[{index}] has no size or type; not nccl-tests -J output")
    placements = {name: p for name in PLACEMENTS
                  if (p := _json_placement(e.get(name), e.get(f"{name}_per_iter"))) is not None}
    return ResultRow(size_bytes=_json_int(e["size"], f"results[{index}].size", path),
                     count=_json_int(e.get("count", 0), f"results[{index}].count", path),
                     type_name=str(e["type"]), redop=str(e.get("redop", "")), root=strtol(str(e.get("root", "-1"))),
                     placements=placements, where=f"results[{index}]")


def _parse_json(path: Path, partial: bool) -> NcclTestsOutput:
    data, count, first_bad, whole = _read_json(path, partial)
    config = _dict(data["config"])
    args = [str(a) for a in data.get("args") or []]
    env = dict(str(item).partition("=")[::2] for item in data.get("env") or [] if "=" in str(item))
    results = StreamedResults(path, count, _json_rows)
    complete = whole and "end_time" in data and "out_of_bounds" in data
    oob = _dict(data.get("out_of_bounds")).get("count")
    avg = _dict(data.get("average_bus_bandwidth")).get("bandwidth")
    version = data.get("nccl_version")
    parsed = _json_config(path, config)
    options = parse_nccl_tests_args(args)   # the config has -z only as true/false and no -u
    if "z" in options:
        parsed.blocking = strtol(options["z"])
    if "u" in options:
        parsed.unalign = strtol(options["u"])
    return NcclTestsOutput(
        path=path, format="json", config=parsed,
        ranks=[_json_rank(d) for d in config.get("devices") or []], results=results, complete=complete,
        program=Path(args[0]).name if args else None,
        nccl_library=int(version) if isinstance(version, int) else None,
        json_version=data.get("version") if isinstance(data.get("version"), int) else None,
        args=args, env=env, start_time=data.get("start_time"), end_time=data.get("end_time"),
        out_of_bounds=oob if isinstance(oob, int) else None, avg_busbw_gbps=_json_float(avg),
        errors=[str(e) for e in data.get("errors") or [] if str(e).strip()],
        bad_time=first_bad,
        ends_at=None if complete else (f"results[{count}]" if not whole else "before its footer"))


# ---------------------------------------------------------------- helpers for the importer

def nccl_version_text(code: int | None) -> str | None:
    """NCCL_VERSION_CODE as a version: 22809 -> '2.28.9' (X*10000+Y*100+Z since 2.9; X*1000+Y*100+Z before)."""
    if not code:
        return None
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


# JSON_FILE_VERSION (src/util.cu) by nccl-tests release: -J first appears in 2.17.3.
JSON_RELEASES = {1: "2.17.3-2.19.1", 2: "2.19.2-2.19.5", 3: "2.19.6"}


def printed_tolerance(value: float, width: int = 7) -> float:
    """Half a unit of the last digit nccl-tests prints for value in a field this wide (getFloatStr:
    2 decimals, then 1, then 0, then one decimal of an exponent)."""
    magnitude = abs(value)
    for decimals in (2, 1, 0):
        digits = width - 1 - decimals if decimals else width   # integer digits that still fit
        if magnitude < 10 ** digits - 0.5 * 10 ** -decimals:
            return 0.5 * 10 ** -decimals + 1e-9
    exponent = len(f"{magnitude:.0f}") - 1
    return 0.05 * 10 ** exponent + 1e-9
