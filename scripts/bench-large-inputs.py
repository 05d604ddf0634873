#!/usr/bin/env python3
"""Time and peak memory of commbench on large inputs (issue 31, item 6).

Generates, in a scratch dir:
- a nccl-tests all_reduce_perf text log of about --log-mb MB (the committed 8-GPU log's header,
  then its table repeated as the cycles of a long `-N` run), imported with `import-nccl-tests`;
- an nccl-tests -J JSON file of about --json-mb MB (the committed 8-GPU run's JSON, its results
  repeated as the cycles of a long -N run), imported the same way;
- a measurements.jsonl of about --rows-mb MB (rows of the committed synthetic 8-GPU run, many
  sizes and backends, as a long resumed sweep would write them), read by the analysis commands;
- a kineto trace of about --trace-mb MB (decode steps of GEMMs and an NCCL allreduce, each kernel
  with its launch call), a merged trace of --devices devices without rank info, and a gzip of
  --blank-gb GB of white space (the bomb), each read by `attribute` (issue 43);
- with --only fleet: a fleet of one recorded run and `fleet query` of --query-rows rows (issue 56).

Each command runs as its own process; its wall time and peak RSS (ru_maxrss of the child) are
printed as a markdown table. Usage: python scripts/bench-large-inputs.py [--log-mb 100] [--json-mb 20]
[--rows-mb 200] [--trace-mb 300] [--devices 6000] [--blank-gb 2] [--only traces|compare|fleet]
[--query-rows 20000000]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "tests" / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.txt"
RUN = ROOT / "tests" / "data" / "runs" / "synthetic-pcie-8gpu"


def big_log(target: Path, megabytes: int) -> int:
    """The 8-GPU log with its result table repeated until the file is `megabytes` long."""
    lines = LOG.read_text().splitlines(keepends=True)
    table = [i for i, line in enumerate(lines) if line.split() and line.split()[0].isdigit()]
    head, body, tail = lines[:table[0]], lines[table[0]:table[-1] + 1], lines[table[-1] + 1:]
    chunk = "".join(body)
    repeats = max(1, megabytes * 1_000_000 // len(chunk))
    with open(target, "w") as handle:
        handle.writelines(head)
        for _ in range(repeats):
            handle.write(chunk)
        handle.writelines(tail)
    return repeats * len(body)


def big_json(target: Path, megabytes: int) -> int:
    """The 8-GPU run's -J file with its results repeated until the file is `megabytes` long,
    written a piece at a time: this process stays small, and a child's peak RSS (which counts
    this process's pages from before its exec) stays the child's own."""
    data = json.loads(LOG.with_suffix(".json").read_text())
    chunk = ", ".join(json.dumps(item) for item in data["results"])
    head, _, tail = json.dumps({**data, "results": ["@"]}).partition('"@"')
    repeats = max(1, megabytes * 1_000_000 // len(chunk))
    with open(target, "w") as handle:
        handle.write(head)
        for index in range(repeats):
            handle.write(chunk if index == 0 else ", " + chunk)
        handle.write(tail)
    return repeats * len(data["results"])


def big_rows(run: Path, megabytes: int, slower_every: int = 0) -> int:
    """The synthetic run with rows for many backends and sizes (distinct keys) up to `megabytes`;
    `slower_every` N: every Nth backend 30% slower (the B side of a compare), so that some changes
    are beyond the rows' spread and most are not."""
    shutil.copytree(RUN, run)
    template = [json.loads(line) for line in (RUN / "measurements.jsonl").read_text().splitlines()
                if '"status": "ok"' in line][0]
    count, written = 0, 0
    with open(run / "measurements.jsonl", "w") as handle:
        while written < megabytes * 1_000_000:
            backend, size = count // 2000, 4096 + 1024 * (count % 2000)
            latency_us = (20.0 + size / 1e5 + backend) * (1.3 if slower_every and backend % slower_every == 0 else 1.0)
            row = dict(template, backend=f"nccl:variant{backend}", message_bytes=size, latency_p50_us=latency_us)
            line = json.dumps(row) + "\n"
            handle.write(line)
            written += len(line)
            count += 1
    return count


