"""The path model: which allreduce paths vLLM and SGLang can take on a probed box at one TP size,
in the order each engine tries them, which one each takes by default at a message size for a
model, and what turns each on or off.

The rules are the facts of vllm.py / sglang.py (or the same facts read from the installed
engine: source.active), applied to a probe snapshot; every state names the facts it rests on
(`PathState.source`). recommend and floor price these paths, `commbench engines` prints them and
the probe's explain section renders them. No torch: the analysis reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from commbench.engines import libs, settings, source
from commbench.engines.facts import FactSet
from commbench.engines.settings import (CUSTOM_AR, FLASHINFER_AR, FLASHINFER_FUSED, FLASHINFER_PCIE_IPC, MSCCLPP,
                                        NCCL_PATH, NCCL_SYMM, SGLANG, TORCH_SYMM_MEM, VLLM, Settings)
from commbench.ops import ALLREDUCE, FUSED_OP
from commbench.policy import multicast_policy_reason
from commbench.topology.needs import p2p_reason, vmm_reason
from commbench.topology.selection import gpu_pairs, p2p_entry, used_gpus, used_hosts
from commbench.units import DTYPE_BYTES

MiB = 1 << 20
GRAPH, EAGER = "graph", "eager"


@dataclass(frozen=True)
class PathRule:
    """One path of one engine, in the order the engine tries them for a call."""

    engine: str
    path: str
    title: str
    op: str
    default_on: bool        # taken without any setting, for every model, where it is available
    turn_on: str            # what selects it (opt-in) or keeps it (default)
    turn_off: str           # what moves decode allreduces off it
    facts: tuple[str, ...]  # the engine facts (vllm.py / sglang.py keys) its gate and limits rest on


# Dispatch order: vLLM as its start-up log lists the backends (facts "dispatch_order"; ROCm paths
# left out), its compiled allreduce+RMSNorm fusion first since it replaces the call itself.
# SGLang as GroupCoordinator.all_reduce tries them (facts "outplace_order" and the two checks
# before it): NCCL symmetric memory for what custom allreduce and MSCCL++ leave, FlashInfer where
# its fusion is on, MSCCL++ where it takes the message, custom allreduce, PCIe IPC, torch
# symmetric memory, PyNccl.
RULES: tuple[PathRule, ...] = (
    PathRule(VLLM, FLASHINFER_FUSED, "FlashInfer allreduce+RMSNorm fusion", FUSED_OP, True,
             "on by default at -O2 (TP > 1, SM90/SM10x)",
             "--compilation-config '{\"pass_config\": {\"fuse_allreduce_rms\": false}}' or -O1",
             ("fusion_on_at_O2", "default_O2", "fusion_archs", "flashinfer_max_mb")),
    PathRule(VLLM, FLASHINFER_PCIE_IPC, "FlashInfer PCIe IPC allreduce", ALLREDUCE, False,
             "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1, with CUDA graphs", "leave the variable unset",
             ("env_use_pcie_ipc", "pcie_ipc_world_sizes", "pcie_ipc_needs_graphs", "default_max_capture_tokens")),
    PathRule(VLLM, FLASHINFER_AR, "FlashInfer allreduce", ALLREDUCE, True, "VLLM_ALLREDUCE_USE_FLASHINFER=1 (default)",
             "VLLM_ALLREDUCE_USE_FLASHINFER=0", ("env_use_flashinfer", "flashinfer_max_mb", "flashinfer_mnnvl_max_mb")),
    PathRule(VLLM, NCCL_SYMM, "NCCL symmetric memory", ALLREDUCE, False, "VLLM_USE_NCCL_SYMM_MEM=1",
             "leave the variable unset", ("env_use_nccl_symm_mem", "nccl_symm_config")),
    PathRule(VLLM, CUSTOM_AR, "custom allreduce (CUDA IPC)", ALLREDUCE, True, "on unless --disable-custom-all-reduce",
             "--disable-custom-all-reduce", ("custom_ar_world_sizes", "custom_ar_max_bytes",
                                              "custom_ar_max_with_symm_mem", "env_skip_p2p_check")),
    PathRule(VLLM, TORCH_SYMM_MEM, "torch symmetric memory", ALLREDUCE, True, "VLLM_ALLREDUCE_USE_SYMM_MEM=1 (default)",
             "VLLM_ALLREDUCE_USE_SYMM_MEM=0", ("env_use_symm_mem", "symm_mem_max_bytes", "symm_mem_multimem_world_sizes")),
    PathRule(VLLM, NCCL_PATH, "NCCL (PyNccl)", ALLREDUCE, True, "the fallback for every other size", "-",
             ("dispatch_order",)),
    PathRule(SGLANG, NCCL_SYMM, "NCCL symmetric memory", ALLREDUCE, False, "--enable-symm-mem", "leave the flag out",
             ("symm_mem_before_flashinfer",)),
    PathRule(SGLANG, FLASHINFER_AR, "FlashInfer allreduce (fusion workspace)", ALLREDUCE, False,
             "--flashinfer-allreduce-fusion-backend trtllm (on by default for the listed architectures)",
             settings.SGLANG_NO_FLASHINFER, ("flashinfer_archs", "flashinfer_max_tokens", "flashinfer_needs_sm90_sm10x")),
    PathRule(SGLANG, MSCCLPP, "MSCCL++", ALLREDUCE, False, "--enable-mscclpp", "leave the flag out",
             ("mscclpp_world_sizes", "outplace_order")),
    PathRule(SGLANG, CUSTOM_AR, "custom allreduce (CUDA IPC)", ALLREDUCE, True, "on unless --disable-custom-all-reduce",
             "--disable-custom-all-reduce", ("v2_default_on", "v2_max_kb", "v2_inclusive", "skip_p2p_check",
                                              "legacy_world_sizes", "legacy_max_bytes", "legacy_inclusive")),
    PathRule(SGLANG, FLASHINFER_PCIE_IPC, "FlashInfer PCIe IPC allreduce", ALLREDUCE, False,
             "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1", "leave the variable unset", ("pcie_ipc_env", "pcie_ipc_world_sizes")),
    PathRule(SGLANG, TORCH_SYMM_MEM, "torch symmetric memory", ALLREDUCE, False, "--enable-torch-symm-mem",
             "leave the flag out", ("torch_symm_mem_max_bytes", "torch_symm_mem_multimem")),
    PathRule(SGLANG, NCCL_PATH, "NCCL (PyNccl)", ALLREDUCE, True, "the fallback for every other size", "-",
             ("outplace_order",)),
    PathRule(SGLANG, FLASHINFER_FUSED, "FlashInfer allreduce+RMSNorm fusion", FUSED_OP, False,
             "--flashinfer-allreduce-fusion-backend trtllm (on by default for the listed architectures)",
             settings.SGLANG_NO_FLASHINFER, ("flashinfer_archs", "flashinfer_max_tokens")),
)


@dataclass(frozen=True)
class Workload:
    """What the engines' model-dependent rules read: the model's architecture (config.json
    architectures[0]; None: not given), hidden size (None: unknown), and the timing mode."""

    arch: str | None = None
    hidden: int | None = None
    mode: str = GRAPH


@dataclass(frozen=True)
class PathState:
    """One engine path on one box: can it run, why (not), and up to which size the engine sends it."""

    rule: PathRule
    available: bool | None      # None: this run cannot tell (ranks share a GPU, a fact not probed)
    why: str
    max_bytes: int | None = None    # the engine routes a message here only up to this size
    inclusive: bool = False         # max_bytes itself included (symm-mem, FlashInfer, SGLang) or not (vLLM custom AR)
    # False: the engine runs another kernel on this path here than the one its own-kernel backend
    # measures (SGLang's legacy custom allreduce where its v2 gate fails): such rows stand in.
    own_kernel: bool = True
    on_by_default: bool | None = None   # None: the rule's default; else this model's (SGLang's architecture list)
    skipped: tuple[int, int] | None = None   # sizes strictly between these go elsewhere (vLLM NCCL symm-mem)
    source: str = ""                # the engine version and files its rule was read from

    @property
    def path(self) -> str:
        return self.rule.path

    @property
    def default_on(self) -> bool:
        return self.rule.default_on if self.on_by_default is None else self.on_by_default

    def admits(self, message_bytes: int) -> bool:
        if self.skipped and self.skipped[0] < message_bytes < self.skipped[1]:
            return False
        if self.max_bytes is None:
            return True
        return message_bytes <= self.max_bytes if self.inclusive else message_bytes < self.max_bytes


@dataclass(frozen=True)
class Box:
    """The facts of a snapshot the engines' gates read, at one world size."""

    world_size: int
    has_gpus: bool
    shares_gpus: bool           # ranks share GPUs (an MPS emulation): fabric gates cannot be read
    multi_node: bool
    cc: str
    nvlink_all: bool
    can_access_all: bool
    p2p_ok: bool
    multicast: bool
    vmm_reason: str | None
    nccl_version: tuple[int, ...] | None
    multicast_blocked: str | None = None    # the host's policy forbids multicast objects (commbench.policy)
    imported: bool = False      # an nccl-tests import: GPUs and nodes known, the fabric not

    @property
    def multicast_usable(self) -> bool:
        return self.multicast and self.multicast_blocked is None

    @property
    def cc_int(self) -> int | None:
        """'9.0' -> 90, the key of vLLM's FlashInfer tables."""
        major, _, minor = self.cc.partition(".")
        return int(major) * 10 + int(minor) if major.isdigit() and minor.isdigit() else None

    @property
    def major(self) -> int | None:
        major = self.cc.partition(".")[0]
        return int(major) if major.isdigit() else None


