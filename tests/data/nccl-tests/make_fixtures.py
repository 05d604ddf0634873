"""Writes the hand-made nccl-tests outputs in this folder (see README.md): `python3 make_fixtures.py`.

Every line is printed with the format strings of NVIDIA/nccl-tests v2.19.6 (commit a0b82b2,
src/util.cu: writeDeviceReport, writeResultHeader, writeBenchmarkLinePreamble/Body, writePerIterReport,
writeResultFooter, writeErrors; the JSON writer's compact, escaped output with "%lf" doubles and
"true"/"false" strings). The numbers come from a plain latency model, not from a GPU.
This script shares no code with commbench's parser on purpose.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
NCCL_CODE = 22809          # NCCL 2.28.9: NCCL_VERSION(2,28,9) = 2*10000 + 28*100 + 9
BIN = "/opt/nccl-tests/build/all_reduce_perf"
H200_BUS = ["0000:18:00", "0000:2a:00", "0000:3a:00", "0000:5d:00", "0000:9a:00", "0000:ab:00", "0000:ba:00",
            "0000:db:00"]
K, M = 1 << 10, 1 << 20


@dataclass
class Run:
    name: str
    argv: list[str]
    processes: int
    threads: int
    graph: int
    iters: int
    check: int
    min_bytes: int
    max_bytes: int
    model: str                      # "copy" (one GPU), "graph8", "eager8"
    per_iter: bool = False
    json: bool = True
    host: str = "h200-07"
    pid0: int = 41211
    start: str = "2026-12-02 10:15:03"
    end: str = "2026-12-02 10:15:41"
    env: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        return self.processes * self.threads

    def sizes(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            size *= 2
        return out


def float_str(value: float, width: int) -> str:
    """nccl-tests' getFloatStr (v2.19.6)."""
    for fmt in (f"%{width}.2f", f"%{width}.1f", f"%{width}.0f"):
        text = fmt % value
        if len(text) <= width:
            return text
    return (f"%{width}.1e" if width >= 7 else f"%{width}.0e") % value


# ---------------------------------------------------------------- the latency model (microseconds)

GRAPH8 = {4 * K: 9.02, 8 * K: 9.15, 16 * K: 9.48, 32 * K: 9.91, 64 * K: 10.84, 128 * K: 12.61, 256 * K: 15.32,
          512 * K: 19.87, 1 * M: 25.73, 2 * M: 34.96, 4 * M: 47.85, 8 * M: 68.40, 16 * M: 103.7, 32 * M: 171.9,
          64 * M: 301.2, 128 * M: 556.8, 256 * M: 1071.5}


def model_us(run: Run, size: int, in_place: bool, rng: random.Random) -> float:
    wobble = 1 + rng.uniform(-0.012, 0.012)
    if run.model == "copy":        # one GPU: out of place is a device copy, in place a no-op
        return (rng.uniform(0.09, 0.15) if in_place else (1.84 + size / 2.05e6) * wobble)
    base = GRAPH8[size]
    if run.model == "eager8":      # launches cost more than a graph replay at small sizes
        base += 3.9 * math.exp(-size / (2 * M)) + 0.6
    return base * wobble * (0.993 if in_place else 1.0)


def bandwidths(size: int, time_us: float, ranks: int) -> tuple[float, float]:
    algbw = size / 1.0e9 / (time_us * 1e-6)
    return algbw, algbw * (2 * (ranks - 1)) / ranks


def per_iteration_us(mean_us: float, iters: int, rng: random.Random) -> list[float]:
    samples = [mean_us * 0.97 * (1 + rng.gauss(0, 0.03)) for _ in range(iters)]
    samples[0] *= 1.6              # the first timed iteration is the slow one, as usual
    return samples


