"""Findings for the PCIe failure modes users hit (pure functions of a snapshot).

- P2P that silently goes through system memory: SM peer traffic far below the copy engine's;
- P2P that hangs or corrupts only under collectives: the NCCL A/B with P2P off as the control;
- TP groups that span sockets (islands.py), NCCL's own view of the box (its XML dumps);
- driver and link health: kernel module flavor, AER counters, PCIe replays, links that stay
  below their maximum while the GPU is busy.

Every threshold carries its published source; docs/probe-findings.md explains each finding.
Remedies are printed, never applied.
"""

from __future__ import annotations

from typing import Any

from commbench.topology import islands, nccl_checks
from commbench.topology.finding import FAIL, INFO, WARN, finding
from commbench.topology.nccl_xml import RING, TREES, NcclXmlError, parse_graphs
from commbench.units import format_bytes

# SM peer path vs copy engine: healthy PCIe kernel writes reach ~0.8 of the copy engine
# (copy engines "only ~24% faster than kernel writes", flashinfer#4393); kernel traffic staged
# through system memory makes a PCIe one-shot allreduce ~15x slower (~0.07). 0.25 sits ~3x from both.
SM_TO_COPY_MIN_RATIO = 0.25
SM_TO_COPY_SOURCE = ("kernel writes ~0.8 of copy-engine bandwidth on healthy PCIe (copy engines ~24% faster, "
                     "flashinfer#4393); ~15x slower PCIe one-shot allreduce when kernel P2P is staged through system "
                     "memory (rtx6kpro hardware/pcie-bandwidth.md, ForceP2P section); 0.25 sits ~3x from each")
# P2P write latency 0.36-0.45 us with P2P on, ~14 us off (rtx6kpro, p2pBandwidthLatencyTest). A
# dependent read pays a whole round trip, so a healthy one reads above the write figure; 5 us is
# about a third of the "off" figure.
SM_READ_LATENCY_MAX_US = 5.0
SM_READ_LATENCY_SOURCE = ("P2P latency 0.36-0.45 us with P2P on, ~14 us with P2P off (rtx6kpro "
                          "hardware/pcie-bandwidth.md, p2pBandwidthLatencyTest writes); a dependent read is a full "
                          "round trip, so the limit sits at about a third of the 'off' figure")
FORCE_P2P_REMEDY = ('the NVIDIA driver registry override ForceP2P: options nvidia NVreg_RegistryDwords="ForceP2P=0x11;'
                    'RMForceP2PType=1;RMPcieP2PType=2;GrdmaPciTopoCheckOverride=1;EnableResizableBar=1" in '
                    '/etc/modprobe.d, reboot, check RegistryDwords in /proc/driver/nvidia/params (rtx6kpro '
                    'hardware/pcie-bandwidth.md). Users report it needed on direct-attach (NODE/PHB) boxes, not '
                    'on switch boxes: measure before and after, and re-run this probe')
NCCL_FAULT_REMEDY = ("serve with NCCL_P2P_DISABLE=1 (and --disable-custom-all-reduce) until fixed; check the ACS, "
                     "IOMMU and uvm_disable_hmm findings: those are the usual causes (NVIDIA/nccl#2079, #1999)")
AER_SOURCE = ("correctable errors are retransmitted by the link (no data lost); a handful per minute of Replay "
              "Timer Timeouts under cross-root traffic is normal on AMD multi-switch hosts (rtx6kpro "
              "hardware/aer-replay-timeouts-during-collapse.md); uncorrectable ones (e.g. Surprise Link Down, "
              "aer_uncor_status 0x20) preceded lockups (rtx6kpro hardware/pcie-bandwidth.md)")
LINK_LOAD_SOURCE = ("idle GPUs retrain their links Gen1 <-> Gen5 (rtx6kpro hardware/pcie-bandwidth.md) and cap "
                    "copies at 2-3 GB/s (club-3090 p2p_collective_check), so only a reading under load counts; "
                    "DCGM's pcie plugin checks the same downtraining")
NCCL_SUGGESTION = "suggestion to measure, not a fix: "
SOCKET_SOURCE = ("across sockets one-shot kernels beat NCCL only below 48 KB and lost 4-16% end to end with MTP "
                 "(rtx6kpro, 8 PCIe GPUs)")


# ---------------------------------------------------------------------------------------------
# SM peer path vs copy engine
# ---------------------------------------------------------------------------------------------