IMPORTED = "imported"     # the snapshot key an nccl-tests import's box is built from (decide.box_snapshot)


def box(snapshot: dict[str, Any] | None, world_size: int, multicast_blocked: str | None = None) -> Box:
    """multicast_blocked: why the host's policy forbids multicast objects (the probe passes its own
    host's; a run's analysis passes none)."""
    snapshot = snapshot if isinstance(snapshot, dict) else {}
    imported = snapshot.get(IMPORTED)
    if isinstance(imported, dict):
        nodes = imported.get("nodes")
        return Box(world_size, True, False, isinstance(nodes, int) and nodes > 1, "?", False, False, False, False,
                   "not tested", settings.nccl_version(snapshot), imported=True)
    gpus_used = used_gpus(snapshot, world_size) if snapshot.get("gpus") else []
    if not gpus_used:
        return Box(world_size, False, False, False, "?", False, False, False, False, "no GPU in the snapshot", None)
    gpus = snapshot["gpus"]
    distinct = sorted(set(gpus_used))
    pairs = gpu_pairs(gpus_used)
    nvlink = len(distinct) > 1 and settings.nvlink_everywhere(snapshot, distinct)
    return Box(world_size=world_size, has_gpus=True, shares_gpus=len(distinct) < len(gpus_used),
               multi_node=len(used_hosts(snapshot, world_size)) > 1,
               cc=str(gpus[distinct[0]].get("compute_capability", "?")), nvlink_all=nvlink,
               can_access_all=all((p2p_entry(snapshot, a, b) or {}).get("can_access_peer") is True for a, b in pairs),
               p2p_ok=p2p_reason(snapshot, world_size) is None,
               multicast=all((gpus[g].get("attributes") or {}).get("multicast") == 1 for g in distinct),
               vmm_reason=vmm_reason(snapshot, world_size), nccl_version=settings.nccl_version(snapshot),
               multicast_blocked=multicast_blocked)


