"""take_snapshot(): run every probe step and merge the results into one JSON-ready dict.

Under torchrun each rank probes its own GPU (driver facts, NVML, host facts) and takes part in
the cross-process IPC/VMM checks as itself; the lowest rank of each host also runs the
same-process P2P pair checks (and bandwidth) over the GPUs of that host's ranks; rank 0 merges
everything. Without torchrun one process probes every visible GPU, starting one IPC/VMM
participant per GPU (two on a one-GPU machine, so the cross-process path is still exercised).
Every step that talks to CUDA runs in a child process with a time limit (childproc.py).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import shutil
import socket
import tempfile
import time
import uuid
from typing import TYPE_CHECKING, Any

from commbench.policy import multicast_policy_reason
from commbench.topology import host as host_mod
from commbench.topology import link_health, nvml_facts, pcie
from commbench.topology.childproc import Child, module_argv, run_child
from commbench.topology.pcie_snapshot import merge_pcie_checks, run_pcie_steps
from commbench.topology.snapshot_file import SCHEMA_VERSION, SNAPSHOT_KIND
from commbench.probe.software import installed_versions

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

DEFAULT_TIMEOUT_S = 20.0
LOCAL_MODULE = "commbench.topology.local_checks"
GROUP_MODULE = "commbench.topology.group_checks"
BANDWIDTH_METHOD = ("cuMemcpyPeerAsync with peer access on (where it can be enabled), one directed pair at a "
                    "time: 64 MiB x 10 copies for bandwidth (GB/s = 1e9 B/s), 100 back-to-back 4-byte copies "
                    "for latency (us per copy), CUDA events, as CUDA's p2pBandwidthLatencyTest")


def software_versions(driver_version: str | None, nvml: dict[str, Any]) -> dict[str, Any]:
    return {**installed_versions(), "nvidia_driver": nvml.get("driver_version"),
            "cuda_driver": driver_version or nvml.get("cuda_driver_version"), "commbench": _version("commbench")}


def backend_software() -> dict[str, str | None]:
    """Each registered variant's software verdict on this machine (None: it is there)."""
    from commbench.backends import probe_variants
    from commbench.probe.verdicts import software_record

    return software_record(probe_variants())


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_present() -> str | None:
    """None when libcuda can be loaded (nothing is initialised); else why not."""
    from commbench.topology.cudadrv import load_driver

    try:
        load_driver()
    except OSError:
        return "no CUDA GPU: libcuda.so.1 not found (no NVIDIA driver on this machine)"
    return None


# ----------------------------------------------------------------------------------------------
# What one process gathers
# ----------------------------------------------------------------------------------------------

