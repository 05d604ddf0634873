"""scripts/fused-ratios.py on recorded rows: p2p:fused against FlashInfer's faster fused kernel and
the unfused baseline of the same run, and the goal of issue 55 per token count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from factories import row, write_run

from commbench.ops import FUSED_OP

SCRIPT = Path(__file__).parents[2] / "scripts" / "fused-ratios.py"
spec = importlib.util.spec_from_file_location("fused_ratios_under_test", SCRIPT)
ratios = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ratios)


def fused_row(backend: str, tokens: int, latency_us: float | None, **changes):
    return row(backend=backend, op=FUSED_OP, world_size=8, tokens=tokens, hidden=7168, latency_us=latency_us,
               **changes)


def test_each_token_count_compares_with_flashinfers_faster_kernel_and_says_the_goal(tmp_path):
    rows = [fused_row("p2p:fused", 1, 5.0, extra={"p2p_fused_kernel": "fused_oneshot"}),
            fused_row("p2p:fused_oneshot", 1, 5.0), fused_row("p2p:fused_twoshot", 1, 9.0),
            fused_row("flashinfer:fused_oneshot", 1, 6.0), fused_row("flashinfer:fused_twoshot", 1, 8.0),
            fused_row("unfused:best", 1, 15.0),
            fused_row("p2p:fused", 16, 20.0), fused_row("flashinfer:fused_oneshot", 16, 21.0),
            fused_row("flashinfer:fused_twoshot", 16, None, status="hang"),
            row(backend="p2p:auto", world_size=8, message_bytes=14336, latency_us=3.0)]   # plain: not a fused row
    run = write_run(tmp_path / "run", rows)
    lines = ratios.table(run)
    assert lines[0].startswith("### 8 ranks, hidden 7168")
    one = [c.strip() for c in next(l for l in lines if l.startswith("| 1 |")).strip("|").split("|")]
    assert one == ["1", "5.00 (fused_oneshot)", "5.00", "9.00", "6.00 (fused_oneshot)", "15.00", "0.83x", "0.33x",
                   "yes"]
    sixteen = [c.strip() for c in next(l for l in lines if l.startswith("| 16 |")).strip("|").split("|")]
    # the hung two-shot is no peer; 20 / 21 misses 0.9x
    assert sixteen[4:] == ["21.00 (fused_oneshot)", "-", "0.95x", "-", "no"]
    assert len([l for l in lines if l.startswith("| ") and l[2].isdigit()]) == 2
