"""NCCL, FlashInfer and torch symmetric memory: the libraries both engines' paths run, their
facts with sources and the gates they set whichever engine calls them. FlashInfer's wheel ships its
Python and kernel sources: its facts are in flashinfer.py, checked by `commbench engines --check`
against a release, and the constants here are read from there. NCCL's and torch's are stated with
the release and file they were read in (no wheel of these ships source that states them, so the
check does not read them).
"""

from __future__ import annotations

from commbench.engines import flashinfer
from commbench.engines.paths import SHARED, Gate, size_text
from commbench.topology.box import Box

NCCL_VERSION = "2.30.7"      # the NCCL whose environment semantics the settings follow
# NCCL 2.29.2, commit ebd1e929 (src/sym_kernels.cc): the first NCCL whose built-in symmetric
# kernels run only on fully NVLink-connected systems (ncclSymkAvailable() false otherwise).
NCCL_SYMMETRIC_PCIE_OFF = (2, 29, 2)
NCCL_SYMMETRIC_SOURCE = "NCCL 2.29.2, commit ebd1e929 (src/sym_kernels.cc)"

# FlashInfer (flashinfer.py, checked): the trtllm allreduce kernels are built for SM 9.x/10.x/12.x, its
# workspace takes 2, 4, 8 or 16 ranks of one node; the PCIe IPC allreduce (PcieIpcAllReduceWorkspace,
# since 0.7.2) takes 2, 4 or 8 ranks (each engine states its own: their facts).
FLASHINFER_WORLD_SIZES = flashinfer.WORLD_SIZES
FLASHINFER_ARCHS = (f"FlashInfer's trtllm kernels are built for SM {'/'.join(f'{m}.x' for m in flashinfer.SM_MAJORS)} "
                    "only (not RTX 4090 / L40)")


def nccl_symm_fabric(b: Box) -> Gate | None:
    """NCCL's symmetric kernels, whichever engine registers the windows."""
    if b.shares_gpus:
        return Gate(None, SHARED)
    version = b.nccl_version
    if version is not None and version >= NCCL_SYMMETRIC_PCIE_OFF and not b.nvlink_all:
        return Gate(False, "NCCL >= 2.29.2 runs its symmetric kernels only on fully NVLink-connected systems")
    return None


def nccl_symmetric_inert(b: Box) -> tuple[str, str] | None:
    """(why, source) where this box's NCCL leaves every symmetric-kernel setting inert."""
    version = b.nccl_version
    if version is None or version < NCCL_SYMMETRIC_PCIE_OFF or b.nvlink_all or b.world_size < 2:
        return None
    shown = ".".join(str(p) for p in version)
    return (f"from NCCL 2.29.2 the built-in symmetric kernels run only on fully NVLink-connected systems "
            f"(ncclSymkAvailable() is false otherwise): NCCL {shown} here uses its regular kernels",
            NCCL_SYMMETRIC_SOURCE)


def flashinfer_common(b: Box) -> Gate | None:
    """What FlashInfer's allreduce workspace needs in either engine."""
    if b.world_size not in FLASHINFER_WORLD_SIZES:
        return Gate(False, f"world size {b.world_size} is not one of {FLASHINFER_WORLD_SIZES}")
    if b.cc == "?":
        return Gate(None, "the snapshot has no compute capability")
    return None


def vmm_gate(b: Box, gate: Gate, said: str) -> Gate:
    """FlashInfer's workspace is cuMemCreate memory shared between the ranks: `said` is how the
    engine fails where it cannot be, with {} where the box's reason goes."""
    if not b.vmm_reason or gate.available is False:
        return gate
    unknown = None if "not tested" in b.vmm_reason else False
    return gate._replace(available=unknown, why=said.format(b.vmm_reason))


def _multicast_off(b: Box) -> Gate | None:
    if not b.multicast:
        return Gate(False, ("no multicast on these GPUs: the symmetric-memory handle has multicast_ptr == 0 and the "
                            "communicator turns itself off, even for two-shot (vLLM #50179)"))
    if b.multicast_blocked:
        return Gate(False, (f"multicast {b.multicast_blocked}: multicast_ptr == 0, and the communicator turns itself "
                            "off even for two-shot"))
    return None


def symm_mem_gate(b: Box, caps: dict, multimem: dict, key: object, table: str, after: str, dtype: str,
                  inclusive: bool) -> Gate:
    """Torch symmetric memory as either engine runs it: off without multicast or for a dtype but
    bf16 (both keep a bf16 buffer), else up to the engine's table's size."""
    off = _multicast_off(b)
    if off:
        return off
    cap = caps.get(key, {}).get(b.world_size)
    if cap is None:
        return Gate(False, f"{table} has no entry for compute capability {b.cc} at world size {b.world_size}")
    if dtype != "bf16":   # the communicator is up (other paths' caps read that) and refuses each message
        return Gate(True, f"bf16 only (its buffer is bf16 and it refuses every {dtype} message, which goes on "
                          "down the chain)", 0, False)
    kind = "multimem" if b.world_size in multimem.get(key, ()) else "two-shot"
    return Gate(True, f"{kind} up to {size_text(cap)}{' inclusive' if inclusive else ' (exclusive)'}, after {after}",
                cap, inclusive)