def local_report(own_device: int | None, pair_devices: list[int], bandwidth: bool, participants: list[dict],
                 me: int | None, meet_dir: str | None, allow_multicast: bool, timeout_s: float,
                 nccl: bool = False) -> dict[str, Any]:
    """Everything this process probes.

    own_device None = single process: describe every visible GPU, check every pair and start
    one IPC/VMM participant per GPU (two on a one-GPU machine); participants is then filled in.
    Otherwise describe own_device and pair_devices, check pairs among pair_devices (the host's
    first rank passes them) and take part in the meeting as participant `me`.
    """
    host = socket.gethostname()
    report: dict[str, Any] = {"hostname": host, "failures": [], "notes": [], "caps": []}
    report["nvml"] = nvml_facts.collect()
    no_driver = driver_present()
    if no_driver:
        report["notes"].append(no_driver)
        report["host"] = host_mod.host_facts([])
        return report
    single = own_device is None
    devices: Any = "all" if single else sorted({own_device, *pair_devices})
    pairs: Any = "all" if single else [[a, b] for a in pair_devices for b in pair_devices if a != b]
    caps = run_child(LOCAL_MODULE, {"task": "caps", "devices": devices, "pairs": pairs}, timeout_s)
    report["caps"] = caps.records
    if caps.failure():
        last = caps.last_start() or {}
        report["failures"].append({"step": "driver facts and P2P pair checks", "detail": caps.failure(),
                                   "timed_out": caps.timed_out, "last_step": last.get("step"),
                                   "last_src": last.get("src"), "last_dst": last.get("dst")})
    device_records = [r for r in caps.records if r.get("kind") == "device" and "error" not in r]
    bus_ids = [r["pci_bus_id"] for r in device_records]
    report["host"] = host_mod.host_facts(bus_ids)
    for r in device_records:
        r["numa_node"] = host_mod.gpu_numa_node(r["pci_bus_id"])
        r["cpu_affinity"] = host_mod.gpu_cpu_affinity(r["pci_bus_id"])
        r["aer"] = link_health.gpu_aer(r["pci_bus_id"])
    if single or pair_devices:
        report["pcie_paths"] = [{**{k: v for k, v in p.items() if k not in ("a", "b")},
                                 "a_bus": bus_ids[p["a"]], "b_bus": bus_ids[p["b"]]}
                                for p in pcie.gpu_pair_paths(bus_ids)]
    if single:
        n = len(device_records)
        group_devices = list(range(n)) if n > 1 else [0, 0] if n == 1 else []
        participants[:] = [{"id": k, "rank": None, "host": host, "device": d} for k, d in enumerate(group_devices)]
        me = 0
        pair_devices = [r["index"] for r in device_records]
    else:
        group_devices = [own_device]
    if meet_dir and group_devices and me is not None:
        # Cross-process IPC / VMM (and multicast when allowed and no policy forbids it).
        deadline = time.time() + timeout_s
        multicast = multicast_policy_reason(allow_multicast) is None
        children = [Child(module_argv(GROUP_MODULE, {"dir": meet_dir, "me": me + k, "count": len(participants),
                                                     "device": dev, "deadline": deadline, "multicast": multicast}))
                    for k, dev in enumerate(group_devices)]
        results = [c.wait(time.monotonic() + timeout_s + 5) for c in children]
        report["group"] = [{"participant": me + k, "records": r.records, "failure": r.failure(),
                            "timed_out": r.timed_out, "last_step": r.last_started()}
                           for k, r in enumerate(results)]
    if bandwidth and pair_devices:
        bw = run_child(LOCAL_MODULE, {"task": "bandwidth", "pairs": [[a, b] for a in pair_devices
                                                                     for b in pair_devices]}, timeout_s * 3)
        report["bandwidth"] = bw.records
        if bw.failure():
            report["failures"].append({"step": "bandwidth", "detail": bw.failure(), "timed_out": bw.timed_out,
                                       "last_step": bw.last_started()})
    if pair_devices:
        run_pcie_steps(report, pair_devices, bandwidth, nccl, allow_multicast, timeout_s)
    return report


# ----------------------------------------------------------------------------------------------
# Merging reports into the snapshot
# ----------------------------------------------------------------------------------------------

