"""Which allreduce paths vLLM and SGLang can take on a probed box at one TP size, which of them
each engine takes by default at a message size, and what turns each on.

The engines' rules are the facts in commbench/engines.py (versions and sources there and in the
comments below); this module applies them to a probe snapshot. It is the one set of gates and
size rules: recommend and floor price its paths, and the probe's explain section renders them
(explain()). No torch: the analysis reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commbench import engines
from commbench.engines import (CUSTOM_AR, FLASHINFER_AR, FLASHINFER_FUSED, FLASHINFER_PCIE_IPC, MSCCLPP, NCCL_PATH,
                               NCCL_SYMM, SGLANG, TORCH_SYMM_MEM, VLLM)
from commbench.ops import ALLREDUCE, FUSED_OP
from commbench.policy import multicast_policy_reason
from commbench.topology.needs import p2p_reason, vmm_reason
from commbench.topology.selection import gpu_pairs, p2p_entry, used_gpus, used_hosts

MiB = 1 << 20

# vLLM 0.33.0 all_reduce_utils.py CUSTOM_ALL_REDUCE_MAX_SIZES: the custom allreduce's cap where the
# torch symm-mem communicator is on (multicast); else CUSTOM_AR_MAX_BYTES (8 MiB).
CUSTOM_AR_CAP_WITH_SYMM = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 512 << 10, 8: 256 << 10},
                           "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB}}
# vLLM 0.33.0 symm_mem.py SYMM_MEM_ALL_REDUCE_MAX_SIZES.
VLLM_SYMM_MEM_MAX = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
                     "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB}}
# vLLM 0.33.0 FI_ALLREDUCE_FUSION_MAX_SIZE_MB (allreduce_rms_fusion.py), which also sizes the
# standalone FlashInfer allreduce's workspace (flashinfer_all_reduce.py max_workspace_size).
FLASHINFER_MAX = {"9.0": {2: 64 * MiB, 4: 2 * MiB, 8: MiB // 2},
                  "10.0": {2: 64 * MiB, 4: 32 * MiB, 8: 1 * MiB, 16: 64 * MiB}}
FLASHINFER_WORLD_SIZES = (2, 4, 8, 16)
PCIE_IPC_WORLD_SIZES = (2, 4, 8)
MSCCLPP_WORLD_SIZES = (4, 8, 16, 32, 64)
# vLLM 0.33.0 custom_all_reduce.cuh: one stage always at TP2; above, one stage below these sizes
# (with full NVLink), two stages from them.
VLLM_ONE_STAGE_BELOW = ((4, 512 << 10), (8, 256 << 10))
# Where the torch symm-mem communicator uses multimem rather than two-shot: vLLM 0.33.0 symm_mem.py
# _WORLD_SIZES_MULTIMEM; SGLang 0.5.23 torch_symm_mem.py (SM9/SM10 at 4/6/8 ranks).
VLLM_MULTIMEM_WORLD_SIZES = {"9.0": (4, 6, 8), "10.0": (6, 8)}
SGLANG_MULTIMEM_WORLD_SIZES = {"9": (4, 6, 8), "10": (4, 6, 8)}


@dataclass(frozen=True)
class PathRule:
    """One path of one engine, in the order the engine tries them for a call."""

    engine: str
    path: str
    title: str
    op: str
    default_on: bool        # taken without any setting where it is available
    turn_on: str            # what selects it (opt-in) or keeps it (default)
    source: str


RULES: tuple[PathRule, ...] = (
    # vLLM 0.33.0 cuda_communicator.py CudaCommunicator.all_reduce, dispatch order (ROCm paths left out).
    PathRule(VLLM, NCCL_SYMM, "NCCL symmetric memory", ALLREDUCE, False, "VLLM_USE_NCCL_SYMM_MEM=1",
             f"vLLM {engines.VLLM_VERSION} all_reduce_utils.py"),
    PathRule(VLLM, FLASHINFER_PCIE_IPC, "FlashInfer PCIe IPC allreduce", ALLREDUCE, False,
             "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1", "vLLM #53576, flashinfer_pcie_ipc_all_reduce.py"),
    PathRule(VLLM, FLASHINFER_AR, "FlashInfer allreduce (trtllm)", ALLREDUCE, True,
             "VLLM_ALLREDUCE_USE_FLASHINFER=1 (default)", f"vLLM {engines.VLLM_VERSION} flashinfer_all_reduce.py"),
    PathRule(VLLM, CUSTOM_AR, "custom allreduce (CUDA IPC)", ALLREDUCE, True,
             "on unless --disable-custom-all-reduce", f"vLLM {engines.VLLM_VERSION} custom_all_reduce.py"),
    PathRule(VLLM, TORCH_SYMM_MEM, "torch symmetric memory", ALLREDUCE, True,
             "VLLM_ALLREDUCE_USE_SYMM_MEM=1 (default)", f"vLLM {engines.VLLM_VERSION} symm_mem.py"),
    PathRule(VLLM, NCCL_PATH, "NCCL (PyNccl)", ALLREDUCE, True, "the fallback for every other size",
             f"vLLM {engines.VLLM_VERSION} pynccl.py"),
    PathRule(VLLM, FLASHINFER_FUSED, "FlashInfer allreduce+RMSNorm fusion", FUSED_OP, False,
             "--compilation-config fuse_allreduce_rms", f"vLLM {engines.VLLM_VERSION} allreduce_rms_fusion.py"),
    # SGLang 0.5.23 parallel_state.py all_reduce: custom AR, then the opt-in communicators, then PyNccl.
    PathRule(SGLANG, CUSTOM_AR, "custom allreduce (CUDA IPC)", ALLREDUCE, True,
             "on unless --disable-custom-all-reduce", f"SGLang {engines.SGLANG_VERSION} custom_all_reduce.py"),
    PathRule(SGLANG, MSCCLPP, "MSCCL++", ALLREDUCE, False, "--enable-mscclpp",
             f"SGLang {engines.SGLANG_VERSION} pymscclpp.py"),
    PathRule(SGLANG, TORCH_SYMM_MEM, "torch symmetric memory", ALLREDUCE, False, "--enable-torch-symm-mem",
             f"SGLang {engines.SGLANG_VERSION} torch_symm_mem.py"),
    PathRule(SGLANG, NCCL_SYMM, "NCCL symmetric memory", ALLREDUCE, False, "--enable-symm-mem",
             f"SGLang {engines.SGLANG_VERSION} pynccl_allocator.py"),
    PathRule(SGLANG, NCCL_PATH, "NCCL (PyNccl)", ALLREDUCE, True, "the fallback for every other size",
             f"SGLang {engines.SGLANG_VERSION} pynccl.py"),
    PathRule(SGLANG, FLASHINFER_FUSED, "FlashInfer allreduce+RMSNorm fusion", FUSED_OP, True,
             "--flashinfer-allreduce-fusion-backend trtllm (auto by default on SM90/SM10x)",
             f"SGLang {engines.SGLANG_VERSION} flashinfer_comm_fusion.py"),
)


@dataclass(frozen=True)
class PathState:
    """One engine path on one box: can it run, why (not), and up to which size the engine sends it."""

    rule: PathRule
    available: bool | None      # None: this run cannot tell (ranks share a GPU, a fact not probed)
    why: str
    max_bytes: int | None = None    # the engine routes a message here only below this size
    inclusive: bool = False         # max_bytes itself included (symm-mem, FlashInfer) or not (custom AR)
    # False: the engine runs another kernel on this path here than the one its own-kernel backend
    # measures (SGLang's legacy custom allreduce where its v2 gate fails): such rows stand in.
    own_kernel: bool = True

    @property
    def path(self) -> str:
        return self.rule.path

    def admits(self, message_bytes: int) -> bool:
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

    @property
    def multicast_usable(self) -> bool:
        return self.multicast and self.multicast_blocked is None


def box(snapshot: dict[str, Any] | None, world_size: int, multicast_blocked: str | None = None) -> Box:
    """multicast_blocked: why the host's policy forbids multicast objects (the probe passes its own
    host's; a run's analysis passes none)."""
    snapshot = snapshot if isinstance(snapshot, dict) else {}
    gpus_used = used_gpus(snapshot, world_size) if snapshot.get("gpus") else []
    if not gpus_used:
        return Box(world_size, False, False, False, "?", False, False, False, False, "no GPU in the snapshot", None)
    gpus = snapshot["gpus"]
    distinct = sorted(set(gpus_used))
    pairs = gpu_pairs(gpus_used)
    nvlink = len(distinct) > 1 and engines.nvlink_everywhere(snapshot, distinct)
    return Box(world_size=world_size, has_gpus=True, shares_gpus=len(distinct) < len(gpus_used),
               multi_node=len(used_hosts(snapshot, world_size)) > 1,
               cc=str(gpus[distinct[0]].get("compute_capability", "?")), nvlink_all=nvlink,
               can_access_all=all((p2p_entry(snapshot, a, b) or {}).get("can_access_peer") is True for a, b in pairs),
               p2p_ok=p2p_reason(snapshot, world_size) is None,
               multicast=all((gpus[g].get("attributes") or {}).get("multicast") == 1 for g in distinct),
               vmm_reason=vmm_reason(snapshot, world_size), nccl_version=engines.nccl_version(snapshot),
               multicast_blocked=multicast_blocked)


SHARED = "ranks share one GPU in this run (an emulation): the engine's gate on the fabric cannot be read"
P2P_TRUST_WARNING = ("WARNING: vLLM trusts cudaDeviceCanAccessPeer by default (VLLM_SKIP_P2P_CHECK=1) but the "
                     "write-and-verify check failed here — expect a hang or wrong output; use "
                     "--disable-custom-all-reduce or VLLM_SKIP_P2P_CHECK=0")


def size_text(n_bytes: int) -> str:
    return f"{n_bytes >> 20} MiB" if n_bytes >= MiB and n_bytes % MiB == 0 else f"{n_bytes >> 10} KiB"


def _vllm_stages(world_size: int) -> str:
    if world_size == 2:
        return "always 1-stage at TP2"
    below = next(size for ws, size in VLLM_ONE_STAGE_BELOW if world_size <= ws)
    return f"1-stage below {size_text(below)}, 2-stage above (full NVLink)"


def _custom_ar(b: Box, engine: str) -> tuple[bool | None, str, int | None]:
    if b.multi_node:
        return False, "the group spans nodes", None
    if b.world_size not in engines.CUSTOM_AR_WORLD_SIZES:
        return False, f"world size {b.world_size} is not one of {engines.CUSTOM_AR_WORLD_SIZES}", None
    cap = engines.CUSTOM_AR_MAX_BYTES
    if engine == VLLM and b.multicast_usable:
        cap = CUSTOM_AR_CAP_WITH_SYMM.get(b.cc, {}).get(b.world_size, cap)
    if b.shares_gpus and b.world_size > 2:
        return None, SHARED, cap
    if b.world_size > 2 and not b.nvlink_all:
        return False, ("above 2 GPUs it needs NVLink between every pair ('not supported on more than two "
                       "PCIe-only GPUs': is_fully_connected() asks NVML for NVLink and never tests PCIe peer "
                       "access; vLLM #56128)"), cap
    if not b.can_access_all:
        return False, "cudaDeviceCanAccessPeer is false on some pair (VLLM_SKIP_P2P_CHECK=1 default)", cap
    if engine == SGLANG:
        return True, f"messages below {size_text(cap)}", cap
    why = f"{_vllm_stages(b.world_size)}, messages below {size_text(cap)} (custom_all_reduce.cuh)"
    return True, why if b.p2p_ok else f"{why}; {P2P_TRUST_WARNING}", cap


def _multimem(b: Box, engine: str) -> bool:
    if engine == VLLM:
        return b.world_size in VLLM_MULTIMEM_WORLD_SIZES.get(b.cc, ())
    return b.world_size in SGLANG_MULTIMEM_WORLD_SIZES.get(b.cc.split(".")[0], ())


def _symm_mem(b: Box, engine: str) -> tuple[bool | None, str, int | None]:
    if not b.multicast:
        return False, ("no multicast on these GPUs: the symmetric-memory handle has multicast_ptr == 0 and the "
                       "communicator turns itself off, even for two-shot (vLLM #50179)"), None
    if b.multicast_blocked:
        return False, (f"multicast {b.multicast_blocked}: multicast_ptr == 0, and the communicator turns itself "
                       "off even for two-shot"), None
    kind = "multimem" if _multimem(b, engine) else "two-shot"
    if engine == VLLM:
        cap = VLLM_SYMM_MEM_MAX.get(b.cc, {}).get(b.world_size)
        if cap is None:
            return False, f"no SYMM_MEM_ALL_REDUCE_MAX_SIZES entry for compute capability {b.cc}", None
        return True, f"{kind} up to {size_text(cap)}, after the custom allreduce's sizes", cap
    return True, f"{kind} (multimem at 4/6/8 ranks on SM9/SM10, else two-shot)", None


def _flashinfer_backend(b: Box, engine: str, fused: bool) -> str:
    """Which FlashInfer backend the engine's 'auto' resolves to here."""
    if engine == VLLM and not fused:
        # vLLM flashinfer_all_reduce.py _resolve_fi_ar_backend: auto -> mnnvl on one node where multicast works
        if not b.multicast:
            return "its backend 'auto' falls back to trtllm (cuMemCreate + POSIX FD buffers, no multicast)"
        forbidden = f" — forbidden by this host's policy ({b.multicast_blocked})" if b.multicast_blocked else ""
        return ("its backend 'auto' resolves to mnnvl on one node and creates a multicast object "
                f"(cuMulticastCreate){forbidden}: set VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm for trtllm")
    if engine == SGLANG:
        # SGLang flashinfer_comm_fusion.py: auto -> trtllm on SM90, mnnvl on Blackwell
        if b.cc.startswith("9"):
            return "backend 'auto' -> trtllm (SM90, single node)"
        return "backend 'auto' -> mnnvl (Blackwell), which needs multicast" + (
            "" if b.multicast_usable else ", unavailable here")
    return "fused AR+residual+RMSNorm"