SHARED = "ranks share one GPU in this run (an emulation): the engine's gate on the fabric cannot be read"
FROM_IMPORT = "cannot tell from an import (an nccl-tests log has no NVLink, P2P, multicast or compute capability)"
P2P_TRUST_WARNING = ("WARNING: vLLM trusts cudaDeviceCanAccessPeer by default (VLLM_SKIP_P2P_CHECK=1) but the "
                     "write-and-verify check failed here — expect a hang or wrong output; use "
                     "--disable-custom-all-reduce or VLLM_SKIP_P2P_CHECK=0")


def size_text(n_bytes: int | float) -> str:
    n = int(n_bytes)
    if n >= MiB and n % MiB == 0:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} bytes"


class Gate(NamedTuple):
    available: bool | None
    why: str
    cap: int | None = None
    inclusive: bool = True
    default: bool | None = None          # this model's default where it differs by model
    skipped: tuple[int, int] | None = None
    own_kernel: bool = True


def _bytes_per(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 2)


# --- vLLM ----------------------------------------------------------------------------------

VLLM_ONE_STAGE_BELOW = ((4, 512 << 10), (8, 256 << 10))   # vLLM custom_all_reduce.cuh (no Python states it)


def _vllm_stages(world_size: int) -> str:
    if world_size == 2:
        return "always 1-stage at TP2"
    below = next((size for ws, size in VLLM_ONE_STAGE_BELOW if world_size <= ws), None)
    picked = f"1-stage below {size_text(below)}, 2-stage above (full NVLink" if below else "2-stage (full NVLink"
    return f"{picked}; VLLM_CUSTOM_ALLREDUCE_ALGO=1stage|2stage forces one)"