def merge(reports: list[dict[str, Any]], mode: str, world_size: int, participants: list[dict],
          options: dict[str, Any]) -> dict[str, Any]:
    """reports[i] from rank i (torchrun) or one report (single process) -> the snapshot."""
    notes: list[str] = []
    errors: list[dict[str, Any]] = []
    hosts: dict[str, Any] = {}
    gpus: list[dict[str, Any]] = []
    index_of: dict[tuple[str, int], int] = {}     # (host, cuda ordinal) -> snapshot gpu index
    by_uuid: dict[tuple[str, str], int] = {}
    driver_version = None
    for report in reports:
        host = report["hostname"]
        hosts.setdefault(host, report.get("host", {}))
        for note in report.get("notes", []):
            if note not in notes:
                notes.append(note)
        for f in report.get("failures", []):
            errors.append({"host": host, **f})
        nvml = report.get("nvml", {})
        if nvml.get("error") and nvml["error"] not in notes:
            notes.append(nvml["error"])
        nv_by_uuid = {d.get("uuid"): (k, d) for k, d in enumerate(nvml.get("devices", []))}
        for rec in report.get("caps", []):
            if rec.get("kind") == "driver":
                driver_version = rec.get("version")
                if rec.get("device_count") == 0:
                    notes.append("no CUDA GPU: the driver sees 0 devices")
            if rec.get("kind") == "error":
                errors.append({"host": host, "step": rec.get("step"), "detail": rec.get("detail")})
            if rec.get("kind") != "device":
                continue
            if "error" in rec:
                errors.append({"host": host, "step": f"device {rec['index']}", "detail": rec["error"]})
                continue
            key = (host, rec["uuid"])
            if key in by_uuid:
                index_of[(host, rec["index"])] = by_uuid[key]
                continue
            gpu = {k: v for k, v in rec.items() if k not in ("kind", "index")}
            gpu.update(index=len(gpus), host=host, cuda_ordinal=rec["index"])
            nv_index, nv = nv_by_uuid.get(rec["uuid"], (None, None))
            gpu["nvml_index"] = nv_index
            if nv:
                for k in ("pcie", "bar1_total_mib", "ecc", "fabric_state", "nvml_errors"):
                    gpu[k] = nv.get(k)
                gpu["nvlink"] = {k: v for k, v in nv["nvlink"].items() if k != "links"}
            by_uuid[key] = gpu["index"]
            index_of[(host, rec["index"])] = gpu["index"]
            gpus.append(gpu)
    snapshot: dict[str, Any] = {
        "kind": SNAPSHOT_KIND, "schema": SCHEMA_VERSION,
        "taken_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode, "world_size": world_size, "options": options,
        "software": software_versions(driver_version, reports[0].get("nvml", {})),
        "backend_software": backend_software(),
        "notes": notes, "errors": errors, "hosts": hosts, "gpus": gpus,
        "participants": [{**p, "gpu": index_of.get((p["host"], p["device"]))} for p in participants],
    }
    snapshot["shares_gpus"] = len({p["gpu"] for p in snapshot["participants"]}) < len(snapshot["participants"])
    snapshot["links"] = merge_links(reports, gpus)
    snapshot["p2p"] = merge_p2p(reports, gpus, index_of)
    snapshot["pcie_paths"] = merge_pcie(reports, gpus)
    group = [g for report in reports for g in report.get("group", [])]
    labels = {p["id"]: participant_label(p, mode) for p in snapshot["participants"]}
    snapshot["ipc"] = merge_group(group, "ipc", labels)
    snapshot["vmm"] = merge_group(group, "vmm", labels)
    snapshot["multicast"] = merge_multicast(group, gpus, labels, options["allow_multicast"])
    bw = [(report["hostname"], r) for report in reports for r in report.get("bandwidth", [])]
    snapshot["bandwidth"] = None if not options["bandwidth"] else {
        "method": BANDWIDTH_METHOD,
        "pairs": [{"src": index_of.get((h, r["src"])), "dst": index_of.get((h, r["dst"])),
                   **{k: v for k, v in r.items() if k not in ("kind", "src", "dst")}}
                  for h, r in bw if r.get("kind") == "bandwidth"]}
    snapshot.update(merge_pcie_checks(reports, index_of, options))
    return snapshot


def participant_label(p: dict[str, Any], mode: str) -> str:
    if mode == "torchrun":
        return f"rank {p['rank']} (GPU {p['gpu']})"
    return f"process {p['id']} on GPU {p['gpu']}"


def merge_links(reports: list[dict], gpus: list[dict]) -> dict[str, Any]:
    n = len(gpus)
    matrix = [["X" if i == j else "?" for j in range(n)] for i in range(n)]
    error = None
    for report in reports:
        nvml = report.get("nvml", {})
        if nvml.get("error"):
            error = nvml["error"]
            continue
        topo = nvml.get("topology") or []
        for a in gpus:
            for b in gpus:
                if a["host"] == b["host"] == report["hostname"] and a is not b \
                        and a.get("nvml_index") is not None and b.get("nvml_index") is not None:
                    matrix[a["index"]][b["index"]] = topo[a["nvml_index"]][b["nvml_index"]]
    for a in gpus:
        for b in gpus:
            if a["host"] != b["host"]:
                matrix[a["index"]][b["index"]] = "NET"
    nvswitch = any((g.get("nvlink") or {}).get("to_switch") for g in gpus)
    return {"matrix": matrix, "source": "NVML" if error is None else None, "error": error, "nvswitch": nvswitch}


