"""`commbench import-nccl-tests FILE... --out DIR`: nccl-tests' all_reduce_perf output as a results dir.

One row per (size, dtype, reduction, placement) and run: backend `nccl-tests:out-of-place` or
`nccl-tests:in-place`, mode `graph` for `-G` runs (ops_per_graph = -n x -m calls per graph,
iterations = -G replays) and `eager` otherwise. nccl-tests times the loop with one host timer per
thread and combines the threads' and processes' times by its `-a` mode; only the maximum (`-a 3`)
is commbench's headline, so:

- `-a 3` (max), or a run with one timer (one thread of one process drives every GPU and waits for
  all of them, so there is nothing to combine): `latency_us`, algbw and busbw as nccl-tests gave them;
- `-a 1` (mean, nccl-tests' default): `latency_rank_mean_us`; latency_us stays empty;
- `-a 0` (rank 0) and `-a 2` (min): only in `extra`;
- `-C 1` (host enqueue time): only in `extra`.

The value nccl-tests printed is always in `extra.nccl_tests_time_us`, with what it is in
`extra.nccl_tests_time_is`. `#wrong` N/A (validation off, `-c 0`) is `wrong_elements` None,
`checked_calls` 0 and a reason that says so; nccl-tests checks one separate call after the timed
loop (`-c` times), never the timed calls, and `extra.check` says that.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from commbench.analysis import render
from commbench.analysis.nccl_tests_format import (JSON_RELEASES, PLACEMENTS, SOURCE, NcclTestsOutput, PerIteration,
                                                  Placement, RankLine, ResultRow, nccl_version_text, printed_tolerance,
                                                  read_output, strtol)
from commbench.errors import UsageError
from commbench.files import staged_folder
from commbench.ops import ALLREDUCE
from commbench.results import (ENV_PREFIXES, NO_WORK, OK, ROWS_FILE, RUN_FILE, WRONG, Lines, Measurement, RunDir,
                               RunInfo, csv_line, json_line, percentile, write_whole)
from commbench.results.templates import Templates
from commbench.units import format_bytes


BACKENDS = {"out_of_place": "nccl-tests:out-of-place", "in_place": "nccl-tests:in-place"}
AVERAGE_MODES = {0: "rank 0's time", 1: "the mean over ranks", 2: "the minimum over ranks",
                 3: "the maximum over ranks"}
DTYPES = {"bfloat16": "bf16", "half": "fp16", "float": "fp32"}   # other nccl-tests types keep their names
EXTRA_ENV = ("LD_LIBRARY_PATH", "LD_PRELOAD")


@dataclass
class Source:
    """One file to import, with how its ranks' times were combined."""

    output: NcclTestsOutput
    sha256: str
    average: int | None          # None: a text output with one timer, where -a changes nothing
    average_from: str
    same_run: list[Path] = field(default_factory=list)   # text files of the same run, read for checking
    same_run_sha256: list[str] = field(default_factory=list)
    gpu_ranks: list[RankLine] = field(default_factory=list)  # the fullest device list (a text lists every rank)

    def __post_init__(self) -> None:
        self.gpu_ranks = self.gpu_ranks or list(self.output.ranks)

    @property
    def path(self) -> Path:
        return self.output.path


# ---------------------------------------------------------------- arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="all_reduce_perf stdout (the table) or its -J JSON file; several runs go into one dir")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="the results dir to write (created; a dir of earlier nccl-tests imports is appended to)")
    parser.add_argument("--average", type=int, choices=(0, 1, 2, 3), metavar="N",
                        help="the -a the text outputs ran with (0 rank 0, 1 mean = nccl-tests' default, 2 min, "
                             "3 max): the table does not print it; a JSON file's args do")
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                        help="a process-level variable this run was made under (like sweep --env), e.g. "
                             "NCCL_PROTO=LL; tags every row; checked against a JSON file's environment")
    parser.add_argument("--expect-world-size", type=int, metavar="N",
                        help="refuse a run of another world size (catches an all_reduce_perf built without MPI "
                             "that mpirun started as N separate one-GPU jobs)")
    parser.add_argument("--partial", action="store_true",
                        help="import the complete rows of an output that ends early (a run cut short)")
    parser.add_argument("--snapshot", type=Path, metavar="PROBE.json",
                        help="a `commbench probe --json FILE` of the box nccl-tests ran on: recorded as the run's "
                             "box, so recommend, floor and engines read its gates as for a sweep (its GPUs must be "
                             "the log's, by PCI bus id and name)")


