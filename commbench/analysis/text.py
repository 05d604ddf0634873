"""The old plain-text table, kept only until recommend and floor move to commbench.analysis.render
(which owns the number formats; they are re-exported here for those two)."""

from __future__ import annotations

from typing import Sequence

from commbench.analysis.render import fmt_num, fmt_pct, fmt_us

__all__ = ["fmt_num", "fmt_pct", "fmt_us", "render"]


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Columns padded to the widest cell; indexes in `right` are right-aligned (numbers)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(cells)]
        return "  ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in rows)
    return "\n".join(out)