def sm_path_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Per directed pair: copy-engine GB/s, SM store and load GB/s, their ratio, read latency."""
    copy = {(p["src"], p["dst"]): p for p in (snapshot.get("bandwidth") or {}).get("pairs", [])}
    rows = []
    for p in (snapshot.get("sm_peer") or {}).get("pairs", []):
        ce = copy.get((p["src"], p["dst"])) or {}
        row = {**p, "copy_gbps": ce.get("bandwidth_gbps"), "ratio": None}
        sm_best = max(p.get("store_gbps") or 0.0, p.get("load_gbps") or 0.0)
        if p.get("status") == "ok" and row["copy_gbps"]:
            row["ratio"] = round(sm_best / row["copy_gbps"], 3)
        rows.append(row)
    return rows


def staged_pairs(snapshot: dict[str, Any], min_ratio: float = SM_TO_COPY_MIN_RATIO) -> list[dict[str, Any]]:
    """Pairs of two GPUs whose faster SM direction is below min_ratio of the copy engine."""
    return [r for r in sm_path_rows(snapshot) if r["src"] != r["dst"] and r["ratio"] is not None
            and r["ratio"] < min_ratio]


def slow_latency_pairs(snapshot: dict[str, Any], max_us: float = SM_READ_LATENCY_MAX_US) -> list[dict[str, Any]]:
    return [r for r in sm_path_rows(snapshot) if r["src"] != r["dst"] and r.get("status") == "ok"
            and (r.get("read_latency_us") or 0.0) > max_us]


def _force_p2p_in_effect(snapshot: dict[str, Any]) -> str | None:
    for h in (snapshot.get("hosts") or {}).values():
        dwords = (h.get("nvidia_module") or {}).get("registry_dwords") or ""
        if "ForceP2P" in dwords:
            return dwords
    return None


def sm_path_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    set_now = _force_p2p_in_effect(snapshot)
    remedy = FORCE_P2P_REMEDY if not set_now else f"ForceP2P is already set ({set_now}): check the ACS and IOMMU findings"
    for r in staged_pairs(snapshot):
        out.append(finding(WARN, "p2p_sysmem_staged",
                           f"GPU {r['src']} -> GPU {r['dst']}: SM stores {r['store_gbps']:g} / loads "
                           f"{r['load_gbps']:g} GB/s vs copy engine {r['copy_gbps']:g} GB/s ({r['ratio']:.2f}x, "
                           f"below {SM_TO_COPY_MIN_RATIO}): kernel-initiated P2P looks staged through system "
                           f"memory; custom allreduce kernels would crawl while copies look fine", remedy))
    for r in slow_latency_pairs(snapshot):
        out.append(finding(WARN, "p2p_sm_latency_high",
                           f"GPU {r['src']} -> GPU {r['dst']}: peer read round trip {r['read_latency_us']:g} us "
                           f"(limit {SM_READ_LATENCY_MAX_US:g} us): the P2P-off figure is ~14 us", remedy))
    write_ok = {(e["src"], e["dst"]) for e in snapshot.get("p2p") or []
                if (e.get("write_verify") or {}).get("status") == "ok"}
    for r in sm_path_rows(snapshot):
        if r.get("status") == "hangs":
            out.append(finding(FAIL, "p2p_sm_hangs", f"GPU {r['src']} -> GPU {r['dst']}: SM peer loads/stores never "
                                                     f"completed ({r.get('detail')})", NCCL_FAULT_REMEDY))
        elif r.get("status") == "fail" and (r["src"], r["dst"]) in write_ok:
            out.append(finding(WARN, "p2p_sm_failed", f"GPU {r['src']} -> GPU {r['dst']}: the write check passed but "
                                                      f"the SM peer kernels failed: {r.get('detail')}"))
    return out


# ---------------------------------------------------------------------------------------------
# NCCL: collective A/B and NCCL's view
# ---------------------------------------------------------------------------------------------

def ab_pairs(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: both runs and what the pair means (nccl_checks.ab_meaning)."""
    by_size: dict[int, dict[str, Any]] = {}
    for run in entry.get("ab") or []:
        by_size.setdefault(run["size_bytes"], {"size_bytes": run["size_bytes"], "label": run["label"]})[run["arm"]] = run
    out = []
    for size in sorted(by_size):
        pair = by_size[size]
        if "p2p" in pair and "p2p_disabled" in pair:
            pair["meaning"], pair["why"] = nccl_checks.ab_meaning(pair["p2p"]["verdict"], pair["p2p_disabled"]["verdict"])
            out.append(pair)
    return out


def nccl_ab_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for entry in snapshot.get("nccl_checks") or []:
        where = f"{entry['host']} GPUs {entry.get('gpus')}"
        if entry.get("ab_note"):
            out.append(finding(INFO, "nccl_ab_one_gpu", f"{where}: collective A/B not run: {entry['ab_note']}"))
        for pair in ab_pairs(entry):
            size = f"{format_bytes(pair['size_bytes'])} ({pair['label']})"
            if pair["meaning"] == nccl_checks.P2P_FAULT:
                out.append(finding(FAIL, "nccl_p2p_fault", f"{where}: NCCL allreduce of {size}: {pair['why']} "
                                                           f"({pair['p2p']['detail']})", NCCL_FAULT_REMEDY))
            elif pair["meaning"] == nccl_checks.INCONCLUSIVE:
                out.append(finding(WARN, "nccl_ab_inconclusive",
                                   f"{where}: NCCL allreduce of {size}: {pair['why']} (with P2P: "
                                   f"{pair['p2p']['detail']}; without: {pair['p2p_disabled']['detail']})"))
    return out