def _flashinfer(b: Box, engine: str, fused: bool) -> tuple[bool | None, str, int | None]:
    if b.multi_node:
        return False, "trtllm is single-node only; mnnvl needs multicast across nodes", None
    if b.world_size not in FLASHINFER_WORLD_SIZES:
        return False, f"world size {b.world_size} is not one of {FLASHINFER_WORLD_SIZES}", None
    if b.cc == "?":
        return None, "the snapshot has no compute capability", None
    if engine == SGLANG and b.cc.split(".")[0] not in ("9", "10"):
        return False, f"needs SM90 or SM10x, this is compute capability {b.cc}", None
    cap = FLASHINFER_MAX.get(b.cc, {}).get(b.world_size)
    if engine == VLLM and cap is None:
        return False, f"FI_ALLREDUCE_FUSION_MAX_SIZE_MB has no entry for compute capability {b.cc}", None
    if b.vmm_reason:
        unknown = None if "not tested" in b.vmm_reason else False
        if engine == SGLANG:
            return unknown, ("its cuMemCreate preflight would fail on at least one rank ('Skipping allreduce "
                             f"fusion to avoid cross-rank desync'); here: {b.vmm_reason}"), cap
        return unknown, f"FlashInfer's cuMemCreate workspace cannot be shared here ({b.vmm_reason})", cap
    kind = _flashinfer_backend(b, engine, fused)
    return True, f"{kind}; up to {size_text(cap)}" if cap else kind, cap