_KERNEL = ('{{"ph": "X", "cat": "kernel", "name": "{name}", "pid": {device}, "tid": 7, "ts": {ts:.3f}, "dur": {dur}, '
           '"args": {{"correlation": {corr}, "stream": 7, "device": {device}, "grid": [132, 1, 1]}}}}')
_LAUNCH = ('{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 4000, "tid": 4000, "ts": {ts:.3f}, '
           '"dur": 3, "args": {{"correlation": {corr}}}}}')
_NAMES = ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "flash_fwd_splitkv_kernel",
          "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)")


def big_trace(target: Path, megabytes: int, devices: int = 1) -> int:
    """A kineto trace of decode steps (two GEMMs, attention, an NCCL allreduce per layer), each
    kernel with its launch; `devices` > 1: a merged trace without rank info, kernels spread over
    that many devices."""
    count, written, ts = 0, 0, 1_000_000.0
    with open(target, "w") as handle:
        head = '{"schemaVersion": 1, "deviceProperties": [{"name": "NVIDIA H200"}], "traceEvents": ['
        handle.write(head)
        while written < megabytes * 1_000_000:
            name = _NAMES[count % 3]
            events = (_KERNEL.format(name=name, device=count % devices, ts=ts, dur=20, corr=count),
                      _LAUNCH.format(ts=ts - 5, corr=count))
            text = ("" if count == 0 else ", ") + ", ".join(events)
            handle.write(text)
            written += len(text)
            ts += 21 if count % 12 else 400   # a step every 12 kernels: the gap rule finds them
            count += 1
        handle.write("]}")
    return count