def merge_p2p(reports: list[dict], gpus: list[dict], index_of: dict) -> list[dict[str, Any]]:
    pairs: dict[tuple[int, int], dict[str, Any]] = {}
    for a in gpus:
        for b in gpus:
            if a is not b and a["host"] == b["host"]:
                pairs[(a["index"], b["index"])] = {"src": a["index"], "dst": b["index"], "can_access_peer": None,
                                                   "nvml": None, "enable_peer_access": None, "write_verify": None}
    for report in reports:
        host = report["hostname"]
        nvml = report.get("nvml", {})
        for (i, j), entry in pairs.items():
            a, b = gpus[i], gpus[j]
            if a["host"] == host and a.get("nvml_index") is not None and b.get("nvml_index") is not None:
                entry["nvml"] = (nvml.get("p2p_status") or {}).get(f"{a['nvml_index']},{b['nvml_index']}")
        for rec in report.get("caps", []):
            if "src" not in rec:
                continue
            key = (index_of.get((host, rec["src"])), index_of.get((host, rec["dst"])))
            if key not in pairs:
                continue
            entry = pairs[key]
            if rec["kind"] == "can_access":
                entry["can_access_peer"] = rec.get("value", rec.get("error"))
            elif rec["kind"] in ("enable_peer", "write_verify"):
                field = "enable_peer_access" if rec["kind"] == "enable_peer" else "write_verify"
                entry[field] = {k: v for k, v in rec.items() if k not in ("kind", "src", "dst")}
        for failure in report.get("failures", []):
            if not failure.get("timed_out") or not str(failure.get("last_step")).startswith("P2P write"):
                continue
            # The pair the child was writing when its time ran out hung; later pairs never ran.
            key = (index_of.get((host, failure["last_src"])), index_of.get((host, failure["last_dst"])))
            for k, entry in pairs.items():
                if gpus[k[0]]["host"] != host:
                    continue
                if k == key:
                    entry["write_verify"] = {"status": "hangs", "detail": f"no completion within the time limit "
                                                                         f"({failure['detail']})"}
                elif entry["write_verify"] is None:
                    entry["write_verify"] = {"status": "not_run", "detail": "an earlier pair hung"}
    return [pairs[k] for k in sorted(pairs)]


def merge_pcie(reports: list[dict], gpus: list[dict]) -> list[dict[str, Any]]:
    by_bus = {(g["host"], pcie.normalize_bdf(g["pci_bus_id"])): g["index"] for g in gpus}
    out: list[dict[str, Any]] = []
    for report in reports:
        host = report["hostname"]
        for p in report.get("pcie_paths") or []:
            a = by_bus.get((host, pcie.normalize_bdf(p["a_bus"])))
            b = by_bus.get((host, pcie.normalize_bdf(p["b_bus"])))
            if a is not None and b is not None:
                out.append({"a": a, "b": b, **{k: v for k, v in p.items() if k not in ("a_bus", "b_bus")}})
    return out


def merge_group(group: list[dict], mechanism: str, labels: dict[int, str]) -> dict[str, Any]:
    """Per directed participant pair: ok / fail / wrong / hangs, naming who failed and how."""
    exports, writes, verifies = [], {}, {}
    broken: dict[int, tuple[str, str]] = {}   # participant -> (status, why) for children that died or hung
    for g in group:
        errors = [r for r in g["records"] if r.get("kind") == "error"]
        why = g.get("failure") or (errors[0]["detail"] if errors else None)
        if why:
            where = f" (last step: {g['last_step']})" if g.get("last_step") else ""
            broken[g["participant"]] = ("hangs" if g.get("timed_out") else "fail", why + where)
        for r in g["records"]:
            if r.get("mechanism") != mechanism:
                continue
            if r["kind"] == "export":
                exports.append({"participant": r["participant"], "status": r["status"], "detail": r.get("detail")})
            elif r["kind"] == "write":
                writes[(r["writer"], r["owner"])] = r
            elif r["kind"] == "verify":
                verifies[(r["writer"], r["owner"])] = r
    ids = sorted(labels)
    pairs = []
    for w in ids:
        for o in ids:
            if w == o:
                continue
            write, verify = writes.get((w, o)), verifies.get((w, o))
            who = labels[w]
            if write and write["status"] != "ok":
                status, detail = "fail", f"{who} writing to {labels[o]}: {write.get('detail')}"
            elif write is None and w in broken:
                status, detail = broken[w][0], f"{who}: {broken[w][1]}"
            elif write and verify and verify["status"] == "ok":
                status, detail = "ok", None
            elif verify and verify["status"] in ("wrong", "fail"):
                status, detail = verify["status"], f"{labels[o]} checking {who}'s writes: {verify.get('detail')}"
            elif o in broken:
                status, detail = broken[o][0], f"{labels[o]}: {broken[o][1]}"
            else:
                status, detail = "not_run", (verify or {}).get("detail") or "no result (participant did not report)"
            pairs.append({"writer": w, "owner": o, "status": status, "detail": detail})
    return {"exports": sorted(exports, key=lambda e: e["participant"]), "pairs": pairs,
            "tested": bool(group)}


