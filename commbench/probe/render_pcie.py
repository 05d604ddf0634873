"""The probe's PCIe sections as rich tables (reads the snapshot dict only): SM peer path vs copy
engine, links under load and their error counters, the NCCL A/B and NCCL's own view, islands
and placement, the driver module, and the settings that do nothing on this box."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from commbench.topology import islands, nccl_checks
from commbench.units import format_bytes
from commbench.engines import inert_settings
from commbench.topology import box
from commbench.topology.nccl_xml import NcclXmlError, parse_graphs, parse_topology
from commbench.topology.pcie_findings import (SM_READ_LATENCY_MAX_US, SM_READ_LATENCY_SOURCE, SM_TO_COPY_MIN_RATIO,
                                              SM_TO_COPY_SOURCE, ab_pairs, aer_rows, below_max, sm_path_rows)
from commbench.probe.tables import new_table, styled

VERDICT_STYLE = {nccl_checks.HEALTHY: "green", nccl_checks.HANGS: "bold red", nccl_checks.WRONG: "bold red",
                 nccl_checks.INCONCLUSIVE: "yellow", nccl_checks.P2P_FAULT: "bold red"}


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _verdict(text: str, detail: str = "") -> Text:
    return styled(text, VERDICT_STYLE.get(text, ""), detail)


def sm_path_table(s: dict[str, Any]) -> Table:
    t = new_table("P2P paths per directed pair: copy engine vs SM-initiated loads and stores",
                  ("pair", "copy GB/s", "SM store GB/s", "SM load GB/s", "SM/copy", "read latency us", "result"),
                  caption=f"{s['sm_peer'].get('method')}. Flagged below {SM_TO_COPY_MIN_RATIO}x of the copy engine "
                      f"({SM_TO_COPY_SOURCE}) or above {SM_READ_LATENCY_MAX_US:g} us read latency "
                      f"({SM_READ_LATENCY_SOURCE}). A GPU with itself is local memory: the check ran, no fabric "
                      f"was measured.")
    for r in sm_path_rows(s):
        pair = f"{r['src']} -> {r['dst']}" + (" (same GPU, no fabric)" if r["src"] == r["dst"] else "")
        if r.get("status") != "ok":
            t.add_row(pair, _num(r["copy_gbps"]), "-", "-", "-", "-",
                      styled(str(r.get("status")), "red", f" {r.get('detail')}"))
            continue
        flagged = r["src"] != r["dst"] and ((r["ratio"] is not None and r["ratio"] < SM_TO_COPY_MIN_RATIO)
                                           or r["read_latency_us"] > SM_READ_LATENCY_MAX_US)
        t.add_row(pair, _num(r["copy_gbps"]), _num(r["store_gbps"]), _num(r["load_gbps"]), _num(r["ratio"], "{:.2f}"),
                  _num(r["read_latency_us"], "{:.2f}"),
                  styled("WARN: far below the copy path", "yellow") if flagged else "ok")
    return t


def link_table(s: dict[str, Any]) -> Table:
    t = new_table("PCIe links while busy (sysfs, read during SM stores) and error counters since boot",
                  ("GPU", "under load now/max", "while", "NVML replays", "AER correctable / nonfatal / fatal"),
                  caption="an idle GPU trains its link down; only a loaded reading says whether the link reaches "
                          "its maximum")
    loads = {r["gpu"]: r for r in s.get("link_under_load") or []}
    aer: dict[int, list[str]] = {}
    for r in aer_rows(s):
        aer.setdefault(r["gpu"], []).append(f"{r['end']} {r['correctable']}/{r['nonfatal']}/{r['fatal']}")
    for g in s.get("gpus") or []:
        r = loads.get(g["index"]) or {}
        now: Text | str = "-" if not r else str(r["error"]) if r.get("error") else Text.assemble(
            f"Gen{r.get('gen_current')} x{r.get('width_current')} / Gen{r.get('gen_max')} x{r.get('width_max')}",
            (" below max", "yellow") if below_max(r) else "")
        t.add_row(str(g["index"]), now, str(r.get("during") or "-"),
                  str((g.get("pcie") or {}).get("replay_counter", "-")), "; ".join(aer.get(g["index"], [])) or "-")
    return t


def nccl_ab_table(entry: dict[str, Any]) -> Table:
    t = new_table(f"NCCL collective A/B on {entry['host']} GPUs {entry.get('gpus')} (exact values, hard time "
                  f"limit per run)", ("allreduce", "with P2P", "NCCL_P2P_DISABLE=1", "meaning"),
                  caption="after club-3090's p2p_collective_check: with P2P as NCCL chooses, then NCCL_P2P_DISABLE=1 "
                          "as the control")
    if entry.get("ab_note"):
        t.add_row("-", "-", "-", str(entry["ab_note"]))
    for pair in ab_pairs(entry):
        t.add_row(f"{format_bytes(pair['size_bytes'])} ({pair['label']})",
                  _verdict(pair["p2p"]["verdict"], f" {pair['p2p']['detail']}"),
                  _verdict(pair["p2p_disabled"]["verdict"], f" {pair['p2p_disabled']['detail']}"),
                  _verdict(pair["meaning"], f": {pair['why']}"))
    return t


def nccl_view_table(entry: dict[str, Any]) -> Table:
    topology = entry.get("topology") or {}
    t = new_table(f"NCCL's view of {entry['host']} ({topology.get('ranks')} rank(s), one per GPU)", ("", ""),
                  show_header=False, caption="from NCCL_TOPO_DUMP_FILE / NCCL_GRAPH_DUMP_FILE and its TUNING log; "
                                             "with one rank NCCL sees one GPU")
    t.add_row("run", _verdict(str(topology.get("verdict")), f" {topology.get('detail') or ''}"))
    try:
        for g in parse_graphs(topology["graph_xml"]) if topology.get("graph_xml") else []:
            t.add_row(f"graph: {g.name}", f"{g.nchannels} channel(s), typeintra {g.type_intra}, "
                                          f"{g.speed_intra_gbps:g} GB/s per channel (NCCL's estimate)")
        for cpu in parse_topology(topology["topo_xml"])["cpus"] if topology.get("topo_xml") else []:
            t.add_row(f"CPU NUMA {cpu['numaid']}", f"{cpu['vendor']} family {cpu['familyid']} model {cpu['modelid']}: "
                                                  f"GPUs {cpu['gpus']}")
    except NcclXmlError as exc:
        t.add_row("dump", styled("unreadable", "red", f": {exc}"))
    small = topology.get("small_message") or {}
    t.add_row(f"{format_bytes(small.get('bytes', 0))} allreduce", f"algo {small.get('algo')}, proto {small.get('proto')}")
    for name, value in (topology.get("env") or {}).items():
        t.add_row(f"set: {name}", str(value))
    return t


def placement_table(s: dict[str, Any]) -> Table:
    t = new_table("Islands and placement (from the NVML link matrix and the NUMA nodes' sockets)",
                  ("host", "what", "GPUs", "stays inside"),
                  caption="CUDA ordinals as this probe saw them (relative to its own CUDA_VISIBLE_DEVICES); GPU UUIDs "
                          "in the devices table work too")
    for host, gpus in islands.host_gpus(s).items():
        for level, groups in islands.islands(s, gpus):
            t.add_row(host, f"islands: {level}", " | ".join(",".join(map(str, g)) for g in groups), level)
        if not islands.sockets_known(s, gpus):
            t.add_row(host, "sockets", "-", "unknown: no package ids in this snapshot, NUMA nodes stand in")
        for p in (p for p in islands.placements(s) if p.host == host):
            devices = " | ".join(f"CUDA_VISIBLE_DEVICES={islands.cuda_visible_devices(s, g)}" for g in p.groups)
            levels = ", ".join(sorted(set(p.levels), key=islands.LEVEL_ORDER.index))
            t.add_row(host, f"TP{p.tp} x {len(p.groups)}", devices,
                      styled(levels, "yellow") if p.spans_sockets else levels)
    return t


def driver_table(s: dict[str, Any]) -> Table:
    t = new_table("NVIDIA kernel module (read-only)", ("", ""), show_header=False)
    for name, h in (s.get("hosts") or {}).items():
        m = h.get("nvidia_module") or {}
        t.add_row(name, f"{m.get('flavor')} {m.get('version') or ''} ({m.get('source')})")
        t.add_row("RegistryDwords", str(m.get("registry_dwords") or "(none)"))
    return t


def inert_table(s: dict[str, Any], world_size: int) -> Table:
    t = new_table(f"Settings that do nothing here at world size {world_size}",
                  ("setting", "why", "rule (source, version)"))
    for rule in inert_settings(box.read(s, world_size)):
        t.add_row(rule.setting, rule.why, rule.source)
    return t


def pcie_tables(s: dict[str, Any], world_size: int) -> list[Table]:
    """The tables this snapshot has data for."""
    tables = []
    if (s.get("sm_peer") or {}).get("pairs"):
        tables.append(sm_path_table(s))
    if s.get("gpus") and (s.get("link_under_load") is not None or any(g.get("aer") for g in s["gpus"])):
        tables.append(link_table(s))
    for entry in s.get("nccl_checks") or []:
        tables += [nccl_ab_table(entry), nccl_view_table(entry)]
    if s.get("gpus"):
        tables.append(placement_table(s))
    if any(h.get("nvidia_module") for h in (s.get("hosts") or {}).values()):
        tables.append(driver_table(s))
    if inert_settings(box.read(s, world_size)):
        tables.append(inert_table(s, world_size))
    return tables