def _vllm_custom_ar(b: Box, f: FactSet) -> Gate:
    if b.multi_node:
        return Gate(False, "the group spans nodes")
    sizes = f.value("custom_ar_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    cap = f.value("custom_ar_max_bytes")
    if b.multicast_usable:
        table = f.value("custom_ar_max_with_symm_mem").get(b.cc, {})
        cap = min(table.get(b.world_size, cap), cap)
    if b.shares_gpus and b.world_size > 2:
        return Gate(None, SHARED, cap, False)
    if b.world_size > 2 and not b.nvlink_all:
        return Gate(False, ("above 2 GPUs it needs NVLink between every pair ('not supported on more than two "
                            "PCIe-only GPUs': is_fully_connected() asks NVML for NVLink and never tests PCIe peer "
                            "access; vLLM #56128)"), cap, False)
    if not b.can_access_all:
        return Gate(False, "cudaDeviceCanAccessPeer is false on some pair (VLLM_SKIP_P2P_CHECK=1 default)", cap, False)
    why = f"{_vllm_stages(b.world_size)}, messages below {size_text(cap)}"
    return Gate(True, why if b.p2p_ok else f"{why}; {P2P_TRUST_WARNING}", cap, False)


def _symm_mem(b: Box, caps: dict, multimem: dict, key: Any, table: str, after: str) -> Gate:
    """Torch symmetric memory in either engine: off without multicast, else up to its table's size."""
    off = _multicast_off(b)
    if off:
        return off
    cap = caps.get(key, {}).get(b.world_size)
    if cap is None:
        return Gate(False, f"{table} has no entry for compute capability {b.cc} at world size {b.world_size}")
    kind = "multimem" if b.world_size in multimem.get(key, ()) else "two-shot"
    return Gate(True, f"{kind} up to {size_text(cap)}, after {after}", cap)


def _multicast_off(b: Box) -> Gate | None:
    if not b.multicast:
        return Gate(False, ("no multicast on these GPUs: the symmetric-memory handle has multicast_ptr == 0 and the "
                            "communicator turns itself off, even for two-shot (vLLM #50179)"))
    if b.multicast_blocked:
        return Gate(False, (f"multicast {b.multicast_blocked}: multicast_ptr == 0, and the communicator turns itself "
                            "off even for two-shot"))
    return None


def _flashinfer_common(b: Box) -> Gate | None:
    if b.multi_node:
        return Gate(False, "trtllm is single-node only; mnnvl needs multicast across nodes")
    if b.world_size not in libs.FLASHINFER_WORLD_SIZES:
        return Gate(False, f"world size {b.world_size} is not one of {libs.FLASHINFER_WORLD_SIZES}")
    if b.cc == "?":
        return Gate(None, "the snapshot has no compute capability")
    return None


def _vmm(b: Box, engine: str, gate: Gate) -> Gate:
    """FlashInfer's workspace is cuMemCreate memory shared between the ranks."""
    if not b.vmm_reason:
        return gate
    unknown = None if "not tested" in b.vmm_reason else False
    if engine == SGLANG:
        return gate._replace(available=unknown, why=("its cuMemCreate preflight would fail on at least one rank "
                                                     f"('Skipping allreduce fusion to avoid cross-rank desync'); "
                                                     f"here: {b.vmm_reason}"))
    return gate._replace(available=unknown, why=f"FlashInfer's cuMemCreate workspace cannot be shared here "
                                                f"({b.vmm_reason})")


def _vllm_flashinfer(b: Box, f: FactSet, fused: bool, w: Workload) -> Gate:
    common = _flashinfer_common(b)
    if common:
        return common
    if fused:
        if w.mode == EAGER:
            return Gate(False, "under --enforce-eager nothing is compiled, so the fusion pass never runs")
        if not (b.cc == "9.0" or b.major == 10):
            return Gate(False, f"enable_allreduce_rms_fusion turns it on at SM90 and SM10x only, not compute "
                               f"capability {b.cc}")
    mb = f.value("flashinfer_max_mb").get(b.cc_int, {}).get(b.world_size)
    if mb is None:
        return Gate(False, f"FI_ALLREDUCE_FUSION_MAX_SIZE_MB has no entry for compute capability {b.cc} at world "
                           f"size {b.world_size}")
    cap = int(mb * MiB)
    if fused:
        tokens = f" ({cap // (w.hidden * 2)} tokens of hidden {w.hidden} in bf16)" if w.hidden else ""
        kind = (f"on by default at -O2 (TP > 1, SM90/SM10x, FlashInfer installed): decode allreduce + residual + "
                f"RMSNorm run FlashInfer's fused kernel up to {size_text(cap)}{tokens}")
        return _vmm(b, VLLM, Gate(True, kind, cap))
    # _resolve_fi_ar_backend: auto -> mnnvl on one node, trtllm where no multicast object can be made
    if not b.multicast:
        kind = "its backend 'auto' falls back to trtllm (cuMemCreate + POSIX FD buffers, no multicast)"
    else:
        forbidden = f" — forbidden by this host's policy ({b.multicast_blocked})" if b.multicast_blocked else ""
        kind = ("its backend 'auto' resolves to mnnvl on one node and creates a multicast object "
                f"(cuMulticastCreate){forbidden}: set VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm for trtllm")
        tuned = f.value("flashinfer_mnnvl_max_mb").get((b.cc_int, b.world_size, 1))
        if b.multicast_usable and tuned is not None:
            cap = int(tuned * MiB)
    return _vmm(b, VLLM, Gate(True, f"{kind}; up to {size_text(cap)}", cap))


def _vllm_pcie_ipc(b: Box, f: FactSet, dtype: str, w: Workload) -> Gate:
    sizes = f.value("pcie_ipc_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    if dtype not in ("bf16", "fp16"):
        return Gate(False, f"bf16/fp16 only, not {dtype}")
    if w.mode == EAGER:
        return Gate(False, "needs CUDA graphs: its workspace is set up for the graph capture sizes, and under "
                           "--enforce-eager there are none, so it turns itself off")
    if b.multi_node or not b.p2p_ok:
        return Gate(False, "needs working P2P between the GPUs of one node")
    tokens = 1024 if b.major == 10 else 512
    if w.hidden:
        cap = tokens * w.hidden * _bytes_per(dtype)
        return Gate(True, f"bf16/fp16 over PCIe peer-to-peer, inside CUDA graphs only, up to the largest captured "
                          f"batch x hidden ({tokens} tokens by default: {size_text(cap)})", cap)
    return Gate(True, f"bf16/fp16 over PCIe peer-to-peer, inside CUDA graphs only, up to the largest captured batch x "
                      f"hidden ({tokens} tokens by default)")


def _vllm_nccl_symm(b: Box, f: FactSet) -> Gate:
    config = f.value("nccl_symm_config")
    ranges = config.get("custom_ar_preferred_ranges", {})
    if b.world_size < config.get("min_world_size", 4) or not (
            b.world_size in ranges or b.world_size > config.get("always_use_above_world_size", 8)):
        return Gate(False, f"not used at world size {b.world_size} (NCCL_SYMM_MEM_ALL_REDUCE_CONFIG)")
    nccl = _nccl_symm_fabric(b)
    if nccl:
        return nccl
    skipped = tuple(ranges[b.world_size]) if b.world_size in ranges else None
    note = (f"; sizes strictly between {size_text(skipped[0])} and {size_text(skipped[1])} are left to the custom "
            "allreduce") if skipped else ""
    return Gate(True, f"NCCL's symmetric kernels on windows the engine registers{note}", None, True,
                skipped=skipped)  # type: ignore[arg-type]


def _nccl_symm_fabric(b: Box) -> Gate | None:
    if b.shares_gpus:
        return Gate(None, SHARED)
    version = b.nccl_version
    if version is not None and version >= libs.NCCL_SYMMETRIC_PCIE_OFF and not b.nvlink_all:
        return Gate(False, "NCCL >= 2.29.2 runs its symmetric kernels only on fully NVLink-connected systems")
    return None


# --- SGLang --------------------------------------------------------------------------------

def _sglang_flashinfer(b: Box, f: FactSet, fused: bool, dtype: str, w: Workload) -> Gate:
    if b.cc != "?" and b.major not in (9, 10):
        return Gate(False, f"needs SM90 or SM10x, this is compute capability {b.cc}: here "
                           "--flashinfer-allreduce-fusion-backend (or --enable-flashinfer-allreduce-fusion) stops the "
                           "server at start-up with 'FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs'")
    common = _flashinfer_common(b)
    if common:
        return common
    listed = f.value("flashinfer_archs")
    if w.arch is None:
        default, said = False, (f"on by default only for the {len(listed)} architectures SGLang lists (a preset "
                                "or --arch names the model's); opt-in otherwise")
    elif w.arch in listed:
        default, said = True, (f"on by default for {w.arch} (TP > 1, SM90/SM10x, one node, no attention-DP): "
                               f"SGLang sends it every tensor-parallel allreduce")
    else:
        default, said = False, f"{w.arch} is not in SGLang's list of architectures it turns this on for: opt-in"
    tokens = f.value("flashinfer_max_tokens")
    cap = tokens * w.hidden * _bytes_per(dtype) if w.hidden else None
    limit = f"up to {tokens} tokens" + (f" ({size_text(cap)})" if cap else "")
    backend = ("backend 'auto' -> trtllm (SM90, single node)" if b.major == 9 else
               "backend 'auto' -> mnnvl (Blackwell), which needs multicast" + (
                   "" if b.multicast_usable else ", unavailable here"))
    what = "fused with residual + RMSNorm" if fused else "the plain allreduces too"
    return _vmm(b, SGLANG, Gate(True, f"{said}; {limit}, {what}; {backend}", cap, True, default))


SGLANG_KERNEL_UNKNOWN = ("whether SGLang runs its v2 kernel or the legacy one here cannot be told (ranks share one "
                         "GPU: v2 needs NVLink on every pair), so its own rows only stand in")


def _sglang_custom_ar(b: Box, f: FactSet) -> Gate:
    if b.multi_node:
        return Gate(False, "the group spans nodes")
    if b.shares_gpus and b.world_size > 2:
        return Gate(None, f"{SHARED}; {SGLANG_KERNEL_UNKNOWN}", own_kernel=False)
    v2 = b.nvlink_all and not b.shares_gpus
    sizes = range(2, 17) if v2 else f.value("legacy_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one the kernel supports")
    if b.world_size > 2 and not b.nvlink_all:
        return Gate(False, "above 2 GPUs it needs NVLink between every pair (like vLLM's; vLLM #56128)")
    if not b.p2p_ok:
        return Gate(False, "SGLang runs a real P2P write test by default (SGLANG_SKIP_P2P_CHECK=0) and it fails here")
    if v2:
        cap = f.value("v2_max_kb") * 1024
        return Gate(True, f"custom allreduce v2 (JIT), messages up to {size_text(cap)} inclusive; 1shot/2shot push or "
                          "pull by size", cap)
    cap = f.value("legacy_max_bytes")
    legacy = (SGLANG_KERNEL_UNKNOWN if b.shares_gpus else
              f"SGLang {f.version} runs its legacy kernel here (v2 needs NVLink on every pair, 2 GPUs included), so "
              "rows of its v2 kernel only stand in")
    return Gate(True, f"messages up to {size_text(cap)} inclusive; {legacy}", cap, own_kernel=False)


def _sglang_pcie_ipc(b: Box, f: FactSet, dtype: str) -> Gate:
    sizes = f.value("pcie_ipc_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    if dtype != "bf16":
        return Gate(False, f"bf16 only (its tuning is keyed by dtype), not {dtype}")
    if b.multi_node or not b.p2p_ok:
        return Gate(False, "needs working P2P between the GPUs of one node")
    return Gate(True, "bf16 over PCIe peer-to-peer, right after the custom allreduce; up to the server's decode "
                      "batch width x hidden (SGLANG_PCIE_IPC_MAX_NUMEL overrides)")


def _sglang_mscclpp(b: Box, f: FactSet, w: Workload) -> Gate:
    sizes = f.value("mscclpp_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    if w.mode == EAGER:
        return Gate(False, "runs only inside CUDA graphs")
    if not b.p2p_ok:
        return Gate(False, "P2P does not work here")
    return Gate(True, "runs only inside CUDA graphs; where it takes a message it goes ahead of custom allreduce")


def _sglang_nccl_symm(b: Box) -> Gate:
    return _nccl_symm_fabric(b) or Gate(True, "NCCL's symmetric kernels for every message custom allreduce and "
                                              "MSCCL++ do not take, ahead of FlashInfer")


def _gate(rule: PathRule, b: Box, f: FactSet, dtype: str, w: Workload) -> Gate:
    if rule.path == NCCL_PATH:
        return Gate(True, "always available: the fallback for every message no path above takes")
    if b.imported:
        listed = rule.engine == SGLANG and rule.path in (FLASHINFER_AR, FLASHINFER_FUSED)
        return Gate(None, FROM_IMPORT, default=(w.arch in f.value("flashinfer_archs")) if listed else None)
    if rule.engine == VLLM:
        return {CUSTOM_AR: lambda: _vllm_custom_ar(b, f),
                TORCH_SYMM_MEM: lambda: _symm_mem(b, f.value("symm_mem_max_bytes"),
                                                  f.value("symm_mem_multimem_world_sizes"), b.cc,
                                                  "SYMM_MEM_ALL_REDUCE_MAX_SIZES", "the custom allreduce's sizes"),
                FLASHINFER_AR: lambda: _vllm_flashinfer(b, f, False, w),
                FLASHINFER_FUSED: lambda: _vllm_flashinfer(b, f, True, w),
                NCCL_SYMM: lambda: _vllm_nccl_symm(b, f), FLASHINFER_PCIE_IPC: lambda: _vllm_pcie_ipc(b, f, dtype, w),
                }[rule.path]()
    return {CUSTOM_AR: lambda: _sglang_custom_ar(b, f),
            TORCH_SYMM_MEM: lambda: _symm_mem(b, f.value("torch_symm_mem_max_bytes"), f.value("torch_symm_mem_multimem"),
                                              b.major, "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES",
                                              "custom allreduce, PCIe IPC and MSCCL++"),
            FLASHINFER_AR: lambda: _sglang_flashinfer(b, f, False, dtype, w),
            FLASHINFER_FUSED: lambda: _sglang_flashinfer(b, f, True, dtype, w),
            NCCL_SYMM: lambda: _sglang_nccl_symm(b), FLASHINFER_PCIE_IPC: lambda: _sglang_pcie_ipc(b, f, dtype),
            MSCCLPP: lambda: _sglang_mscclpp(b, f, w)}[rule.path]()


def rule_source(rule: PathRule, f: FactSet) -> str:
    """'vLLM 0.34.0 (facts built in): all_reduce_utils.py:31, envs.py' — where the path's rule comes from."""
    files: list[str] = []
    for key in rule.facts:
        fact = f.fact(key)
        name = "/".join(fact.file.split("/")[-2:]) + (f":{fact.line}" if fact.line else "")
        if name not in files:
            files.append(name)
    return f"{f.name} {f.version} ({'built in' if f.origin == 'built in' else f.origin}): {', '.join(files)}"


def state(rule: PathRule, b: Box, dtype: str, workload: Workload | None = None,
          facts: FactSet | None = None) -> PathState:
    f = facts or source.active(rule.engine)
    w = workload or Workload()
    src = rule_source(rule, f)
    if not b.has_gpus:
        return PathState(rule, False, "no CUDA GPU in this run's snapshot", source=src)
    if b.world_size < 2:
        return PathState(rule, False, f"world size {b.world_size}: nothing to all-reduce", source=src)
    g = _gate(rule, b, f, dtype, w)
    return PathState(rule, g.available, g.why, g.cap, g.inclusive, g.own_kernel, g.default, g.skipped, src)


def states(engine: str, snapshot: dict[str, Any] | None, world_size: int, dtype: str,
           multicast_blocked: str | None = None, workload: Workload | None = None,
           logged: list[str] | None = None) -> list[PathState]:
    """Every path of `engine` on this box at this TP, in the engine's dispatch order. A path that
    settings.inert_settings() calls inert is off here with that rule's reason, whatever the gates
    above say: the two never disagree in one output. `logged`: the paths the engine's own
    start-up log says it set up (log.py), which then decide what is on."""
    b = box(snapshot, world_size, multicast_blocked)
    inert = settings.inert_settings(snapshot, world_size) if b.has_gpus and not b.imported else []
    out = []
    for rule in RULES:
        if rule.engine != engine:
            continue
        current = state(rule, b, dtype, workload)
        off = next((r for r in inert if (engine, rule.path) in r.paths), None)
        if off is not None and current.available is not False:
            current = replace(current, available=False, why=f"{off.why} ({off.source})")
        if logged is not None and rule.op == ALLREDUCE:
            current = _as_logged(current, logged)
        out.append(current)
    return out


def _as_logged(s: PathState, logged: list[str]) -> PathState:
    if s.path in logged:
        return replace(s, available=True, why=f"set up by the engine (its start-up log); {s.why}")
    return replace(s, available=False, why="not set up by the engine: its start-up log does not list it")


@dataclass(frozen=True)
class Default:
    """The path an engine takes for one message size with no settings changed."""

    path: PathState | None     # None: cannot be told (a default-on path's gate is unknown here)
    why: str


def default_path(paths: list[PathState], message_bytes: int, op: str = ALLREDUCE) -> Default:
    """The first default-on path, in dispatch order, that runs here and takes this size. A fused
    allreduce+RMSNorm path that is on by default takes a decode allreduce too: the engine replaces
    the call with the fused kernel."""
    for p in paths:
        if not p.default_on or (p.rule.op != op and not (op == ALLREDUCE and p.rule.op == FUSED_OP)):
            continue
        if p.available is None:
            return Default(None, f"{p.rule.title} is on by default and {p.why}")
        if p.available and p.admits(message_bytes):
            return Default(p, p.why)
    return Default(None, "no default-on path runs here")


# --- launch lines that do what they claim ---------------------------------------------------

def launch_settings(s: Settings, engine: str, path: str, paths: list[PathState]) -> Settings:
    """`s` plus what its path needs to really take the decode allreduces in `engine` here: vLLM's
    default allreduce+RMSNorm fusion turned off where it would intercept them, SGLang's FlashInfer
    routing turned off where its architecture list turns it on, and a word where the path needs
    CUDA graphs."""
    def intercepts(p: PathState) -> bool:
        return p.available is not False and p.default_on and p.path != path
    notes = list(s.notes)
    if engine == VLLM:
        flags = list(s.vllm_flags)
        fused = next((p for p in paths if p.path == FLASHINFER_FUSED), None)
        if fused is not None and intercepts(fused) and path != FLASHINFER_FUSED \
                and settings.VLLM_NO_FUSE_ALLREDUCE_RMS[0] not in flags:
            flags += settings.VLLM_NO_FUSE_ALLREDUCE_RMS
            notes.append(settings.VLLM_FUSION_OFF_NOTE)
        if path == FLASHINFER_PCIE_IPC:
            notes.append(settings.NEEDS_CUDA_GRAPHS)
        return replace(s, vllm_flags=flags, notes=notes)
    flags = list(s.sglang_flags)
    routed = [p for p in paths if p.path in (FLASHINFER_AR, FLASHINFER_FUSED) and intercepts(p)]
    if routed and path not in (FLASHINFER_AR, FLASHINFER_FUSED) and settings.SGLANG_NO_FLASHINFER not in flags:
        flags.append(settings.SGLANG_NO_FLASHINFER)
        notes.append(settings.SGLANG_FLASHINFER_OFF_NOTE)
    if path == MSCCLPP:
        notes.append(settings.NEEDS_CUDA_GRAPHS)
    return replace(s, sglang_flags=flags, notes=notes)


# --- explain: the probe's words for the paths above --------------------------------------------

def status(p: PathState) -> str:
    if p.available is None:
        return "cannot tell here"
    if not p.available:
        return "off"
    return "on" if p.default_on else "opt-in"


def explain(snapshot: dict[str, Any], world_size: int) -> list[str]:
    """Which allreduce paths vLLM and SGLang would take on this box, and why: states() in words,
    under this host's multicast policy (inert_settings() is folded into states())."""
    if not snapshot.get("gpus"):
        return ["No CUDA GPU in this snapshot: vLLM and SGLang would not start a CUDA tensor-parallel group."]
    if world_size < 2:
        return [f"World size {world_size}: there is nothing to all-reduce; pass --world-size N to see TP=N."]
    blocked = multicast_policy_reason(True)
    b = box(snapshot, world_size, blocked)
    distinct = sorted(set(used_gpus(snapshot, world_size)))
    pairs = "n/a (one GPU, ranks share it)" if len(distinct) == 1 else "yes" if b.nvlink_all else "no"
    policy = f"; multicast {blocked}" if blocked else ""
    lines = [f"TP={world_size} on GPUs {distinct} (compute capability {b.cc}); NVLink between every pair: {pairs}; "
             f"functional P2P: {'yes' if b.p2p_ok else 'no'}; multicast attribute: "
             f"{'yes' if b.multicast else 'no'}{policy}."]
    for engine in settings.ENGINES:
        facts = source.active(engine)
        lines.append(f"{source.provenance_line(facts)}:")
        lines += [f"{facts.name} {facts.version} {p.rule.title}: {status(p)}: {p.why} — {p.rule.turn_on} "
                  f"[{p.source}]." for p in states(engine, snapshot, world_size, "bf16", blocked)]
    return lines