def iter_stats(times: list[float]) -> dict[str, float]:
    """nccl-tests' computeIterStats (nearest-rank p95/p99, population stdev)."""
    s = sorted(times)
    n = len(s)
    pct = lambda p: s[min(n - 1, (n * p + 99) // 100 - 1)]
    avg = sum(s) / n
    stdev = math.sqrt(sum((x - avg) ** 2 for x in s) / n)
    return {"min": s[0], "max": s[-1], "p50": s[n // 2], "p95": pct(95), "p99": pct(99), "avg": avg, "stdev": stdev}


# ---------------------------------------------------------------- measuring (the model) once per run

def measure(run: Run) -> list[dict]:
    rng = random.Random(run.name)
    rows = []
    for size in run.sizes():
        row = {"size": size, "count": size // 2, "placements": []}
        for in_place in (False, True):
            t = model_us(run, size, in_place, rng)
            algbw, busbw = bandwidths(size, t, run.ranks)
            p = {"time": t, "algbw": algbw, "busbw": busbw, "wrong": 0 if run.check else None}
            if run.per_iter:
                per_proc = [per_iteration_us(t, run.iters, rng) for _ in range(run.processes)]
                p["times"] = [max(v) for v in zip(*per_proc)]
                p["per_process"] = per_proc
            row["placements"].append(p)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- text (stdout of rank 0)

def device_lines(run: Run) -> list[str]:
    return [f"#  Rank {r:2d} Group {0:2d} Pid {run.pid0 + (r if run.processes > 1 else 0):6d} on {run.host:>10s} "
            f"device {r:2d} [{H200_BUS[r]}] NVIDIA H200" for r in range(run.ranks)]


def text_output(run: Run, rows: list[dict]) -> str:
    out = []
    if run.json:
        out.append(f"# Writing JSON output to {run.name}.json")
    out.append(f"# nccl-tests version 2.19.6 nccl-headers={NCCL_CODE} nccl-library={NCCL_CODE}")
    out.append("# Collective test starting: all_reduce_perf")
    out.append(f"# nThread {run.threads} nGpus 1 minBytes {run.min_bytes} maxBytes {run.max_bytes} step: 2(factor) "
               f"warmup iters: 1 iters: {run.iters} agg iters: 1 validation: {run.check} graph: {run.graph} unalign: 0")
    if run.per_iter:
        out.append("# Per-Iteration Report: CUDA event timing; i_* uses max over process rows \n".rstrip("\n"))
    out.append("#")
    out.append("# Using devices")
    out += device_lines(run)
    out.append("#")
    e = ""
    if run.per_iter:
        out.append("# %10s  %12s  %8s  %6s  %6s              out-of-place (+ per-iteration)"
                   "                                in-place (+ per-iteration)" % (e, e, e, e, e))
        out.append("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  %6s  %6s  %7s  %7s  "
                   "%7s  %7s %s" % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                                    "i_min", "i_max", "i_p99", "i_cv%", "time", "algbw", "busbw", "#wrong", "i_min",
                                    "i_max", "i_p99", "i_cv%", e))
        out.append("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %7s  %7s  %7s  %7s  %6s  %6s  %6s  %7s  %7s  "
                   "%7s  %7s %s" % ("(B)", "(elements)", e, e, e, "(us)", "(GB/s)", "(GB/s)", e, "(us)", "(us)", "(us)",
                                    "(%)", "(us)", "(GB/s)", "(GB/s)", e, "(us)", "(us)", "(us)", "(%)", e))
    else:
        out.append("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          "
                   % (e, e, e, e, e))
        out.append("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %s"
                   % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
                      "busbw", "#wrong", e))
        out.append("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s %s"
                   % ("(B)", "(elements)", e, e, e, "(us)", "(GB/s)", "(GB/s)", e, "(us)", "(GB/s)", "(GB/s)", e, e))
    busbw_sum = 0.0
    for row in rows:
        line = "%12d  %12d  %8s  %6s  %6s" % (row["size"], row["count"], "bfloat16", "sum", "%6i" % -1)
        for p in row["placements"]:
            body = (float_str(p["time"], 7), float_str(p["algbw"], 6), float_str(p["busbw"], 6))
            line += ("  %7s  %6s  %6s  %6g" % (*body, p["wrong"]) if p["wrong"] is not None
                     else "  %7s  %6s  %6s    N/A" % body)
            if run.per_iter:
                st = iter_stats(p["times"])
                cv = st["stdev"] / st["avg"] * 100
                line += "  %7s  %7s  %7s  %7s" % (float_str(st["min"], 7), float_str(st["max"], 7),
                                                  float_str(st["p99"], 7), float_str(cv, 7))
            busbw_sum += p["busbw"]
        out.append(line)
    avg = busbw_sum / (2 * len(rows))
    out.append("# %-20s : %d %s" % ("Out of bounds values", 0, "OK"))
    out.append("# %-20s : %g %s" % ("Avg bus bandwidth", avg, ""))
    out.append("#")
    out.append("# Collective test concluded: all_reduce_perf")
    out.append("#")
    out.append("")            # writeErrors with no NCCL error prints an empty line
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- JSON (-J, rank 0)

def jd(value: float) -> "JsonDouble":
    return JsonDouble(value)


class JsonDouble(float):
    """Printed with "%lf" like nccl-tests' jsonDouble."""


def render(value) -> str:
    """nccl-tests' writer: no spaces, '/' escaped, doubles as %lf."""
    if isinstance(value, JsonDouble):
        return "%f" % value
    if value is None:
        return "null"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("/", "\\/") + '"'
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(render(v) for v in value) + "]"
    return "{" + ",".join(f"{render(k)}:{render(v)}" for k, v in value.items()) + "}"


def json_output(run: Run, rows: list[dict]) -> str:
    devices = [{"rank": r * run.threads, "group": 0, "pid": run.pid0 + r, "hostname": run.host,
                "device": r * run.threads, "device_hex": H200_BUS[r * run.threads], "device_info": "NVIDIA H200"}
               for r in range(run.processes)]           # one entry per process: the first line of its block
    config = {"nthreads": run.threads, "ngpus": 1, "minimum_bytes": run.min_bytes, "maximum_bytes": run.max_bytes,
              "step_factor": 2, "warmup_iters": 1, "iterations": run.iters, "aggregated_iterations": 1,
              "validation": run.check, "graph": run.graph, "blocking_collectives": "false",
              "per_iter_timing": "true" if run.per_iter else "false", "per_iter_skip": 0,
              "parallel_init": "false", "devices": devices}
    results = []
    busbw_sum = 0.0
    for row in rows:
        entry = {"size": row["size"], "count": row["count"], "type": "bfloat16", "redop": "sum", "root": "%6i" % -1}
        for name, p in zip(("out_of_place", "in_place"), row["placements"]):
            entry[name] = {"time": jd(p["time"]), "alg_bw": jd(p["algbw"]), "bus_bw": jd(p["busbw"]),
                           "nwrong": jd(p["wrong"]) if p["wrong"] is not None else None}
            busbw_sum += p["busbw"]
            if run.per_iter:
                st = iter_stats(p["times"])
                entry[f"{name}_per_iter"] = {
                    "skipped_iterations": 0, "min_us": jd(st["min"]), "max_us": jd(st["max"]), "avg_us": jd(st["avg"]),
                    "p50_us": jd(st["p50"]), "p95_us": jd(st["p95"]), "p99_us": jd(st["p99"]),
                    "stdev_us": jd(st["stdev"]), "cv_pct": jd(st["stdev"] / st["avg"] * 100),
                    "times_us": [jd(t) for t in p["times"]],
                    "per_process_max_times_us": [[jd(t) for t in proc] for proc in p["per_process"]]}
        entry["actual_iterations"] = run.iters
        entry["experiment_name"] = ""
        results.append(entry)
    doc = {"version": 3, "start_time": run.start, "args": run.argv, "env": run.env, "nccl_version": NCCL_CODE,
           "config": config, "results": results, "out_of_bounds": {"count": 0, "okay": "true"},
           "average_bus_bandwidth": {"bandwidth": jd(busbw_sum / (2 * len(rows))), "okay": "unchecked"},
           "errors": [""], "end_time": run.end}
    return render(doc)           # one line, no newline at the end, as nccl-tests leaves it


# ---------------------------------------------------------------- the runs

def _env(ranks_mpi: bool) -> list[str]:
    env = ["HOSTNAME=h200-07", "HOME=/root", "PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
           "LD_LIBRARY_PATH=/opt/venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda/lib64",
           "CUDA_HOME=/usr/local/cuda", "LANG=C.UTF-8"]
    if ranks_mpi:
        env += ["OMPI_COMM_WORLD_SIZE=8", "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_LOCAL_RANK=0"]
    return env


def runs() -> list[Run]:
    common = ["-b", "4K", "-e", "256M", "-f", "2", "-g", "1", "-d", "bfloat16", "-a", "3", "-G", "100"]
    return [
        Run("h200-1gpu-graph", [BIN, *common, "-J", "h200-1gpu-graph.json"], processes=1, threads=1, graph=100,
            iters=20, check=1, min_bytes=4 * K, max_bytes=256 * M, model="copy", pid0=40117, env=_env(False),
            start="2026-12-02 10:11:47", end="2026-12-02 10:11:58"),
        Run("h200-8gpu-mpi-graph", [BIN, *common, "-J", "h200-8gpu-mpi-graph.json"], processes=8, threads=1,
            graph=100, iters=20, check=1, min_bytes=4 * K, max_bytes=256 * M, model="graph8", env=_env(True)),
        Run("h200-8gpu-mpi-eager-periter",
            [BIN, "-b", "4K", "-e", "1M", "-f", "2", "-g", "1", "-d", "bfloat16", "-a", "3", "-I", "1",
             "-J", "h200-8gpu-mpi-eager-periter.json"], processes=8, threads=1, graph=0, iters=20, check=1,
            min_bytes=4 * K, max_bytes=1 * M, model="eager8", per_iter=True, pid0=41302, env=_env(True),
            start="2026-12-02 10:17:20", end="2026-12-02 10:17:29"),
        Run("h200-8gpu-threads-eager-nocheck", [BIN, "-t", "8", "-g", "1", "-b", "4K", "-e", "256M", "-f", "2",
                                                "-d", "bfloat16", "-c", "0"],
            processes=1, threads=8, graph=0, iters=20, check=0, min_bytes=4 * K, max_bytes=256 * M, model="eager8",
            json=False, pid0=41577),
    ]


def main() -> None:
    for run in runs():
        rows = measure(run)
        (HERE / f"{run.name}.txt").write_text(text_output(run, rows), encoding="utf-8")
        if run.json:
            text = json_output(run, rows)
            json.loads(text)     # it must be valid JSON
            (HERE / f"{run.name}.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
