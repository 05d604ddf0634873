"""vLLM, whole: its allreduce facts with their sources, its paths in the order its own
CudaCommunicator.all_reduce tries them, each path's gate on a box, its words, its start-up log's
names, its prefill default and the settings that do nothing on a box.

Read at vLLM 0.34.0; 0.33.0 gives every fact the same value except the one marked `since`
(results/reference/engine-rules/ has `commbench engines --check` on both wheels, gates and order
included). Updating to a new release is an edit of this file and one `commbench engines --check`
run against its wheel.
"""

from __future__ import annotations

import inspect
import types

from commbench.engines import libs
from commbench.engines import probes
from commbench.engines.facts import ENV, KERNELS, PARAM, TEXT, Fact, FactSet
from commbench.engines.paths import (CUSTOM_AR, EAGER, FLASHINFER_AR, FLASHINFER_FUSED, FLASHINFER_PCIE_IPC,
                                     FROM_IMPORT, NCCL_PATH, NCCL_SYMM, SHARED, TORCH_SYMM_MEM, Engine, Gate,
                                     GateProbe, InertSetting, PathRule, PathState, Words, Workload, bytes_per, env,
                                     flags, pick, size_text)
from commbench.ops import ALLREDUCE, FUSED_OP
from commbench.topology.box import Box

KEY, NAME = "vllm", "vLLM"
VERSION = "0.34.0"
CHECKED = ("0.33.0", "0.34.0")     # releases whose source gives every fact below

MiB, KiB = 1 << 20, 1 << 10
_COMM = "vllm/distributed/device_communicators/"
_FUSION = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"