def merge_multicast(group: list[dict], gpus: list[dict], labels: dict[int, str], allow: bool) -> dict[str, Any]:
    attribute = {g["index"]: (g.get("attributes") or {}).get("multicast") for g in gpus}
    policy = multicast_policy_reason(allow)
    results = [r for g in group for r in g["records"] if r.get("kind") == "multicast"]
    if policy is not None:
        functional = {"status": policy}
    elif not results:
        functional = {"status": "not tested: no participant reached the multicast step"}
    else:
        failed = [f"{labels.get(r['participant'], r['participant'])}: {r.get('detail')}"
                  for r in results if r["status"] != "ok"]
        functional = {"status": "fail" if failed else "ok", "detail": "; ".join(failed) or None}
    return {"attribute": attribute, "functional": functional}


# ----------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------

def _meet_dir(token: str) -> str:
    # Short path: Unix socket names live in it (108-byte limit).
    path = os.path.join(tempfile.gettempdir(), f"cbp-{token}")
    os.makedirs(path, exist_ok=True)
    return path


def take_snapshot(ctx: "RunContext | None", bandwidth: bool = False, allow_multicast: bool = False,
                  timeout_s: float = DEFAULT_TIMEOUT_S, nccl: bool = False) -> dict[str, Any]:
    """Probe this machine (or every rank's GPU under torchrun) and return the snapshot dict."""
    options = {"bandwidth": bandwidth, "allow_multicast": allow_multicast, "timeout_s": timeout_s, "nccl": nccl}
    if ctx is None or ctx.world_size == 1:
        return _single_process(options)
    return _torchrun(ctx, options)


def _single_process(options: dict[str, Any]) -> dict[str, Any]:
    participants: list[dict[str, Any]] = []
    meet_dir = _meet_dir(uuid.uuid4().hex[:10])
    try:
        report = local_report(None, [], options["bandwidth"], participants, 0, meet_dir,
                              options["allow_multicast"], options["timeout_s"], options["nccl"])
    finally:
        shutil.rmtree(meet_dir, ignore_errors=True)
    return merge([report], "single-process", 1, participants, options)


def _torchrun(ctx: "RunContext", options: dict[str, Any]) -> dict[str, Any]:
    token = ctx.broadcast_object(uuid.uuid4().hex[:10] if ctx.rank == 0 else None)
    device = ctx.device.index if ctx.is_cuda else None
    host = socket.gethostname()
    everyone = ctx.all_gather_objects({"rank": ctx.rank, "host": host, "device": device})
    local = [e for e in everyone if e["host"] == host]
    participants = [{"id": e["rank"], "rank": e["rank"], "host": e["host"], "device": e["device"]}
                    for e in everyone if e["device"] is not None]
    first_local = min(e["rank"] for e in local) == ctx.rank
    # The lowest rank of a host runs the same-process pair checks over that host's GPUs.
    pair_devices = sorted({e["device"] for e in local if e["device"] is not None}) if first_local else []
    local_ids = sorted(e["rank"] for e in local if e["device"] is not None)
    meet_dir = _meet_dir(token) if device is not None else None
    report: dict[str, Any]
    if device is None:
        report = {"hostname": host, "failures": [], "caps": [], "nvml": nvml_facts.collect(),
                  "notes": ["no CUDA GPU: this rank runs on the CPU"], "host": host_mod.host_facts([])}
    else:
        # Participant ids are global ranks; group children count only this host's ranks, so
        # renumber to local positions for the meeting and back afterwards.
        position = local_ids.index(ctx.rank)
        local_participants = [p for p in participants if p["host"] == host]
        report = local_report(device, pair_devices, options["bandwidth"], local_participants, position, meet_dir,
                              options["allow_multicast"], options["timeout_s"], options["nccl"])
        for g in report.get("group", []):
            g["participant"] = local_ids[g["participant"]]
            for r in g["records"]:
                for key in ("participant", "writer", "owner"):
                    if key in r:
                        r[key] = local_ids[r[key]]
    reports = ctx.all_gather_objects(report)
    if first_local and meet_dir:
        shutil.rmtree(meet_dir, ignore_errors=True)
    if ctx.rank != 0:
        return {}
    return merge(reports, "torchrun", ctx.world_size, participants, options)
