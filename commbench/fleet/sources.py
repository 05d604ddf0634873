"""What `fleet build` reads: run dirs found under the paths given, and NCCL Inspector JSONL.

A path is a run dir (it has run.json), a folder searched for run dirs (shared storage laid out
as <node>/<job>/<run>, or any other way), or a .jsonl file of Inspector records. Everything is
read through the validated readers (RunDir.info, RunDir.read_rows); what cannot be read is one
line naming the path and why, and the rest is read on.

A run's node and job come from run.json's env: the scheduler scripts (deploy/) export
COMMBENCH_NODE and COMMBENCH_JOB, and the sweep records every COMMBENCH_* variable. Without
them the node is the run's host and the job its run id.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from commbench.errors import UsageError
from commbench.fleet import inspector
from commbench.inflight import pending
from commbench.results import ROWS_FILE, RUN_FILE, Measurement, RunDir
from commbench.results.validate import clean_text

NODE_VAR = "COMMBENCH_NODE"
JOB_VAR = "COMMBENCH_JOB"
_NAME = re.compile(r"[^A-Za-z0-9_.:@+-]")


@dataclass
class Loaded:
    """One run read for the fleet: where from, its run.json, its rows and what was wrong with it."""

    path: str
    source: str          # "sweep", "nccl-tests" or "nccl-inspector"
    node: str
    job: str
    info: dict[str, Any]
    rows: Sequence[Measurement]
    warnings: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return str(self.info.get("run_id") or Path(self.path).name)


@dataclass
class Found:
    run_dirs: list[Path] = field(default_factory=list)
    inspector_files: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def name(value: Any, fallback: str) -> str:
    """A node or job name from a file: one short line of safe characters, else the fallback."""
    text = _NAME.sub("_", clean_text(value))[:128] if isinstance(value, str) else ""
    return text.strip("_") or fallback


def _walk(root: Path, found: Found) -> Iterator[Path]:
    """Folders under root at any depth, in name order, each run dir once (not searched inside),
    no symlink followed. A stack, not recursion (Python 3.11's os.walk recurses): however deep
    the folders go, a run dir is found; a folder that cannot be listed is named and skipped."""
    todo = [root]
    while todo:
        here = todo.pop()
        try:
            with os.scandir(here) as listing:
                entries = sorted(listing, key=lambda e: e.name)
            files = {e.name for e in entries if e.is_file(follow_symlinks=False)}
            dirs = [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            found.problems.append(f"{here}: cannot list it ({exc.strerror}); skipped")
            continue
        if RUN_FILE in files:
            yield here
            continue
        if ROWS_FILE in files:
            found.problems.append(f"{here}: has {ROWS_FILE} but no {RUN_FILE}: not a commbench run dir "
                                  "(another tool's output?); skipped")
        found.inspector_files.extend(here / f for f in sorted(files) if f.endswith(".jsonl") and f != ROWS_FILE)
        todo.extend(reversed(dirs))   # popped in name order


def find(paths: Sequence[str | Path]) -> Found:
    found = Found()
    for given in paths:
        path = Path(given)
        if path.is_file() and path.suffix == ".jsonl":
            found.inspector_files.append(path)
        elif path.is_dir():
            before = len(found.run_dirs) + len(found.inspector_files)
            found.run_dirs.extend(_walk(path, found))
            if len(found.run_dirs) + len(found.inspector_files) == before:
                found.problems.append(f"{path}: no commbench run dir (a folder with {RUN_FILE}) or Inspector "
                                      "JSONL under it; skipped")
        elif path.exists():
            found.problems.append(f"{path}: neither a run dir, a folder of run dirs nor a .jsonl file; skipped")
        else:
            found.problems.append(f"{path}: no such file or folder; skipped")
    return found


def identify(path: Path) -> Loaded:
    """A run dir's run.json, node and job, its rows not yet read (read_rows reads them); UsageError
    when it is no run dir (no or a bad run.json). A build skips a run it already holds unread."""
    info = RunDir(path).info().to_dict()
    env = info.get("env") if isinstance(info.get("env"), dict) else {}
    node = name(env.get(NODE_VAR), name(info.get("host"), path.name))
    job = name(env.get(JOB_VAR), name(info.get("run_id"), path.name))
    return Loaded(str(path), str(info.get("source") or "sweep"), node, job, info, [])


def read_rows(run: Loaded) -> Loaded:
    """The run's rows through the validated reader, and a line for each thing wrong with them."""
    path = Path(run.path)
    read = RunDir(path).read_rows()
    rows_path = path / ROWS_FILE
    run.rows = read.rows
    run.warnings = [line for line in (read.problems_line(rows_path), read.duplicates_line(rows_path), pending(path))
                    if line]
    if run.source == "sweep" and not run.info.get("finished"):
        run.warnings.append(f"{path}: half-written (run.json records no finish: a sweep still running, or stopped); "
                            f"its {len(read.rows)} complete row(s) are kept")
    return run


def read_inspector(files: Sequence[Path]) -> tuple[list[Loaded], list[str]]:
    read = inspector.runs_of(files)
    loaded = [Loaded(r.files[0], inspector.SOURCE, name(r.host, "unknown"), name(r.job, "unknown"), r.info, r.rows)
              for r in read.runs]
    return loaded, read.problems


def read_all(paths: Sequence[str | Path], skip: Callable[[Loaded], bool] = lambda run: False
             ) -> tuple[list[Loaded], list[str]]:
    """Every run under the paths but those `skip` (given a run's identity) says not to read, and
    one line per thing that could not be read (or read whole)."""
    found = find(paths)
    problems = list(found.problems)
    loaded: list[Loaded] = []
    for path in found.run_dirs:
        try:
            run = identify(path)
            if not skip(run):
                loaded.append(read_rows(run))
        except UsageError as exc:
            problems.append(f"{exc}; skipped")
    runs, lines = read_inspector(found.inspector_files)
    return loaded + [run for run in runs if not skip(run)], problems + lines