FACTS = FactSet(KEY, NAME, VERSION, (
    Fact("dispatch_order", ["FLASHINFER_PCIE_IPC", "FLASHINFER", "NCCL_SYMM_MEM", "QUICK_REDUCE", "AITER_CUSTOM",
                            "CUSTOM", "SYMM_MEM", "PYNCCL"],
         _COMM + "cuda_communicator.py", "CudaCommunicator._log_all_reduce_backend_selection.all_potential_ar_backends",
         meaning="the all-reduce backends as vLLM logs them at start-up; the order calls take is all_reduce's own "
                 "(NCCL symmetric memory first where FlashInfer does not take the message, then PCIe IPC, "
                 "FlashInfer, custom allreduce, torch symmetric memory, PyNccl), compared by `engines --check`"),
    Fact("dispatch_log", True, _COMM + "cuda_communicator.py", "all-reduce backends (in dispatch order) for group",
         TEXT, "the start-up log line naming the backends set up for each group (--engine-log reads it)"),
    Fact("custom_ar_world_sizes", [2, 4, 6, 8, 16], _COMM + "custom_all_reduce.py",
         "CustomAllreduce._SUPPORTED_WORLD_SIZES", meaning="world sizes the custom allreduce starts at"),
    Fact("custom_ar_above_8_refused", True, _COMM + "custom_all_reduce.py", "self.world_size > 8", TEXT,
         "should_custom_ar refuses every message above 8 ranks: at TP16 the communicator starts and takes nothing"),
    Fact("custom_ar_max_bytes", 8 * MiB, _COMM + "custom_all_reduce.py", "CustomAllreduce.__init__.max_size", PARAM,
         "the custom allreduce takes messages below this size (inp_size < max_size)"),
    Fact("custom_ar_max_with_symm_mem", {
        "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 512 * KiB, 8: 256 * KiB},
        "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB},
        "10.3": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB},
        "10.7": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB}},
        _COMM + "all_reduce_utils.py", "CUSTOM_ALL_REDUCE_MAX_SIZES",
        meaning="where torch symmetric memory is on, the custom allreduce's cap is min(this, max_size); with "
                "VLLM_ALLREDUCE_USE_SYMM_MEM=0 it keeps max_size"),
    Fact("symm_mem_max_bytes", {
        "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
        "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
        "10.3": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB},
        "10.7": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB}},
        _COMM + "all_reduce_utils.py", "SYMM_MEM_ALL_REDUCE_MAX_SIZES",
        meaning="torch symmetric memory takes messages up to this size (inclusive) per compute capability"),
    Fact("symm_mem_bf16_only", True, _COMM + "symm_mem.py", "self.dtype = torch.bfloat16", TEXT,
         "its buffer is bf16 and should_use_symm_mem refuses any other dtype: fp16 messages go on to PyNccl"),
    Fact("symm_mem_multimem_world_sizes", {"9.0": [4, 6, 8], "10.0": [6, 8], "10.3": [6, 8], "10.7": [6, 8]},
         _COMM + "symm_mem.py", "SymmMemCommunicator._WORLD_SIZES_MULTIMEM",
         meaning="where torch symmetric memory uses multimem rather than two-shot"),
    Fact("flashinfer_max_mb", {90: {2: 64, 4: 2, 8: 0.5}, 100: {2: 64, 4: 32, 8: 1, 16: 64},
                               103: {2: 64, 4: 64, 8: 4, 16: 64}, 107: {2: 64, 4: 64, 8: 2}},
         _FUSION, "FI_ALLREDUCE_FUSION_MAX_SIZE_MB",
         meaning="the allreduce+RMSNorm fusion's size limit, and the standalone FlashInfer allreduce's workspace "
                 "where no tuned MNNVL limit applies"),
    Fact("flashinfer_mnnvl_max_mb", {(100, 8, 1): 128, (100, 8, 2): 128, (103, 4, 1): 80, (103, 8, 1): 128,
                                     (103, 8, 2): 128, (103, 16, 4): 8},
         _COMM + "all_reduce_utils.py", "FI_MNNVL_ALLREDUCE_MAX_SIZE_MB",
         meaning="tuned limits of the standalone FlashInfer allreduce when its backend is mnnvl, by (capability, "
                 "world size, nodes)"),
    Fact("flashinfer_mnnvl_multi_node", True, _COMM + "flashinfer_all_reduce.py",
         "elif current_platform.has_device_capability(100):", TEXT,
         "backend 'auto' across nodes: mnnvl on Blackwell (SM10x), which needs multicast across the nodes (MNNVL); "
         "no FlashInfer allreduce across nodes elsewhere"),
    Fact("flashinfer_hisparse_trtllm", True, _COMM + "flashinfer_all_reduce.py",
         "config.attention_config.hisparse_config is not None", TEXT,
         "with HiSparse attention, backend 'auto' is trtllm on one node and FlashInfer is off across nodes "
         "(vllm#64327)", since="0.34.0", absent=False),
    Fact("nccl_symm_config", {"min_world_size": 4, "custom_ar_preferred_ranges": {4: (16 * KiB, 512 * KiB),
                                                                                 8: (16 * KiB, 128 * KiB)},
                              "always_use_above_world_size": 8},
         _COMM + "all_reduce_utils.py", "NCCL_SYMM_MEM_ALL_REDUCE_CONFIG",
         meaning="NCCL symmetric memory: from 4 ranks, not for sizes strictly inside the custom allreduce's range"),
    Fact("nccl_symm_allocator_jit", True, _COMM + "pynccl_allocator.py",
         "return envs.VLLM_USE_NCCL_SYMM_MEM and not _nccl_allocator_failed_to_compile", TEXT,
         "where the NCCL allocator's JIT build fails, VLLM_USE_NCCL_SYMM_MEM=1 turns itself off without an error"),
    Fact("pcie_ipc_world_sizes", (2, 4, 8), _COMM + "flashinfer_pcie_ipc_all_reduce.py", "_SUPPORTED_WORLD_SIZES"),
    Fact("pcie_ipc_needs_graphs", True, _COMM + "flashinfer_pcie_ipc_all_reduce.py",
         "capture_sizes = worker.vllm_config.compilation_config.cudagraph_capture_sizes", TEXT,
         "the PCIe IPC workspace is set up for the CUDA-graph capture sizes only: nothing under --enforce-eager, "
         "and no message above the largest captured batch x hidden"),
    Fact("pcie_ipc_off_under_dbo", True, _COMM + "flashinfer_pcie_ipc_all_reduce.py",
         "does not yet support DBO or", TEXT,
         "with dual-batch overlap (micro-batching) the PCIe IPC allreduce turns itself off with a warning"),
    Fact("default_max_capture_tokens", True, "vllm/config/vllm.py",
         "1024 if current_platform.is_device_capability_family(100) else 512", TEXT,
         "the largest captured batch by default: min(2 x max_num_seqs, 512; 1024 on SM10x)"),
    Fact("fusion_on_at_O2", True, "vllm/config/vllm.py", '"fuse_allreduce_rms": enable_allreduce_rms_fusion', TEXT,
         "-O2 and -O3 turn fuse_allreduce_rms on through enable_allreduce_rms_fusion"),
    Fact("default_O2", True, "vllm/config/vllm.py", "optimization_level: OptimizationLevel = OptimizationLevel.O2",
         TEXT, "the default optimization level is -O2"),
    Fact("fusion_archs", True, "vllm/config/vllm.py", "current_platform.is_device_capability_family(100)", TEXT,
         "enable_allreduce_rms_fusion: TP > 1, CUDA, FlashInfer installed, SM90 or any SM10x"),
    Fact("batch_invariant", True, "vllm/config/vllm.py", "The fused all-reduce + RMSNorm path is not batch-invariant",
         TEXT, "VLLM_BATCH_INVARIANT=1 turns off FlashInfer (fused and standalone), PCIe IPC, torch and NCCL "
               "symmetric memory, and lets the custom allreduce take every size"),
    Fact("enforce_eager", True, "vllm/config/model.py", "enforce_eager: bool = False", TEXT,
         "--enforce-eager runs without CUDA graphs"),
    Fact("custom_ar_kernels", ["cross_device_reduce_1stage", "cross_device_reduce_2stage"],
         "vllm/_C_stable_libtorch.abi3.so", r"vllm[0-9]+(cross_device_reduce_[12]stage)I", KERNELS,
         "the custom allreduce's kernels as a profiler trace names them (vllm::cross_device_reduce_1stage<...>)"),
    Fact("algo_var_in_kernel", ["VLLM_CUSTOM_ALLREDUCE_ALGO"], "vllm/_C_stable_libtorch.abi3.so",
         r"(VLLM_CUSTOM_ALLREDUCE_ALGO)", KERNELS,
         "the custom allreduce's kernel reads VLLM_CUSTOM_ALLREDUCE_ALGO=1stage|2stage (no Python file states it)"),
    Fact("env_use_flashinfer", "1", "vllm/envs.py", "VLLM_ALLREDUCE_USE_FLASHINFER", ENV),
    Fact("env_use_symm_mem", "1", "vllm/envs.py", "VLLM_ALLREDUCE_USE_SYMM_MEM", ENV),
    Fact("env_use_pcie_ipc", "0", "vllm/envs.py", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", ENV),
    Fact("env_use_nccl_symm_mem", "0", "vllm/envs.py", "VLLM_USE_NCCL_SYMM_MEM", ENV),
    Fact("env_skip_p2p_check", "1", "vllm/envs.py", "VLLM_SKIP_P2P_CHECK", ENV),
))

