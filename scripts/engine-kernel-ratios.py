#!/usr/bin/env python3
"""Same-run ratios of the engines' own allreduce kernels against commbench's and torch's.

    python scripts/engine-kernel-ratios.py RUN_DIR [RUN_DIR ...]

For each run (one world size, graph mode, bf16) prints a markdown table per message size:
`p2p:auto`, the faster of `symm_mem:one_shot`/`two_shot`, the faster of FlashInfer's TRT-LLM
one-shot/two-shot, `sglang:auto` (with the algorithm SGLang's table chose) and its forced
algorithms, `vllm:auto` (with the stage its kernel ran), and the engines' kernels as ratios of
the others (< 1: the engine's kernel is faster). Then, per run, `p2p:auto` against the fastest
of every other kernel measured at that size (SGLang's every algorithm, vLLM's kernel in both
stages, FlashInfer's TRT-LLM one/two-shot, torch symmetric memory), and whether it meets the
goal of issue 40: at most GOAL_RATIO times that kernel's time. Only `ok` rows of the same run
are used; a missing or failed row is "-". Rows are read through commbench's validated reader.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commbench.results import OK, Measurement, RunDir
from commbench.units import format_bytes

MODE, DTYPE = "graph", "bf16"
SGLANG_FORCED = ("sglang:1shot_push", "sglang:1shot_pull", "sglang:2shot_pull")
PEERS = ("sglang:auto", *SGLANG_FORCED, "vllm:auto", "vllm:one_stage", "vllm:two_stage", "flashinfer:trtllm_oneshot",
         "flashinfer:trtllm_twoshot", "symm_mem:one_shot", "symm_mem:two_shot")
GOAL_RATIO = 0.9


def best(by: dict[str, Measurement], names: tuple[str, ...]) -> Measurement | None:
    rows = [by[name] for name in names if name in by]
    return min(rows, key=lambda row: row.latency_us) if rows else None


def us(row: Measurement | None) -> str:
    return "-" if row is None else f"{row.latency_us:.2f}"


def named(row: Measurement | None) -> str:
    return "-" if row is None else f"{row.latency_us:.2f} ({row.backend.split(':', 1)[1]})"


def ratio(engine: Measurement | None, peer: Measurement | None) -> str:
    return "-" if engine is None or peer is None else f"{engine.latency_us / peer.latency_us:.2f}x"


def graph_rows(run_dir: Path) -> tuple[dict[int, dict[str, Measurement]], int | None]:
    """The run's ok graph-mode bf16 rows by size and backend, and its world size."""
    sizes: dict[int, dict[str, Measurement]] = {}
    world = None
    for row in RunDir(run_dir).rows():
        if row.status == OK and row.mode == MODE and row.dtype == DTYPE and row.latency_us:
            sizes.setdefault(row.message_bytes, {})[row.backend] = row
            world = row.world_size
    return sizes, world


def goal_table(run_dir: Path) -> list[str]:
    """p2p:auto against the fastest other kernel of the same run, per size."""
    sizes, world = graph_rows(run_dir)
    head = ("bytes", "p2p:auto", "fastest other kernel", "p2p:auto / it", f"<= {GOAL_RATIO}x")
    lines = [f"#### {world} ranks: `p2p:auto` against the fastest other kernel", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in sorted(sizes):
        by = sizes[size]
        p2p, peer = by.get("p2p:auto"), best(by, PEERS)
        meets = "-" if p2p is None or peer is None else (
            "yes" if p2p.latency_us <= GOAL_RATIO * peer.latency_us else "no")
        cells = (format_bytes(size), us(p2p), f"{us(peer)} ({peer.backend})" if peer else "-", ratio(p2p, peer), meets)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table(run_dir: Path) -> list[str]:
    sizes, world = graph_rows(run_dir)
    head = ("bytes", "p2p:auto", "symm_mem best", "flashinfer best", "sglang:auto (algo)",
            "sglang 1shot_push / 1shot_pull / 2shot_pull", "vllm:auto (stage)",
            "sglang:auto / p2p:auto", "/ symm_mem", "/ flashinfer",
            "vllm:auto / p2p:auto", "/ symm_mem", "/ flashinfer")
    lines = [f"### {world} ranks (`{run_dir.parent.name}/{run_dir.name}`)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in sorted(sizes):
        by = sizes[size]
        p2p, sglang, vllm = by.get("p2p:auto"), by.get("sglang:auto"), by.get("vllm:auto")
        symm = best(by, ("symm_mem:one_shot", "symm_mem:two_shot"))
        flashinfer = best(by, ("flashinfer:trtllm_oneshot", "flashinfer:trtllm_twoshot"))
        choice = sglang.extra.get("sglang_choice") if sglang else None   # extra is a file's JSON: any shape
        algo = choice.get(MODE) if isinstance(choice, dict) else None
        stage = vllm.extra.get("vllm_stage") if vllm else None
        cells = (format_bytes(size), us(p2p), named(symm), named(flashinfer),
                 f"{us(sglang)} ({algo})" if sglang else "-",
                 " / ".join(us(by.get(name)) for name in SGLANG_FORCED),
                 f"{us(vllm)} ({stage})" if vllm else "-",
                 ratio(sglang, p2p), ratio(sglang, symm), ratio(sglang, flashinfer),
                 ratio(vllm, p2p), ratio(vllm, symm), ratio(vllm, flashinfer))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        if not (run_dir / "measurements.jsonl").is_file():
            print(f"engine-kernel-ratios: {run_dir}: no measurements.jsonl", file=sys.stderr)
            return 2
        print("\n".join(table(run_dir)) + "\n")
        print("\n".join(goal_table(run_dir)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
