"""Print a snapshot as rich tables: devices, links, P2P rows, IPC/VMM/multicast, host facts,
bandwidth, findings, verdicts and the explain section. Reads the dict only."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from commbench.topology.findings import findings
from commbench.engines import explain
from commbench.topology.render_pcie import pcie_tables
from commbench.topology.verdicts import reason_for

STATUS_STYLE = {"ok": "green", "fail": "red", "wrong": "bold red", "hangs": "bold red", "not_run": "yellow"}


def _status(check: dict[str, Any] | None) -> str:
    if not check:
        return "-"
    status = check.get("status", "?")
    style = STATUS_STYLE.get(status, "")
    text = status.upper() if status in ("hangs", "wrong") else status
    detail = f" {check['detail']}" if check.get("detail") else ""
    return f"[{style}]{text}[/]{detail}" if style else text + detail


def _yn(value: Any) -> str:
    return {True: "yes", False: "no", 1: "yes", 0: "no", None: "-"}.get(value, str(value))


def devices_table(s: dict[str, Any]) -> Table:
    t = Table(title="Devices", title_justify="left")
    for col in ("GPU", "name", "UUID", "PCI bus", "CC", "memory MiB", "SMs", "NUMA", "CPUs", "PCIe now/max",
                "BAR1 MiB", "NVLink active", "ECC"):
        t.add_column(col)
    for g in s.get("gpus") or []:
        p = g.get("pcie") or {}
        pcie = (f"Gen{p.get('gen_current')} x{p.get('width_current')} / Gen{p.get('gen_max')} x{p.get('width_max')}"
                if p else "-")
        nv = g.get("nvlink") or {}
        ecc = g.get("ecc") or {}
        ecc_text = "-" if not ecc else ("off" if ecc.get("enabled") is False else
                                        f"unc {ecc.get('volatile_uncorrected', 0)}, retired {ecc.get('retired_pages')}")
        t.add_row(str(g["index"]), g.get("name", "?"), (g.get("uuid") or "")[:13], g.get("pci_bus_id", "?"),
                  g.get("compute_capability", "?"), str(g.get("memory_total_mib", "?")), str(g.get("sm_count", "?")),
                  str(g.get("numa_node", "-")), str(g.get("cpu_affinity") or "-"), pcie,
                  str(g.get("bar1_total_mib", "-")),
                  f"{nv.get('links_active', 0)}/{nv.get('links_total', 0)}" + (" (NVSwitch)" if nv.get("to_switch") else "")
                  if nv else "-", ecc_text)
    return t


def software_table(s: dict[str, Any]) -> Table:
    t = Table(title="Software", title_justify="left", show_header=False)
    sw = s.get("software") or {}
    for key in ("nvidia_driver", "cuda_driver", "torch", "torch_cuda", "nccl", "python", "commbench"):
        t.add_row(key, str(sw.get(key)))
    for name, version in (sw.get("packages") or {}).items():
        t.add_row(name, version)
    return t


def links_table(s: dict[str, Any]) -> Table:
    links = s.get("links") or {}
    matrix = links.get("matrix") or []
    t = Table(title="Links" + (f" — {links['error']}" if links.get("error") else ""), title_justify="left",
              caption="as nvidia-smi topo -m: NV# = NVLink count, PIX/PXB/PHB/NODE/SYS = PCIe path")
    t.add_column("")
    for j in range(len(matrix)):
        t.add_column(f"GPU{j}")
    for i, row in enumerate(matrix):
        t.add_row(f"GPU{i}", *row)
    return t


def p2p_table(s: dict[str, Any]) -> Table:
    t = Table(title="P2P per directed pair (each row a separate check, none inferred from another)",
              title_justify="left")
    for col in ("pair", "cudaDeviceCanAccessPeer", "NVML read/write/atomics/nvlink", "enable peer access",
                "write-and-verify (SM stores)"):
        t.add_column(col)
    for e in s.get("p2p") or []:
        nv = e.get("nvml") or {}
        nv_text = "/".join(str(nv.get(k, "-")) for k in ("read", "write", "atomics", "nvlink")) if nv else "-"
        t.add_row(f"{e['src']} -> {e['dst']}", _yn(e.get("can_access_peer")), nv_text,
                  _status(e.get("enable_peer_access")), _status(e.get("write_verify")))
    return t


def group_table(s: dict[str, Any]) -> Table:
    t = Table(title="Cross-process sharing per directed pair (writer -> owner)", title_justify="left")
    for col in ("check", "writer -> owner", "result"):
        t.add_column(col)
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
    t = Table(title="Driver attributes per GPU", title_justify="left")
    keys = ("unified_addressing", "vmm", "posix_fd_handle", "fabric_handle", "multicast", "gpudirect_rdma")
    t.add_column("GPU")
    for k in keys:
        t.add_column(k)
    for g in s.get("gpus") or []:
        attrs = g.get("attributes") or {}
        t.add_row(str(g["index"]), *(_yn(attrs.get(k)) for k in keys))
    return t


def host_table(s: dict[str, Any]) -> Table:
    t = Table(title="Host (read-only)", title_justify="left", show_header=False)
    for name, h in (s.get("hosts") or {}).items():
        iommu = h.get("iommu") or {}
        t.add_row("host", f"{name}  kernel {h.get('kernel')}  CPU {h.get('cpu')} ({h.get('cpu_count')} threads)")
        t.add_row("NUMA nodes", ", ".join(f"{k}: {v}" for k, v in (h.get("numa_nodes") or {}).items()) or "-")
        t.add_row("IOMMU", f"{iommu.get('mode')} ({iommu.get('source')})")
        t.add_row("PCIe ASPM policy", str(h.get("aspm_policy")))
        t.add_row("nvidia_uvm uvm_disable_hmm", str(h.get("uvm_disable_hmm")))
    for p in s.get("pcie_paths") or []:
        if p.get("error"):
            t.add_row(f"path GPU{p['a']}<->GPU{p['b']}", p["error"])
            continue
        parts = []
        for b in p.get("bridges", []):
            state = b.get("error") or b.get("acs") or " ".join(b.get("flags", []))
            parts.append(f"{b['bdf']} [{state}]")
        t.add_row(f"path GPU{p['a']}<->GPU{p['b']}", "; ".join(parts) or "(same device)")
    return t


def bandwidth_table(s: dict[str, Any]) -> Table:
    bw = s.get("bandwidth") or {}
    t = Table(title="Copy-engine bandwidth GB/s / small-copy latency us per directed pair (src row, dst column)",
              title_justify="left", caption=bw.get("method"))
    gpus = sorted({p["src"] for p in bw.get("pairs", []) if p.get("src") is not None}
                  | {p["dst"] for p in bw.get("pairs", []) if p.get("dst") is not None})
    t.add_column("src \\ dst")
    for g in gpus:
        t.add_column(f"GPU{g}")
    cell = {(p["src"], p["dst"]): p for p in bw.get("pairs", [])}
    for a in gpus:
        row = []
        for b in gpus:
            p = cell.get((a, b))
            if not p:
                row.append("-")
            elif p.get("error"):
                row.append(f"[red]{p['error']}[/]")
            else:
                row.append(f"{p['bandwidth_gbps']:.1f} / {p['latency_us']:.2f}" + ("" if p.get("peer_access") else " (no P2P)"))
        t.add_row(f"GPU{a}", *row)
    return t


def findings_table(s: dict[str, Any]) -> Table:
    t = Table(title="Findings", title_justify="left")
    for col in ("level", "code", "finding", "remedy (never applied)"):
        t.add_column(col)
    style = {"FAIL": "bold red", "WARN": "yellow", "INFO": "cyan"}
    for f in findings(s):
        t.add_row(f"[{style[f['level']]}]{f['level']}[/]", f["code"], f["message"], f.get("remedy") or "")
    return t


def verdicts_table(s: dict[str, Any], world_size: int, allow_multicast: bool) -> Table:
    from commbench.backends import probe_variants

    t = Table(title=f"Backend verdicts at world size {world_size}", title_justify="left")
    t.add_column("backend")
    t.add_column("verdict")
    for backend in probe_variants():
        reason = reason_for(backend, s, world_size, allow_multicast)
        unsafe = backend.snapshot_warning(s)
        verdict = "[green]can run[/]" if reason is None else f"[red]skip[/]: {reason}"
        if reason is None and unsafe:
            verdict += f" [yellow](WARN: {unsafe})[/]"
        t.add_row(backend.name, verdict)
    return t


def render(s: dict[str, Any], world_size: int, allow_multicast: bool, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"[bold]commbench probe[/] — {s.get('mode')} snapshot taken {s.get('taken_at')}, "
                  f"{len(s.get('gpus') or [])} GPU(s), world size {s.get('world_size')}")
    for note in s.get("notes") or []:
        console.print(f"[yellow]{note}[/]")
    tables = [software_table(s), host_table(s)]
    if s.get("gpus"):
        tables += [devices_table(s), capabilities_table(s), links_table(s), p2p_table(s), group_table(s)]
    if s.get("bandwidth"):
        tables.append(bandwidth_table(s))
    tables += pcie_tables(s, world_size)
    tables += [findings_table(s), verdicts_table(s, world_size, allow_multicast)]
    for table in tables:
        console.print(table)
    console.print("[bold]Explain[/] (published rules of each engine; versions named per line)")
    for line in explain(s, world_size):
        console.print(f"  - {line}")