def _nccl_symm(b: Box) -> tuple[bool | None, str, int | None]:
    if b.world_size < 4:
        return False, "used from 4 ranks only (NCCL_SYMM_MEM_ALL_REDUCE_CONFIG)", None
    if b.shares_gpus:
        return None, SHARED, None
    version = b.nccl_version
    if version is not None and version >= engines.NCCL_SYMMETRIC_PCIE_OFF and not b.nvlink_all:
        return False, "NCCL >= 2.29.2 runs its symmetric kernels only on fully NVLink-connected systems", None
    return True, "NCCL's symmetric kernels on windows the engine registers", None


def _pcie_ipc(b: Box, dtype: str) -> tuple[bool | None, str, int | None]:
    if b.world_size not in PCIE_IPC_WORLD_SIZES:
        return False, f"world size {b.world_size} is not one of {PCIE_IPC_WORLD_SIZES}", None
    if dtype not in ("bf16", "fp16"):
        return False, f"bf16/fp16 only, not {dtype}", None
    if b.multi_node or not b.p2p_ok:
        return False, "needs working P2P between the GPUs of one node", None
    return True, "bf16/fp16 over PCIe peer-to-peer", None


def _mscclpp(b: Box) -> tuple[bool | None, str, int | None]:
    if b.world_size not in MSCCLPP_WORLD_SIZES:
        return False, f"world size {b.world_size} is not one of {MSCCLPP_WORLD_SIZES}", None
    if not b.p2p_ok:
        return False, "P2P does not work here", None
    return True, "runs only inside CUDA graphs", None


