"""What NVML says about the GPUs and the links between them (read-only; no CUDA context).

NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, so everything here is keyed
by UUID and matched to CUDA devices by the snapshot.
"""

from __future__ import annotations

from typing import Any, Callable

# nvmlGpuP2PCapsIndex_t; pynvml's own READ constant is a tuple in some releases, so literal ints.
P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3}
P2P_STATUS = {0: "OK", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
              4: "disabled by regkey", 5: "not supported", 6: "unknown"}
# nvmlGpuTopologyLevel_t -> the nvidia-smi topo -m legend
TOPOLOGY_LEVEL = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NVLINK_REMOTE_SWITCH = 2
MAX_NVLINKS = 36


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(fn: Callable[[], Any], errors: dict[str, str], key: str) -> Any:
    """Run one NVML query; record its error under key instead of failing the whole probe."""
    try:
        return fn()
    except Exception as exc:  # pynvml raises NVMLError subclasses, and AttributeError on old bindings
        errors[key] = _text(exc) or type(exc).__name__
        return None


def load_nvml() -> tuple[Any | None, str | None]:
    try:
        import pynvml
    except ImportError:
        return None, "NVML not queried: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return None, f"NVML unavailable: {_text(exc)}"
    return pynvml, None


def device_facts(nv: Any, handle: Any) -> dict[str, Any]:
    errors: dict[str, str] = {}
    d: dict[str, Any] = {
        "name": _try(lambda: _text(nv.nvmlDeviceGetName(handle)), errors, "name"),
        "uuid": _try(lambda: _text(nv.nvmlDeviceGetUUID(handle)), errors, "uuid"),
        "pci_bus_id": _try(lambda: _text(nv.nvmlDeviceGetPciInfo(handle).busId), errors, "pci_bus_id"),
    }
    d["pcie"] = {
        "gen_current": _try(lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(handle), errors, "pcie_gen_current"),
        "gen_max": _try(lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(handle), errors, "pcie_gen_max"),
        "width_current": _try(lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(handle), errors, "pcie_width_current"),
        "width_max": _try(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(handle), errors, "pcie_width_max"),
        # Link-level retransmissions since the driver loaded: a flaky riser or slot shows here first.
        "replay_counter": _try(lambda: nv.nvmlDeviceGetPcieReplayCounter(handle), errors, "pcie_replay_counter"),
    }
    bar1 = _try(lambda: nv.nvmlDeviceGetBAR1MemoryInfo(handle), errors, "bar1")
    d["bar1_total_mib"] = bar1.bar1Total // (1 << 20) if bar1 is not None else None
    links = []
    for link in range(MAX_NVLINKS):
        try:
            active = bool(nv.nvmlDeviceGetNvLinkState(handle, link))
        except Exception:   # past the last link, or no NVLink at all
            break
        entry: dict[str, Any] = {"link": link, "active": active}
        if active:
            try:
                entry["remote_bus_id"] = _text(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except Exception:
                pass
            try:
                entry["remote_is_switch"] = nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) == NVLINK_REMOTE_SWITCH
            except Exception:
                pass
        links.append(entry)
    d["nvlink"] = {"links_total": len(links), "links_active": sum(1 for e in links if e["active"]),
                   "to_switch": sum(1 for e in links if e.get("remote_is_switch")), "links": links}
    ecc: dict[str, Any] = {}
    mode = _try(lambda: nv.nvmlDeviceGetEccMode(handle), errors, "ecc_mode")
    ecc["enabled"] = bool(mode[0]) if mode is not None else None
    if ecc["enabled"]:
        ecc["volatile_uncorrected"] = _try(lambda: nv.nvmlDeviceGetTotalEccErrors(handle, 1, 0), errors, "ecc")
        ecc["aggregate_uncorrected"] = _try(lambda: nv.nvmlDeviceGetTotalEccErrors(handle, 1, 1), errors, "ecc")
        ecc["volatile_corrected"] = _try(lambda: nv.nvmlDeviceGetTotalEccErrors(handle, 0, 0), errors, "ecc")
    retired = [_try(lambda c=c: len(nv.nvmlDeviceGetRetiredPages(handle, c)), errors, "retired_pages")
               for c in (0, 1)]
    ecc["retired_pages"] = sum(retired) if None not in retired else None
    ecc["retired_pages_pending"] = _try(lambda: bool(nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)),
                                        errors, "retired_pages_pending")
    rows = _try(lambda: nv.nvmlDeviceGetRemappedRows(handle), errors, "remapped_rows")
    if rows is not None:
        ecc["remapped_rows_uncorrectable"], ecc["remap_pending"], ecc["remap_failed"] = rows[1], bool(rows[2]), bool(rows[3])
    d["ecc"] = ecc
    d["fabric_state"] = _try(lambda: fabric_state(nv, handle), errors, "fabric")
    # Only the queries a user can act on are kept as errors; "not supported" on a PCIe part is normal.
    d["nvml_errors"] = {k: v for k, v in errors.items() if "Not Supported" not in v}
    return d


def fabric_state(nv: Any, handle: Any) -> int | None:
    """NVSwitch fabric registration state; bindings differ on whether they allocate the struct."""
    try:
        info = nv.nvmlDeviceGetGpuFabricInfo(handle)
    except TypeError:
        info = nv.c_nvmlGpuFabricInfo_t()
        nv.nvmlDeviceGetGpuFabricInfo(handle, info)
    return getattr(info, "state", None)


def link_label(a: dict[str, Any], b: dict[str, Any], level: int | None) -> str:
    """NV# (NVLink count, switch links for NVSwitch systems) or the PCIe topology level."""
    b_bus = (b.get("pci_bus_id") or "").lower()
    direct = sum(1 for e in a["nvlink"]["links"] if e.get("active") and (e.get("remote_bus_id") or "").lower() == b_bus)
    if direct:
        return f"NV{direct}"
    if a["nvlink"]["to_switch"] and b["nvlink"]["to_switch"]:
        return f"NV{min(a['nvlink']['to_switch'], b['nvlink']['to_switch'])}"
    return TOPOLOGY_LEVEL.get(level, "?") if level is not None else "?"


def collect() -> dict[str, Any]:
    """Everything NVML can say; {'error': ...} when it cannot be used."""
    nv, error = load_nvml()
    if nv is None:
        return {"error": error}
    out: dict[str, Any] = {"driver_version": None, "cuda_driver_version": None, "devices": []}
    errors: dict[str, str] = {}
    out["driver_version"] = _try(lambda: _text(nv.nvmlSystemGetDriverVersion()), errors, "driver")
    cuda = _try(lambda: nv.nvmlSystemGetCudaDriverVersion_v2(), errors, "cuda")
    out["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        out["devices"] = [device_facts(nv, h) for h in handles]
        n = len(handles)
        out["topology"] = [["X"] * n for _ in range(n)]
        out["p2p_status"] = {}
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                level = _try(lambda: nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]), errors, "topology")
                out["topology"][i][j] = link_label(out["devices"][i], out["devices"][j], level)
                status = {}
                for key, index in P2P_CAPS.items():
                    code = _try(lambda: nv.nvmlDeviceGetP2PStatus(handles[i], handles[j], index), errors, "p2p")
                    status[key] = P2P_STATUS.get(code, f"code {code}") if code is not None else None
                out["p2p_status"][f"{i},{j}"] = status
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
    out["errors"] = errors
    return out
