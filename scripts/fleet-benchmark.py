#!/usr/bin/env python3
"""How long `commbench fleet build` takes, and how much memory, on a fleet of N runs x R rows.

    python scripts/fleet-benchmark.py [--runs 1000] [--rows 300] [--dir DIR]

Writes N run dirs (a copy of tests/data/runs/cpu-gloo-4rank-a's run.json, R rows each: backends x
dtypes x sizes, every row a checked ok row) under DIR/results/<node>/<job>/, then times, each in
its own process (wall seconds, and CPU seconds and peak RSS from getrusage of the child):

    read    every run dir through commbench.runs.load_run (the per-run reader, the peer)
    build   commbench fleet build DIR/results --out DIR/fleet
    again   the same build once more (every run already in: nothing added)
    qualify commbench fleet qualify DIR/fleet --json DIR/verdicts.json

and prints one line per step. results/reference/fleet-build/README.md keeps a run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "tests" / "data" / "runs" / "cpu-gloo-4rank-a" / "run.json"
BACKENDS = ("gloo", "nccl", "custom:oneshot")
DTYPES = ("bf16", "fp32")

READ = """
import sys
from pathlib import Path
from commbench.runs import load_run
rows = sum(len(load_run(p.parent).rows) for p in Path(sys.argv[1]).rglob("run.json"))
print(rows, "rows read")
"""


def row(backend: str, dtype: str, size: int, node: int) -> str:
    latency = 10.0 + size / 1e4 + node % 7 * 0.1
    return json.dumps({"schema": 3, "backend": backend, "mode": "graph", "dtype": dtype, "message_bytes": size,
                       "world_size": 8, "status": "ok", "count": size // 2, "iterations": 100, "ops_per_graph": 100,
                       "latency_us": latency, "jitter_samples": 100, "jitter_p10_us": latency * 0.97,
                       "jitter_p50_us": latency, "jitter_p90_us": latency * 1.03, "jitter_p99_us": latency * 1.1,
                       "algbw_gbps": size / latency / 1e3, "busbw_gbps": size / latency / 1e3 * 1.75,
                       "checked_calls": 300, "wrong_elements": 0, "ranks_identical": True,
                       "extra": {"nccl_version_loaded": "2.28.9"}, "timestamp": 1.0e9}, sort_keys=True) + "\n"


def make(results: Path, runs: int, rows: int) -> None:
    info = json.loads(TEMPLATE.read_text())
    sizes_per_cell = -(-rows // (len(BACKENDS) * len(DTYPES)))
    sizes = [1024 * (i + 1) for i in range(sizes_per_cell)]
    cells = [(b, d, s) for b in BACKENDS for d in DTYPES for s in sizes][:rows]
    for n in range(runs):
        run = results / f"node-{n:04d}" / "job1" / "run"
        run.mkdir(parents=True)
        node_info = {**info, "run_id": f"bench-{n:04d}", "world_size": 8,
                     "env": {"COMMBENCH_NODE": f"node-{n:04d}", "COMMBENCH_JOB": "job1"}}
        (run / "run.json").write_text(json.dumps(node_info))
        (run / "measurements.jsonl").write_text("".join(row(b, d, s, n) for b, d, s in cells))


# Each step runs under a fresh python that reports its one child's CPU seconds (user + system)
# and peak RSS (KiB) on stderr's last line: RUSAGE_CHILDREN of this script would be the largest of every step so far.
MEASURE = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(usage.ru_utime + usage.ru_stime, usage.ru_maxrss, file=sys.stderr)
sys.exit(done.returncode)
"""


def timed(name: str, command: list[str]) -> None:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"{name}: exit {done.returncode}: {done.stderr[-800:]}")
    cpu_s, peak_kib = done.stderr.strip().splitlines()[-1].split()
    first = (done.stdout.strip().splitlines() or [""])[0]
    print(f"{name:8s} {wall:6.1f} s wall {float(cpu_s):6.1f} s CPU  peak RSS {int(peak_kib) / 1024:5.0f} MiB  | {first[:90]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder, removed after)")
    args = parser.parse_args()
    where = args.dir or Path(tempfile.mkdtemp(prefix="fleet-benchmark-"))
    try:
        start = time.perf_counter()
        make(where / "results", args.runs, args.rows)
        print(f"made {args.runs} runs x {args.rows} rows in {time.perf_counter() - start:.1f} s under {where}")
        python = [sys.executable]
        cli = python + ["-m", "commbench"]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        timed("read", python + ["-c", READ, str(where / "results")])
        timed("build", cli + ["fleet", "build", str(where / "results"), "--out", str(where / "fleet")])
        timed("again", cli + ["fleet", "build", str(where / "results"), "--out", str(where / "fleet")])
        timed("qualify", cli + ["fleet", "qualify", str(where / "fleet"), "--json", str(where / "verdicts.json")])
    finally:
        if args.dir is None:
            shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