def state(rule: PathRule, b: Box, dtype: str) -> PathState:
    if not b.has_gpus:
        return PathState(rule, False, "no CUDA GPU in this run's snapshot")
    if b.world_size < 2:
        return PathState(rule, False, f"world size {b.world_size}: nothing to all-reduce")
    gate = {CUSTOM_AR: lambda: _custom_ar(b, rule.engine),
            TORCH_SYMM_MEM: lambda: _symm_mem(b, rule.engine),
            FLASHINFER_AR: lambda: _flashinfer(b, rule.engine, False),
            FLASHINFER_FUSED: lambda: _flashinfer(b, rule.engine, True),
            NCCL_SYMM: lambda: _nccl_symm(b),
            FLASHINFER_PCIE_IPC: lambda: _pcie_ipc(b, dtype),
            MSCCLPP: lambda: _mscclpp(b),
            NCCL_PATH: lambda: (True, "always available", None)}[rule.path]
    available, why, cap = gate()
    # Also where the gate itself cannot be read: which kernel would run is then unknown too.
    if rule.engine == SGLANG and rule.path == CUSTOM_AR and available is not False:
        legacy = _sglang_legacy_kernel(b)
        if legacy:
            return PathState(rule, available, f"{why}; {legacy}", cap, own_kernel=False)
    return PathState(rule, available, why, cap, inclusive=rule.path != CUSTOM_AR)


