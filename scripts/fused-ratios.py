#!/usr/bin/env python3
"""Same-run ratios of commbench's fused allreduce + residual + RMSNorm kernel against FlashInfer's.

    python scripts/fused-ratios.py RUN_DIR [RUN_DIR ...]

For each run (one world size and hidden, graph mode, bf16: a fused part of scripts/mps-reference.sh)
prints a markdown table per token count: `p2p:fused` (with the kernel it ran), its forms
`p2p:fused_oneshot` and `p2p:fused_twoshot`, the faster of FlashInfer's `fused_oneshot` and
`fused_twoshot`, `unfused:best` (the run's fastest allreduce, then torch's add and RMSNorm), and
`p2p:fused` as a ratio of FlashInfer's faster kernel and of the unfused baseline, with whether it
meets the goal of issue 55: at most GOAL_RATIO times FlashInfer's faster fused kernel. Only `ok`
rows of the same run are used; a missing or failed row is "-", its status named where it has one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commbench.ops import FUSED_OP
from commbench.results import OK, Measurement, RunDir

MODE, DTYPE = "graph", "bf16"
OURS, FORMS = "p2p:fused", ("p2p:fused_oneshot", "p2p:fused_twoshot")
FLASHINFER = ("flashinfer:fused_oneshot", "flashinfer:fused_twoshot")
UNFUSED = "unfused:best"
GOAL_RATIO = 0.9


def shaped_rows(run_dir: Path) -> tuple[dict[int, dict[str, Measurement]], int | None, int | None]:
    """The run's graph-mode bf16 fused-pattern rows by token count and backend (every status), its
    world size and hidden."""
    tokens: dict[int, dict[str, Measurement]] = {}
    world = hidden = None
    for row in RunDir(run_dir).rows():
        if row.op == FUSED_OP and row.mode == MODE and row.dtype == DTYPE and row.tokens:
            tokens.setdefault(row.tokens, {})[row.backend] = row
            world, hidden = row.world_size, row.hidden
    return tokens, world, hidden


def ok(row: Measurement | None) -> Measurement | None:
    return row if row is not None and row.status == OK and row.latency_us else None


def us(row: Measurement | None) -> str:
    if ok(row) is None:
        return "-" if row is None else row.status
    return f"{row.latency_us:.2f}"


def ratio(a: Measurement | None, b: Measurement | None) -> str:
    return "-" if ok(a) is None or ok(b) is None else f"{a.latency_us / b.latency_us:.2f}x"


def table(run_dir: Path) -> list[str]:
    tokens, world, hidden = shaped_rows(run_dir)
    head = ("tokens", "p2p:fused (kernel)", "fused_oneshot", "fused_twoshot", "flashinfer best", UNFUSED,
            "p2p:fused / flashinfer", "p2p:fused / unfused", f"<= {GOAL_RATIO}x")
    lines = [f"### {world} ranks, hidden {hidden} (`{run_dir.parent.name}/{run_dir.name}`)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for count in sorted(tokens):
        by = tokens[count]
        ours = by.get(OURS)
        flashinfer = min((r for r in (ok(by.get(n)) for n in FLASHINFER) if r), key=lambda r: r.latency_us,
                         default=None)
        kernel = ours.extra.get("p2p_fused_kernel") if ok(ours) else None   # a file's JSON: any shape
        meets = "-" if ok(ours) is None or flashinfer is None else (
            "yes" if ours.latency_us <= GOAL_RATIO * flashinfer.latency_us else "no")
        cells = (str(count), f"{us(ours)} ({kernel})" if isinstance(kernel, str) else us(ours),
                 *(us(by.get(name)) for name in FORMS),
                 f"{flashinfer.latency_us:.2f} ({flashinfer.backend.split(':', 1)[1]})" if flashinfer else "-",
                 us(by.get(UNFUSED)), ratio(ours, flashinfer), ratio(ours, by.get(UNFUSED)), meets)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        if not (run_dir / "measurements.jsonl").is_file():
            print(f"fused-ratios: {run_dir}: no measurements.jsonl", file=sys.stderr)
            return 2
        print("\n".join(table(run_dir)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
