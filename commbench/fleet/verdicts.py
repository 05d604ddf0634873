"""Per-node verdicts of a fleet: the spec on every node, and every node against its group.

Each node (a run: node and job) gets checks, each PASS, WARN or FAIL with a machine-readable
reason when it is not a PASS:

    threshold_violation     a spec's latency / busbw / reference limit
    outlier_vs_fleet        slower (or, for a GPU pair, lower bandwidth) than its group by the rule
    hardware_check_failed   a fabric check, the world size, or data that is not real hardware
    workload_failed         wrong results, a hang, a crash or an error row
    no_data                 nothing trusted to judge (no checked row, a size the spec reads missing)

Groups (provenance kind, world size, GPU model(s), fabric: store.fleet_group) are compared within
themselves only; a fleet of several groups says so.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from commbench.analysis import qualify as single
from commbench.analysis.curves import Curve
from commbench.fleet.outliers import Finding, Rule, limit, outliers, shown
from commbench.fleet.store import FleetRun, pairs_of
from commbench.units import format_bytes

PASS, WARN, FAIL = single.PASS, single.WARN, single.FAIL
THRESHOLD = "threshold_violation"
OUTLIER = "outlier_vs_fleet"
HARDWARE = "hardware_check_failed"
WORKLOAD = "workload_failed"
NO_DATA = "no_data"
REASONS = (THRESHOLD, OUTLIER, HARDWARE, WORKLOAD, NO_DATA)
_MISSING = ("measured, no trusted row",)


@dataclass
class Check:
    name: str
    status: str
    reason: str      # one of REASONS when not a PASS, else ""
    detail: str
    source: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status, "reason": self.reason, "detail": self.detail,
                "source": self.source}


@dataclass
class NodeVerdict:
    run: FleetRun
    checks: list[Check] = field(default_factory=list)

    @property
    def status(self) -> str:
        statuses = {c.status for c in self.checks}
        return FAIL if FAIL in statuses else WARN if WARN in statuses else PASS

    @property
    def reasons(self) -> list[str]:
        return sorted({c.reason for c in self.checks if c.status == FAIL and c.reason}, key=REASONS.index)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.run.node, "job": self.run.job, "run_key": self.run.key, "group": self.run.group,
                "source": self.run.source, "run_id": self.run.run.info.run_id, "status": self.status,
                "reasons": self.reasons, "checks": [c.to_dict() for c in self.checks]}


def reason_of(result: single.Result) -> str:
    """The fleet reason of a single-run qualify result that is not a PASS."""
    if result.status == single.NOT_MEASURED:
        return NO_DATA
    if result.group in ("latency", "busbw", "reference"):
        return NO_DATA if any(m in result.detail for m in _MISSING) else THRESHOLD
    if result.group == "correctness":
        return WORKLOAD
    return HARDWARE   # fabric, and the run checks: real hardware, world size


def spec_checks(spec: single.Spec, run: FleetRun) -> list[Check]:
    """The spec on one node. A check qualify says is not measured is a FAIL here with the reason
    no_data: qualify passes only a run whose every check was measured (INCOMPLETE, exit 1,
    otherwise), and a fleet drains a node it cannot judge the same way."""
    return [Check(f"spec: {r.group}: {r.name}", FAIL if r.status == single.NOT_MEASURED else r.status,
                  "" if r.status == PASS else reason_of(r), r.detail, r.source)
            for r in single.qualify(spec, run.run, None)]


def workload_checks(run: FleetRun) -> list[Check]:
    """Without a spec: the correctness checks over every backend the run measured, and data."""
    scope = {r.backend for r in run.run.rows}
    return [Check(f"workload: {r.name}", r.status, "" if r.status == PASS else WORKLOAD, r.detail)
            for r in (single.check_wrong(run.run, scope), single.check_hangs(run.run, scope))]


def _curve_name(curve: Curve) -> str:
    op = "" if curve.key.op == "allreduce" else f" {curve.key.op}"
    return f"{curve.key.variant} ({curve.key.mode} {curve.key.dtype}{op})"


def _identity(curve: Curve) -> tuple[Any, ...]:
    return (curve.key.variant, curve.key.mode, curve.key.dtype, curve.key.op, curve.key.library, curve.key.emulation)


@dataclass
class Comparison:
    """One point compared across a group: what, where, the median and limit, and who is out."""

    group: str
    what: str            # curve name, or "GPU pair a->b bandwidth"
    message_bytes: int | None
    unit: str
    median: float
    limit: float
    nodes: int
    values: dict[str, float]
    out: list[Finding]


def _fmt(value: float, unit: str) -> str:
    return f"{shown(value, unit)} {unit}"


def compare_group(group: str, runs: list[FleetRun], rule: Rule) -> tuple[list[Comparison], dict[str, list[Check]]]:
    """Every point the group's nodes share, compared; a check per node per curve (and one for its
    GPU pairs, where the probe recorded them)."""
    comparisons: list[Comparison] = []
    points: dict[tuple[Any, ...], dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    names: dict[tuple[Any, ...], str] = {}
    has: dict[str, set[tuple[Any, ...]]] = defaultdict(set)
    for run in runs:
        for curve in run.curves:
            ident = _identity(curve)
            names[ident] = _curve_name(curve)
            has[run.key].add(ident)
            for point in curve.points:
                points[ident][point.message_bytes][run.key] = point.latency_us
    checks: dict[str, list[Check]] = defaultdict(list)
    for ident in sorted(points, key=lambda i: names[i]):
        out_at: dict[str, list[str]] = defaultdict(list)
        compared = 0
        for size in sorted(points[ident]):
            values = points[ident][size]
            found = outliers(values, rule)
            bounds = limit(list(values.values()), rule, True)
            if bounds is None:
                continue
            compared += 1
            comparisons.append(Comparison(group, names[ident], size, "us", bounds[0], bounds[1], len(values), values, found))
            for f in found:
                out_at[f.name].append(f"{format_bytes(size)}: {_fmt(f.value, 'us')} vs median {_fmt(f.median, 'us')} "
                                      f"(limit {_fmt(f.limit, 'us')})")
        for run in runs:
            if ident not in has[run.key]:
                continue
            name = f"fleet: {names[ident]} latency vs group"
            if not compared:
                checks[run.key].append(Check(name, WARN, NO_DATA, f"fewer than {rule.min_nodes} nodes of the group "
                                             "measured it: not compared"))
            elif out_at.get(run.key):
                checks[run.key].append(Check(name, FAIL, OUTLIER, "slower than the fleet at " + "; ".join(out_at[run.key])))
            else:
                checks[run.key].append(Check(name, PASS, "", f"within the group at {compared} size(s)"))
    comparisons.extend(_pair_comparisons(group, runs, rule, checks))
    return comparisons, checks


def _pair_comparisons(group: str, runs: list[FleetRun], rule: Rule, checks: dict[str, list[Check]]) -> list[Comparison]:
    """Each directed GPU pair's probe bandwidth against the same pair on the group's other nodes."""
    by_pair: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    probed = set()
    for run in runs:
        for src, dst, gbps, _ in pairs_of(run.run.info.snapshot):
            if gbps is not None:
                by_pair[(src, dst)][run.key] = gbps
                probed.add(run.key)
    comparisons, out_at = [], defaultdict(list)
    for (src, dst), values in sorted(by_pair.items()):
        bounds = limit(list(values.values()), rule, False)
        if bounds is None:
            continue
        found = outliers(values, rule, higher_is_worse=False)
        comparisons.append(Comparison(group, f"GPU pair {src}->{dst} bandwidth", None, "GB/s", bounds[0], bounds[1],
                                      len(values), values, found))
        for f in found:
            out_at[f.name].append(f"GPU {src}->{dst}: {_fmt(f.value, 'GB/s')} vs median {_fmt(f.median, 'GB/s')} "
                                  f"(limit {_fmt(f.limit, 'GB/s')})")
    if comparisons:
        for key in sorted(probed):
            name = "fleet: GPU pair bandwidth vs group (probe matrix)"
            checks[key].append(Check(name, FAIL, OUTLIER, "; ".join(out_at[key])) if out_at.get(key)
                               else Check(name, PASS, "", f"{len(comparisons)} pair(s) within the group"))
    return comparisons


@dataclass
class FleetVerdict:
    nodes: list[NodeVerdict]
    comparisons: list[Comparison]
    groups: dict[str, list[str]]     # group -> its run keys
    rule: Rule

    @property
    def failed(self) -> list[NodeVerdict]:
        return [n for n in self.nodes if n.status == FAIL]


def judge(runs: Iterable[FleetRun], spec: single.Spec | None, rule: Rule) -> FleetVerdict:
    runs = list(runs)
    groups: dict[str, list[FleetRun]] = defaultdict(list)
    for run in runs:
        groups[run.group].append(run)
    verdicts = {run.key: NodeVerdict(run) for run in runs}
    for run in runs:
        checks = spec_checks(spec, run) if spec is not None else workload_checks(run)
        if not run.curves:
            checks.append(Check("data: trusted rows", FAIL, NO_DATA, "no trusted row (status ok, output checked and "
                                "right): nothing to judge this node by"))
        verdicts[run.key].checks.extend(checks)
    comparisons: list[Comparison] = []
    for group, members in sorted(groups.items()):
        found, checks = compare_group(group, members, rule)
        comparisons.extend(found)
        for key, more in checks.items():
            verdicts[key].checks.extend(more)
    ordered = sorted(verdicts.values(), key=lambda v: (v.run.group, v.run.node, v.run.job))
    return FleetVerdict(ordered, comparisons, {g: [r.key for r in m] for g, m in sorted(groups.items())}, rule)