def nccl_patterns(topology: dict[str, Any]) -> list[dict[str, Any]]:
    """The patterns users hit in NCCL's graphs, each with the setting to measure."""
    if topology.get("ranks", 0) < 2:
        return []
    try:
        graphs = parse_graphs(topology["graph_xml"]) if topology.get("graph_xml") else []
    except NcclXmlError as exc:
        return [finding(WARN, "nccl_dump_unreadable", f"NCCL's graph dump: {exc}")]
    out = []
    # Graphs NCCL found no channel for (collnet and NVLS without the hardware) say nothing.
    intra = [g for g in graphs if g.pattern in (RING, *TREES) and g.nchannels > 0]
    ring = [g for g in intra if g.pattern == RING]
    if intra and all(g.type_intra == "SYS" for g in intra):
        speed = min(g.speed_intra_gbps for g in intra)
        out.append(finding(WARN, "nccl_all_sys",
                           f"NCCL classes every ring and tree channel as SYS (estimated {speed:g} GB/s per channel): "
                           f"its search found no closer path for them",
                           NCCL_SUGGESTION + "NCCL_P2P_LEVEL=SYS (a level the box cannot carry deadlocks: rtx6kpro "
                           "optimization/nccl-tuning.md), or NCCL_GRAPH_FILE with typeintra PHB as in the AMD Turin case "
                           "(32 KiB 48.16 -> 26.20 us)"))
    if ring and max(g.nchannels for g in ring) <= 2:
        out.append(finding(WARN, "nccl_two_channels",
                           f"NCCL's ring uses {max(g.nchannels for g in ring)} channel(s), its minimum",
                           NCCL_SUGGESTION + "NCCL_MIN_NCHANNELS=8 (8-GPU busbw 22.2 -> 37.6 GB/s on dual Turin, "
                           "rtx6kpro optimization/nccl-tuning.md)"))
    small = topology.get("small_message") or {}
    if small.get("proto") == "Simple":
        out.append(finding(WARN, "nccl_simple_small",
                           f"NCCL chose Simple for a {format_bytes(small['bytes'])} allreduce ({small.get('algo')}): "
                           f"its cost model passed over LL, the low-latency protocol, at a decode-sized message",
                           NCCL_SUGGESTION + "NCCL_PROTO=LL (+22% in the users' 8-GPU PCIe runs, docs/design.md) or NCCL_GRAPH_FILE "
                           "(AMD Turin: 32 KiB 48.16 -> 26.20 us, rtx6kpro optimization/nccl-tuning.md); "
                           "compare with commbench sweep --nccl-proto LL,Simple"))
    return out


def nccl_view_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for entry in snapshot.get("nccl_checks") or []:
        topology = entry.get("topology") or {}
        if topology.get("verdict") not in (None, nccl_checks.HEALTHY):
            out.append(finding(WARN, "nccl_dump_failed", f"{entry['host']}: NCCL's topology run "
                                                         f"{topology['verdict']}: {topology.get('detail')}"))
        for f in nccl_patterns(topology):
            f["message"] = f"{entry['host']}: {f['message']}"
            out.append(f)
    return out


# ---------------------------------------------------------------------------------------------
# Placement, driver and link health
# ---------------------------------------------------------------------------------------------

def _replica_hint(snapshot: dict[str, Any], every: list[islands.Placement], p: islands.Placement) -> str:
    """The largest smaller TP whose replicas fill the host without crossing sockets, as a command."""
    n = len(islands.host_gpus(snapshot)[p.host])
    inside = [q for q in every if q.host == p.host and q.tp < p.tp and not q.spans_sockets
              and len(q.groups) * q.tp == n]
    if not inside:
        return ""
    q = inside[-1]
    devices = " and ".join(f"CUDA_VISIBLE_DEVICES={islands.cuda_visible_devices(snapshot, g)}" for g in q.groups)
    return f"run TP{q.tp} x {len(q.groups)} replicas ({devices}) where the model fits; "


def placement_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    every = islands.placements(snapshot)
    for p in every:
        if not p.spans_sockets:
            continue
        spanning = [g for g, level in zip(p.groups, p.levels) if level in (islands.ACROSS_SOCKETS, islands.ACROSS_NUMA)]
        what = ("sockets" if islands.ACROSS_SOCKETS in p.levels
                else "NUMA nodes over SYS links (socket ids not in this snapshot)")
        groups = "; ".join(",".join(map(str, g)) for g in spanning)
        out.append(finding(WARN, "tp_spans_sockets",
                           f"{p.host}: TP{p.tp} on GPUs {groups} spans {what}: every allreduce crosses the socket "
                           f"interconnect", _replica_hint(snapshot, every, p) + "otherwise measure it first: "
                           + SOCKET_SOURCE))
    return out


