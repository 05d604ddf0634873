"""`commbench fleet build|qualify|query`: many runs as one dataset, per-node verdicts.

    commbench fleet build RUNS_DIR... --out FLEET      read run dirs (and Inspector JSONL) into FLEET
    commbench fleet qualify FLEET [--spec SPEC]        PASS / WARN / FAIL per node, with reasons
    commbench fleet query FLEET "SQL"                  DuckDB over the views runs, measurements, pairs

`commbench report FLEET` writes the fleet's HTML page; `table`, `compare` and `report` read one
run of a fleet as FLEET#NODE (or FLEET#NODE/JOB, FLEET#RUN_ID).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from commbench.analysis import qualify as single
from commbench.analysis import render
from commbench.errors import ResultsUnwritable, UsageError
from commbench.files import STDOUT, check_file_target, write_json
from commbench.fleet import exports, sources
from commbench.fleet.outliers import Rule, shown
from commbench.fleet.store import FleetDir, first_line, is_fleet, run_key
from commbench.fleet.verdicts import FAIL, PASS, WARN, FleetVerdict, NodeVerdict, judge
from commbench.results import write_whole
from commbench.results.text import clean_text
from commbench.units import format_bytes


def warn(line: str) -> None:
    # Paths and names in a warning come from folders and files anyone may have made.
    print(f"commbench fleet: warning: {clean_text(line)}", file=sys.stderr)


def open_fleet(path: str | Path) -> FleetDir:
    if not is_fleet(path):
        raise UsageError(f"{path}: not a fleet (no fleet.json); make one with commbench fleet build RUNS_DIR... "
                         f"--out {path}")
    fleet = FleetDir(path)
    fleet.check()
    return fleet


# ---------------------------------------------------------------- build

def build(paths: Sequence[str], out: Path) -> int:
    fleet = FleetDir.target(out)
    with fleet.writing():   # one build at a time: the run table is rewritten whole
        return _build(fleet, paths, out)


def _build(fleet: FleetDir, paths: Sequence[str], out: Path) -> int:
    kept = fleet.run_records()
    known = {r["run_key"]: (r["run_id"], r["path"]) for r in kept}
    again = 0

    def skip(run: sources.Loaded) -> bool:
        """A run the fleet holds (counted once), or one claiming a node and job another run holds."""
        nonlocal again
        key = run_key(run.node, run.job)
        if key not in known:
            known[key] = (run.run_id, run.path)
            return False
        run_id, path = known[key]
        if run_id != run.run_id:
            warn(f"{run.path}: run {run.run_id} claims node {run.node} job {run.job}, which run {run_id} ({path}) "
                 "holds; skipped (give each run its own COMMBENCH_JOB)")
        else:
            again += 1   # the same run again (in the fleet, or given twice): its rows are not read
        return True

    new, problems = sources.read_all(paths, skip)
    for line in problems:
        warn(line)
    for run in new:
        for line in run.warnings:
            warn(line)
    if not new and not kept:
        raise UsageError("no run could be read: nothing to build")   # and nothing written
    fleet.make()
    build_number = fleet.next_build()
    rows = fleet.append(new, build_number, kept) if new else 0
    records, problems = fleet.checked_records()
    for line in problems:
        warn(line)
    groups: dict[str, set[str]] = {}
    for record in records:
        groups.setdefault(record["fleet_group"], set()).add(record["node"])
    shown_out = clean_text(str(out))
    print(f"fleet {shown_out}: added {len(new)} run(s) ({rows} rows) as build {build_number}" if new
          else f"fleet {shown_out}: nothing new")
    if again:
        print(f"{again} run(s) already in the fleet (or given twice) were not added again")
    print(f"now {len(records)} run(s) of {len({r['node'] for r in records})} node(s) in {len(groups)} group(s):")
    for group, nodes in sorted(groups.items()):
        print(f"  {group}: {len(nodes)} node(s)")
    if len(groups) > 1:
        print("fleet qualify compares nodes within their group only (kind, ranks, GPUs, fabric), never across groups")
    return 0


# ---------------------------------------------------------------- qualify

def _rule(args: argparse.Namespace) -> Rule:
    for flag, value in (("--mad-k", args.mad_k), ("--min-effect-pct", args.min_effect_pct)):
        if not 0 <= value < math.inf:
            raise UsageError(f"{flag} must be a non-negative finite number, got {value:g}")
    if args.min_nodes < 3:
        raise UsageError(f"--min-nodes must be at least 3 (a median of two has no outlier), got {args.min_nodes}")
    return Rule(args.mad_k, args.min_effect_pct, args.min_nodes)


def print_verdict(verdict: FleetVerdict, fleet: Path, spec: single.Spec | None, wide: bool) -> None:
    runs = len(verdict.nodes)
    about = f"spec {spec.name} ({spec.path})" if spec else "no spec: workload checks and the fleet comparison only"
    print(render.prose(f"fleet {fleet}: {runs} run(s) of {len({n.run.node for n in verdict.nodes})} node(s); "
                       f"{about}", wide))
    print(render.fill(f"rule: {verdict.rule.text()}", wide))
    for group, keys in verdict.groups.items():
        print(render.fill(f"group {group}: {len(keys)} run(s)", wide))
    if len(verdict.groups) > 1:
        print(render.prose(f"note: {len(verdict.groups)} groups; each node is compared with its own group only", wide))
    several = len(verdict.groups) > 1
    headers = ["node", "job", *(["group"] if several else []), "status", "reasons", "checks"]
    rows = []
    for node in verdict.nodes:
        counts = ", ".join(f"{sum(c.status == s for c in node.checks)} {s}" for s in (PASS, WARN, FAIL))
        rows.append([node.run.node, node.run.job, *([node.run.group] if several else []), node.status,
                     ", ".join(node.reasons) or "-", counts])
    print()
    print(render.table(headers, rows, wide=wide))
    if verdict.failed:
        print()
        print("\n".join(_failures(verdict.failed, wide)))
    out = [c for c in verdict.comparisons if c.out]
    if out:
        print("\noutliers against the group:")
        for c in out:
            where = f" at {format_bytes(c.message_bytes)}" if c.message_bytes is not None else ""
            names = ", ".join(f"{f.name} {shown(f.value, c.unit)}" for f in c.out)
            print(render.prose(f"{c.what}{where}: median {shown(c.median, c.unit)} {c.unit} over {c.nodes} nodes, "
                               f"limit {shown(c.limit, c.unit)} {c.unit}; out: {names}", wide, indent="    ",
                               first="  "))
    counts = {s: sum(n.status == s for n in verdict.nodes) for s in (PASS, WARN, FAIL)}
    failed = ", ".join(n.run.node for n in verdict.failed)
    print("\n" + render.prose(f"{counts[PASS]} PASS, {counts[WARN]} WARN, {counts[FAIL]} FAIL -> "
                              + (f"FAIL: {failed}" if failed else "PASS"), wide))


def _failures(nodes: list[NodeVerdict], wide: bool) -> list[str]:
    """Each failed node's failed checks, said once for the nodes that failed alike: the nodes on
    one line, then one line per check (reason, check, why), folded to the terminal."""
    alike: dict[tuple[str, ...], list[NodeVerdict]] = {}
    for node in nodes:
        said = tuple(f"{c.reason}: {c.name}: {c.detail}" for c in node.checks if c.status == FAIL)
        alike.setdefault(said, []).append(node)
    out = []
    for said, group in alike.items():
        jobs = {n.run.job for n in group}
        who = (", ".join(n.run.node for n in group) + f" (job {group[0].run.job})" if len(jobs) == 1
               else ", ".join(f"{n.run.node} (job {n.run.job})" for n in group))
        out.append(render.fill(f"{FAIL} {who}:", wide))
        out += [render.prose(line, wide, indent="    ", first="  ") for line in said]
    return out


def _write(target: Path | None, flag: str, text: str) -> None:
    if target is None:
        return
    try:
        write_whole(target, text)   # whole or not at all: node-exporter may read it at any moment
    except ResultsUnwritable as exc:
        raise UsageError(f"{flag}: {exc}") from None
    print(f"wrote {target}")


def qualify(args: argparse.Namespace) -> int:
    for target, flag in ((args.junit, "--junit"), (args.prometheus, "--prometheus"), (args.json, "--json")):
        check_file_target(target, flag)
    rule = _rule(args)
    spec = single.load_spec(args.spec) if args.spec is not None else None
    fleet = open_fleet(args.fleet)
    runs, problems = fleet.runs()
    for line in problems:
        warn(line)
    if not runs:
        raise UsageError(f"{args.fleet}: the fleet holds no readable run")
    verdict = judge(runs, spec, rule)
    if args.json != STDOUT:
        print_verdict(verdict, Path(args.fleet), spec, args.wide)
    write_json(args.json, exports.payload(verdict, str(args.fleet), str(spec.path) if spec else None))
    _write(args.junit, "--junit", exports.junit_xml(verdict, f"commbench fleet qualify {Path(args.fleet).name}"))
    _write(args.prometheus, "--prometheus", exports.prometheus(verdict))
    return 1 if verdict.failed else 0


# ---------------------------------------------------------------- query

DEFAULT_LIMIT = 1000   # rows a query prints unless --limit says otherwise
MAX_LIMIT = 100_000   # the rows are drawn as one table: 10^6 rows took 1.2 GB and 110 s
_READING = ("SELECT", "EXPLAIN")   # DuckDB's statement types that only read


def query(args: argparse.Namespace) -> int:
    """One reading statement over the fleet's views, at most --limit rows printed: the rows past
    it are never fetched (a query of 2 x 10^7 rows took 9.2 GB when every row was)."""
    if not 1 <= args.limit <= MAX_LIMIT:
        raise UsageError(f"--limit must be from 1 to {MAX_LIMIT:,} rows, got {args.limit}")
    fleet = open_fleet(args.fleet)
    con = fleet.connect(confined=True)
    try:
        statements = con.extract_statements(args.sql)
        if not statements:
            raise UsageError("query: an empty query; give one SELECT statement over runs, measurements and pairs")
        if len(statements) > 1 or statements[0].type.name not in _READING:
            kinds = ", ".join(st.type.name for st in statements)
            raise UsageError(f"query: fleet query runs one SELECT statement and only reads the fleet (got {kinds})")
        result = con.execute(args.sql)
        names = [clean_text(str(d[0])) for d in result.description or []]
        fetched = result.fetchmany(args.limit + 1)
    except UsageError:
        raise
    except Exception as exc:   # duckdb.Error: the user's SQL, bad input
        raise UsageError(f"query: {first_line(exc)}") from None
    # Text from the fleet's files is anyone's: no escape sequence reaches the terminal.
    rows: list[list[Any]] = [["" if v is None else clean_text(str(v)) for v in row] for row in fetched[:args.limit]]
    print(render.table(names, rows, wide=args.wide))
    if len(fetched) > args.limit:
        print(f"(the first {args.limit:,} rows; more were not fetched: --limit N shows up to N, or narrow the query)")
    return 0


# ---------------------------------------------------------------- command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", metavar="build|qualify|query", parser_class=type(parser))
    b = sub.add_parser("build", help="read run dirs (and NCCL Inspector JSONL) into a fleet dataset (Parquet)")
    b.add_argument("paths", nargs="+", metavar="RUNS_DIR", help="run dirs, folders of run dirs, Inspector .jsonl files")
    b.add_argument("--out", type=Path, required=True, metavar="FLEET", help="the fleet folder (made, or added to)")
    q = sub.add_parser("qualify", help="per node: the spec, and an outlier test against the node's group")
    q.add_argument("fleet", metavar="FLEET")
    q.add_argument("--spec", type=Path, help="machine-class spec (TOML), e.g. commbench/specs/pcie-8x.toml")
    q.add_argument("--mad-k", type=float, default=Rule.k, help=f"outlier: MADs from the median (default {Rule.k:g})")
    q.add_argument("--min-effect-pct", type=float, default=Rule.min_effect_pct,
                   help=f"outlier: and at least this %% worse than the median (default {Rule.min_effect_pct:g})")
    q.add_argument("--min-nodes", type=int, default=Rule.min_nodes,
                   help=f"compare a point only when this many nodes measured it (default {Rule.min_nodes})")
    q.add_argument("--junit", type=Path, metavar="FILE", help="JUnit XML: one test case per node x check")
    q.add_argument("--prometheus", type=Path, metavar="FILE.prom",
                   help="a textfile for node-exporter's textfile collector")
    q.add_argument("--json", metavar="FILE", help="the verdicts as JSON ('-' for stdout)")
    render.add_arguments(q)
    s = sub.add_parser("query", help="SQL (DuckDB) over the views runs, measurements and pairs")
    s.add_argument("fleet", metavar="FLEET")
    s.add_argument("sql", metavar="SQL", help="one SELECT statement; it reads the fleet's files and nothing else")
    s.add_argument("--limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                   help=f"print at most N rows (default {DEFAULT_LIMIT:,}); the rest are never fetched")
    render.add_arguments(s)


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if args.fleet_command == "build":
        return build(args.paths, args.out)
    if args.fleet_command == "qualify":
        return qualify(args)
    if args.fleet_command == "query":
        return query(args)
    raise UsageError("name what to do: commbench fleet build|qualify|query (commbench fleet -h)")