# --- the settings that select its paths (what backends declare, and what launch lines add) ------

DISABLE_CUSTOM_ALLREDUCE = "--disable-custom-all-reduce"     # the same flag in SGLang
# The raw JSON: paste-ready lines quote every value themselves (shlex.quote).
FUSE_ALLREDUCE_RMS_CONFIG = '{"pass_config": {"fuse_allreduce_rms": true}}'
NO_FUSE_ALLREDUCE_RMS_CONFIG = '{"pass_config": {"fuse_allreduce_rms": false}}'
FUSE_ALLREDUCE_RMS = ["--compilation-config", FUSE_ALLREDUCE_RMS_CONFIG]
NO_FUSE_ALLREDUCE_RMS = ["--compilation-config", NO_FUSE_ALLREDUCE_RMS_CONFIG]
USE_FLASHINFER, USE_SYMM_MEM = "VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_ALLREDUCE_USE_SYMM_MEM"
USE_PCIE_IPC, USE_NCCL_SYMM = "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", "VLLM_USE_NCCL_SYMM_MEM"
ONLY_NCCL = {USE_SYMM_MEM: "0", USE_FLASHINFER: "0"}
ONLY_CUSTOM_ALLREDUCE = {USE_FLASHINFER: "0", USE_SYMM_MEM: "0"}
ONLY_SYMM_MEM = {USE_SYMM_MEM: "1", USE_FLASHINFER: "0"}
FLASHINFER_TRTLLM_ENV = {USE_FLASHINFER: "1", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}
PCIE_IPC_ENV = {USE_PCIE_IPC: "1"}                              # vLLM #53576, opt-in
ALGO_VAR = "VLLM_CUSTOM_ALLREDUCE_ALGO"    # read by its kernel (custom_all_reduce.cuh): 1stage | 2stage
ONE_STAGE_BELOW = ((4, 512 << 10), (8, 256 << 10))   # custom_all_reduce.cuh (no Python states it)

WORDS = Words(command="vllm serve MODEL --tensor-parallel-size {tp}", eager="--enforce-eager",
              deterministic="VLLM_BATCH_INVARIANT=1", nccl_so_var="VLLM_NCCL_SO_PATH")

# The order CudaCommunicator.all_reduce tries them (ROCm's quick reduce and AITER left out), its
# compiled allreduce+RMSNorm fusion first since it replaces the call itself.
RULES: tuple[PathRule, ...] = (
    PathRule(FLASHINFER_FUSED, "FlashInfer allreduce+RMSNorm fusion", FUSED_OP, True,
             "on by default at -O2 (TP > 1, SM90/SM10x)",
             f"--compilation-config '{NO_FUSE_ALLREDUCE_RMS_CONFIG}' or -O1",
             ("fusion_on_at_O2", "default_O2", "fusion_archs", "flashinfer_max_mb"),
             on=flags(*FUSE_ALLREDUCE_RMS), off=flags(*NO_FUSE_ALLREDUCE_RMS)),
    PathRule(NCCL_SYMM, "NCCL symmetric memory", ALLREDUCE, False, f"{USE_NCCL_SYMM}=1",
             "leave the variable unset", ("env_use_nccl_symm_mem", "nccl_symm_config", "nccl_symm_allocator_jit"),
             on=env(USE_NCCL_SYMM, "1"), off=env(USE_NCCL_SYMM, "0"), yields_to=(FLASHINFER_AR,)),
    PathRule(FLASHINFER_PCIE_IPC, "FlashInfer PCIe IPC allreduce", ALLREDUCE, False,
             f"{USE_PCIE_IPC}=1, with CUDA graphs", "leave the variable unset",
             ("env_use_pcie_ipc", "pcie_ipc_world_sizes", "pcie_ipc_needs_graphs", "default_max_capture_tokens",
              "pcie_ipc_off_under_dbo"),
             on=env(USE_PCIE_IPC, "1"), off=env(USE_PCIE_IPC, "0"), graphs_only=True),
    PathRule(FLASHINFER_AR, "FlashInfer allreduce", ALLREDUCE, True, f"{USE_FLASHINFER}=1 (default)",
             f"{USE_FLASHINFER}=0", ("env_use_flashinfer", "flashinfer_max_mb", "flashinfer_mnnvl_max_mb",
                                     "flashinfer_mnnvl_multi_node"),
             on=env(USE_FLASHINFER, "1"), off=env(USE_FLASHINFER, "0")),
    PathRule(CUSTOM_AR, "custom allreduce (CUDA IPC)", ALLREDUCE, True, f"on unless {DISABLE_CUSTOM_ALLREDUCE}",
             DISABLE_CUSTOM_ALLREDUCE, ("custom_ar_world_sizes", "custom_ar_above_8_refused", "custom_ar_max_bytes",
                                        "custom_ar_max_with_symm_mem", "env_skip_p2p_check"),
             off=flags(DISABLE_CUSTOM_ALLREDUCE)),
    PathRule(TORCH_SYMM_MEM, "torch symmetric memory", ALLREDUCE, True, f"{USE_SYMM_MEM}=1 (default)",
             f"{USE_SYMM_MEM}=0", ("env_use_symm_mem", "symm_mem_max_bytes", "symm_mem_bf16_only",
                                   "symm_mem_multimem_world_sizes"),
             on=env(USE_SYMM_MEM, "1"), off=env(USE_SYMM_MEM, "0")),
    PathRule(NCCL_PATH, "NCCL (PyNccl)", ALLREDUCE, True, "the fallback for every other size", "-",
             ("dispatch_order",)),
)

