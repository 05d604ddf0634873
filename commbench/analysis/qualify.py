"""`commbench qualify --spec SPEC.toml RUN_DIR`: PASS / WARN / FAIL per check, exit 1 on any FAIL.

A spec names the machine class and its limits (see commbench/specs/*.toml). Fabric checks read
the probe snapshot stored in run.json; anything the probe did not record is a WARN "not probed",
never a silent PASS. Measurement checks read trusted rows only. The PCIe-box checks (SM peer
path, NCCL A/B, links under load, AER, NCCL's view, TP across sockets) run where a spec turns
them on, on a probe snapshot taken with --bandwidth --nccl (`--snapshot FILE`).

The output starts with the run's provenance. A run that is not real hardware (a fixture, an
emulated run, a CPU run) FAILs "real hardware", every check of it says so with the same prefix
("fixture data: ", "emulated data: ", "CPU data: "), and no check that its data would pass about the
machine (fabric from its own snapshot, latency, bus bandwidth, reference; a fixture's correctness
too) is a PASS: each becomes a WARN. The correctness checks are scoped to the backends the spec
names ([spec] backend, each limit's backend, [reference] backends): a failing kernel outside them
is a WARN, never a FAIL of a spec about NCCL and the machine.

A check whose data the run never measured (a size no row reached, a backend with no rows, a
reference with nothing in common) is "not measured": neither a PASS nor a FAIL. The verdict is
PASS only when every check was measured and none failed; with a check not measured and none
failed it is INCOMPLETE. Exit status: 0 on PASS, 1 on FAIL or INCOMPLETE (a CI gate passes on a
measured PASS only; the verdict tells the two apart), 2 on bad input.
"""

from __future__ import annotations

import argparse
import difflib
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from commbench.analysis import next_steps, provenance, render, results_out
from commbench.analysis.curves import (INTERPOLATED, Curve, build_curves, exceeds_spread, is_failed_check, pick_mode,
                                      price, run_world_size, select, variant_label)
from commbench.errors import UsageError
from commbench.files import check_file_target, read_text
from commbench.ops import ALLREDUCE
from commbench.results import CRASHED, ERROR, HANG, SKIPPED, Measurement, Run
from commbench.results.validate import SPEC_MAX_BYTES, loads_toml
from commbench.runs import load_run
from commbench.topology import islands, nccl_checks
from commbench.topology import pcie_findings as pf
from commbench.units import DTYPE_BYTES, format_bytes, parse_bytes

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
NOT_MEASURED = "not measured"   # the run has no measurement the check reads: neither PASS nor FAIL
INCOMPLETE = "INCOMPLETE"       # the verdict where a check is not measured and none failed

_SPEC_KEYS = {"name", "description", "world_size", "dtype", "mode", "backend"}
_CHECK_KEYS = {"p2p_all_pairs", "pcie_link_at_max", "no_acs_redirect", "zero_wrong", "no_hangs",
               "p2p_sm_path", "nccl_collective_ab", "link_under_load", "aer_clean", "nccl_topology",
               "tp_within_socket"}
# [fabric.<check>] tables: the thresholds of the PCIe-box checks and the figure behind them.
_FABRIC_KEYS = {"p2p_sm_path": {"min_ratio", "max_read_latency_us", "source"},
                "aer_clean": {"max_correctable", "source"}, "nccl_collective_ab": {"source"},
                "link_under_load": {"source"}, "nccl_topology": {"source"}, "tp_within_socket": {"source"}}
_LATENCY_KEYS = {"size", "max_us", "warn_us", "backend", "source"}
_BUSBW_KEYS = {"size", "min_gbps", "warn_gbps", "backend", "source"}
_REFERENCE_KEYS = {"run", "max_slowdown_pct", "warn_slowdown_pct", "sizes", "backends", "source"}
_TOP_KEYS = {"spec", "checks", "latency", "busbw", "reference", "fabric"}
P2P_CHECK = "functional P2P on every pair"
LINK_CHECK = "PCIe link width and generation at max"
ACS_CHECK = "no ACS redirect between GPUs"


@dataclass
class Limit:
    """One latency (upper) or busbw (lower) threshold at one message size."""

    message_bytes: int
    fail_at: float
    warn_at: float | None
    backend: str
    source: str


@dataclass
class ReferenceSpec:
    run: Path
    max_slowdown_pct: float
    warn_slowdown_pct: float | None
    sizes: list[int] | None
    backends: list[str] | None
    source: str


@dataclass
class Spec:
    path: Path
    name: str
    world_size: int | None
    dtype: str
    mode: str
    checks: dict[str, bool]
    latency: list[Limit] = field(default_factory=list)
    busbw: list[Limit] = field(default_factory=list)
    reference: ReferenceSpec | None = None
    fabric: dict[str, dict[str, Any]] = field(default_factory=dict)
    backend: str = "nccl"   # [spec] backend: the default of every limit

    def backends(self) -> set[str]:
        """The backends the spec is about: its own, each limit's, its reference's."""
        names = {self.backend} | {limit.backend for limit in self.latency + self.busbw}
        return names | set(self.reference.backends or []) if self.reference is not None else names

    def message_sizes(self) -> list[int]:
        """Every size a latency or busbw limit reads (a sweep for this spec must cover them)."""
        return sorted({limit.message_bytes for limit in self.latency + self.busbw})


def in_scope(backend: str, names: set[str]) -> bool:
    """Is a row's backend one the spec names? A family name (nccl) covers its variants
    (nccl:proto=LL, nccl:lib=...); a variant name covers itself only."""
    return backend in names or backend.split(":")[0] in {n for n in names if ":" not in n}


@dataclass
class Result:
    group: str
    name: str
    status: str
    detail: str
    source: str = ""
    command: str = ""      # the command that would answer the check (printed whole, below the table)


