"""A fleet verdict as files for machines: JSON, JUnit XML (one test case per node x check) and a
Prometheus textfile for node-exporter's textfile collector.

The Prometheus labels take NCCL Inspector's names where they mean the same thing (its textfile
mode, NVIDIA/nccl ext-profiler/inspector: node, gpu, nranks, message_size, algo_proto,
slurm_job_id) and add backend; message_size is in bytes, gpu is a GPU's index (pair metrics
only: a latency belongs to every GPU of the run), algo_proto is NCCL's algorithm_protocol as the
row observed it, empty where none was recorded.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from commbench.analysis import provenance
from commbench.analysis.curves import variant_label
from commbench.fleet.store import pairs_of
from commbench.fleet.verdicts import FAIL, REASONS, FleetVerdict

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def payload(verdict: FleetVerdict, fleet: str, spec: str | None) -> dict[str, Any]:
    return {"fleet": fleet, "spec": spec, "rule": verdict.rule.to_dict(), "reasons": list(REASONS),
            "groups": [{"group": g, "runs": keys} for g, keys in verdict.groups.items()],
            "compared_across_groups": False,
            "failed_nodes": [n.run.node for n in verdict.failed],
            "nodes": [n.to_dict() for n in verdict.nodes],
            "outliers": [{"group": c.group, "what": c.what, "message_bytes": c.message_bytes, "unit": c.unit,
                          "median": c.median, "limit": c.limit, "nodes": c.nodes,
                          "out": [{"run_key": f.name, "value": f.value} for f in c.out]}
                         for c in verdict.comparisons if c.out]}


def junit_xml(verdict: FleetVerdict, title: str) -> str:
    root = ET.Element("testsuites", name=title)
    for group, keys in verdict.groups.items():
        nodes = [n for n in verdict.nodes if n.run.key in keys]
        cases = [(n, c) for n in nodes for c in n.checks]
        suite = ET.SubElement(root, "testsuite", name=f"{title}: {group}", tests=str(len(cases)),
                              failures=str(sum(c.status == FAIL for _, c in cases)), errors="0", skipped="0")
        ET.SubElement(ET.SubElement(suite, "properties"), "property", name="rule", value=verdict.rule.text())
        for node, check in cases:
            case = ET.SubElement(suite, "testcase", classname=f"commbench.fleet.{node.run.node}.{node.run.job}",
                                 name=check.name)
            text = check.detail + (f" [source: {check.source}]" if check.source else "")
            if check.status == FAIL:
                ET.SubElement(case, "failure", message=f"{check.reason}: {check.detail}", type=check.reason).text = text
            else:
                ET.SubElement(case, "system-out").text = f"{check.status}: {text}"
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(metric: str, labels: dict[str, Any], value: float) -> str:
    inner = ",".join(f'{name}="{_escape(v)}"' for name, v in labels.items() if _LABEL_NAME.match(name))
    return f"{metric}{{{inner}}} {value:.10g}"


def _algo_proto(observed: dict[str, Any]) -> str:
    parts = [str(observed[k]) for k in ("NCCL_ALGO", "NCCL_PROTO") if isinstance(observed, dict) and observed.get(k)]
    return "_".join(parts)


_HELP = {
    "commbench_node_qualified": ("gauge", "1 when the node passed every fleet check, 0 when one failed"),
    "commbench_node_check_failed": ("gauge", "1 for each failed check of a node, with its reason"),
    "commbench_collective_exec_time_microseconds": ("gauge", "headline latency per call (loop total / calls, max over "
                                                   "ranks) of each trusted point"),
    "commbench_bus_bandwidth_gbs": ("gauge", "bus bandwidth (GB/s, 1e9) of each trusted point"),
    "commbench_gpu_pair_bandwidth_gbs": ("gauge", "probe copy bandwidth (GB/s) of a directed GPU pair"),
}


def prometheus(verdict: FleetVerdict) -> str:
    samples: dict[str, list[str]] = {name: [] for name in _HELP}
    for node in verdict.nodes:
        run = node.run
        origin = provenance.of(run.run)
        base = {"node": run.node, "slurm_job_id": run.job, "nranks": origin.world_size or ""}
        samples["commbench_node_qualified"].append(_sample("commbench_node_qualified",
                                                           {**base, "group": run.group}, node.status != FAIL))
        for check in node.checks:
            if check.status == FAIL:
                samples["commbench_node_check_failed"].append(
                    _sample("commbench_node_check_failed", {**base, "reason": check.reason, "check": check.name}, 1))
        observed = {(variant_label(r), r.message_bytes): r.observed for r in run.run.rows if r.observed}
        for curve in run.curves:
            for point in curve.points:
                labels = {**base, "backend": curve.key.variant, "collective": curve.key.op, "dtype": curve.key.dtype,
                          "mode": curve.key.mode, "message_size": point.message_bytes,
                          "algo_proto": _algo_proto(observed.get((curve.key.variant, point.message_bytes), {}))}
                samples["commbench_collective_exec_time_microseconds"].append(
                    _sample("commbench_collective_exec_time_microseconds", labels, point.latency_us))
                if point.busbw_gbps is not None:
                    samples["commbench_bus_bandwidth_gbs"].append(
                        _sample("commbench_bus_bandwidth_gbs", labels, point.busbw_gbps))
        for src, dst, gbps, _ in pairs_of(run.run.info.snapshot):
            if gbps is not None:
                samples["commbench_gpu_pair_bandwidth_gbs"].append(
                    _sample("commbench_gpu_pair_bandwidth_gbs", {**base, "gpu": src, "peer_gpu": dst}, gbps))
    lines = []
    for name, (kind, text) in _HELP.items():
        if samples[name]:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples[name]]
    return "\n".join(lines) + "\n"