P2P_TRUST_WARNING = ("WARNING: vLLM trusts cudaDeviceCanAccessPeer by default (VLLM_SKIP_P2P_CHECK=1) but the "
                     "write-and-verify check failed here — expect a hang or wrong output; use "
                     f"{DISABLE_CUSTOM_ALLREDUCE} or VLLM_SKIP_P2P_CHECK=0")
BATCH_INVARIANT_OFF = "VLLM_BATCH_INVARIANT=1 (the deterministic mode asked for) turns it off"


def _stages(world_size: int) -> str:
    if world_size == 2:
        return "always 1-stage at TP2"
    below = next((size for ws, size in ONE_STAGE_BELOW if world_size <= ws), None)
    picked = f"1-stage below {size_text(below)}, 2-stage above (full NVLink" if below else "2-stage (full NVLink"
    return f"{picked}; {ALGO_VAR}=1stage|2stage forces one)"


def _symm_on(b: Box, f: FactSet, deterministic: bool) -> bool:
    """Whether its torch symmetric-memory communicator starts here (the custom allreduce's cap reads it)."""
    return (b.multicast_usable and not deterministic
            and b.world_size in f.value("symm_mem_max_bytes").get(b.cc, {}))


def _custom_ar(b: Box, f: FactSet, deterministic: bool) -> Gate:
    if b.multi_node:
        return Gate(False, "the group spans nodes (should_custom_ar refuses every message of an MNNVL group)")
    sizes = f.value("custom_ar_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    if b.world_size > 8 and f.value("custom_ar_above_8_refused"):
        return Gate(False, f"should_custom_ar refuses every message above 8 ranks: the communicator starts at "
                           f"TP{b.world_size} and takes nothing")
    cap = f.value("custom_ar_max_bytes")
    alone = None
    if _symm_on(b, f, deterministic):
        table = f.value("custom_ar_max_with_symm_mem").get(b.cc, {})
        alone = (TORCH_SYMM_MEM, cap)
        cap = min(table.get(b.world_size, cap), cap)
    if b.shares_gpus and b.world_size > 2:
        return Gate(None, SHARED, cap, False, cap_alone=alone)
    if b.world_size > 2 and not b.nvlink_all:
        return Gate(False, ("above 2 GPUs it needs NVLink between every pair ('not supported on more than two "
                            "PCIe-only GPUs': is_fully_connected() asks NVML for NVLink and never tests PCIe peer "
                            "access; vLLM #56128)"), cap, False)
    if not b.can_access_all:
        return Gate(False, "cudaDeviceCanAccessPeer is false on some pair (VLLM_SKIP_P2P_CHECK=1 default)", cap, False)
    if deterministic:
        return Gate(True, "VLLM_BATCH_INVARIANT=1: every size (batch_invariant bypasses the size check)", None, False)
    why = f"{_stages(b.world_size)}, messages below {size_text(cap)}"
    if alone:
        why += f" ({size_text(alone[1])} with {USE_SYMM_MEM}=0)"
    return Gate(True, why if b.p2p_ok else f"{why}; {P2P_TRUST_WARNING}", cap, False, cap_alone=alone)


def flashinfer_backend(cc_int: int | None, nodes: int, hisparse: bool, f: FactSet) -> str | None:
    """_resolve_fi_ar_backend with VLLM_FLASHINFER_ALLREDUCE_BACKEND=auto: 'mnnvl+trtllm' (mnnvl,
    trtllm where its workspace cannot be made), 'trtllm', 'mnnvl' or None (no FlashInfer)."""
    if hisparse and f.value("flashinfer_hisparse_trtllm"):
        return "trtllm" if nodes == 1 else None
    if nodes == 1:
        return "mnnvl+trtllm"
    return "mnnvl" if cc_int is not None and cc_int >= 100 and f.value("flashinfer_mnnvl_multi_node") else None


def _flashinfer(b: Box, f: FactSet, fused: bool, mode: str, hidden: int | None, deterministic: bool) -> Gate:
    common = libs.flashinfer_common(b)
    if common:
        return common
    if deterministic:
        return Gate(False, BATCH_INVARIANT_OFF)
    if fused:
        if mode == EAGER:
            return Gate(False, "under --enforce-eager nothing is compiled, so the fusion pass never runs")
        if not (b.cc == "9.0" or b.major == 10):
            return Gate(False, f"enable_allreduce_rms_fusion turns it on at SM90 and SM10x only, not compute "
                               f"capability {b.cc}")
    if flashinfer_backend(b.cc_int, b.nodes or 1, False, f) is None:
        return Gate(False, "across nodes its backend 'auto' needs MNNVL (Blackwell): FlashInfer is off here")
    mb = f.value("flashinfer_max_mb").get(b.cc_int, {}).get(b.world_size)
    if mb is None:
        return Gate(False, f"FI_ALLREDUCE_FUSION_MAX_SIZE_MB has no entry for compute capability {b.cc} at world "
                           f"size {b.world_size}")
    cap = int(mb * MiB)
    hisparse = ("; with HiSparse attention backend 'auto' is trtllm (off across nodes; vllm#64327)"
                if f.value("flashinfer_hisparse_trtllm") else "")
    if b.multi_node:
        if not b.multicast_usable:
            return Gate(False, "across nodes its backend is mnnvl, which needs multicast across the nodes (MNNVL): "
                               "none here")
        kind = f"across {b.nodes} nodes backend 'auto' is mnnvl (Blackwell MNNVL)"
    elif not b.multicast:
        kind = "its backend 'auto' falls back to trtllm (cuMemCreate + POSIX FD buffers, no multicast)"
    else:
        forbidden = f" — forbidden by this host's policy ({b.multicast_blocked})" if b.multicast_blocked else ""
        kind = ("its backend 'auto' resolves to mnnvl on one node and creates a multicast object "
                f"(cuMulticastCreate){forbidden}: set VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm for trtllm")
    if fused:
        tokens = f" ({cap // (hidden * 2)} tokens of hidden {hidden} in bf16)" if hidden else ""
        why = (f"on by default at -O2 (TP > 1, SM90/SM10x, FlashInfer installed): decode allreduce + residual + "
               f"RMSNorm run FlashInfer's fused kernel up to {size_text(cap)}{tokens}; {kind}{hisparse}")
    else:
        tuned = f.value("flashinfer_mnnvl_max_mb").get((b.cc_int, b.world_size, b.nodes or 1))
        cap = int(tuned * MiB) if tuned is not None and b.multicast_usable else cap
        why = f"{kind}; up to {size_text(cap)}{hisparse}"
    gate = Gate(True, why, cap)
    return libs.vmm_gate(b, gate, "FlashInfer's cuMemCreate workspace cannot be shared here ({})")


def _pcie_ipc(b: Box, f: FactSet, dtype: str, mode: str, hidden: int | None, deterministic: bool) -> Gate:
    sizes = f.value("pcie_ipc_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    if dtype not in ("bf16", "fp16"):
        return Gate(False, f"bf16/fp16 only, not {dtype}")
    if deterministic:
        return Gate(False, BATCH_INVARIANT_OFF)
    if mode == EAGER:
        return Gate(False, "needs CUDA graphs: its workspace is set up for the graph capture sizes, and under "
                           "--enforce-eager there are none, so it turns itself off")
    if b.multi_node or not b.p2p_ok:
        return Gate(False, "needs working P2P between the GPUs of one node")
    tokens = 1024 if b.major == 10 else 512
    said = (f"bf16/fp16 over PCIe peer-to-peer, inside CUDA graphs only (off with dual-batch overlap), up to the "
            f"largest captured batch x hidden ({tokens} tokens by default")
    if hidden:
        cap = tokens * hidden * bytes_per(dtype)
        return Gate(True, f"{said}: {size_text(cap)})", cap)
    return Gate(True, f"{said})")


def _nccl_symm(b: Box, f: FactSet, deterministic: bool) -> Gate:
    config = f.value("nccl_symm_config")
    ranges = config.get("custom_ar_preferred_ranges", {})
    if b.world_size < config.get("min_world_size", 4) or not (
            b.world_size in ranges or b.world_size > config.get("always_use_above_world_size", 8)):
        return Gate(False, f"not used at world size {b.world_size} (NCCL_SYMM_MEM_ALL_REDUCE_CONFIG)")
    if deterministic:
        return Gate(False, BATCH_INVARIANT_OFF)
    fabric = libs.nccl_symm_fabric(b)
    if fabric:
        return fabric
    skipped = tuple(ranges[b.world_size]) if b.world_size in ranges else None
    note = (f"; sizes strictly between {size_text(skipped[0])} and {size_text(skipped[1])} are left to the custom "
            "allreduce") if skipped else ""
    return Gate(True, f"NCCL's symmetric kernels on windows the engine registers, where FlashInfer does not take "
                      f"the message{note}; off without an error where the NCCL allocator's JIT build fails",
                None, True, skipped=skipped)  # type: ignore[arg-type]


def gate(rule: PathRule, b: Box, f: FactSet, w: Workload) -> Gate:
    if not b.fabric_known:
        return Gate(None, FROM_IMPORT)
    return {CUSTOM_AR: lambda: _custom_ar(b, f, w.deterministic),
            TORCH_SYMM_MEM: lambda: (Gate(False, BATCH_INVARIANT_OFF) if w.deterministic else libs.symm_mem_gate(
                b, f.value("symm_mem_max_bytes"), f.value("symm_mem_multimem_world_sizes"), b.cc,
                "SYMM_MEM_ALL_REDUCE_MAX_SIZES", "the custom allreduce's sizes", w.dtype, True)),
            FLASHINFER_AR: lambda: _flashinfer(b, f, False, w.mode, w.hidden, w.deterministic),
            FLASHINFER_FUSED: lambda: _flashinfer(b, f, True, w.mode, w.hidden, w.deterministic),
            NCCL_SYMM: lambda: _nccl_symm(b, f, w.deterministic),
            FLASHINFER_PCIE_IPC: lambda: _pcie_ipc(b, f, w.dtype, w.mode, w.hidden, w.deterministic),
            }[rule.path]()


# --- the prefill chunk: vLLM 0.33.0 vllm/engine/arg_utils.py:2940-3005 (EngineArgs.get_batch_defaults,
# API server: >= 160 GiB 16384, >= 70 GiB and not A100 / GB10 8192, else 2048 tokens per step)

def prefill_tokens(b: Box, f: FactSet) -> tuple[int, str]:
    mib = b.memory_mib
    small = "a100" in b.gpu_name.lower() or b.cc == "12.1"
    tokens = 16384 if mib and mib >= 160 * 1024 else 8192 if mib and mib >= 70 * 1024 and not small else 2048
    seen = f"{mib / 1024:.0f} GiB GPUs" if mib else "GPU memory not recorded"
    return tokens, (f"{f.name} {f.version} max_num_batched_tokens default for the API server, {seen} "
                    "(vllm/engine/arg_utils.py get_batch_defaults)")


# --- settings that do nothing on a probed box ----------------------------------------------------

def inert(b: Box, f: FactSet) -> list[InertSetting]:
    """vLLM settings that change nothing at this world size on this box, each with why and source."""
    if not b.has_gpus or b.multi_node:
        return []
    out = []
    if b.cc.startswith("12."):
        out.append(InertSetting("vLLM compilation pass fuse_allreduce_rms (FlashInfer allreduce + RMSNorm fusion)",
                                f"turned on automatically at -O2 on SM90 and every SM10x only; its size table "
                                f"FI_ALLREDUCE_FUSION_MAX_SIZE_MB has no row for compute capability {b.cc}, so "
                                "nothing is fused",
                                f"vLLM {f.version} config/vllm.py, compilation/passes/fusion/allreduce_rms_fusion.py",
                                ((KEY, FLASHINFER_FUSED),)))
    if b.cc == "12.0":
        out.append(InertSetting("vLLM VLLM_ALLREDUCE_USE_SYMM_MEM=1 (torch symmetric-memory allreduce, on by default)",
                                "SYMM_MEM_ALL_REDUCE_MAX_SIZES gives sizes for compute capability 9.0 and 10.x and "
                                "none for 12.0: no message takes this path",
                                f"vLLM {f.version} distributed/device_communicators/symm_mem.py",
                                ((KEY, TORCH_SYMM_MEM),)))
    if b.shares_gpus:
        return out    # an emulation: no fabric to read the NVLink gates from
    if b.world_size > 2 and not b.nvlink_all:
        out.append(InertSetting("vLLM custom allreduce (on by default: no --disable-custom-all-reduce needed to turn "
                                "it off here)",
                                f"above 2 GPUs it needs NVLink between every pair ('not supported on more than two "
                                f"PCIe-only GPUs'); at TP {b.world_size} without full NVLink it falls back to NCCL",
                                f"vLLM {f.version} distributed/device_communicators/custom_all_reduce.py",
                                ((KEY, CUSTOM_AR),)))
    symmetric = libs.nccl_symmetric_inert(b)
    if symmetric:
        out.append(InertSetting(f"NCCL symmetric kernels (vLLM {USE_NCCL_SYMM}=1, NCCL_SYM_KERNEL)", *symmetric,
                                ((KEY, NCCL_SYMM),)))
    return out


# --- its start-up log ------------------------------------------------------------------------

# The line it logs per group (fact dispatch_log), and the backend names as it lists them
# (cuda_communicator.py all_potential_ar_backends) -> path ids; QUICK_REDUCE and AITER_CUSTOM are ROCm's.
LOG_LINE = (r"Using \[((?:'[A-Z_]{1,40}'(?:, )?){0,16})\] all-reduce backends \(in dispatch order\) "
            r"for group '([A-Za-z0-9_:.-]{0,64})'")
LOG_SAID = "Using [...] all-reduce backends (in dispatch order) for group"
LOG_NAMES = {"FLASHINFER_PCIE_IPC": FLASHINFER_PCIE_IPC, "FLASHINFER": FLASHINFER_AR, "NCCL_SYMM_MEM": NCCL_SYMM,
             "CUSTOM": CUSTOM_AR, "SYMM_MEM": TORCH_SYMM_MEM, "PYNCCL": NCCL_PATH}


# --- its gates and order, compared with its own functions by `engines --check` ----------------------
# Each `theirs` runs in the check's child process with torch and the named modules imported from
# the wheel (gates.py); it sets on the engine's objects only what the function reads.

def _rule(path: str) -> PathRule:
    return next(r for r in RULES if r.path == path)


def _ours_dispatch(point: dict, f: FactSet) -> str | None:
    return pick([r for r in RULES if r.op == ALLREDUCE], {*point["takers"], NCCL_PATH})


def _theirs_dispatch(load, torch):
    mod = load(_MOD + "cuda_communicator")
    calls: list[str] = []
    mod.current_platform = types.SimpleNamespace(is_rocm=lambda: False)
    mod.envs = probes.Proxy(mod.envs, VLLM_BATCH_INVARIANT=False)
    mod.torch = probes.Proxy(torch, ops=types.SimpleNamespace(vllm=types.SimpleNamespace(
        all_reduce_symmetric_with_copy=lambda x: calls.append(NCCL_SYMM) or "out")))
    tensor = probes.meta(torch, 64 * KiB)

    def ask(point: dict) -> str | None:
        takers = set(point["takers"])
        mod.should_nccl_symm_mem_allreduce = lambda world_size, inp: NCCL_SYMM in takers
        me = types.SimpleNamespace(
            fi_ar_comm=probes.Comm(FLASHINFER_AR, FLASHINFER_AR in takers, calls), qr_comm=None, aiter_ar_comm=None,
            fi_pcie_ipc_ar_comm=probes.Comm(FLASHINFER_PCIE_IPC, FLASHINFER_PCIE_IPC in takers, calls),
            use_aiter_allreduce=False, ca_comm=probes.Comm(CUSTOM_AR, CUSTOM_AR in takers, calls),
            symm_mem_comm=probes.Comm(TORCH_SYMM_MEM, TORCH_SYMM_MEM in takers, calls),
            pynccl_comm=probes.Comm(NCCL_PATH, True, calls, world_size=8), device_group=None)
        calls.clear()
        mod.CudaCommunicator.all_reduce(me, tensor)
        return calls[0] if calls else None
    return ask


def _ours_custom_ar(point: dict, f: FactSet) -> bool:
    g = _custom_ar(probes.probe_box(point["tp"], nvlink=point["nvlink"], multicast=False), f, point["batch_invariant"])
    return g.available is True and PathState(_rule(CUSTOM_AR), True, "", g.cap, g.inclusive).admits(point["bytes"])


def _theirs_custom_ar(load, torch):
    mod = load(_MOD + "custom_all_reduce")
    mod.is_weak_contiguous = lambda inp: inp.is_contiguous()
    max_size = inspect.signature(mod.CustomAllreduce.__init__).parameters["max_size"].default
    return lambda p: mod.CustomAllreduce.should_custom_ar(types.SimpleNamespace(
        disabled=False, mnnvl_only=False, world_size=p["tp"], fully_connected=p["nvlink"],
        batch_invariant=p["batch_invariant"], max_size=max_size), probes.meta(torch, p["bytes"], p["dtype"]))


def _ours_symm_mem(point: dict, f: FactSet) -> bool:
    g = libs.symm_mem_gate(probes.probe_box(point["tp"], point["cc"]), f.value("symm_mem_max_bytes"),
                           f.value("symm_mem_multimem_world_sizes"), point["cc"], "", "", point["dtype"], True)
    return g.available is True and PathState(_rule(TORCH_SYMM_MEM), True, "", g.cap, g.inclusive).admits(point["bytes"])


def _theirs_symm_mem(load, torch):
    mod = load(_MOD + "symm_mem")
    table = load(_MOD + "all_reduce_utils").SYMM_MEM_ALL_REDUCE_MAX_SIZES
    return lambda p: mod.SymmMemCommunicator.should_use_symm_mem(types.SimpleNamespace(
        disabled=False, dtype=torch.bfloat16, max_size=table[p["cc"]][p["tp"]]),
        probes.meta(torch, p["bytes"], p["dtype"]))


def _ours_nccl_symm(point: dict, f: FactSet) -> bool:
    g = _nccl_symm(probes.probe_box(point["tp"]), f, point["batch_invariant"])
    return g.available is True and PathState(_rule(NCCL_SYMM), True, "", g.cap, g.inclusive, skipped=g.skipped).admits(
        point["bytes"])


def _theirs_nccl_symm(load, torch):
    mod = load(_MOD + "all_reduce_utils")
    load(_MOD + "pynccl_allocator").is_symmetric_memory_enabled = lambda: True
    flags_ = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)
    mod.envs = flags_

    def ask(p: dict) -> bool:
        flags_.VLLM_BATCH_INVARIANT = p["batch_invariant"]
        return mod.should_nccl_symm_mem_allreduce(p["tp"], probes.meta(torch, p["bytes"]))
    return ask


def _ours_fi_backend(point: dict, f: FactSet) -> str | None:
    return flashinfer_backend(int(float(point["cc"]) * 10), point["nodes"], point["hisparse"], f)


def _theirs_fi_backend(load, torch):
    mod = load(_MOD + "flashinfer_all_reduce")
    mod.envs = types.SimpleNamespace(VLLM_FLASHINFER_ALLREDUCE_BACKEND="auto")

    platforms = load("vllm.platforms")

    def ask(p: dict) -> str | None:
        cc = int(float(p["cc"]) * 10)
        mod._node_count = lambda group: p["nodes"]
        mod.current_platform = platforms.current_platform = types.SimpleNamespace(
            has_device_capability=lambda c: cc >= c)
        config = types.SimpleNamespace(attention_config=types.SimpleNamespace(
            hisparse_config=object() if p["hisparse"] else None))
        mod.get_current_vllm_config_or_none = lambda: config
        backend, fallback = mod._resolve_fi_ar_backend(None)
        return None if backend is None else backend + ("+trtllm" if fallback else "")
    return ask


def _ours_fusion(point: dict, f: FactSet) -> bool:
    b = probes.probe_box(point["tp"], point["cc"])
    return b.world_size > 1 and _flashinfer(b, f, True, "graph", None, point["batch_invariant"]).available is True


def _theirs_fusion(load, torch):
    mod = load("vllm.config.vllm")
    flags_ = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)
    mod.envs = flags_
    load("vllm.utils.flashinfer").has_flashinfer = lambda: True
    platforms = load("vllm.platforms")     # 0.33 imports current_platform inside the function

    def ask(p: dict) -> bool:
        major, minor = (int(x) for x in p["cc"].split("."))
        flags_.VLLM_BATCH_INVARIANT = p["batch_invariant"]
        mod.current_platform = platforms.current_platform = types.SimpleNamespace(
            is_rocm=lambda: False, is_cuda=lambda: True, is_device_capability_family=lambda c: major * 10 == c,
            is_device_capability=lambda c: major * 10 + minor == c)
        cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(tensor_parallel_size=p["tp"]))
        return bool(mod.enable_allreduce_rms_fusion(cfg))
    return ask