def module_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, h in (snapshot.get("hosts") or {}).items():
        module = h.get("nvidia_module")
        if not module:
            continue
        out.append(finding(INFO, "nvidia_module", f"{name}: nvidia kernel module {module.get('flavor')} "
                                                  f"{module.get('version') or ''} ({module.get('source')})".rstrip()))
        if "ForceP2P" in (module.get("registry_dwords") or ""):
            out.append(finding(INFO, "nvidia_force_p2p", f"{name}: the driver runs with registry overrides "
                                                         f"{module['registry_dwords']}"))
    return out


def _aer_total(counters: dict[str, Any] | None, kind: str) -> int:
    values = (counters or {}).get(kind)
    return sum(v for k, v in values.items() if not k.startswith("TOTAL")) if isinstance(values, dict) else 0


def _aer_detail(counters: dict[str, Any], kind: str) -> str:
    values = counters.get(kind) or {}
    return ", ".join(f"{k} {v}" for k, v in values.items() if v and not k.startswith("TOTAL"))


def aer_rows(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Per GPU and its upstream port: error counts by kind."""
    rows = []
    for g in snapshot.get("gpus") or []:
        for end in ("gpu", "port"):
            counters = (g.get("aer") or {}).get(end)
            if counters:
                rows.append({"gpu": g["index"], "end": end, "bdf": counters.get("bdf"), "counters": counters,
                             **{kind: _aer_total(counters, kind) for kind in ("correctable", "nonfatal", "fatal")}})
    return rows


def link_health_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in aer_rows(snapshot):
        where = f"GPU {r['gpu']} {'link (GPU side)' if r['end'] == 'gpu' else 'link (port ' + str(r['bdf']) + ')'}"
        if r["nonfatal"] or r["fatal"]:
            detail = "; ".join(filter(None, (_aer_detail(r["counters"], "nonfatal"), _aer_detail(r["counters"], "fatal"))))
            out.append(finding(FAIL, "aer_uncorrectable", f"{where}: uncorrectable PCIe errors since boot: {detail}",
                               "reseat the card and riser, check the slot; boot with pcie_aspm=off pcie_port_pm=off "
                               "if they are Surprise Link Down (" + AER_SOURCE + ")"))
        elif r["correctable"]:
            out.append(finding(WARN, "aer_correctable", f"{where}: correctable PCIe errors since boot: "
                                                        f"{_aer_detail(r['counters'], 'correctable')}",
                               "watch whether the count grows at idle; BadTLP/BadDLLP growth points at a riser or "
                               "slot (" + AER_SOURCE + ")"))
    for g in snapshot.get("gpus") or []:
        replays = (g.get("pcie") or {}).get("replay_counter")
        if replays:
            out.append(finding(WARN, "pcie_replays", f"GPU {g['index']}: {replays} PCIe replay(s) since the driver "
                                                     f"loaded (NVML)", "a count that grows points at the link: riser, "
                                                                       "slot, cable"))
    for reading in snapshot.get("link_under_load") or []:
        if below_max(reading):
            out.append(finding(WARN, "pcie_below_max_under_load",
                               f"GPU {reading['gpu']} PCIe link at Gen{reading['gen_current']} x{reading['width_current']} "
                               f"of Gen{reading['gen_max']} x{reading['width_max']} while busy ({reading.get('during')})",
                               "a loaded link should train to its maximum: reseat the card or riser, check the slot "
                               "wiring and the BIOS link-speed and bifurcation settings"))
    return out


def below_max(reading: dict[str, Any]) -> bool:
    """A reading taken under load that stays below the link's maximum width or generation."""
    pairs = (("gen_current", "gen_max"), ("width_current", "width_max"))
    return any(reading.get(c) and reading.get(m) and reading[c] < reading[m] for c, m in pairs)


def at_max_under_load(snapshot: dict[str, Any], gpu: int) -> bool:
    """True when a reading taken while the GPU was busy reached the link's maximum generation."""
    for reading in snapshot.get("link_under_load") or []:
        if reading.get("gpu") == gpu and reading.get("gen_current") and reading.get("gen_max"):
            return reading["gen_current"] >= reading["gen_max"]
    return False


def pcie_box_findings(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return (sm_path_findings(snapshot) + nccl_ab_findings(snapshot) + nccl_view_findings(snapshot)
            + placement_findings(snapshot) + link_health_findings(snapshot) + module_findings(snapshot))
