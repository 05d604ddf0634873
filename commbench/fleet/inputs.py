"""A fleet where a command takes run dirs: `table FLEET` reads every run of it, `compare` and
`report` read one as FLEET#NODE (or FLEET#NODE/JOB, FLEET#RUN_ID). A path that is not a fleet is
a run dir, read by load_run as before; neither pyarrow nor duckdb is imported for one."""

from __future__ import annotations

import sys
from pathlib import Path

from commbench.errors import UsageError
from commbench.fleet.store import FleetDir, FleetRun, is_fleet
from commbench.results import Run
from commbench.runs import load_run

SELECT = "#"


def split(arg: str | Path) -> tuple[str, str | None]:
    """(path, selector): 'FLEET#node-3' -> ('FLEET', 'node-3'); a plain path has no selector."""
    text = str(arg)
    path, sep, selector = text.rpartition(SELECT)
    return (path, selector) if sep and is_fleet(path) else (text, None)


def is_whole_fleet(arg: str | Path) -> bool:
    path, selector = split(arg)
    return selector is None and is_fleet(path)


def fleet_runs(arg: str | Path) -> list[FleetRun] | None:
    """The runs of a fleet argument (those its selector names), None when it names no fleet."""
    path, selector = split(arg)
    if not is_fleet(path):
        return None
    fleet = FleetDir(path)
    fleet.check()
    runs, problems = fleet.runs()
    for line in problems:
        print(f"commbench: warning: {line}", file=sys.stderr)
    if selector is None:
        return runs
    chosen = [r for r in runs if selector in (r.node, r.key, r.run.run_id)]
    if not chosen:
        names = ", ".join(sorted({r.key for r in runs})[:12])
        raise UsageError(f"{arg}: no run of the fleet is node, node/job or run id {selector!r} (it has: {names})")
    return chosen


def load_runs(arg: str | Path) -> list[Run]:
    """Every run a command argument names: a fleet's (or its selection), else the one run dir."""
    runs = fleet_runs(arg)
    return [load_run(arg)] if runs is None else [r.run for r in runs]


def load_one(arg: str | Path) -> Run:
    """The one run an argument names; a fleet (or selection) of several is bad input."""
    runs = load_runs(arg)
    if len(runs) != 1:
        names = ", ".join(r.run_id for r in runs[:8])
        raise UsageError(f"{arg}: {len(runs)} runs of a fleet; name one as {split(arg)[0]}#NODE, #NODE/JOB or "
                         f"#RUN_ID ({names}{', ...' if len(runs) > 8 else ''})")
    return runs[0]