_MOD = "vllm.distributed.device_communicators."
_FILE = "vllm/distributed/device_communicators/"
PROBES = (
    GateProbe(
        "dispatch_order", _FILE + "cuda_communicator.py", "CudaCommunicator.all_reduce",
        "the path all_reduce calls for every set of paths that would take the message",
        lambda: probes.subsets((NCCL_SYMM, FLASHINFER_PCIE_IPC, FLASHINFER_AR, CUSTOM_AR, TORCH_SYMM_MEM)),
        _ours_dispatch, _theirs_dispatch, (_MOD + "cuda_communicator",)),
    GateProbe("custom_ar_takes", _FILE + "custom_all_reduce.py", "CustomAllreduce.should_custom_ar",
              "the custom allreduce takes the message (world size, NVLink, dtype, size, batch invariance)",
              lambda: probes.grid(tp=(2, 4, 6, 8, 16), nvlink=(True, False), dtype=("bf16", "fp16"),
                                 batch_invariant=(False, True), bytes=probes.SIZES),
              _ours_custom_ar, _theirs_custom_ar, (_MOD + "custom_all_reduce",)),
    GateProbe("symm_mem_takes", _FILE + "symm_mem.py", "SymmMemCommunicator.should_use_symm_mem",
              "torch symmetric memory takes the message (capability, world size, dtype, size)",
              lambda: probes.grid(cc=("9.0", "10.0", "10.3"), tp=(2, 4, 6, 8), dtype=("bf16", "fp16"),
                                 bytes=probes.SIZES),
              _ours_symm_mem, _theirs_symm_mem, (_MOD + "symm_mem", _MOD + "all_reduce_utils")),
    GateProbe("nccl_symm_takes", _FILE + "all_reduce_utils.py", "should_nccl_symm_mem_allreduce",
              "NCCL symmetric memory takes the message (world size, size, batch invariance)",
              lambda: probes.grid(tp=(2, 4, 6, 8, 16), batch_invariant=(False, True), bytes=probes.SIZES),
              _ours_nccl_symm, _theirs_nccl_symm, (_MOD + "all_reduce_utils",)),
    GateProbe("flashinfer_backend", _FILE + "flashinfer_all_reduce.py", "_resolve_fi_ar_backend",
              "the FlashInfer backend 'auto' resolves to (capability, nodes, HiSparse)",
              lambda: probes.grid(cc=("9.0", "10.0", "10.3"), nodes=(1, 2), hisparse=(False, True)),
              _ours_fi_backend, _theirs_fi_backend, (_MOD + "flashinfer_all_reduce",)),
    GateProbe("fusion_on", "vllm/config/vllm.py", "enable_allreduce_rms_fusion",
              "-O2 turns the allreduce+RMSNorm fusion on (capability, TP, batch invariance)",
              lambda: probes.grid(cc=("8.0", "9.0", "10.0", "10.3", "12.0"), tp=(1, 2, 8),
                                  batch_invariant=(False, True)),
              _ours_fusion, _theirs_fusion, ("vllm.config.vllm",), ("pydantic",)),
)

ENGINE = Engine(KEY, NAME, FACTS, CHECKED, RULES, gate, WORDS, prefill_tokens, inert, LOG_LINE, LOG_SAID,
                LOG_NAMES, PROBES)
