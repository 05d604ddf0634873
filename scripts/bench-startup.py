#!/usr/bin/env python3
"""How long commbench's commands take to start and answer, beside the interpreter's own start.

    python scripts/bench-startup.py [--repeat N] [--run RUN_DIR]

Runs each command N times (default 5), interleaved with `python -c pass` so that both see the
same machine load, and prints a markdown table of medians: the command's time, its time over the
interpreter's start, and the ratio of the two. Targets (issue 32): `--help` and
`floor --list-models` within 0.5 s of `python -c pass`; report, floor and recommend on the
committed 8-rank emulated run within 2 s; (issue 54) `sweep --help`, which imports no torch,
within 0.3 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUN = ROOT / "results" / "reference" / "h200-mps-emulated" / "world8" / "allreduce"
MODEL = "deepseek-v3"


def commands(run_dir: Path, out: Path) -> list[tuple[str, list[str], float | None]]:
    """(label, argv after the interpreter, target seconds over `python -c pass` or None)."""
    cb = ["-m", "commbench"]
    return [
        ("python -c pass", ["-c", "pass"], None),
        ("commbench --help", [*cb, "--help"], 0.5),
        ("commbench sweep --help", [*cb, "sweep", "--help"], 0.3),
        ("commbench floor --list-models", [*cb, "floor", "--list-models"], 0.5),
        ("commbench report RUN", [*cb, "report", str(run_dir), "--out", str(out)], 2.0),
        (f"commbench floor RUN --model {MODEL}", [*cb, "floor", str(run_dir), "--model", MODEL], 2.0),
        (f"commbench recommend RUN --model {MODEL}", [*cb, "recommend", str(run_dir), "--model", MODEL], 2.0),
    ]


def one_run_dir(path: Path) -> Path:
    """A run dir, or the one run dir inside a results root."""
    if (path / "run.json").is_file():
        return path
    found = [p for p in sorted(path.iterdir()) if (p / "run.json").is_file()] if path.is_dir() else []
    if len(found) != 1:
        sys.exit(f"bench-startup: {path}: not a run dir, nor a folder with exactly one")
    return found[0]


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"bench-startup: {' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--run", type=Path, default=DEFAULT_RUN, help="the run dir to analyse")
    args = parser.parse_args()
    run_dir = one_run_dir(args.run)
    with tempfile.TemporaryDirectory() as tmp:
        table = commands(run_dir, Path(tmp) / "report")
        times: dict[str, list[float]] = {label: [] for label, _, _ in table}
        for _ in range(args.repeat):   # rounds, so that a burst of load hits every command alike
            for label, argv, _ in table:
                times[label].append(timed(argv))
    base = statistics.median(times["python -c pass"])
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPU cores, load average "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min), Python {sys.version.split()[0]}, "
          f"median of {args.repeat} runs; RUN = {run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir}")
    print()
    print("| command | median s | over `python -c pass` s | x `python -c pass` | target |")
    print("| --- | ---: | ---: | ---: | --- |")
    for label, _, target in table:
        median = statistics.median(times[label])
        goal = "" if target is None else (f"≤ {target:g} s over" if target < 1 else f"≤ {target:g} s")
        met = target is None or (median - base if target < 1 else median) <= target
        print(f"| `{label}` | {median:.2f} | {median - base:.2f} | {median / base:.1f} | "
              f"{goal}{'' if met else ' (missed)'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
