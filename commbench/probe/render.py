"""Print a snapshot as rich tables: devices, links, P2P rows, IPC/VMM/multicast, host facts,
bandwidth, findings, verdicts and the explain section. Reads the dict only; every string from
it prints literally (probe.tables)."""

from __future__ import annotations

from typing import Any, TextIO

from rich.table import Table
from rich.text import Text

from commbench.topology.findings import findings
from commbench.engines.explain import explain
from commbench.probe.render_pcie import pcie_tables
from commbench.probe.tables import literal_console, new_table, styled
from commbench.probe.verdicts import reason_for

STATUS_STYLE = {"ok": "green", "fail": "red", "wrong": "bold red", "hangs": "bold red", "not_run": "yellow"}
# What a missing version means, where the snapshot stores None for "this machine has none".
NO_VERSION = {"nccl": "none (this torch has no NCCL)", "torch_cuda": "none (a CPU build of torch)"}


def _status(check: dict[str, Any] | None) -> Text | str:
    if not check:
        return "-"
    status = str(check.get("status", "?"))
    text = status.upper() if status in ("hangs", "wrong") else status
    detail = f" {check['detail']}" if check.get("detail") else ""
    return styled(text, STATUS_STYLE[status], detail) if status in STATUS_STYLE else text + detail


def _yn(value: Any) -> str:
    return {True: "yes", False: "no", 1: "yes", 0: "no", None: "-"}.get(value, str(value))


def devices_table(s: dict[str, Any]) -> Table:
    t = new_table("Devices", ("GPU", "name", "UUID", "PCI bus", "CC", "memory MiB", "SMs"),
                  whole=("GPU", "UUID", "PCI bus", "CC", "SMs"))
    for g in s.get("gpus") or []:
        t.add_row(str(g["index"]), str(g.get("name", "?")), str(g.get("uuid") or "")[:13],
                  str(g.get("pci_bus_id", "?")), str(g.get("compute_capability", "?")),
                  str(g.get("memory_total_mib", "?")), str(g.get("sm_count", "?")))
    return t


def placement_links_table(s: dict[str, Any]) -> Table:
    """The rest of each device's facts, apart from the devices table so both fit 80 columns."""
    t = new_table("Devices: NUMA, CPUs, PCIe link, BAR1, NVLink, ECC",
                  ("GPU", "NUMA", "CPUs", "PCIe now / max", "BAR1 MiB", "NVLink active", "ECC"))
    for g in s.get("gpus") or []:
        p = g.get("pcie") or {}
        pcie = (f"Gen{p.get('gen_current')} x{p.get('width_current')} / Gen{p.get('gen_max')} x{p.get('width_max')}"
                if p else "-")
        nv = g.get("nvlink") or {}
        ecc = g.get("ecc") or {}
        ecc_text = "-" if not ecc else ("off" if ecc.get("enabled") is False else
                                        f"unc {ecc.get('volatile_uncorrected', 0)}, retired {ecc.get('retired_pages')}")
        t.add_row(str(g["index"]), str(g.get("numa_node", "-")), str(g.get("cpu_affinity") or "-"), pcie,
                  str(g.get("bar1_total_mib", "-")),
                  f"{nv.get('links_active', 0)}/{nv.get('links_total', 0)}" + (" (NVSwitch)" if nv.get("to_switch") else "")
                  if nv else "-", ecc_text)
    return t


def software_table(s: dict[str, Any]) -> Table:
    t = new_table("Software", ("", ""), show_header=False)
    sw = s.get("software") or {}
    for key in ("nvidia_driver", "cuda_driver", "torch", "torch_cuda", "nccl", "python", "commbench"):
        t.add_row(key, NO_VERSION.get(key, "unknown") if sw.get(key) is None else str(sw[key]))
    for name, version in (sw.get("packages") or {}).items():
        t.add_row(str(name), str(version))
    return t


def links_table(s: dict[str, Any]) -> Table:
    links = s.get("links") or {}
    matrix = links.get("matrix") or []
    t = new_table("Links" + (f" — {links['error']}" if links.get("error") else ""),
                  ("", *(f"GPU{j}" for j in range(len(matrix)))),
                  caption="as nvidia-smi topo -m: NV# = NVLink count, PIX/PXB/PHB/NODE/SYS = PCIe path")
    for i, row in enumerate(matrix):
        t.add_row(f"GPU{i}", *map(str, row))
    return t


def p2p_table(s: dict[str, Any]) -> Table:
    t = new_table("P2P per directed pair (each row a separate check, none inferred from another)",
                  ("pair", "cudaDeviceCanAccessPeer", "NVML read/write/atomics/nvlink", "enable peer access",
                   "write-and-verify (SM stores)"))
    for e in s.get("p2p") or []:
        nv = e.get("nvml") or {}
        nv_text = "/".join(str(nv.get(k, "-")) for k in ("read", "write", "atomics", "nvlink")) if nv else "-"
        t.add_row(f"{e['src']} -> {e['dst']}", _yn(e.get("can_access_peer")), nv_text,
                  _status(e.get("enable_peer_access")), _status(e.get("write_verify")))
    return t


