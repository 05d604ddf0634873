"""Fused vs unfused allreduce + residual + RMSNorm, from rows: pair every fused row with the
unfused baseline of the same work. The backends themselves are commbench.backends.fused and
commbench.backends.unfused (which picks the baseline's allreduce from measured rows)."""

from __future__ import annotations

from typing import Any, Iterable

from commbench.analysis.render import fmt_pct, fmt_us
from commbench.ops import FUSED_OP
from commbench.results import OK, Measurement


def _family(backend_name: str) -> str:
    return backend_name.partition(":")[0]


def summarize(rows: Iterable[Measurement]) -> list[dict[str, Any]]:
    """Pair every measured fused row with the unfused baseline of the same work (two passes
    over `rows`, which may be any iterable that can be iterated twice).

    Same work = same op, mode, dtype, world size, tokens, hidden and process-level env. The
    time compared is the headline latency per call; saving_us > 0 means fusion is faster.
    Fused rows without a measured baseline appear with unfused_us None, so nothing is dropped.
    """
    def work(row: Measurement) -> tuple:
        return (row.op, row.mode, row.dtype, row.world_size, row.tokens, row.hidden,
                tuple(sorted(row.env_setting.items())))

    baselines: dict[tuple, Measurement] = {}
    for row in rows:
        if row.op == FUSED_OP and _family(row.backend) == "unfused" and row.status == OK:
            best = baselines.get(work(row))
            if best is None or (row.latency_us or float("inf")) < (best.latency_us or float("inf")):
                baselines[work(row)] = row
    out: list[dict[str, Any]] = []
    for row in rows:
        if row.op != FUSED_OP or _family(row.backend) == "unfused" or row.status != OK:
            continue
        base = baselines.get(work(row))
        fused_us = row.latency_us
        unfused_us = base.latency_us if base is not None else None
        saving = (unfused_us - fused_us) if (unfused_us is not None and fused_us is not None) else None
        out.append({
            "op": row.op, "mode": row.mode, "dtype": row.dtype, "world_size": row.world_size,
            "tokens": row.tokens, "hidden": row.hidden, "message_bytes": row.message_bytes,
            "fused_backend": row.backend, "fused_us": fused_us,
            "unfused_backend": base.backend if base is not None else None,
            "unfused_allreduce": base.extra.get("allreduce_backend") if base is not None else None,
            "unfused_us": unfused_us,
            "saving_us": saving,
            "saving_pct": (100.0 * saving / unfused_us) if saving is not None and unfused_us else None,
        })
    out.sort(key=lambda d: (d["mode"], d["dtype"], d["tokens"] or 0, d["hidden"] or 0, d["fused_backend"]))
    return out


COMPARISON_TITLE = "allreduce + residual + RMSNorm: fused vs unfused"
COMPARISON_HEADERS = ["ranks", "mode", "dtype", "hidden", "tokens", "fused", "fused us", "unfused allreduce",
                      "unfused us", "saving us", "saving"]
COMPARISON_NUMERIC = (0, 3, 4, 6, 8, 9, 10)     # the numeric ones of COMPARISON_HEADERS, right-aligned


def comparison_cells(rows: Iterable[Measurement]) -> list[list[str]]:
    """summarize() as table cells under COMPARISON_HEADERS, one line per fused row, in order."""
    pairs = sorted(summarize(rows), key=lambda p: (p["world_size"], p["mode"], p["dtype"], p["hidden"] or 0,
                                                   p["tokens"] or 0, p["fused_backend"]))
    return [[str(p["world_size"]), p["mode"], p["dtype"], str(p["hidden"]), str(p["tokens"]), p["fused_backend"],
             fmt_us(p["fused_us"]), p["unfused_allreduce"] or p["unfused_backend"] or "-", fmt_us(p["unfused_us"]),
             fmt_us(p["saving_us"]), fmt_pct(p["saving_pct"])] for p in pairs]