# ---------------------------------------------------------------- spec parsing

def _table(path: Path, where: str, value: Any) -> dict[str, Any]:
    """A TOML table, or bad input naming where (`spec = 5` is not a [spec] table)."""
    if not isinstance(value, dict):
        raise UsageError(f"{path}: {where} must be a table, got {value!r}")
    return value


def _unknown(path: Path, where: str, data: Any, known: set[str]) -> dict[str, Any]:
    """The table, checked for keys the spec format does not have (with the nearest known one)."""
    table = _table(path, where, data)
    for key in table:
        if key not in known:
            hint = difflib.get_close_matches(key, sorted(known), n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(sorted(known))})"
            raise UsageError(f"{path}: unknown key {key!r} in {where}{suggestion}")
    return table


def _number(path: Path, where: str, data: dict[str, Any], key: str, required: bool = True) -> float | None:
    if key not in data:
        if required:
            raise UsageError(f"{path}: {where} needs {key!r}")
        return None
    value = data[key]
    # TOML has nan and inf: a limit of either would pass or fail everything without a word.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise UsageError(f"{path}: {where} {key} must be a non-negative finite number, got {value!r}")
    return float(value)


def _text(path: Path, where: str, data: dict[str, Any], key: str, default: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise UsageError(f"{path}: {where} {key} must be a string, got {value!r}")
    return value


def _texts(path: Path, where: str, data: dict[str, Any], key: str) -> list[str] | None:
    value = data.get(key)
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise UsageError(f"{path}: {where} {key} must be a list of strings, got {value!r}")
    return value


def _world_size(path: Path, head: dict[str, Any]) -> int | None:
    value = head.get("world_size")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UsageError(f"{path}: [spec] world_size must be a whole number of ranks, got {value!r}")
    return value


def _size(path: Path, where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UsageError(f"{path}: {where}: size must be bytes or a text like '4K', got {value!r}")
    try:
        return parse_bytes(str(value))
    except UsageError as exc:
        raise UsageError(f"{path}: {where}: {exc}") from None


def _limits(path: Path, table: str, entries: Any, keys: set[str], fail_key: str, warn_key: str,
            default_backend: str) -> list[Limit]:
    if not isinstance(entries, list):
        raise UsageError(f"{path}: [[{table}]] must be an array of tables")
    out = []
    for i, entry in enumerate(entries, start=1):
        where = f"[[{table}]] #{i}"
        entry = _unknown(path, where, entry, keys)
        if "size" not in entry:
            raise UsageError(f"{path}: {where} needs 'size'")
        out.append(Limit(_size(path, where, entry["size"]), _number(path, where, entry, fail_key),  # type: ignore[arg-type]
                         _number(path, where, entry, warn_key, required=False),
                         _text(path, where, entry, "backend", default_backend),
                         _text(path, where, entry, "source", "")))
    return out


def _fabric(path: Path, tables: Any) -> dict[str, dict[str, Any]]:
    tables = _unknown(path, "[fabric]", tables, set(_FABRIC_KEYS))
    out = {}
    for check, entry in tables.items():
        where = f"[fabric.{check}]"
        entry = _unknown(path, where, entry, _FABRIC_KEYS[check])
        out[check] = {k: (_text(path, where, entry, k, "") if k == "source" else _number(path, where, entry, k))
                      for k in entry}
    return out


def _reference(path: Path, ref: Any) -> ReferenceSpec:
    ref = _unknown(path, "[reference]", ref, _REFERENCE_KEYS)
    if "run" not in ref:
        raise UsageError(f"{path}: [reference] needs 'run' (a results dir, relative to the spec)")
    sizes = ref.get("sizes")
    if sizes is not None and not isinstance(sizes, list):
        raise UsageError(f"{path}: [reference] sizes must be a list of sizes, got {sizes!r}")
    return ReferenceSpec(
        path.parent / _text(path, "[reference]", ref, "run", ""),
        _number(path, "[reference]", ref, "max_slowdown_pct"),  # type: ignore[arg-type]
        _number(path, "[reference]", ref, "warn_slowdown_pct", required=False),
        [_size(path, "[reference] sizes", s) for s in sizes] if sizes is not None else None,
        _texts(path, "[reference]", ref, "backends"), _text(path, "[reference]", ref, "source", ""))


def load_spec(path: Path) -> Spec:
    data = loads_toml(read_text(path, "a qualify spec (TOML)", SPEC_MAX_BYTES), str(path))
    _unknown(path, "the spec", data, _TOP_KEYS)
    head = _unknown(path, "[spec]", data.get("spec", {}), _SPEC_KEYS)
    mode = _text(path, "[spec]", head, "mode", "graph")
    if mode not in ("graph", "eager", "any"):
        raise UsageError(f"{path}: [spec] mode must be graph, eager or any, got {mode!r}")
    dtype = _text(path, "[spec]", head, "dtype", "bf16")
    if dtype not in DTYPE_BYTES:
        raise UsageError(f"{path}: [spec] dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    checks = _unknown(path, "[checks]", data.get("checks", {}), _CHECK_KEYS)
    for key, value in checks.items():
        if not isinstance(value, bool):
            raise UsageError(f"{path}: [checks] {key} must be true or false")
    backend = _text(path, "[spec]", head, "backend", "nccl")
    spec = Spec(path, _text(path, "[spec]", head, "name", path.stem), _world_size(path, head), dtype,
                "auto" if mode == "any" else mode, dict(checks),
                _limits(path, "latency", data.get("latency", []), _LATENCY_KEYS, "max_us", "warn_us", backend),
                _limits(path, "busbw", data.get("busbw", []), _BUSBW_KEYS, "min_gbps", "warn_gbps", backend),
                backend=backend)
    spec.fabric = _fabric(path, data.get("fabric", {}))
    if "reference" in data:
        spec.reference = _reference(path, data["reference"])
    return spec


# ---------------------------------------------------------------- fabric checks (probe snapshot)

def check_p2p(snapshot: dict[str, Any]) -> Result:
    pairs = snapshot.get("p2p")
    if pairs is None:
        return Result("fabric", P2P_CHECK, WARN, "not probed: the snapshot has no P2P results")
    if not pairs:
        return Result("fabric", P2P_CHECK, WARN, "not probed: fewer than two GPUs")
    bad, unknown = [], []
    for p in pairs:
        verify = p.get("write_verify")
        if not isinstance(verify, dict) or verify.get("status") in (None, "not_run"):
            unknown.append(f"{p.get('src')}->{p.get('dst')}")
        elif verify.get("status") != "ok":
            bad.append(f"{p.get('src')}->{p.get('dst')} {verify.get('status')}")
    if bad:
        return Result("fabric", P2P_CHECK, FAIL,
                      f"{len(bad)} of {len(pairs)} directed pairs failed write-and-verify: {', '.join(bad[:8])}")
    if unknown:
        return Result("fabric", P2P_CHECK, WARN,
                      f"not probed on {len(unknown)} of {len(pairs)} pairs: {', '.join(unknown[:8])}")
    return Result("fabric", P2P_CHECK, PASS, f"write-and-verify ok on all {len(pairs)} directed pairs")


def check_links(snapshot: dict[str, Any]) -> Result:
    name = LINK_CHECK
    gpus = snapshot.get("gpus")
    if not gpus:
        return Result("fabric", name, WARN, "not probed: the snapshot lists no GPUs")
    narrow, slow, unknown = [], [], []
    for gpu in gpus:
        link = gpu.get("pcie") or {}
        idx = gpu.get("index", "?")
        if link.get("width_current") is None or link.get("width_max") is None:
            unknown.append(str(idx))
            continue
        if link["width_current"] < link["width_max"]:
            narrow.append(f"GPU {idx} x{link['width_current']} of x{link['width_max']}")
        if None not in (link.get("gen_current"), link.get("gen_max")) and link["gen_current"] < link["gen_max"] \
                and not pf.at_max_under_load(snapshot, idx):   # a loaded reading at max clears an idle one
            slow.append(f"GPU {idx} Gen{link['gen_current']} of Gen{link['gen_max']}")
    if narrow:
        return Result("fabric", name, FAIL, "link trained narrower than it can: " + ", ".join(narrow))
    if unknown:
        return Result("fabric", name, WARN, f"not probed for GPU {', '.join(unknown)} (NVML link facts missing)")
    if slow:
        # Idle GPUs drop their PCIe generation to save power; only a loaded link must run at max.
        return Result("fabric", name, WARN, "below max generation (normal when idle: re-probe under load): "
                      + ", ".join(slow))
    return Result("fabric", name, PASS, f"all {len(gpus)} GPUs at max width and generation")


def check_acs(snapshot: dict[str, Any]) -> Result:
    name = ACS_CHECK
    paths = snapshot.get("pcie_paths")
    if paths is None:
        return Result("fabric", name, WARN, "not probed: the snapshot has no PCIe paths")
    redirect, unreadable = set(), set()
    for path in paths:
        if path.get("error"):
            unreadable.add(f"GPU {path.get('a')}-{path.get('b')}: {path['error']}")
        for bridge in path.get("bridges") or []:
            if bridge.get("error"):
                unreadable.add(f"{bridge.get('bdf')}: {bridge['error']}")
            elif bridge.get("req_redir") or bridge.get("cmplt_redir"):
                redirect.add(f"{bridge.get('bdf')} (ACSCtl {bridge.get('acs_ctl')}) on GPU {path.get('a')}-{path.get('b')}")
    if redirect:
        return Result("fabric", name, FAIL, "P2P is redirected through the root complex / IOMMU at "
                      + "; ".join(sorted(redirect)[:6]) + " (fix with BIOS ACS off or pci=noacs; commbench never "
                      "writes config space)")
    if unreadable:
        return Result("fabric", name, WARN, "not probed: " + "; ".join(sorted(unreadable)[:4]))
    if not paths:
        return Result("fabric", name, WARN, "not probed: no GPU pairs on a PCIe path")
    return Result("fabric", name, PASS, f"no redirect bits on the bridges of {len(paths)} GPU pairs")


# ---------------------------------------------------------------- PCIe-box checks (probe --bandwidth --nccl)

SM_PATH_CHECK = "SM peer path close to the copy-engine path"
NCCL_AB_CHECK = "NCCL allreduce correct with and without P2P"
LOAD_CHECK = "PCIe links at max while busy"
AER_CHECK = "no PCIe link errors (AER, replays)"
NCCL_VIEW_CHECK = "NCCL's topology view"
SOCKET_CHECK = "TP group inside one socket"
CLUB_3090_SOURCE = ("4 B (LL) and 16 MiB (Simple) exact allreduce vs an NCCL_P2P_DISABLE=1 control "
                    "(club-3090 p2p_collective_check)")


# One snapshot answers every fabric check: the probe with all its readings.
PROBE_ALL = next_steps.probe_command("--bandwidth", "--nccl")


def _not_probed(name: str, flag: str, source: str) -> Result:
    return Result("fabric", name, WARN, f"not probed: the snapshot has no {flag} reading (take it on the box with "
                                        "the command below, then qualify with --snapshot probe.json)", source,
                  PROBE_ALL)


def _pairs_text(rows: list[dict[str, Any]], what: str) -> str:
    return ", ".join(f"{r['src']}->{r['dst']} {what.format(**r)}" for r in rows[:6])


def check_sm_path(snapshot: dict[str, Any], limits: dict[str, Any]) -> Result:
    name, source = SM_PATH_CHECK, limits.get("source", f"{pf.SM_TO_COPY_SOURCE}; {pf.SM_READ_LATENCY_SOURCE}")
    min_ratio = limits.get("min_ratio", pf.SM_TO_COPY_MIN_RATIO)
    max_us = limits.get("max_read_latency_us", pf.SM_READ_LATENCY_MAX_US)
    if not snapshot.get("sm_peer"):
        return _not_probed(name, "--bandwidth", source)
    rows = [r for r in pf.sm_path_rows(snapshot) if r["src"] != r["dst"]]
    if not rows:
        return Result("fabric", name, WARN, "not probed: fewer than two GPUs (a GPU with itself measures no fabric)",
                      source)
    broken = [r for r in rows if r.get("status") in ("hangs", "fail")]
    staged, slow = pf.staged_pairs(snapshot, min_ratio), pf.slow_latency_pairs(snapshot, max_us)
    if broken or staged or slow:
        parts = ([f"SM kernels {_pairs_text(broken, '{status}')}"] if broken else []) + \
                ([f"below {min_ratio:g}x of the copy engine: {_pairs_text(staged, '{ratio:.2f}x')}"] if staged else []) + \
                ([f"read latency above {max_us:g} us: {_pairs_text(slow, '{read_latency_us:g} us')}"] if slow else [])
        return Result("fabric", name, FAIL, "; ".join(parts), source)
    unmeasured = [r for r in rows if r["ratio"] is None]
    if unmeasured:
        return Result("fabric", name, WARN, f"not probed on {len(unmeasured)} of {len(rows)} pairs: "
                      + _pairs_text(unmeasured, "{status}"), source)
    low = min(rows, key=lambda r: r["ratio"])
    return Result("fabric", name, PASS, f"{len(rows)} pairs; lowest SM/copy {low['ratio']:.2f}x "
                  f"(limit {min_ratio:g}), highest read latency {max(r['read_latency_us'] for r in rows):g} us "
                  f"(limit {max_us:g})", source)


def check_nccl_ab(snapshot: dict[str, Any], limits: dict[str, Any]) -> Result:
    name, source = NCCL_AB_CHECK, limits.get("source", CLUB_3090_SOURCE)
    entries = snapshot.get("nccl_checks")
    if entries is None:
        return _not_probed(name, "--nccl", source)
    pairs = [(e["host"], p) for e in entries for p in pf.ab_pairs(e)]
    if not pairs:
        notes = "; ".join(e.get("ab_note") or "no runs" for e in entries) or "no host ran it"
        return Result("fabric", name, WARN, f"not probed: {notes}", source)
    faults = [f"{h} {format_bytes(p['size_bytes'])}: {p['why']}" for h, p in pairs if p["meaning"] == nccl_checks.P2P_FAULT]
    if faults:
        return Result("fabric", name, FAIL, "; ".join(faults), source)
    unsure = [f"{h} {format_bytes(p['size_bytes'])}: {p['why']}" for h, p in pairs if p["meaning"] != nccl_checks.HEALTHY]
    if unsure:
        return Result("fabric", name, WARN, "inconclusive: " + "; ".join(unsure), source)
    sizes = sorted({p["size_bytes"] for _, p in pairs})
    return Result("fabric", name, PASS, f"exact with and without P2P at {', '.join(format_bytes(b) for b in sizes)}",
                  source)


def check_link_under_load(snapshot: dict[str, Any], limits: dict[str, Any]) -> Result:
    name, source = LOAD_CHECK, limits.get("source", pf.LINK_LOAD_SOURCE)
    readings = snapshot.get("link_under_load")
    if readings is None:
        return _not_probed(name, "--bandwidth", source)
    low = [r for r in readings if pf.below_max(r)]
    if low:
        return Result("fabric", name, FAIL, "below max while busy: " + ", ".join(
            f"GPU {r['gpu']} Gen{r['gen_current']} x{r['width_current']} of Gen{r['gen_max']} x{r['width_max']}"
            for r in low), source)
    if not readings:
        return Result("fabric", name, WARN, "not probed: no GPU link was read while busy", source)
    unread = [r for r in readings if r.get("error") or not r.get("gen_current")]
    if unread:
        return Result("fabric", name, WARN, "not probed: no sysfs link state for GPU "
                      + ", ".join(str(r["gpu"]) for r in unread), source)
    return Result("fabric", name, PASS, f"all {len(readings)} GPUs at their maximum while busy", source)


def check_aer(snapshot: dict[str, Any], limits: dict[str, Any]) -> Result:
    name, source = AER_CHECK, limits.get("source", pf.AER_SOURCE)
    max_correctable = limits.get("max_correctable", 0)
    gpus = snapshot.get("gpus") or []
    if not any("aer" in g for g in gpus):
        return Result("fabric", name, WARN, "not probed: the snapshot has no AER reading (take it again on the box "
                                            "with the command below)", source, PROBE_ALL)
    rows = pf.aer_rows(snapshot)
    bad = [f"GPU {r['gpu']} {r['end']} nonfatal {r['nonfatal']} fatal {r['fatal']}" for r in rows
           if r["nonfatal"] or r["fatal"]]
    if bad:
        return Result("fabric", name, FAIL, "uncorrectable errors since boot: " + ", ".join(bad), source)
    noisy = [f"GPU {r['gpu']} {r['end']} {r['correctable']}" for r in rows if r["correctable"] > max_correctable]
    replays = [f"GPU {g['index']} {g['pcie']['replay_counter']}" for g in gpus
               if ((g.get("pcie") or {}).get("replay_counter") or 0) > max_correctable]
    if noisy or replays:
        return Result("fabric", name, WARN, ", ".join(
            (["correctable errors: " + ", ".join(noisy)] if noisy else [])
            + (["NVML replays: " + ", ".join(replays)] if replays else [])) + f" (limit {max_correctable:g})", source)
    if not rows:
        return Result("fabric", name, WARN, "not probed: no AER counters readable (kernel without AER reporting?)",
                      source)
    return Result("fabric", name, PASS, f"no errors on {len(rows)} link ends", source)


def check_nccl_view(snapshot: dict[str, Any], limits: dict[str, Any]) -> Result:
    name, source = NCCL_VIEW_CHECK, limits.get("source", "rtx6kpro optimization/nccl-tuning.md")
    entries = snapshot.get("nccl_checks")
    if entries is None:
        return _not_probed(name, "--nccl", source)
    found = [f for e in entries for f in pf.nccl_view_findings({"nccl_checks": [e]})]
    if found:
        return Result("fabric", name, WARN, "; ".join(f"{f['message']} -> {f['remedy'] or 'see the probe'}"
                                                      for f in found), source)
    if all((e.get("topology") or {}).get("ranks", 0) < 2 for e in entries):
        return Result("fabric", name, WARN, "not probed: NCCL ran with one rank and saw one GPU", source)
    return Result("fabric", name, PASS, "no SYS-only graph, more than 2 channels, LL for a 32 KiB allreduce", source)


def check_tp_socket(snapshot: dict[str, Any], limits: dict[str, Any], world_size: int | None) -> Result:
    name, source = SOCKET_CHECK, limits.get("source", pf.SOCKET_SOURCE)
    hosts = islands.host_gpus(snapshot)
    if not hosts:
        return Result("fabric", name, WARN, "not probed: the snapshot places no GPU on a host", source)
    if not (snapshot.get("links") or {}).get("matrix"):
        return Result("fabric", name, WARN, "not probed: the snapshot has no GPU link matrix (take it again on the box "
                                            "with the command below)", source, PROBE_ALL)
    host, gpus = next(iter(hosts.items()))
    tp = world_size or len(gpus)
    if tp > len(gpus):
        return Result("fabric", name, WARN, f"not probed: TP{tp} needs more than the {len(gpus)} GPUs of {host}",
                      source)
    p = islands.placement(snapshot, host, gpus, tp, 1)
    detail = f"TP{tp} on {host} GPUs {','.join(map(str, p.groups[0]))}: {p.levels[0]}"
    return Result("fabric", name, WARN if p.spans_sockets else PASS, detail, source)


# ---------------------------------------------------------------- measurement checks

def _wrong_text(rows: list[Measurement]) -> str:
    return ", ".join(sorted({f"{r.backend} {r.mode} {format_bytes(r.message_bytes)} #wrong {r.wrong_elements}"
                             for r in rows})[:6])


def _hung_text(rows: list[Measurement]) -> str:
    return ", ".join(sorted({f"{r.backend} {format_bytes(r.message_bytes)} {r.status}" for r in rows})[:6])


def no_data(name: str, scope: set[str], required: bool, outside: str = "") -> Result:
    """A check that found no rows to read checked nothing: never a PASS. Not measured where the
    spec asks for the check by name ([checks] KEY = true), WARN where it runs by default; what it
    saw outside the spec's backends is said too."""
    return Result("correctness", name, NOT_MEASURED if required else WARN,
                  f"not measured: the run has no rows of {', '.join(sorted(scope))} to check"
                  + ("; the spec requires this check" if required else "") + outside)


def check_wrong(run: Run, scope: set[str], required: bool = False) -> Result:
    bad: list[Measurement] = []
    checked = 0
    for r in run.rows:   # one pass: a large run's rows are made one at a time (CompactRows)
        if is_failed_check(r) and r.status not in (HANG, CRASHED):
            bad.append(r)
        if r.wrong_elements is not None and in_scope(r.backend, scope):
            checked += 1
    mine = [r for r in bad if in_scope(r.backend, scope)]
    if mine:
        return Result("correctness", "zero #wrong", FAIL,
                      f"{len(mine)} row(s) with wrong results: {_wrong_text(mine)}")
    if not checked:
        return no_data("zero #wrong", scope, required, f"; outside the spec's backends, {len(bad)} row(s) with wrong "
                       f"results: {_wrong_text(bad)}" if bad else "")
    if bad:
        return Result("correctness", "zero #wrong", WARN,
                      f"{checked} checked rows of {', '.join(sorted(scope))}, none wrong; outside the spec's backends, "
                      f"{len(bad)} row(s) with wrong results: {_wrong_text(bad)}")
    return Result("correctness", "zero #wrong", PASS, f"{checked} checked rows of {', '.join(sorted(scope))}, none wrong")


def check_hangs(run: Run, scope: set[str], required: bool = False) -> Result:
    """A hang or a crash (a rank's process died) FAILs: neither may happen while serving."""
    hung: list[Measurement] = []
    errors: list[Measurement] = []
    rows = skipped = 0
    for r in run.rows:   # one pass (see check_wrong)
        own = in_scope(r.backend, scope)
        # Only a row that ran can show that nothing hung: a skipped row never called the backend.
        ran = r.status != SKIPPED
        rows += own and ran
        skipped += own and not ran
        if r.status in (HANG, CRASHED):
            hung.append(r)
        elif r.status == ERROR and own:
            errors.append(r)
    mine = [r for r in hung if in_scope(r.backend, scope)]
    if mine:
        crashes = sum(r.status == CRASHED for r in mine)
        counted = ", ".join(f"{n} {what}" for n, what in ((len(mine) - crashes, "hang(s)"), (crashes, "crash(es)")) if n)
        return Result("correctness", "no hangs", FAIL, f"{counted}: {_hung_text(mine)}")
    outside = (f"; outside the spec's backends, {len(hung)} hang(s) or crash(es): {_hung_text(hung)}"
               if hung else "")
    if not rows:
        return no_data("no hangs", scope, required,
                       (f"; {skipped} of its rows were skipped" if skipped else "") + outside)
    if errors:
        return Result("correctness", "no hangs", WARN, f"no hangs, but {len(errors)} row(s) raised errors: "
                      + ", ".join(sorted({f'{r.backend}: {r.reason}' for r in errors})[:3]) + outside)
    return Result("correctness", "no hangs", WARN if hung else PASS,
                  f"{rows} rows of {', '.join(sorted(scope))} ran, no hangs{outside}")


def _curve(curves: list[Curve], backend: str) -> Curve | None:
    hits = [c for c in curves if c.key.variant == backend and c.key.op == ALLREDUCE]
    return hits[0] if hits else None


def _tried(rows: Sequence[Measurement], limit: Limit, dtype: str, mode: str) -> list[Measurement]:
    """The rows of the limit's backend, dtype, mode and size, whatever their status: where there are
    some but no trusted one, the size was measured and failed, not left unmeasured."""
    return [r for r in rows if r.message_bytes == limit.message_bytes and r.op == ALLREDUCE and r.dtype == dtype
            and (mode == "auto" or r.mode == mode) and variant_label(r) == limit.backend]


def check_limit(curves: list[Curve], limit: Limit, kind: str, where: str, spec: Spec,
                rows: Sequence[Measurement] = ()) -> Result:
    upper = kind == "latency"
    name = f"{limit.backend} {kind} at {format_bytes(limit.message_bytes)}"
    sweep = next_steps.qualify_sweep_command(str(spec.path), spec.world_size)
    failed_rows = _tried(rows, limit, spec.dtype, spec.mode)
    if failed_rows and (curve := _curve(curves, limit.backend)) is None or \
            failed_rows and price(curve, limit.message_bytes).point is None:  # type: ignore[arg-type]
        return Result(kind, name, FAIL, f"measured, no trusted row: {_hung_text(failed_rows)}", limit.source)
    curve = _curve(curves, limit.backend)
    if curve is None:
        have = ", ".join(sorted({c.key.variant for c in curves})) or "none"
        return Result(kind, name, NOT_MEASURED, f"not measured: the run has no {where} rows of {limit.backend} "
                      f"(have: {have})", limit.source, sweep)
    priced = price(curve, limit.message_bytes)
    if priced.point is None:
        return Result(kind, name, NOT_MEASURED, f"not measured: {curve.label} covers {priced.range_text} (the sweep "
                      "below measures every size the spec checks)", limit.source, sweep)
    value = priced.point.latency_us if upper else priced.point.busbw_gbps
    if value is None:
        return Result(kind, name, NOT_MEASURED, "not measured: no bus bandwidth recorded at this size", limit.source)
    how = "interpolated " if priced.how == INTERPOLATED else ""
    unit = "us" if upper else "GB/s"
    shown = f"{how}{'latency' if upper else 'busbw'} {value:.3g} {unit} ({curve.label})"
    failed = value > limit.fail_at if upper else value < limit.fail_at
    warned = limit.warn_at is not None and (value > limit.warn_at if upper else value < limit.warn_at)
    word = "limit" if upper else "floor"
    if failed:
        return Result(kind, name, FAIL, f"{shown} vs {word} {limit.fail_at:g} {unit}", limit.source)
    if warned:
        return Result(kind, name, WARN, f"{shown} vs warning {limit.warn_at:g} {unit}", limit.source)
    return Result(kind, name, PASS, f"{shown}, {word} {limit.fail_at:g} {unit}", limit.source)


def check_reference(run_curves: list[Curve], ref_run: Run, ref: ReferenceSpec, dtype: str, mode: str) -> list[Result]:
    ref_curves = pick_mode(select(build_curves(ref_run.rows), dtype=dtype), mode)
    ref_by_key = {c.key: c for c in ref_curves}
    out = []
    for curve in run_curves:
        base = ref_by_key.get(curve.key)
        if base is None or (ref.backends is not None and curve.key.variant not in ref.backends):
            continue
        worst: tuple[float, int, bool | None] | None = None
        for size in (ref.sizes or curve.sizes()):
            now, then = curve.point(size), base.point(size)
            if now is None or then is None:
                continue
            pct = 100.0 * (now.latency_us - then.latency_us) / then.latency_us
            if worst is None or pct > worst[0]:
                worst = (pct, size, exceeds_spread(now.latency_us - then.latency_us, now, then))
        if worst is None:
            continue
        pct, size, beyond = worst
        detail = (f"worst {pct:+.1f}% latency at {format_bytes(size)} vs {ref_run.run_id}"
                  + ("" if beyond is None else (" (beyond spread)" if beyond else " (within spread)")))
        status = FAIL if pct > ref.max_slowdown_pct else (
            WARN if ref.warn_slowdown_pct is not None and pct > ref.warn_slowdown_pct else PASS)
        out.append(Result("reference", f"{curve.label} within {ref.max_slowdown_pct:g}% of reference",
                          status, detail, ref.source))
    if not out:
        out.append(Result("reference", "within reference run", NOT_MEASURED,
                          f"not measured: no backend and size in common with {ref_run.path}", ref.source))
    return out


def pcie_box_checks(spec: Spec, snapshot: Any) -> list[Result]:
    """The checks a spec turns on (off by default: they need a probe --bandwidth --nccl snapshot)."""
    checks = {"p2p_sm_path": (SM_PATH_CHECK, check_sm_path), "nccl_collective_ab": (NCCL_AB_CHECK, check_nccl_ab),
              "link_under_load": (LOAD_CHECK, check_link_under_load), "aer_clean": (AER_CHECK, check_aer),
              "nccl_topology": (NCCL_VIEW_CHECK, check_nccl_view),
              "tp_within_socket": (SOCKET_CHECK, lambda s, l: check_tp_socket(s, l, spec.world_size))}
    out = []
    for key, (name, check) in checks.items():
        if not spec.checks.get(key, False):
            continue
        if not isinstance(snapshot, dict):
            out.append(Result("fabric", name, WARN, "not probed: no probe snapshot (run.json has none; pass --snapshot)"))
        elif not snapshot.get("gpus"):
            out.append(_no_gpus(name))
        else:
            out.append(check(snapshot, spec.fabric.get(key, {})))
    return out


def _no_gpus(name: str) -> Result:
    """A snapshot of a box without GPUs (a CPU run's): no probe flag there would answer the check."""
    return Result("fabric", name, WARN, "not probed: the snapshot lists no GPUs")


# Groups whose PASS speaks for the machine: a run that is not real hardware cannot earn them.
HARDWARE_GROUPS = ("fabric", "latency", "busbw", "reference")


def not_evidence(results: list[Result], origin: provenance.Provenance, snapshot_given: bool) -> list[Result]:
    """Every check of a non-hardware run with the same prefix, and each PASS it would earn about
    the machine as a WARN (a fabric check read from a --snapshot the user took is that snapshot's:
    its verdict and words are kept)."""
    if origin.kind not in provenance.NOT_HARDWARE:
        return results
    groups = set(HARDWARE_GROUPS) | ({"correctness"} if origin.kind == provenance.FIXTURE else set())
    said = prefix(origin.kind)
    return [r if snapshot_given and r.group == "fabric" else
            replace(r, status=WARN if r.status == PASS and r.group in groups else r.status, detail=said + r.detail)
            for r in results]


def prefix(kind: str) -> str:
    """What every check of a run that is not real hardware starts with."""
    return f"{'CPU' if kind == provenance.CPU else kind} data: "


def qualify(spec: Spec, run: Run, reference: Run | None, probe: dict[str, Any] | None = None) -> list[Result]:
    results: list[Result] = []
    origin = provenance.of(run)
    if origin.kind in provenance.NOT_HARDWARE:
        # A fixture was never measured; ranks that shared a GPU measured the protocol, not this
        # machine's fabric; gloo on the CPU measured no GPU at all.
        why = {provenance.FIXTURE: "a hand-made fixture, never measured",
               provenance.CPU: "gloo on the CPU, no GPU measured"}
        said = why.get(origin.kind) or (run.emulation_line() or "").removeprefix("emulated: ") or "ranks shared GPUs"
        results.append(Result("run", "real hardware", FAIL, f"{said}: no check of this run is evidence about a machine"))
    world = run_world_size(run)
    if spec.world_size is not None:
        status = PASS if world == spec.world_size else FAIL
        results.append(Result("run", "world size", status, f"run has {world} ranks, spec wants {spec.world_size}"))
    fabric = [("p2p_all_pairs", P2P_CHECK, check_p2p), ("pcie_link_at_max", LINK_CHECK, check_links),
              ("no_acs_redirect", ACS_CHECK, check_acs)]
    snapshot = probe if probe is not None else run.info.snapshot
    for key, name, check in fabric:
        if not spec.checks.get(key, True):
            continue
        if not isinstance(snapshot, dict):
            results.append(Result("fabric", name, WARN, "not probed: run.json has no probe snapshot"))
        elif not snapshot.get("gpus"):
            results.append(_no_gpus(name))
        else:
            results.append(check(snapshot))
    results.extend(pcie_box_checks(spec, snapshot))
    if spec.checks.get("zero_wrong", True):
        results.append(check_wrong(run, spec.backends(), "zero_wrong" in spec.checks))
    if spec.checks.get("no_hangs", True):
        results.append(check_hangs(run, spec.backends(), "no_hangs" in spec.checks))
    curves = pick_mode(select(build_curves(run.rows), dtype=spec.dtype), spec.mode)
    where = f"{spec.dtype} {spec.mode if spec.mode != 'auto' else 'graph-or-eager'}"
    results.extend(check_limit(curves, limit, "latency", where, spec, run.rows) for limit in spec.latency)
    results.extend(check_limit(curves, limit, "busbw", where, spec, run.rows) for limit in spec.busbw)
    if reference is not None and spec.reference is not None:
        results.extend(check_reference(curves, reference, spec.reference, spec.dtype, spec.mode))
    return not_evidence(results, origin, probe is not None)


# ---------------------------------------------------------------- output

def junit_xml(spec: Spec, run: Run, results: list[Result]) -> str:
    suite = ET.Element("testsuite", name=f"commbench qualify: {spec.name}", tests=str(len(results)),
                       failures=str(sum(r.status == FAIL for r in results)), errors="0",
                       skipped=str(sum(r.status == NOT_MEASURED for r in results)))
    properties = ET.SubElement(suite, "properties")
    ET.SubElement(properties, "property", name="run", value=run.info.run_id or str(run.path))
    ET.SubElement(properties, "property", name="provenance", value=provenance.describe(run))
    for r in results:
        case = ET.SubElement(suite, "testcase", classname=f"commbench.qualify.{r.group}", name=r.name)
        text = r.detail + (f" [source: {r.source}]" if r.source else "")
        if r.status == FAIL:
            ET.SubElement(case, "failure", message=r.detail, type="FAIL").text = text
        elif r.status == NOT_MEASURED:
            ET.SubElement(case, "skipped", message=r.detail).text = text
        else:
            ET.SubElement(case, "system-out").text = f"{r.status}: {text}"
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="results dir written by commbench sweep")
    parser.add_argument("--spec", required=True, type=Path,
                        help="machine-class spec (TOML), e.g. commbench/specs/pcie-8x.toml")
    parser.add_argument("--reference", type=Path, help="reference run of the same machine class "
                        "(overrides [reference] run in the spec)")
    parser.add_argument("--max-slowdown-pct", type=float, help="with --reference: FAIL above this latency slowdown (default 10)")
    parser.add_argument("--junit", type=Path, metavar="FILE", help="also write JUnit XML for CI")
    parser.add_argument("--json", metavar="FILE", help="also write the checks as JSON ('-' for stdout: JSON alone)")
    results_out.add_arguments(parser)
    parser.add_argument("--snapshot", metavar="SNAPSHOT.json",
                        help="probe snapshot for the fabric checks instead of the one in run.json (take it with "
                             "commbench probe --bandwidth --nccl --json FILE)")
    render.add_arguments(parser)


@dataclass(frozen=True)
class QualifyResult:
    """What `qualify` answers; its --json is dataclasses.asdict of this (docs/results.md)."""

    provenance: dict[str, Any]
    described: str                 # the provenance line the text leads with
    run_id: str
    spec: str
    spec_path: str
    snapshot: str | None           # --snapshot: the fabric checks read it, not run.json's
    data: str                      # what data every check read (the provenance kind)
    checks: tuple[Result, ...]
    passed: int
    warned: int
    failed: int
    not_measured: int              # checks whose data the run never measured: no PASS while there are any
    verdict: str                   # FAIL, else INCOMPLETE where a check is not measured, else PASS


def result_of(spec: Spec, run: Run, checks: list[Result], snapshot: str | None) -> QualifyResult:
    counts = {s: sum(r.status == s for r in checks) for s in (PASS, WARN, FAIL, NOT_MEASURED)}
    verdict = FAIL if counts[FAIL] else INCOMPLETE if counts[NOT_MEASURED] else PASS
    return QualifyResult(provenance.of(run).to_dict(), provenance.describe(run), run.run_id, spec.name,
                         str(spec.path), snapshot, provenance.of(run).kind, tuple(checks), counts[PASS],
                         counts[WARN], counts[FAIL], counts[NOT_MEASURED], verdict)


def text(result: QualifyResult, wide: bool) -> str:
    lines = [render.prose(result.described, wide),
             render.prose(f"qualify {result.run_id} against {result.spec} ({result.spec_path})"
                          + (f"; fabric checks read {result.snapshot}" if result.snapshot else ""), wide) + "\n",
             render.table(["status", "group", "check", "detail"],
                          [[r.status, r.group, r.name, r.detail] for r in result.checks], wide=wide)]
    commands: dict[str, list[str]] = {}
    for r in result.checks:
        if r.command:
            commands.setdefault(r.command, []).append(r.name)
    if commands:
        lines.append("\nwhat would answer the checks that are not:")
        for command, names in commands.items():
            lines += [render.prose(", ".join(names) + ":", wide, indent="  "), f"    {command}"]
    sources = [(r.name, r.source) for r in result.checks if r.source]
    if sources:
        lines.append("\nwhere the thresholds come from:")
        lines += [render.prose(f"{name}: {source}", wide, indent="    ", first="  ") for name, source in sources]
    counts = f"{result.passed} PASS, {result.warned} WARN, {result.failed} FAIL"
    if result.not_measured:
        counts += f", {result.not_measured} not measured"
    lines.append("\n" + render.prose(f"{counts} -> {result.verdict}" + _verdict_said(result), wide))
    return "\n".join(lines)


def _verdict_said(result: QualifyResult) -> str:
    """What checks that were not measured mean for PASS."""
    if not result.not_measured:
        return ""
    return (f": {result.not_measured} check(s) not measured, neither PASS nor FAIL; the verdict is PASS only when "
            "every check is measured and none fails (exit 1 until then)")


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    check_file_target(args.junit, "--junit")   # before the verdict is printed, not after
    results_out.check_targets(args)
    spec = load_spec(args.spec)
    if args.max_slowdown_pct is not None and not 0 <= args.max_slowdown_pct < math.inf:
        raise UsageError(f"--max-slowdown-pct must be a non-negative finite percentage, got {args.max_slowdown_pct:g}")
    if args.reference is not None:
        base = spec.reference or ReferenceSpec(args.reference, 10.0, None, None, None, "command line")
        spec.reference = ReferenceSpec(args.reference, args.max_slowdown_pct or base.max_slowdown_pct,
                                       base.warn_slowdown_pct, base.sizes, base.backends, base.source)
    result = answer(spec, args.run_dir, args.junit, args.wide, args.snapshot)
    results_out.write(args, result, f"qualify {result.run_id} against {result.spec}")
    return exit_status(result)


def answer(spec: Spec, run_dir: Path, junit: Path | None = None, wide: bool = False,
           snapshot: str | None = None) -> QualifyResult:
    """The verdict on one run dir, printed, and its JUnit XML written where asked: what `qualify`
    and `sweep --qualify` both answer (the targets checked writable before any work)."""
    run = load_run(run_dir)
    reference = load_run(spec.reference.run) if spec.reference is not None else None
    probe = None
    if snapshot:
        from commbench.topology.snapshot_file import load_snapshot

        probe = load_snapshot(snapshot)
    checks = qualify(spec, run, reference, probe)
    result = result_of(spec, run, checks, snapshot)
    print(text(result, wide))
    if junit:
        try:
            junit.write_text(junit_xml(spec, run, checks), encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"{junit}: cannot write ({exc.strerror})") from None
        print(f"wrote {junit}")
    return result


def exit_status(result: QualifyResult) -> int:
    """0 on PASS only; 1 when a check failed or was not measured (a CI gate passes on a measured
    PASS; the verdict, FAIL or INCOMPLETE, tells the two apart)."""
    return 0 if result.verdict == PASS else 1