def group_table(s: dict[str, Any]) -> Table:
    t = new_table("Cross-process sharing per directed pair (writer -> owner)", ("check", "writer -> owner", "result"))
    labels = {"ipc": "legacy CUDA IPC", "vmm": "cuMemCreate -> POSIX FD -> import -> cuMemSetAccess"}
    for section, label in labels.items():
        group = s.get(section) or {}
        if not group.get("tested"):
            t.add_row(label, "-", "not tested")
        for export in group.get("exports", []):
            if export["status"] != "ok":
                t.add_row(label, f"export by {export['participant']}", _status(export))
        for p in group.get("pairs", []):
            t.add_row(label, f"{p['writer']} -> {p['owner']}", _status(p))
    mc = s.get("multicast") or {}
    attr = ", ".join(f"GPU{g}={v}" for g, v in (mc.get("attribute") or {}).items()) or "-"
    functional = mc.get("functional") or {}
    t.add_row("multicast", f"attribute: {attr}", _status(functional) if functional.get("status") in STATUS_STYLE
              else str(functional.get("status", "-")))
    return t


def capabilities_table(s: dict[str, Any]) -> Table:
    keys = ("unified_addressing", "vmm", "posix_fd_handle", "fabric_handle", "multicast", "gpudirect_rdma")
    t = new_table("Driver attributes per GPU", ("GPU", *keys))
    for g in s.get("gpus") or []:
        attrs = g.get("attributes") or {}
        t.add_row(str(g["index"]), *(_yn(attrs.get(k)) for k in keys))
    return t


def host_table(s: dict[str, Any]) -> Table:
    t = new_table("Host (read-only)", ("", ""), show_header=False)
    for name, h in (s.get("hosts") or {}).items():
        iommu = h.get("iommu") or {}
        t.add_row("host", f"{name}  kernel {h.get('kernel')}  CPU {h.get('cpu')} ({h.get('cpu_count')} threads)")
        t.add_row("NUMA nodes", ", ".join(f"{k}: {v}" for k, v in (h.get("numa_nodes") or {}).items()) or "-")
        t.add_row("IOMMU", f"{iommu.get('mode')} ({iommu.get('source')})")
        t.add_row("PCIe ASPM policy", str(h.get("aspm_policy")))
        t.add_row("nvidia_uvm uvm_disable_hmm", str(h.get("uvm_disable_hmm")))
    for p in s.get("pcie_paths") or []:
        if p.get("error"):
            t.add_row(f"path GPU{p['a']}<->GPU{p['b']}", str(p["error"]))
            continue
        parts = []
        for b in p.get("bridges", []):
            state = b.get("error") or b.get("acs") or " ".join(b.get("flags", []))
            parts.append(f"{b['bdf']} [{state}]")
        t.add_row(f"path GPU{p['a']}<->GPU{p['b']}", "; ".join(parts) or "(same device)")
    return t


def bandwidth_table(s: dict[str, Any]) -> Table:
    bw = s.get("bandwidth") or {}
    gpus = sorted({p["src"] for p in bw.get("pairs", []) if p.get("src") is not None}
                  | {p["dst"] for p in bw.get("pairs", []) if p.get("dst") is not None})
    t = new_table("Copy-engine bandwidth GB/s / small-copy latency us per directed pair (src row, dst column)",
                  ("src \\ dst", *(f"GPU{g}" for g in gpus)), caption=bw.get("method"))
    cell = {(p["src"], p["dst"]): p for p in bw.get("pairs", [])}
    for a in gpus:
        row: list[Text | str] = []
        for b in gpus:
            p = cell.get((a, b))
            if not p:
                row.append("-")
            elif p.get("error"):
                row.append(styled(str(p["error"]), "red"))
            else:
                row.append(f"{p['bandwidth_gbps']:.1f} / {p['latency_us']:.2f}" + ("" if p.get("peer_access") else " (no P2P)"))
        t.add_row(f"GPU{a}", *row)
    return t


def findings_table(s: dict[str, Any]) -> Table:
    t = new_table("Findings", ("level", "code", "finding", "remedy (never applied)"))
    style = {"FAIL": "bold red", "WARN": "yellow", "INFO": "cyan"}
    for f in findings(s):
        t.add_row(styled(f["level"], style[f["level"]]), f["code"], f["message"], f.get("remedy") or "")
    return t


def verdicts_table(s: dict[str, Any], world_size: int, allow_multicast: bool) -> Table:
    from commbench.backends import probe_variants

    t = new_table(f"Backend verdicts at world size {world_size}", ("backend", "verdict"))
    for backend in probe_variants():
        reason = reason_for(backend, s, world_size, allow_multicast)
        unsafe = backend.snapshot_warning(s)
        verdict = styled("can run", "green") if reason is None else styled("skip", "red", f": {reason}")
        if reason is None and unsafe:
            verdict.append(f" (WARN: {unsafe})", style="yellow")
        t.add_row(backend.name, verdict)
    return t


def render(s: dict[str, Any], world_size: int, allow_multicast: bool, file: TextIO | None = None,
           width: int | None = None) -> None:
    """Print every table; to stdout at the terminal's width (80 columns when piped) by default."""
    console = literal_console(file, width)
    console.print(styled("commbench probe", "bold", f" — {s.get('mode')} snapshot taken {s.get('taken_at')}, "
                         f"{len(s.get('gpus') or [])} GPU(s), world size {s.get('world_size')}"))
    for note in s.get("notes") or []:
        console.print(styled(str(note), "yellow"))
    tables = [software_table(s), host_table(s)]
    if s.get("gpus"):
        tables += [devices_table(s), placement_links_table(s), capabilities_table(s), links_table(s), p2p_table(s),
                   group_table(s)]
    if s.get("bandwidth"):
        tables.append(bandwidth_table(s))
    tables += pcie_tables(s, world_size)
    tables += [findings_table(s), verdicts_table(s, world_size, allow_multicast)]
    for table in tables:
        console.print(table)
    console.print(styled("Explain", "bold", " (published rules of each engine; versions named per line)"))
    for line in explain(s, world_size):
        console.print(Text(f"  - {line}"))