def parse_settings(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not name.strip().replace("_", "").isalnum():
            raise UsageError(f"malformed --setting {item!r}: expected NAME=VALUE, e.g. NCCL_PROTO=LL")
        out[name.strip()] = value
    return out


# ---------------------------------------------------------------- reading and pairing the sources

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:   # in pieces: a large log is never held whole
        for piece in iter(lambda: handle.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def _json_average(out: NcclTestsOutput, given: int | None) -> tuple[int, str]:
    options = out.options()
    if "a" in options:
        value, origin = strtol(options["a"]), "-a in the JSON's args"
    else:
        value, origin = 1, "nccl-tests' default (no -a in the JSON's args)"
    if given is not None and given != value:
        raise UsageError(f"{out.path}: ran with -a {value} ({origin}), not --average {given}")
    return value, origin


def _same_run(text: NcclTestsOutput, js: NcclTestsOutput) -> bool:
    """The text and the JSON of one run: the JSON's devices among the text's ranks, the same
    settings, and every time equal to what the text printed."""
    text_ranks = {(r.rank, r.pid, r.host, r.device) for r in text.ranks}
    if not js.ranks or any((r.rank, r.pid, r.host, r.device) not in text_ranks for r in js.ranks):
        return False
    same_shape = (text.config.iters, text.config.graph_launches, text.config.nthreads, text.config.ngpus) == \
                 (js.config.iters, js.config.graph_launches, js.config.nthreads, js.config.ngpus)
    sizes = [(r.size_bytes, r.type_name, r.redop) for r in text.results]
    if not same_shape or sizes != [(r.size_bytes, r.type_name, r.redop) for r in js.results[:len(sizes)]]:
        return False
    for t_row, j_row in zip(text.results, js.results):
        for name, t in t_row.placements.items():
            j = j_row.placements.get(name)
            if j is None or t.time_us is None or j.time_us is None:
                continue
            if abs(t.time_us - j.time_us) > printed_tolerance(j.time_us):
                raise UsageError(f"{text.path} and {js.path} list the same ranks and pids but different times "
                                 f"({t_row.where}: {t.time_us} vs {j.time_us} us); import them one at a time")
    return True


def read_sources(paths: list[Path], average: int | None, partial: bool) -> list[Source]:
    """Every file parsed; a text output that is the same run as a JSON file given with it is
    read for checking and its numbers taken from the JSON (six decimals instead of two)."""
    outputs = [read_output(p, partial=partial) for p in paths]
    jsons = [o for o in outputs if o.format == "json"]
    sources: list[Source] = []
    by_json: dict[int, Source] = {}
    for out in jsons:
        value, origin = _json_average(out, average)
        by_json[id(out)] = Source(out, _sha256(out.path), value, origin)
        sources.append(by_json[id(out)])
    for out in outputs:
        if out.format != "text":
            continue
        twin = next((j for j in jsons if _same_run(out, j)), None)
        if twin is not None:
            source = by_json[id(twin)]
            source.same_run.append(out.path)
            source.same_run_sha256.append(_sha256(out.path))
            if len(out.ranks) > len(source.gpu_ranks):
                source.gpu_ranks = list(out.ranks)   # the text lists every rank, the JSON one per process
            continue
        if average is None and out.timers == 1:
            sources.append(Source(out, _sha256(out.path), None, "not printed in the text; one timer, so -a "
                                  "has nothing to combine"))
            continue
        if average is None:
            companion = f" or give its JSON ({out.json_companion}) with it" if out.json_companion else ""
            raise UsageError(f"{out.path}: the text table does not say how nccl-tests combined the ranks' times; "
                             f"pass --average N (the -a it ran with; 1 if none was given){companion}")
        sources.append(Source(out, _sha256(out.path), average, "--average"))
    return sources


def check_settings(source: Source, settings: dict[str, str]) -> None:
    env = source.output.env
    if env is None:
        return
    for name, value in settings.items():
        if name not in env:
            raise UsageError(f"{source.path}: --setting {name}={value}, but the run's environment has no {name}")
        if env[name] != value:
            raise UsageError(f"{source.path}: --setting {name}={value}, but the run's environment has "
                             f"{name}={env[name]}")


# ---------------------------------------------------------------- rows

def _timers_text(out: NcclTestsOutput) -> str:
    return f"{out.timers} host timer(s) ({out.processes} process(es) x {out.config.nthreads} thread(s))"


def time_meaning(out: NcclTestsOutput, average: int | None) -> tuple[str, str | None]:
    """What nccl-tests' time column is for this run, and which row field holds it (None: extra only)."""
    world = out.world_size()
    if out.timers == 1:
        told = "" if average is None else f" (-a {average})"
        return (f"one host timer around the loop: one thread drove all {world} GPU(s) and waited for every "
                f"one, so it is the slowest rank's time whatever -a says{told}"), "latency_us"
    if average == 3:
        return f"the maximum over {_timers_text(out)} of the loop time / calls (-a 3)", "latency_us"
    if average == 1:
        return f"the mean over {_timers_text(out)} of the loop time / calls (-a 1)", "latency_rank_mean_us"
    if average in AVERAGE_MODES:
        return f"{AVERAGE_MODES[average]} of {_timers_text(out)} (-a {average})", None
    return f"combined by -a {average}, which nccl-tests does not define", None


def _time_fields(p: Placement, meaning: str, target: str | None,
                 average: int | None) -> tuple[dict[str, Any], list[str]]:
    extra: dict[str, Any] = {"nccl_tests_time_us": p.time_us, "nccl_tests_algbw_gbps": p.algbw_gbps,
                             "nccl_tests_busbw_gbps": p.busbw_gbps}
    if p.cputime:
        extra["nccl_tests_time_is"] = "host time to enqueue the calls, without waiting for them (-C 1)"
        return {"extra": extra}, ["nccl-tests -C 1: its time is the host's enqueue time, not a latency (in extra)"]
    extra["nccl_tests_time_is"] = meaning
    if target == "latency_us":
        return {"latency_us": p.time_us, "algbw_gbps": p.algbw_gbps, "busbw_gbps": p.busbw_gbps,
                "extra": extra}, []
    if target == "latency_rank_mean_us":
        return {"latency_rank_mean_us": p.time_us, "extra": extra}, [
            "nccl-tests -a 1: its time is the mean over ranks (latency_rank_mean_us); the slowest rank "
            "(commbench's headline, -a 3) was not recorded"]
    what = AVERAGE_MODES.get(average, "combined in a way nccl-tests does not define") if average is not None else "?"
    return {"extra": extra}, [f"nccl-tests -a {average}: its time is {what}, not the slowest rank's; "
                              "kept in extra only"]


def _check_fields(p: Placement, out: NcclTestsOutput) -> tuple[dict[str, Any], list[str]]:
    if p.wrong is None or out.config.validation <= 0:
        return ({"wrong_elements": None, "checked_calls": 0,
                 "extra": {"check": "none: validation did not run (-c 0), nccl-tests printed #wrong N/A"}},
                ["not validated: nccl-tests ran with -c 0 (#wrong N/A)"])
    checks = out.config.validation
    graph = " (each captured in a graph of its own)" if out.config.graph_launches > 0 else ""
    scope = (f"nccl-tests: {checks} separate call(s) after the timed loop{graph}, each with fresh inputs, "
             "checked on every rank; the timed calls themselves were not checked")
    # nccl-tests stops at the first check with wrong elements and does not say which one that was
    known = p.wrong == 0 or checks == 1
    return {"wrong_elements": p.wrong, "checked_calls": checks if known else 0, "extra": {"check": scope}}, []


def _jitter_fields(per: PerIteration | None, iters: int, skip: int) -> dict[str, Any]:
    """-I 1: one CUDA-event sample per iteration, max over ranks per iteration (as commbench's jitter pass)."""
    if per is None:
        return {}
    extra: dict[str, Any] = {"nccl_tests_per_iteration": {
        "min_us": per.min_us, "max_us": per.max_us, "p99_nearest_rank_us": per.p99_us, "cv_pct": per.cv_pct,
        "skipped": per.skipped or skip, **per.summary}}
    samples = sorted(per.times_us[per.skipped:]) if per.times_us else []
    if samples:
        return {"jitter_samples": len(samples), "jitter_p10_us": percentile(samples, 10),
                "jitter_p50_us": percentile(samples, 50), "jitter_p90_us": percentile(samples, 90),
                "jitter_p99_us": percentile(samples, 99), "jitter_min_us": samples[0], "jitter_max_us": samples[-1],
                "extra": extra}
    return {"jitter_samples": max(0, iters - skip), "jitter_min_us": per.min_us, "jitter_max_us": per.max_us,
            "extra": extra}


def run_flags(source: Source) -> dict[str, Any]:
    """The settings nccl-tests ran with, by its flag names (header / JSON config, then JSON args)."""
    c = source.output.config
    flags: dict[str, Any] = {"-t": c.nthreads, "-g": c.ngpus, "-b": c.min_bytes, "-e": c.max_bytes,
                             "-f" if c.step_factor is not None else "-i": c.step_factor or c.step_bytes,
                             "-w": c.warmup_iters, "-n": c.iters, "-m": c.agg_iters, "-c": c.validation,
                             "-G": c.graph_launches, "-I": int(c.per_iter_timing)}
    if source.average is not None:
        flags["-a"] = source.average
    if c.blocking is not None:
        flags["-z"] = c.blocking
    if c.unalign is not None:
        flags["-u"] = c.unalign
    if c.per_iter_skip:
        flags["-K"] = c.per_iter_skip
    for letter in "RxDVyCSNTM":
        value = source.output.options().get(letter)
        if value is not None:
            flags[f"-{letter}"] = strtol(value)
    return flags


def caveats(source: Source) -> list[str]:
    """Settings that change what a per-call time means."""
    c = source.output.config
    out = []
    if c.agg_iters > 1:
        out.append(f"-m {c.agg_iters}: that many calls were grouped in one ncclGroupStart/End per iteration, "
                   "so the time per call is not one call's latency")
    if c.blocking is None or c.blocking > 0:
        out.append(f"-z {c.blocking if c.blocking is not None else '>0'}: each call waited for completion")
    if c.unalign:
        out.append(f"-u {c.unalign}: buffers misaligned by {c.unalign} element(s)")
    return out


@dataclass
class RowContext:
    """What every row of one source shares."""

    source: Source
    settings: dict[str, str]
    meaning: str
    target: str | None
    flags: dict[str, Any]
    notes: list[str]


def _base_row(ctx: RowContext, result: ResultRow, name: str) -> Measurement:
    out = ctx.source.output
    c = out.config
    graph = c.graph_launches > 0
    env = out.env or {}
    row = Measurement(
        backend=BACKENDS[name], mode="graph" if graph else "eager", dtype=DTYPES.get(result.type_name, result.type_name),
        message_bytes=result.size_bytes, world_size=out.world_size(), status=OK, count=result.count,
        nodes=len(out.hosts()) or 1, op=ALLREDUCE if result.redop == "sum" else f"{ALLREDUCE}_{result.redop}",
        iterations=c.graph_launches if graph else c.iters * c.agg_iters,
        ops_per_graph=c.iters * c.agg_iters if graph else 1,
        env_setting=dict(ctx.settings), timestamp=time.time(),
        requested={var: value for var in ("NCCL_PROTO", "NCCL_ALGO")
                   if (value := env.get(var, ctx.settings.get(var)))})
    row.extra.update({"source": f"{SOURCE} {out.program or 'all_reduce_perf'} ({out.format})",
                      "source_file": out.path.name, "source_sha256": ctx.source.sha256, "source_row": result.where,
                      "nccl_tests_type": result.type_name, "nccl_tests_flags": ctx.flags})
    if out.nccl_library:
        # As commbench's own NCCL rows record it: imports of two NCCL versions are two curves.
        row.extra["nccl_version_loaded"] = nccl_version_text(out.nccl_library)
    if result.cycle:
        row.extra["nccl_tests_cycle"] = result.cycle
    if result.timestamp:
        row.extra["nccl_tests_timestamp"] = result.timestamp
    return row


def check_results(source: Source) -> None:
    """Bad input when a result holds a value no reader of a run dir takes (a time that is nan,
    inf or negative, a size of 10^30 bytes, a type that is no plain name, a count that does not
    fit its size): it would be imported and then skipped by every reader (a time became an ok
    row before). Said before any row is written: the first pass found it (bad_time). Lines of
    the table that start like a row but are none are named, with their count."""
    out = source.output
    if out.bad_time is not None:
        where, why = out.bad_time
        raise UsageError(f"{out.path}: {where}: {why}; not importable")
    if out.dropped_count:
        named = [f"line {number} ({line!r})" for number, line in out.dropped]
        more = [f"{out.dropped_count - len(named)} more"] if out.dropped_count > len(named) else []
        print(render.prose(f"commbench import-nccl-tests: warning: {out.path}: dropped {out.dropped_count} line(s) of "
                           "the results table that are no result row (a negative size or count?): "
                           + "; ".join(named + more), indent="  ", first=""), file=sys.stderr)


def _row(ctx: RowContext, result: ResultRow, name: str, p: Placement) -> Measurement:
    row = _base_row(ctx, result, name)
    c = ctx.source.output.config
    notes: list[str] = []
    for fields, more in (_time_fields(p, ctx.meaning, ctx.target, ctx.source.average),
                         _check_fields(p, ctx.source.output),
                         (_jitter_fields(p.per_iteration, c.iters, c.per_iter_skip), [])):
        row.extra.update(fields.pop("extra", {}))
        for key, value in fields.items():
            setattr(row, key, value)
        notes += more
    if (row.wrong_elements or 0) > 0:
        row.status = WRONG
        notes.insert(0, f"nccl-tests found {row.wrong_elements} wrong element(s)")
    elif row.world_size == 1:
        row.status = NO_WORK
        notes.insert(0, "world size 1: nothing is communicated; the time is the local call alone "
                        "(in place, a no-op)")
    row.reason = "; ".join(notes + ctx.notes) or None
    return row


def iter_rows(source: Source, settings: dict[str, str]) -> Iterator[Measurement]:
    """The rows of one file, one at a time (a large log is never held as rows)."""
    ctx = _context(source, settings)
    return (_row(ctx, result, name, result.placements[name])
            for result in source.output.results for name in PLACEMENTS if name in result.placements)


def _context(source: Source, settings: dict[str, str]) -> RowContext:
    meaning, target = time_meaning(source.output, source.average)
    return RowContext(source, settings, meaning, target, run_flags(source), caveats(source))


def _values(result: ResultRow, p: Placement) -> tuple[Any, ...]:
    """What changes from one row of a log to the next: the slots of its rows' template."""
    return (result.size_bytes, result.count, p.time_us, p.algbw_gbps, p.busbw_gbps, result.where, result.cycle,
            result.timestamp, time.time())


def _row_of(ctx: RowContext, result: ResultRow, name: str, p: Placement, values: Sequence[Any]) -> Measurement:
    """The row of `result` with _values() replaced by `values` (a template's sentinels, or its own)."""
    size, count, time_us, algbw, busbw, where, cycle, stamp, now = values
    row = _row(ctx, replace(result, size_bytes=size, count=count, where=where, cycle=cycle, timestamp=stamp), name,
               replace(p, time_us=time_us, algbw_gbps=algbw, busbw_gbps=busbw))
    row.timestamp = now
    return row


@dataclass
class Encoded:
    """A row as written (its lines) and what the summary counts of it."""

    lines: Lines
    backend: str
    dtype: str
    mode: str
    message_bytes: int


def iter_encoded(source: Source, settings: dict[str, str]) -> Iterator[Encoded]:
    """The rows of iter_rows, encoded: a row of -I 1 (per-iteration times) in full, every other
    from its shape's template (commbench.results.templates): the same lines, ~10x faster."""
    ctx = _context(source, settings)
    templates = Templates()
    mode = "graph" if source.output.config.graph_launches > 0 else "eager"
    for result in source.output.results:
        dtype = DTYPES.get(result.type_name, result.type_name)
        for name in PLACEMENTS:
            p = result.placements.get(name)
            if p is None:
                continue
            if p.per_iteration is not None:
                row = _row(ctx, result, name, p)
                yield Encoded(Lines(json_line(row), csv_line(row)), row.backend, row.dtype, row.mode, row.message_bytes)
                continue
            shape = (name, result.type_name, result.redop, result.root, p.wrong, p.cputime)
            lines = templates.lines(shape, _values(result, p),
                                    lambda values: _row_of(ctx, result, name, p, values))  # noqa: B023 (called now)
            yield Encoded(lines, BACKENDS[name], dtype, mode, result.size_bytes)


def rows_for(source: Source, settings: dict[str, str]) -> list[Measurement]:
    return list(iter_rows(source, settings))


@dataclass
class Written:
    """What was written of one file's rows: enough for run.json and the summary line."""

    rows: int = 0
    sizes: set[int] = field(default_factory=set)
    dtypes: set[str] = field(default_factory=set)
    modes: set[str] = field(default_factory=set)
    backends: set[str] = field(default_factory=set)

    def add(self, row: Measurement | Encoded) -> None:
        self.rows += 1
        self.sizes.add(row.message_bytes)
        self.dtypes.add(row.dtype)
        self.modes.add(row.mode)
        self.backends.add(row.backend)

    def merge(self, other: "Written") -> None:
        self.rows += other.rows
        for mine, theirs in ((self.sizes, other.sizes), (self.dtypes, other.dtypes), (self.modes, other.modes),
                             (self.backends, other.backends)):
            mine |= theirs


# ---------------------------------------------------------------- run.json

def _gpus(ranks: list[RankLine]) -> list[dict[str, Any]]:
    return [{"rank": r.rank, "host": r.host, "device": r.device, "name": r.name, "pci_bus_id": r.pci_bus_id,
             "group": r.group, "pid": r.pid} for r in ranks]


def _relevant_env(env: dict[str, str] | None) -> dict[str, str]:
    return {k: v for k, v in (env or {}).items() if k.startswith(ENV_PREFIXES) or k in EXTRA_ENV}


def _versions(out: NcclTestsOutput) -> dict[str, str]:
    versions = {"nccl": nccl_version_text(out.nccl_library), "nccl_headers": nccl_version_text(out.nccl_headers),
                "nccl_tests": out.nccl_tests_version
                or (f"{JSON_RELEASES[out.json_version]} (JSON version {out.json_version})"
                    if out.json_version in JSON_RELEASES else None)}
    return {k: v for k, v in versions.items() if v}


def import_record(source: Source, rows: Written, settings: dict[str, str]) -> dict[str, Any]:
    out = source.output
    meaning, target = time_meaning(out, source.average)
    return {"file": str(out.path), "sha256": source.sha256, "format": out.format, "program": out.program,
            "same_run_as": [str(p) for p in source.same_run], "same_run_sha256": source.same_run_sha256,
            "versions": _versions(out),
            "json_version": out.json_version, "args": out.args, "flags": run_flags(source),
            "average": source.average, "average_from": source.average_from, "time_is": meaning,
            "time_field": target or "extra.nccl_tests_time_us", "world_size": out.world_size(),
            "hosts": out.hosts(), "rows": rows.rows, "complete": out.complete, "ends_at": out.ends_at,
            "start_time": out.start_time, "end_time": out.end_time, "out_of_bounds": out.out_of_bounds,
            "avg_busbw_gbps": out.avg_busbw_gbps, "errors": out.errors, "notes": out.notes,
            "env_setting": settings, "command": sys.argv, "imported": time.time()}


BOX_NOTE = "box: "
NOTES = [
    "imported from nccl-tests all_reduce_perf output, not measured by commbench: its time is one host "
    "timer per thread around -n x -m back-to-back calls (with -G: around -G replays of a graph of them), "
    "divided by the calls, and combined over threads and processes by -a; only -a 3 (max) or a single timer "
    "is commbench's headline latency_us (see each import's time_is)",
    "nccl-tests checks separate calls after the timed loop (-c), not the timed calls; #wrong N/A "
    "(-c 0) rows have wrong_elements null",
]


def run_info(existing: RunInfo | None, sources: list[Source], records: list[dict[str, Any]],
             all_rows: Written) -> RunInfo:
    first = sources[0].output
    info = replace(existing, finished=None) if existing else RunInfo(
        source=SOURCE, command=sys.argv, host=first.ranks[0].host if first.ranks else None,
        gpus=_gpus(sources[0].gpu_ranks), world_size=first.world_size(), nodes=len(first.hosts()) or 1,
        versions=_versions(first), env=_relevant_env(first.env), notes=list(NOTES), imports=[],
        started=first.start_time)
    info.imports = [*(info.imports or []), *records]
    fullest = max(sources, key=lambda s: len(s.gpu_ranks))
    if len(info.gpus or []) < len(fullest.gpu_ranks):
        info.gpus = _gpus(fullest.gpu_ranks)
    nccl = {r["versions"].get("nccl") for r in info.imports}
    if len(nccl) > 1:
        note = f"the imports ran different NCCL versions ({', '.join(sorted(map(str, nccl)))}): see imports[]"
        info.notes = [n for n in info.notes or [] if not n.startswith("the imports ran different NCCL")] + [note]
    info.backends = sorted(set(info.backends or []) | all_rows.backends)
    plan = info.plan or {}
    info.plan = {"message_bytes": sorted(set(plan.get("message_bytes") or []) | all_rows.sizes),
                 "dtypes": sorted(set(plan.get("dtypes") or []) | all_rows.dtypes),
                 "modes": sorted(set(plan.get("modes") or []) | all_rows.modes)}
    settings = list(info.env_settings or [])
    for record in records:
        if record["env_setting"] and record["env_setting"] not in settings:
            settings.append(record["env_setting"])
    info.env_settings = settings
    return info


# ---------------------------------------------------------------- the box

def _bus_id(text: str) -> str:
    """'0000:18:00' (nccl-tests) and '00000000:18:00.0' (NVML) -> '18:00': bus and device."""
    parts = text.lower().split(".")[0].split(":")
    return ":".join(parts[-2:]) if len(parts) >= 2 else text.lower()


def box_snapshot(path: Path, sources: list[Source]) -> tuple[dict[str, Any], str]:
    """The probe snapshot of the box the runs were made on, and a line saying how it matched:
    every rank's GPU of every run must be one of the snapshot's, by PCI bus id and name (by device
    index and name where the log prints no bus id); the host names may differ (a container's)."""
    from commbench.topology.snapshot_file import load_snapshot

    snapshot = load_snapshot(str(path))
    gpus = [g for g in snapshot.get("gpus") or [] if isinstance(g, dict)]
    by_bus = {_bus_id(str(g.get("pci_bus_id") or "")): g for g in gpus}
    by_index = {g.get("index"): g for g in gpus}
    for source in sources:
        for rank in source.gpu_ranks:
            gpu = by_bus.get(_bus_id(rank.pci_bus_id)) if rank.pci_bus_id else by_index.get(rank.device)
            if gpu is None or gpu.get("name") != rank.name:
                where = f"[{rank.pci_bus_id}]" if rank.pci_bus_id else f"device {rank.device}"
                names = [str(g.get("name")) for g in gpus]
                have = ", ".join(f"{names.count(n)}x {n}" for n in sorted(set(names))) or "no GPUs"
                raise UsageError(f"--snapshot {path}: rank {rank.rank}'s GPU {where} {rank.name} in {source.path} is "
                                 f"not in it (it has {have}): take the probe on the box nccl-tests ran on")
    log_hosts = sorted({h for s in sources for h in s.output.hosts()})
    probe_hosts = sorted(str(h) for h in (snapshot.get("hosts") or {}))
    hosts = ("" if not log_hosts or not probe_hosts or log_hosts == probe_hosts
             else f"; host names differ (the log: {', '.join(log_hosts)}; the probe: {', '.join(probe_hosts)})")
    return snapshot, (f"the box from the probe snapshot {path} (sha256 {_sha256(path)[:12]}), its GPUs the log's "
                      f"by PCI bus id and name{hosts}")


# ---------------------------------------------------------------- the results dir

def existing_info(out: Path, world: int) -> RunInfo | None:
    """The run.json of earlier imports into out, or None for a new dir; anything else is refused."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory")
    if (out / RUN_FILE).exists():
        info = RunDir(out).info()
        if info.source != SOURCE:
            raise UsageError(f"{out}: holds a commbench sweep; import nccl-tests output into a dir of its own")
        if info.world_size != world:
            raise UsageError(f"{out}: holds nccl-tests rows of world size {info.world_size}, "
                             f"these are world size {world}; import them into another dir")
        return info
    if (out / ROWS_FILE).exists():
        raise UsageError(f"{out}: has {ROWS_FILE} but no {RUN_FILE}; not a results dir this can add to")
    return None


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".commbench-write-test"
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{out}: cannot write there ({exc.strerror})") from None


def _world_size(sources: list[Source], expected: int | None) -> int:
    worlds = {s.path: s.output.world_size() for s in sources}
    for path, world in worlds.items():
        if expected is not None and world != expected:
            hint = (" (an all_reduce_perf built without MPI=1 under mpirun runs that many one-GPU jobs)"
                    if world == 1 else "")
            raise UsageError(f"{path}: world size {world}, not the expected {expected}{hint}")
    if len(set(worlds.values())) > 1:
        listed = ", ".join(f"{p.name}: {w}" for p, w in worlds.items())
        raise UsageError(f"these runs have different world sizes ({listed}); a results dir holds one, "
                         "import each world size into a dir of its own")
    return next(iter(worlds.values()))


def describe(source: Source, rows: Written) -> str:
    out = source.output
    c = out.config
    meaning, target = time_meaning(out, source.average)
    how = f"graph, {c.iters * c.agg_iters} calls x {c.graph_launches} replays" if c.graph_launches > 0 else \
        f"eager, {c.iters * c.agg_iters} calls"
    versions = _versions(out)
    twin = f" (checked against {', '.join(p.name for p in source.same_run)})" if source.same_run else ""
    sizes = sorted(rows.sizes)
    return (f"{out.path}{twin}: {rows.rows} rows, {format_bytes(sizes[0])}-{format_bytes(sizes[-1])}, "
            f"world size {out.world_size()} on {len(out.hosts()) or 1} node(s), {how}; "
            f"nccl-tests {versions.get('nccl_tests', '?')}, NCCL {versions.get('nccl', '?')}; "
            f"time = {meaning} -> {target or 'extra only'}"
            + ("" if out.complete else f"; PARTIAL: the output ends at {out.ends_at}"))


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    settings = parse_settings(args.setting)
    sources = read_sources([Path(f) for f in args.files], args.average, args.partial)
    for source in sources:
        check_settings(source, settings)
    world = _world_size(sources, args.expect_world_size)
    box = box_snapshot(args.snapshot, sources) if args.snapshot is not None else None
    existing = existing_info(args.out, world)
    if existing is not None:
        repair_partial(RunDir(args.out), existing, {s.sha256 for s in sources})
    records_before = (existing.imports if existing else None) or []
    done = {record.get("sha256") for record in records_before} | {
        sha for record in records_before for sha in record.get("same_run_sha256") or []}
    fresh: list[Source] = []
    for source in sources:
        if source.sha256 in done:
            print(render.prose(f"{source.path}: already imported into {args.out} (same content), skipped"))
        else:
            fresh.append(source)
            done |= {source.sha256, *source.same_run_sha256}
    sources = fresh
    if not sources:
        if box is not None and existing is not None:   # the runs are in already: record the box alone
            RunDir(args.out).write_info(_with_box(existing, box))
            print(render.prose(f"{BOX_NOTE}{box[1]}", indent="  ", first="") + f"\nwrote {args.out / RUN_FILE}")
        return 0
    for source in sources:
        if not any(name in result.placements for result in source.output.results for name in PLACEMENTS):
            raise UsageError(f"{source.path}: no out-of-place or in-place results in it")
        check_results(source)
    # A new dir is built beside its name and moved there at the end: an import that fails leaves
    # nothing behind. Into an earlier import's dir the rows are appended in place, their record
    # last, and the next import of a file cut short repairs it (repair_partial).
    new = existing is None and not args.out.exists()
    with staged_folder(args.out) if new else nullcontext(args.out) as where:
        _make_dir(where)
        run = RunDir(where)
        if existing is None:   # a new dir: run.json without the imports, so the rows have a home
            stub = run_info(None, sources, [], Written())
            run.write_info(replace(stub, run_id=args.out.resolve().name))
        # Rows first, streamed, the import recorded last: a write cut short leaves rows no record
        # claims, which the next import of the same file replaces (repair_partial).
        written = [(source, Written()) for source in sources]
        run.append_all(_counted_rows(written, settings), with_csv=True)
        total = Written()
        for _, summary in written:
            total.merge(summary)
        records = [import_record(source, summary, settings) for source, summary in written]
        info = run_info(existing, sources, records, total)
        info.run_id = info.run_id or args.out.resolve().name
        if box is not None:
            info = _with_box(info, box)
        if all(s.output.complete for s in sources) and not existing_partial(info):
            info.finished = time.time()
        run.write_info(info)
    for source, summary in written:
        print(render.prose(describe(source, summary), indent="  ", first=""))
    if box is not None:
        print(render.prose(f"{BOX_NOTE}{box[1]}", indent="  ", first=""))
    print(render.prose(f"wrote {args.out / ROWS_FILE} ({total.rows} rows) and {args.out / RUN_FILE}"))
    return 0


def _with_box(info: RunInfo, box: tuple[dict[str, Any], str]) -> RunInfo:
    """run.json holding the probe snapshot where a sweep keeps its own, and a note of where it came from."""
    notes = [n for n in info.notes or [] if not n.startswith(BOX_NOTE)] + [f"{BOX_NOTE}{box[1]}"]
    return replace(info, snapshot=box[0], notes=notes)


def _counted_rows(written: list[tuple[Source, Written]], settings: dict[str, str]) -> Iterator[Lines]:
    """Every source's rows in turn, encoded, each counted in its summary once the writer asks for the next."""
    for source, summary in written:
        for row in iter_encoded(source, settings):
            yield row.lines
            summary.add(row)


def repair_partial(run: RunDir, info: RunInfo, given: set[str]) -> None:
    """Rows of an import that never recorded itself (the disk filled up, the process died):
    dropped when that file is being imported again, else the dir is refused."""
    recorded = {record.get("sha256") for record in info.imports or []}
    orphans = [row for row in run.rows() if row.extra.get("source_sha256") not in recorded]
    if not orphans:
        return
    missing = {row.extra.get("source_sha256") for row in orphans} - given
    if missing:
        raise UsageError(f"{run.path}: holds {len(orphans)} row(s) of an import that did not finish "
                         f"(source {orphans[0].extra.get('source_file')}); import that file into it again to "
                         "complete it, or import into a new dir")
    kept = [row for row in run.rows() if row.extra.get("source_sha256") in recorded]
    write_whole(run.path / ROWS_FILE, (json_line(r) for r in kept))
    print(render.prose(f"{run.path}: removed {len(orphans)} row(s) of an import that did not finish; importing it "
                       "again"))


def existing_partial(info: RunInfo) -> bool:
    return any(not record.get("complete", True) for record in info.imports or [])