def _sglang_legacy_kernel(b: Box) -> str | None:
    """Why SGLang would run its legacy custom allreduce here, not the v2 kernel `sglang:*` measures:
    v2 needs NVLink on every pair, 2 GPUs included (engines.SGLANG_CUSTOM_AR_V2)."""
    if b.shares_gpus:
        return ("whether SGLang runs its v2 kernel or the legacy one here cannot be told (ranks share one GPU: "
                "v2 needs NVLink on every pair), so its own rows only stand in")
    if not b.nvlink_all:
        return (f"SGLang {engines.SGLANG_VERSION} runs its legacy kernel here (v2 needs NVLink on every pair, "
                "2 GPUs included), so rows of its v2 kernel only stand in")
    return None


def states(engine: str, snapshot: dict[str, Any] | None, world_size: int, dtype: str,
           multicast_blocked: str | None = None) -> list[PathState]:
    """Every path of `engine` on this box at this TP, in the engine's dispatch order. A path that
    engines.inert_settings() calls inert is off here with that rule's reason, whatever the gates
    above say: the two never disagree in one output."""
    b = box(snapshot, world_size, multicast_blocked)
    inert = engines.inert_settings(snapshot, world_size) if b.has_gpus else []
    out = []
    for rule in RULES:
        if rule.engine != engine:
            continue
        current = state(rule, b, dtype)
        off = next((r for r in inert if (engine, rule.path) in r.paths), None)
        if off is not None and current.available is not False:
            current = PathState(rule, False, f"{off.why} ({off.source})")
        out.append(current)
    return out


@dataclass(frozen=True)
class Default:
    """The path an engine takes for one message size with no settings changed."""

    path: PathState | None     # None: cannot be told (a default-on path's gate is unknown here)
    why: str


def default_path(paths: list[PathState], message_bytes: int, op: str = ALLREDUCE) -> Default:
    """The first default-on path, in dispatch order, that runs here and takes this size."""
    for p in paths:
        if not p.rule.default_on or p.rule.op != op:
            continue
        if p.available is None:
            return Default(None, f"{p.rule.title} is on by default and {p.why}")
        if p.available and p.admits(message_bytes):
            return Default(p, p.why)
    return Default(None, "no default-on path runs here")


# --- explain: the probe's words for the paths above --------------------------------------------

def _status(p: PathState) -> str:
    if p.available is None:
        return "cannot tell here"
    if not p.available:
        return "off"
    return "on" if p.rule.default_on else "opt-in"


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
    for engine in engines.ENGINES:
        name = f"{engines.ENGINE_NAMES[engine]} {engines.versions()[engine]}"
        lines += [f"{name} {p.rule.title}: {_status(p)}: {p.why} — {p.rule.turn_on}."
                  for p in states(engine, snapshot, world_size, "bf16", blocked)]
    return lines
