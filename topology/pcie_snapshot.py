"""The probe steps for PCIe boxes, and how their records enter the snapshot.

- with --bandwidth, after the copy-engine step: SM-initiated peer bandwidth and latency per
  directed pair and the link state of each GPU while it is busy (peer_checks.py, a child);
- with --nccl: the collective A/B and NCCL's topology dump (nccl_checks.py, rank children).

Snapshot keys added (schema 1 still reads without them): sm_peer, link_under_load, nccl_checks.
"""

from __future__ import annotations

from typing import Any

from commbench.topology import nccl_checks
from commbench.topology.childproc import run_child
from commbench.topology.peer_checks import METHOD as SM_METHOD

PEER_MODULE = "commbench.topology.peer_checks"
SM_STEP = "SM peer bandwidth and latency"
# A pair takes ~0.1 s on a healthy link and under 1 s when staged through system memory.
SM_SECONDS_PER_PAIR = 2.5
# Each NCCL run imports torch and builds a communicator in every rank: allow three probe limits.
NCCL_LIMIT_FACTOR = 3


def run_pcie_steps(report: dict[str, Any], devices: list[int], bandwidth: bool, nccl: bool, allow_multicast: bool,
                   timeout_s: float) -> None:
    """Add this host's records to report (a local_report in the making)."""
    if bandwidth:
        pairs = [[a, b] for a in devices for b in devices]
        sm = run_child(PEER_MODULE, {"pairs": pairs}, timeout_s + SM_SECONDS_PER_PAIR * len(pairs))
        report["sm_peer"] = sm.records
        if sm.failure():
            last = sm.last_start() or {}
            report["failures"].append({"step": SM_STEP, "detail": sm.failure(), "timed_out": sm.timed_out,
                                       "last_step": last.get("step"), "last_src": last.get("src"),
                                       "last_dst": last.get("dst")})
    if nccl:
        report["nccl"] = nccl_checks.nccl_report(devices, timeout_s * NCCL_LIMIT_FACTOR, allow_multicast)


def _sm_pairs(report: dict[str, Any], host: str, index_of: dict) -> list[dict[str, Any]]:
    pairs = {}
    for rec in report.get("sm_peer") or []:
        if rec.get("kind") == "sm_peer":
            key = (index_of.get((host, rec["src"])), index_of.get((host, rec["dst"])))
            pairs[key] = {"src": key[0], "dst": key[1], **{k: v for k, v in rec.items() if k not in ("kind", "src", "dst")}}
    for failure in report.get("failures") or []:
        if failure.get("step") != SM_STEP or not failure.get("timed_out") or failure.get("last_src") is None:
            continue
        # The pair the child was measuring when its time ran out hung; the pairs after it never ran.
        hung = (index_of.get((host, failure["last_src"])), index_of.get((host, failure["last_dst"])))
        pairs[hung] = {"src": hung[0], "dst": hung[1], "status": "hangs",
                       "detail": f"no completion within the time limit ({failure['detail']})"}
    return list(pairs.values())


def _links_under_load(report: dict[str, Any], host: str, index_of: dict) -> dict[int, dict[str, Any]]:
    """Per GPU the best reading taken while busy: a link that reached its maximum once is fine."""
    best: dict[int, dict[str, Any]] = {}
    for rec in report.get("sm_peer") or []:
        if rec.get("kind") != "link_load":
            continue
        gpu = index_of.get((host, rec["device"]))
        reading = {k: v for k, v in rec.items() if k not in ("kind", "device")}
        rank = (reading.get("gen_current") or 0, reading.get("width_current") or 0)
        held = best.get(gpu)
        if held is None or rank > (held.get("gen_current") or 0, held.get("width_current") or 0):
            best[gpu] = {"gpu": gpu, **reading}
    return best


def merge_pcie_checks(reports: list[dict[str, Any]], index_of: dict, options: dict[str, Any]) -> dict[str, Any]:
    """The snapshot keys of these steps; None where the step was not asked for."""
    sm_pairs: list[dict[str, Any]] = []
    links: dict[int, dict[str, Any]] = {}
    nccl: list[dict[str, Any]] = []
    for report in reports:
        host = report["hostname"]
        sm_pairs += _sm_pairs(report, host, index_of)
        links.update(_links_under_load(report, host, index_of))
        if report.get("nccl"):
            entry = report["nccl"]
            nccl.append({"host": host, "gpus": [index_of.get((host, d)) for d in entry["devices"]],
                         **{k: v for k, v in entry.items() if k != "devices"}})
    bandwidth = options.get("bandwidth")
    return {"sm_peer": {"method": SM_METHOD, "pairs": sorted(sm_pairs, key=lambda p: (p["src"], p["dst"]))}
            if bandwidth else None,
            "link_under_load": [links[g] for g in sorted(links)] if bandwidth else None,
            "nccl_checks": nccl if options.get("nccl") else None}
