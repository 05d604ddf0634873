"""`commbench report FLEET`: the fleet's HTML page, one self-contained file.

Per group (never mixed): the spread of each backend's latency per size across the nodes (a strip
of every node's value, the median and the rule's limit, outliers named), then a row per node a
person can forward (its anchor is #node-<node>-<job>): status, reasons, and every failed check.
The fleet comparison is fleet qualify's, without a spec and with the default rule.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import re
from collections import defaultdict
from pathlib import Path

from commbench.errors import UsageError
from commbench.files import naming, output_folder, staged_folder
from commbench.fleet.inputs import split
from commbench.fleet.outliers import Rule, shown
from commbench.fleet.verdicts import FAIL, Comparison, FleetVerdict, NodeVerdict, judge
from commbench.fleet.command import open_fleet
from commbench.units import format_bytes

PAGE = "fleet.html"
_STYLE = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}td.n{text-align:right}
.FAIL{color:#b00;font-weight:bold}.WARN{color:#a60}.PASS{color:#060}img{max-width:100%}"""


def _e(text: object) -> str:
    return html.escape(str(text))


def anchor(node: NodeVerdict) -> str:
    return "node-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{node.run.node}-{node.run.job}")


def _figure(what: str, rows: list[Comparison]) -> str:
    """Every node's latency per size (grey), the median (line), the limit (dashes), outliers named (red)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = list(range(len(rows)))
    for x, c in zip(xs, rows):
        ax.scatter([x] * len(c.values), list(c.values.values()), s=12, color="0.6", zorder=2)
        for f in c.out:
            ax.scatter([x], [f.value], s=30, color="#b00", zorder=3)
            ax.annotate(f.name.split("/")[0], (x, f.value), textcoords="offset points", xytext=(5, 3), fontsize=8,
                        color="#b00")
    ax.plot(xs, [c.median for c in rows], color="k", label="median")
    ax.plot(xs, [c.limit for c in rows], color="#b00", linestyle="--", label="outlier limit")
    ax.set_xticks(xs, [format_bytes(c.message_bytes or 0) for c in rows])
    ax.set_yscale("log")
    ax.set_ylabel("latency us")
    ax.set_title(what, fontsize=10)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return f'<img alt="{_e(what)}" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def _distribution(verdict: FleetVerdict, group: str) -> list[str]:
    by_what: dict[str, list[Comparison]] = defaultdict(list)
    for c in verdict.comparisons:
        if c.group == group:
            by_what[c.what].append(c)
    parts = []
    for what, rows in sorted(by_what.items()):
        latency = [c for c in rows if c.message_bytes is not None]
        if latency:
            parts.append(_figure(what, latency))
        parts.append(f"<table><tr><th>{_e(what)}</th><th>nodes</th><th>min</th><th>median</th><th>max</th>"
                     "<th>limit</th><th>outliers</th></tr>")
        for c in rows:
            values = sorted(c.values.values())
            where = format_bytes(c.message_bytes) if c.message_bytes is not None else "-"
            out = ", ".join(f'<a href="#{_e(_anchor_of(verdict, f.name))}">{_e(f.name)}</a> {shown(f.value, c.unit)}' for f in c.out)
            parts.append(f"<tr><td>{_e(where)}</td><td class=n>{c.nodes}</td><td class=n>{shown(values[0], c.unit)}</td>"
                         f"<td class=n>{shown(c.median, c.unit)}</td><td class=n>{shown(values[-1], c.unit)}</td>"
                         f"<td class=n>{shown(c.limit, c.unit)} "
                         f"{_e(c.unit)}</td><td class=FAIL>{out}</td></tr>")
        parts.append("</table>")
    return parts or ["<p>Nothing to compare: fewer nodes than the rule needs measured a common point.</p>"]


def _anchor_of(verdict: FleetVerdict, key: str) -> str:
    return next((anchor(n) for n in verdict.nodes if n.run.key == key), "")


def _node_rows(nodes: list[NodeVerdict]) -> list[str]:
    rows = ["<table><tr><th>node</th><th>job</th><th>status</th><th>reasons</th><th>failed checks</th>"
            "<th>run</th></tr>"]
    for n in nodes:
        failed = "".join(f"<div>{_e(c.reason)}: {_e(c.name)}: {_e(c.detail)}</div>" for c in n.checks if c.status == FAIL)
        rows.append(f'<tr id="{_e(anchor(n))}"><td><a href="#{_e(anchor(n))}">{_e(n.run.node)}</a></td>'
                    f"<td>{_e(n.run.job)}</td><td class={n.status}>{n.status}</td><td>{_e(', '.join(n.reasons) or '-')}"
                    f"</td><td>{failed or '-'}</td><td>{_e(n.run.run.run_id)}</td></tr>")
    rows.append("</table>")
    return rows


def render(verdict: FleetVerdict, fleet: str) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>commbench fleet {_e(fleet)}</title>"
             f"<style>{_STYLE}</style></head><body><h1>commbench fleet {_e(fleet)}</h1>",
             f"<p>{len(verdict.nodes)} run(s) in {len(verdict.groups)} group(s); {len(verdict.failed)} FAIL: "
             + ", ".join(f'<a href="#{_e(anchor(n))}">{_e(n.run.node)}</a>' for n in verdict.failed) + "</p>",
             f"<p>Rule: {_e(verdict.rule.text())}.</p>"]
    if len(verdict.groups) > 1:
        parts.append("<p><b>Several groups:</b> each is shown and compared on its own, never with another.</p>")
    for group, keys in verdict.groups.items():
        parts.append(f"<h2>{_e(group)}</h2><h3>Latency across nodes, per backend and size</h3>")
        parts.extend(_distribution(verdict, group))
        parts.append("<h3>Per node</h3>")
        parts.extend(_node_rows([n for n in verdict.nodes if n.run.key in keys]))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def main(args: argparse.Namespace) -> int:
    fleet_path, _ = split(args.run_dir)
    out = output_folder(args.out, f"{Path(fleet_path).resolve().name}-report", [Path(fleet_path)])
    fleet = open_fleet(fleet_path)
    runs, problems = fleet.runs()
    for line in problems:
        print(f"commbench report: warning: {line}")
    if not runs:
        raise UsageError(f"{fleet_path}: the fleet holds no readable run")
    verdict = judge(runs, None, Rule())
    path = out / PAGE
    with staged_folder(out) as work, naming(path):   # moved into place at the end: a failure leaves nothing
        (work / PAGE).write_text(render(verdict, fleet_path), encoding="utf-8")
    print(f"fleet {fleet_path}: {len(verdict.nodes)} run(s), {len(verdict.failed)} FAIL"
          + (": " + ", ".join(n.run.node for n in verdict.failed) if verdict.failed else ""))
    print(f"wrote {path}")
    return 0