def blank_bomb(target: Path, gigabytes: int) -> int:
    """A gzip of `gigabytes` GB of white space inside a trace's event list; its size in bytes."""
    block = b" " * (1 << 24)
    with gzip.open(target, "wb", compresslevel=1) as handle:
        handle.write(b'{"traceEvents": [')
        for _ in range(gigabytes * (1 << 30) // len(block)):
            handle.write(block)
        handle.write(b"]}")
    return target.stat().st_size


def measure(argv: list[str], cwd: Path) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit status) of `python -m commbench argv` (wait4: this child's own)."""
    start = time.monotonic()
    with open(os.devnull, "w") as devnull, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "commbench", *argv], cwd=cwd, stdout=devnull, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        if proc.returncode not in (0, 1):
            err.seek(0)
            print(f"# {' '.join(argv[:2])}: exit {proc.returncode}: {err.read().strip()[-300:]}", file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-mb", type=int, default=100)
    parser.add_argument("--json-mb", type=int, default=20)
    parser.add_argument("--rows-mb", type=int, default=200)
    parser.add_argument("--trace-mb", type=int, default=300)
    parser.add_argument("--devices", type=int, default=6000)
    parser.add_argument("--blank-gb", type=int, default=2)
    parser.add_argument("--only", choices=("traces", "compare", "fleet"),
                        help="only the trace inputs, or only `table` and `compare` on a pair of --rows-mb runs, or "
                             "only `fleet query` of --query-rows rows over a fleet of one recorded run")
    parser.add_argument("--query-rows", type=int, default=20_000_000,
                        help="--only fleet: the rows the query makes (select * from range(N))")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        print("| command | wall s | peak RSS MiB | exit |")
        print("| --- | ---: | ---: | ---: |")
        if args.only == "compare":
            commands = _compare_inputs(scratch, args)
        elif args.only == "fleet":
            commands = _fleet_inputs(scratch, args)
        else:
            commands = ([] if args.only else _run_inputs(scratch, args)) + _trace_inputs(scratch, args)
        for argv in [["--help"], *commands]:
            wall, peak, code = measure(argv, scratch)
            shown = argv[:2] if argv[0] != "fleet" else [*argv[:2], *argv[3:]]
            label = " ".join(a if not a.startswith(str(scratch)) else Path(a).name for a in shown)
            print(f"| `{label}` | {wall:.1f} | {peak:.0f} | {code} |", flush=True)
    return 0


def _run_inputs(scratch: Path, args: argparse.Namespace) -> list[list[str]]:
    log_rows = big_log(scratch / "big.txt", args.log_mb)
    json_rows = big_json(scratch / "big.json", args.json_mb)
    row_count = big_rows(scratch / "run", args.rows_mb)
    log_mb = (scratch / "big.txt").stat().st_size / 1e6
    rows_mb = (scratch / "run" / "measurements.jsonl").stat().st_size / 1e6
    json_mb = (scratch / "big.json").stat().st_size / 1e6
    print(f"# inputs: nccl-tests log {log_mb:.0f} MB ({log_rows} table rows); -J JSON {json_mb:.0f} MB ({json_rows} "
          f"results); measurements.jsonl {rows_mb:.0f} MB ({row_count} rows)")
    run = str(scratch / "run")
    return [["import-nccl-tests", str(scratch / "big.txt"), "--average", "3", "--out", str(scratch / "imp")],
            ["import-nccl-tests", str(scratch / "big.json"), "--out", str(scratch / "imp-json")],
            ["table", run, "--out", str(scratch / "t.md")],
            ["floor", run, "--model", "glm-5"],
            ["qualify", run, "--spec", str(ROOT / "commbench" / "specs" / "pcie-8x.toml")],
            ["recommend", run, "--model", "glm-5"],
            ["report", run, "--out", str(scratch / "report")],
            ["compare", run, run, "--out", str(scratch / "compare")]]


def _compare_inputs(scratch: Path, args: argparse.Namespace) -> list[list[str]]:
    rows = big_rows(scratch / "run", args.rows_mb)
    big_rows(scratch / "run-b", args.rows_mb, slower_every=5)
    print(f"# inputs: two measurements.jsonl of {(scratch / 'run' / 'measurements.jsonl').stat().st_size / 1e6:.0f} "
          f"MB ({rows} rows each; B: every 5th backend 30% slower)")
    run, run_b = str(scratch / "run"), str(scratch / "run-b")
    return [["table", run, "--out", str(scratch / "t.md")],
            ["compare", run, run_b, "--out", str(scratch / "compare")],
            ["compare", run, run_b, "--out", str(scratch / "compare-json"), "--json", str(scratch / "c.json")]]


def _fleet_inputs(scratch: Path, args: argparse.Namespace) -> list[list[str]]:
    """A fleet of one recorded CPU run, and queries: one of --query-rows rows (as `fleet query` prints
    it, and with the largest --limit), and a small one as the peer (start-up, the views)."""
    fleet = str(scratch / "fleet")
    subprocess.run([sys.executable, "-m", "commbench", "fleet", "build", str(ROOT / "tests" / "data" / "runs" /
                                                                            "cpu-gloo-4rank-a"), "--out", fleet],
                   cwd=scratch, check=True, stdout=subprocess.DEVNULL)
    many = f"select range as n from range({args.query_rows})"
    print(f"# inputs: a fleet of one recorded run (cpu-gloo-4rank-a); the query `{many}`")
    return [["fleet", "query", fleet, "select count(*) as n from measurements"],
            ["fleet", "query", fleet, many],
            ["fleet", "query", fleet, many, "--limit", "100000"]]


def _trace_inputs(scratch: Path, args: argparse.Namespace) -> list[list[str]]:
    kernels = big_trace(scratch / "trace.json", args.trace_mb)
    merged = big_trace(scratch / "merged.json", max(1, args.trace_mb // 10), args.devices)
    bomb_bytes = blank_bomb(scratch / "bomb.json.gz", args.blank_gb)
    print(f"# inputs: kineto trace {(scratch / 'trace.json').stat().st_size / 1e6:.0f} MB ({kernels} kernels, "
          f"as many launches); merged trace {(scratch / 'merged.json').stat().st_size / 1e6:.0f} MB ({merged} "
          f"kernels on {args.devices} devices); gzip of {args.blank_gb} GB of white space, {bomb_bytes / 1e6:.1f} MB")
    return [["attribute", str(scratch / "trace.json")], ["attribute", str(scratch / "merged.json")],
            ["attribute", str(scratch / "bomb.json.gz")]]


if __name__ == "__main__":
    raise SystemExit(main())
