"""What a run's numbers are: measured on real GPUs (which, over which fabric), emulated (ranks
sharing GPUs), imported from nccl-tests, measured on the CPU with gloo, or a hand-made fixture.

Every analysis output starts with `describe(run)`, and JSON/HTML outputs carry `of(run).to_dict()`,
so a number is never read without what it is. Read from run.json (untrusted: any field may be
missing or of the wrong type, which gives "unknown" words, never an exception):

- fixture:  run.json `"provenance": "fixture"` (the hand-made runs under tests/data/runs carry it);
- imported: run.json `"source": "nccl-tests"` (written by `commbench import-nccl-tests`);
- emulated: run.json `emulation`, else any row's (ranks sharing GPUs, under MPS or time-sliced);
- cpu:      run.json `device_type` "cpu" (gloo on the CPU: no GPU, no fabric);
- measured: anything else: one rank per GPU, the fabric from the probe snapshot's link matrix.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from commbench.analysis.nccl_tests_format import SOURCE as IMPORT_SOURCE
from commbench.results import Run

FIXTURE = "fixture"
IMPORTED = "imported"
EMULATED = "emulated"
CPU = "cpu"
MEASURED = "measured"
KINDS = (MEASURED, EMULATED, IMPORTED, FIXTURE, CPU)
# Kinds whose rows say nothing about a machine's GPUs or fabric: never a hardware PASS.
NOT_HARDWARE = (EMULATED, FIXTURE, CPU)

NVLINK = "NVLink"
PCIE = "PCIe"
MIXED = "NVLink+PCIe"


@dataclass(frozen=True)
class Provenance:
    kind: str                      # one of KINDS
    run_id: str
    host: str | None
    world_size: int | None
    gpu_names: tuple[str, ...]     # one per distinct GPU, in the run's order
    fabric: str | None             # NVLINK | PCIE | MIXED; None: not recorded or no fabric
    emulation: dict[str, Any] | None

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)

    def gpus_text(self) -> str:
        """'8x NVIDIA H200', '4x A + 4x B', or 'no GPU recorded'."""
        counts = Counter(self.gpu_names)
        return " + ".join(f"{n}x {name}" for name, n in counts.items()) or "no GPU recorded"

    def line(self) -> str:
        return f"{self.what()}; run {self.run_id}"

    def what(self) -> str:
        """The line without its run id: the same for every run of one machine and kind."""
        ranks = f"{self.world_size} ranks" if self.world_size else "ranks not recorded"
        if self.kind == FIXTURE:
            what = (f"fixture: hand-made test data, not a measurement (it claims {ranks} on "
                    f"{self.gpus_text()}{_over(self.fabric)})")
        elif self.kind == IMPORTED:
            what = (f"imported from nccl-tests, not measured by commbench: {ranks} on {self.gpus_text()}"
                    f"{_over(self.fabric)}")
        elif self.kind == EMULATED:
            emulation = self.emulation or {}
            how = ("under MPS" if emulation.get("mps") else "time-sliced (no MPS)" if emulation.get("mps") is False
                   else "MPS unknown")
            share = emulation.get("sm_percent")
            share_text = f", {share:g}% of the SMs each" if isinstance(share, (int, float)) and share else ""
            what = (f"emulated: {emulation.get('ranks', self.world_size)} ranks on {self.gpus_text()} "
                    f"{how}{share_text}: the protocol's cost, no fabric (not NVLink, not PCIe)")
        elif self.kind == CPU:
            what = f"cpu: {ranks} of gloo on the CPU, no GPU and no fabric"
        else:
            what = f"measured: {ranks} on {self.gpus_text()}{_over(self.fabric)}"
        host = f", host {self.host}" if self.host else ""
        return f"data: {what}{host}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "run_id": self.run_id, "host": self.host, "world_size": self.world_size,
                "gpus": list(self.gpu_names), "gpu_count": self.gpu_count, "fabric": self.fabric,
                "emulation": self.emulation, "line": self.line()}


def _over(fabric: str | None) -> str:
    return f" over {fabric}" if fabric else ", fabric not recorded"


def of(run: Run) -> Provenance:
    info = run.info
    emulation = run.emulation
    if info.provenance == FIXTURE:
        kind = FIXTURE
    elif info.source == IMPORT_SOURCE:
        kind = IMPORTED
    elif isinstance(emulation, dict):
        kind = EMULATED
    elif info.device_type == CPU or _cpu_rows(info.gpus or []):
        kind = CPU
    else:
        kind = MEASURED
    world = info.world_size
    if world is None:
        sizes = {r.world_size for r in run.rows}
        world = sizes.pop() if len(sizes) == 1 else None
    gpus = () if kind == CPU else _gpu_names(info.gpus or [])
    shared = emulation.get("gpus") if kind == EMULATED and isinstance(emulation, dict) else None
    if isinstance(shared, int) and 0 < shared < len(gpus):
        gpus = gpus[:shared]   # ranks listed without GPU ids: the emulation knows how many GPUs they shared
    fabric = None if kind in (EMULATED, CPU) else fabric_of(info.snapshot or {}, len(gpus))
    return Provenance(kind, run.run_id, info.host, world, gpus, fabric, emulation if kind == EMULATED else None)


def describe(run: Run) -> str:
    """One line: what the run is, on which GPUs and fabric, and its run id."""
    return of(run).line()


def _cpu_rows(gpus: list[Any]) -> bool:
    return bool(gpus) and all(isinstance(g, dict) and g.get("device") == "cpu" for g in gpus)


def _gpu_names(gpus: list[Any]) -> tuple[str, ...]:
    """A name per distinct GPU: ranks that share a GPU (same host and uuid or bus id) count once."""
    seen: dict[tuple[Any, ...], str] = {}
    for position, gpu in enumerate(gpus):
        if not isinstance(gpu, dict):
            continue
        ident = gpu.get("uuid") or gpu.get("pci_bus_id")
        key = (gpu.get("host"), ident) if isinstance(ident, str) else ("rank", position)
        seen.setdefault(key, str(gpu.get("name") or "unnamed GPU"))
    return tuple(seen.values())


def fabric_of(snapshot: dict[str, Any], gpu_count: int) -> str | None:
    """NVLink, PCIe or both between the run's GPUs, from the probe snapshot: its link matrix
    (nvidia-smi style labels, 'NV<n>' for NVLink), else its PCIe paths; None when neither."""
    links = snapshot.get("links") if isinstance(snapshot.get("links"), dict) else {}
    matrix = links.get("matrix")
    if isinstance(matrix, list) and gpu_count > 1:
        labels = [str(label) for a, row in enumerate(matrix[:gpu_count]) if isinstance(row, list)
                  for b, label in enumerate(row[:gpu_count]) if a != b]
        if labels:
            nvlink = [label.startswith("NV") for label in labels]
            return NVLINK if all(nvlink) else MIXED if any(nvlink) else PCIE
    if snapshot.get("pcie_paths"):
        return PCIE
    return None


def differences(a: Provenance, b: Provenance) -> list[str]:
    """What makes two runs' numbers incomparable as one machine's: kind (measured, emulated,
    ...), host, GPU models and count, fabric, world size, how emulated ranks shared GPUs.
    Empty when none of them differ."""
    def fabric(p: Provenance) -> str | None:
        return "none" if p.kind in (EMULATED, CPU) else p.fabric

    def sharing(p: Provenance) -> str | None:
        """How emulated ranks shared their GPUs (MPS and its SM share, or time slices)."""
        if p.emulation is None:
            return None
        share = p.emulation.get("sm_percent")
        return ("MPS" + (f" {share:g}% of the SMs" if isinstance(share, (int, float)) else "")
                if p.emulation.get("mps") else "time-sliced")

    out = []
    for name, left, right in (("data", a.kind, b.kind), ("host", a.host, b.host),
                              ("GPUs", a.gpus_text(), b.gpus_text()), ("fabric", fabric(a), fabric(b)),
                              ("world size", a.world_size, b.world_size), ("emulation", sharing(a), sharing(b))):
        if left != right:
            out.append(f"{name}: {left if left is not None else 'not recorded'} vs "
                       f"{right if right is not None else 'not recorded'}")
    return out
