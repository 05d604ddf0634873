"""SGLang, whole: its allreduce facts with their sources, its paths in the order its own
GroupCoordinator.all_reduce tries them, each path's gate on a box, its words, its prefill
default and the settings that do nothing on a box.

Read at SGLang 0.5.23 (results/reference/engine-rules/ has `commbench engines --check` on its
wheel, gates and order included). Updating to a new release is an edit of this file and one
`commbench engines --check` run against its wheel.
"""

from __future__ import annotations

import functools
import types

from commbench.engines import libs
from commbench.engines import probes
from commbench.engines.facts import ENV, KERNELS, RETURNS, TEXT, Fact, FactSet
from commbench.engines.paths import (CUSTOM_AR, EAGER, FLASHINFER_AR, FLASHINFER_FUSED, FLASHINFER_PCIE_IPC,
                                     FROM_IMPORT, MSCCLPP, NCCL_PATH, NCCL_SYMM, SHARED, TORCH_SYMM_MEM, Engine, Gate,
                                     GateProbe, InertSetting, PathRule, PathState, Words, Workload, bytes_per, env,
                                     flags, pick, size_text)
from commbench.ops import ALLREDUCE, FUSED_OP
from commbench.topology.box import Box

KEY, NAME = "sglang", "SGLang"
VERSION = "0.5.23"
CHECKED = ("0.5.23",)

MiB = 1 << 20
_COMM = "sglang/srt/distributed/device_communicators/"
_STATE = "sglang/srt/distributed/parallel_state.py"
_OVERRIDES = "sglang/srt/arg_groups/overrides.py"
_FUSION = "sglang/srt/layers/flashinfer_comm_fusion.py"

FACTS = FactSet(KEY, NAME, VERSION, (
    Fact("outplace_order", ["ca", "pcie_ipc", "qr", "pymscclpp", "torch_symm_mem", "pynccl"],
         _STATE, "GroupCoordinator._resolve_outplace_all_reduce_method", RETURNS,
         "after NCCL symmetric memory and FlashInfer: custom allreduce (unless MSCCL++ takes the message, which then "
         "wins), PCIe IPC (likewise), MSCCL++, torch symmetric memory, else PyNccl"),
    Fact("symm_mem_before_flashinfer", True, _STATE, "and not should_use_custom_allreduce", TEXT,
         "--enable-symm-mem: NCCL symmetric memory takes every message custom allreduce and MSCCL++ do not, before "
         "FlashInfer"),
    Fact("flashinfer_archs", frozenset({
        "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM", "GptOssForCausalLM",
        "GlmMoeDsaForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM",
        "Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration", "Qwen3NextForCausalLM",
        "Qwen4ExpForConditionalGeneration", "KimiK25ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM", "NemotronH_Omni_Reasoning_V3"}),
        _OVERRIDES, "_FLASHINFER_ALLREDUCE_FUSION_ARCHS",
        meaning="architectures for which FlashInfer allreduce fusion is on by default"),
    Fact("flashinfer_auto_conditions", True, _OVERRIDES, 'and view.moe_a2a_backend == "none"', TEXT,
         "the default holds with TP > 1 on SM90/SM10x, one node (or SM10x), no attention-DP and no MoE all-to-all "
         "backend; MiMo turns on cutedsl on SM100 instead, DeepSeek V4.1 at TP4 on Blackwell keeps custom allreduce"),
    Fact("flashinfer_max_tokens", 2048, "sglang/srt/layers/layer_boundary/residual/add_norm.py",
         "FUSE_ALLREDUCE_MAX_BATCH_SIZE",
         meaning="with fusion on, every tensor-parallel allreduce of up to this many tokens goes to FlashInfer"),
    Fact("flashinfer_needs_sm90_sm10x", True, _FUSION,
         "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs.", TEXT, "elsewhere (SM12) the fusion flag raises this error at start-up (pre_initialize_workspaces)"),
    Fact("flashinfer_sm10x_mnnvl", True, _FUSION, "Disabling flashinfer allreduce fusion permanently.", TEXT,
         "backend 'auto' is mnnvl on SM10x, which needs multicast: where its workspace cannot be made SGLang turns "
         "the fusion off for good and custom allreduce takes the messages"),
    Fact("flashinfer_off_deterministic", True, _OVERRIDES,
         "Disable --flashinfer-allreduce-fusion-backend because deterministic inference is enabled.", TEXT,
         "--enable-deterministic-inference turns FlashInfer allreduce fusion off"),
    Fact("enforce_disable_flag", True, _OVERRIDES, "view.enforce_disable_flashinfer_allreduce_fusion", TEXT,
         "--enforce-disable-flashinfer-allreduce-fusion wins over the per-architecture default"),
    Fact("v2_default_on", True, "sglang/srt/environ.py", "SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2", ENV),
    Fact("v2_max_kb", 16 * 1024, "sglang/srt/environ.py", "SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB", ENV,
         "custom allreduce v2 takes messages up to this size"),
    Fact("v2_inclusive", True, _COMM + "custom_all_reduce_v2.py", "return inp_size <= self.max_size", TEXT,
         "the v2 size limit is inclusive"),
    Fact("v2_push_env", None, "sglang/srt/environ.py", "SGLANG_FORCE_CUSTOM_ALL_REDUCE_V2_PUSH_SIZE_KB", ENV,
         "set, it forces one-shot push up to that size"),
    Fact("v2_two_shot_push", True, _COMM + "configs/custom_all_reduce_v2.py", "two_shot_push=8 * MB", TEXT,
         "two-shot push at 4 and 8 ranks on SM100; a multicast two-shot pull where multicast works"),
    Fact("v2_multicast_pull", True, _COMM + "configs/custom_all_reduce_v2.py",
         "num_mc_blocks=None if world_size < 4 else 128 // world_size", TEXT,
         "from 4 ranks, where multicast works, v2 runs a multicast two-shot pull for its middle sizes: commbench's "
         "sglang:auto runs with multicast off, so that kernel is never measured"),
    Fact("v2_multi_node_clique", True, _COMM + "custom_all_reduce_v2.py",
         "return is_one_nvlink_clique(group, device) and _is_vmm_backed_allocator(device)", TEXT,
         "across nodes v2 runs only where the ranks form one NVLink clique (MNNVL) with a VMM-backed allocator"),
    Fact("v2_kernels", ["all_reduce_1shot_pull_kernel", "all_reduce_1shot_push_kernel", "all_reduce_2shot_pull_kernel",
                        "all_reduce_2shot_push_kernel"],
         "sglang/kernels/jit/csrc/distributed/custom_all_reduce.cuh",
         r"ALL_REDUCE_KERNEL void (all_reduce_\w+_kernel)\(", KERNELS,
         "custom allreduce v2's kernels as a profiler trace names them (sglang::all_reduce_1shot_push_kernel<>)"),
    Fact("skip_p2p_check", "0", _COMM + "custom_all_reduce_utils.py", "SGLANG_SKIP_P2P_CHECK", ENV,
         "SGLang runs a real P2P test by default (vLLM trusts cudaDeviceCanAccessPeer)"),
    Fact("legacy_world_sizes", [2, 4, 6, 8], _COMM + "custom_all_reduce.py", "CustomAllreduce._SUPPORTED_WORLD_SIZES"),
    Fact("legacy_max_bytes", 8 * MiB, _COMM + "custom_all_reduce.py", "CustomAllreduce._MAX_CAR_SIZE"),
    Fact("legacy_inclusive", True, _COMM + "custom_all_reduce.py", "return inp_size <= self.max_size", TEXT,
         "the legacy kernel's size limit is inclusive too"),
    Fact("pcie_ipc_env", False, "sglang/srt/environ.py", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", ENV,
         "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 turns FlashInfer's PCIe IPC allreduce on (bf16)"),
    Fact("pcie_ipc_world_sizes", (2, 4, 8), _COMM + "pcie_ipc_ar.py", "_SUPPORTED_WORLD_SIZES"),
    Fact("pcie_ipc_decode_cap", True, _COMM + "pcie_ipc_ar.py", "max_numel = width * hidden", TEXT,
         "its workspace takes up to the decode CUDA graph's largest batch x hidden elements (SGLANG_PCIE_IPC_MAX_NUMEL "
         "overrides): prefill stays on NCCL"),
    Fact("pcie_ipc_off_deterministic", True, _COMM + "pcie_ipc_ar.py",
         "Deterministic inference is on; leaving PCIe-IPC all-reduce off.", TEXT,
         "--enable-deterministic-inference (or SGLANG_USE_1STAGE_ALLREDUCE=1) leaves PCIe IPC off"),
    Fact("decode_max_bs", True, "sglang/srt/arg_groups/memory_hook.py", "decode_cuda_graph_config.max_bs = 512", TEXT,
         "the decode CUDA graph's largest batch by GPU memory and TP (< 20 GiB 8; < 35 GiB 48 / 160 from TP4; "
         "< 60 GiB 32 / 160; < 160 GiB 256 / 512; else 512; unknown 160)"),
    Fact("mscclpp_world_sizes", (4, 8, 16, 32, 64), _COMM + "pymscclpp.py", "_SUPPORTED_WORLD_SIZES"),
    Fact("mscclpp_package", True, _COMM + "pymscclpp.py", 'self.mscclpp = importlib.import_module("mscclpp")', TEXT,
         "without the `mscclpp` package --enable-mscclpp logs a warning and runs nothing"),
    Fact("torch_symm_mem_max_bytes", {9: {2: 64 * MiB, 4: 64 * MiB, 6: 128 * MiB, 8: 128 * MiB},
                                      10: {2: 64 * MiB, 4: 64 * MiB, 6: 128 * MiB, 8: 128 * MiB}},
         _COMM + "all_reduce_utils.py", "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES"),
    Fact("torch_symm_mem_strict", True, _COMM + "torch_symm_mem.py", "return inp_size < self.max_size", TEXT,
         "torch symmetric memory takes messages strictly below its cap"),
    Fact("torch_symm_mem_bf16_only", True, _COMM + "torch_symm_mem.py", "self.dtype = torch.bfloat16", TEXT,
         "its buffer is bf16 and it refuses any other dtype"),
    Fact("torch_symm_mem_multimem", {9: [4, 6, 8], 10: [4, 6, 8]}, _COMM + "torch_symm_mem.py",
         "TorchSymmMemCommunicator._WORLD_SIZES_MULTIMEM"),
    Fact("decode_graph_flag", True, "sglang/srt/arg_groups/fields/exec_.py", "disable_decode_cuda_graph: A[", TEXT,
         "--disable-decode-cuda-graph runs decode without CUDA graphs (--disable-cuda-graph is deprecated in 0.5.23, "
         "server_args.py)"),
))

# --- the settings that select its paths -----------------------------------------------------

DISABLE_CUSTOM_ALLREDUCE = "--disable-custom-all-reduce"
TORCH_SYMM_MEM_FLAG = "--enable-torch-symm-mem"
MSCCLPP_FLAG = "--enable-mscclpp"
NCCL_SYMM_FLAG = "--enable-symm-mem"
FLASHINFER_TRTLLM = ["--flashinfer-allreduce-fusion-backend", "trtllm"]
# Where its fusion is on (by default for the architectures in flashinfer_archs) SGLang routes
# every TP allreduce of up to 2048 tokens to FlashInfer: this flag wins over that default.
NO_FLASHINFER = "--enforce-disable-flashinfer-allreduce-fusion"
CUSTOM_AR_V2_ENV = {"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "1"}   # the default in 0.5.23
PCIE_IPC_ENV = {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"}          # environ.py, opt-in

WORDS = Words(command="python -m sglang.launch_server --model-path MODEL --tp {tp}",
              eager="--disable-decode-cuda-graph", deterministic="--enable-deterministic-inference",
              nccl_so_var="SGLANG_NCCL_SO_PATH")

_FLASHINFER_ON = flags(*FLASHINFER_TRTLLM)
_FLASHINFER_OFF = flags(NO_FLASHINFER)

# The order GroupCoordinator.all_reduce tries them (parallel_state.py): NCCL symmetric memory for
# what custom allreduce and MSCCL++ do not take, FlashInfer where its fusion is on, then
# _resolve_outplace_all_reduce_method: custom allreduce and PCIe IPC unless MSCCL++ takes the
# message, MSCCL++, torch symmetric memory, PyNccl. ROCm's quick reduce left out.
RULES: tuple[PathRule, ...] = (
    PathRule(NCCL_SYMM, "NCCL symmetric memory", ALLREDUCE, False, NCCL_SYMM_FLAG, "leave the flag out",
             ("symm_mem_before_flashinfer",), on=flags(NCCL_SYMM_FLAG), yields_to=(CUSTOM_AR, MSCCLPP)),
    PathRule(FLASHINFER_AR, "FlashInfer allreduce (fusion workspace)", ALLREDUCE, False,
             f"{' '.join(FLASHINFER_TRTLLM)} (on by default for the listed architectures)", NO_FLASHINFER,
             ("flashinfer_archs", "flashinfer_auto_conditions", "flashinfer_max_tokens", "flashinfer_needs_sm90_sm10x",
              "flashinfer_sm10x_mnnvl"), on=_FLASHINFER_ON, off=_FLASHINFER_OFF),
    PathRule(CUSTOM_AR, "custom allreduce (CUDA IPC)", ALLREDUCE, True, f"on unless {DISABLE_CUSTOM_ALLREDUCE}",
             DISABLE_CUSTOM_ALLREDUCE, ("v2_default_on", "v2_max_kb", "v2_inclusive", "skip_p2p_check",
                                        "legacy_world_sizes", "legacy_max_bytes", "legacy_inclusive", "v2_kernels"),
             off=flags(DISABLE_CUSTOM_ALLREDUCE), yields_to=(MSCCLPP,)),
    PathRule(FLASHINFER_PCIE_IPC, "FlashInfer PCIe IPC allreduce", ALLREDUCE, False,
             "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1", "leave the variable unset",
             ("pcie_ipc_env", "pcie_ipc_world_sizes", "pcie_ipc_decode_cap", "decode_max_bs"),
             on=env("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "1"), yields_to=(MSCCLPP,)),
    PathRule(MSCCLPP, "MSCCL++", ALLREDUCE, False, MSCCLPP_FLAG, "leave the flag out",
             ("mscclpp_world_sizes", "outplace_order", "mscclpp_package"), on=flags(MSCCLPP_FLAG), graphs_only=True),
    PathRule(TORCH_SYMM_MEM, "torch symmetric memory", ALLREDUCE, False, TORCH_SYMM_MEM_FLAG, "leave the flag out",
             ("torch_symm_mem_max_bytes", "torch_symm_mem_strict", "torch_symm_mem_bf16_only",
              "torch_symm_mem_multimem"), on=flags(TORCH_SYMM_MEM_FLAG)),
    PathRule(NCCL_PATH, "NCCL (PyNccl)", ALLREDUCE, True, "the fallback for every other size", "-",
             ("outplace_order",)),
    PathRule(FLASHINFER_FUSED, "FlashInfer allreduce+RMSNorm fusion", FUSED_OP, False,
             f"{' '.join(FLASHINFER_TRTLLM)} (on by default for the listed architectures)", NO_FLASHINFER,
             ("flashinfer_archs", "flashinfer_max_tokens"), on=_FLASHINFER_ON, off=_FLASHINFER_OFF),
)

KERNEL_UNKNOWN = ("whether SGLang runs its v2 kernel or the legacy one here cannot be told (ranks share one GPU: v2 "
                  "needs NVLink on every pair), so its own rows only stand in")
DETERMINISTIC_OFF = "--enable-deterministic-inference (the deterministic mode asked for) turns it off"


def _listed(f: FactSet, w: Workload) -> tuple[bool, str]:
    """Whether SGLang turns FlashInfer on by default for this model, and the words for it."""
    listed = f.value("flashinfer_archs")
    if w.deterministic:
        return False, DETERMINISTIC_OFF
    if w.arch is None:
        return False, (f"on by default only for the {len(listed)} architectures SGLang lists (a preset or --arch "
                       "names the model's); opt-in otherwise")
    if w.arch in listed:
        return True, (f"on by default for {w.arch} (TP > 1, SM90/SM10x, one node, no attention-DP, no MoE "
                      "all-to-all backend): SGLang sends it every tensor-parallel allreduce")
    return False, f"{w.arch} is not in SGLang's list of architectures it turns this on for: opt-in"


def flashinfer_backend(major: int | None, multi_node: bool) -> str:
    """_resolve_backend('auto', is_multi_node): 'trtllm', 'mnnvl', or 'raises ValueError' (the server
    stops at start-up)."""
    if major not in (9, 10) or (multi_node and major != 10):
        return "raises ValueError"
    return "mnnvl" if major == 10 else "trtllm"


def v2_world_sizes(cc: str) -> tuple[int, ...]:
    """The world sizes custom allreduce v2 has a tuned config for (configs/custom_all_reduce_v2.py:
    SM90 2-8, SM10x 2-8 and 16, any other capability its default for 2-16)."""
    major = cc.split(".")[0]
    return tuple(range(2, 9)) if major == "9" else (*range(2, 9), 16) if major == "10" else tuple(range(2, 17))


def _flashinfer(b: Box, f: FactSet, fused: bool, w: Workload) -> Gate:
    default, said = _listed(f, w)
    if not b.fabric_known:
        return Gate(None, FROM_IMPORT, default=default)
    if w.deterministic:
        return Gate(False, said, default=False)
    if b.cc != "?" and flashinfer_backend(b.major, False).startswith("raises"):
        return Gate(False, f"needs SM90 or SM10x, this is compute capability {b.cc}: here "
                           "--flashinfer-allreduce-fusion-backend (or --enable-flashinfer-allreduce-fusion) stops the "
                           "server at start-up with 'FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs'",
                    default=False)
    common = libs.flashinfer_common(b)
    if common:
        return common._replace(default=default)
    if flashinfer_backend(b.major, b.multi_node).startswith("raises"):
        return Gate(False, "across nodes FlashInfer allreduce fusion needs Blackwell (mnnvl): off here", default=False)
    if b.major == 10 and not b.multicast_usable:
        return Gate(False, "backend 'auto' is mnnvl on SM10x, which needs multicast: its workspace cannot be made "
                           "here, SGLang turns the fusion off for good ('Disabling flashinfer allreduce fusion "
                           "permanently') and custom allreduce takes these messages", default=False)
    tokens = f.value("flashinfer_max_tokens")
    cap = tokens * w.hidden * bytes_per(w.dtype) if w.hidden else None
    limit = f"up to {tokens} tokens" + (f" ({size_text(cap)})" if cap else "")
    backend = ("backend 'auto' -> trtllm (SM90, single node)" if b.major == 9 else
               f"backend 'auto' -> mnnvl (Blackwell, multicast){f' across {b.nodes} nodes' if b.multi_node else ''}")
    what = "fused with residual + RMSNorm" if fused else "the plain allreduces too"
    gate = Gate(True, f"{said}; {limit}, {what}; {backend}", cap, True, default)
    return libs.vmm_gate(b, gate, "its cuMemCreate preflight would fail on at least one rank ('Skipping allreduce "
                                  "fusion to avoid cross-rank desync'); here: {}")


def _custom_ar(b: Box, f: FactSet) -> Gate:
    if b.multi_node:
        if b.major == 10 and b.multicast_usable:
            return Gate(None, "across nodes custom allreduce v2 runs only where the ranks form one NVLink clique "
                              "(MNNVL) with a VMM-backed allocator: the snapshot cannot tell")
        return Gate(False, "the group spans nodes and is no NVLink clique")
    if b.shares_gpus and b.world_size > 2:
        return Gate(None, f"{SHARED}; {KERNEL_UNKNOWN}", own_kernel=False)
    v2 = b.nvlink_all and not b.shares_gpus and b.world_size in v2_world_sizes(b.cc)
    sizes = v2_world_sizes(b.cc) if v2 else f.value("legacy_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one the kernel supports")
    if b.world_size > 2 and not b.nvlink_all:
        return Gate(False, "above 2 GPUs it needs NVLink between every pair (like vLLM's; vLLM #56128)")
    if not b.p2p_ok:
        return Gate(False, "SGLang runs a real P2P write test by default (SGLANG_SKIP_P2P_CHECK=0) and it fails here")
    if v2:
        cap = f.value("v2_max_kb") * 1024
        multicast = ("; from 4 ranks with multicast it also runs a multicast two-shot pull that commbench's "
                     "sglang:auto never measures (it runs with multicast off)"
                     if b.multicast_usable and b.world_size >= 4 else "")
        return Gate(True, f"custom allreduce v2 (JIT), messages up to {size_text(cap)} inclusive; 1shot/2shot push or "
                          f"pull by size{multicast}", cap)
    cap = f.value("legacy_max_bytes")
    legacy = (KERNEL_UNKNOWN if b.shares_gpus else
              f"SGLang {f.version} runs its legacy kernel here (v2 needs NVLink on every pair, 2 GPUs included), so "
              "rows of its v2 kernel only stand in")
    return Gate(True, f"messages up to {size_text(cap)} inclusive; {legacy}", cap, own_kernel=False)


def decode_max_bs(b: Box) -> int:
    """SGLang's decode CUDA graph's largest batch by default (memory_hook.py)."""
    mib, small_tp = b.memory_mib, b.world_size < 4
    if mib is None:
        return 160
    for below_gib, few, many in ((20, 8, 8), (35, 48, 160), (60, 32, 160), (160, 256, 512)):
        if mib < below_gib * 1024:
            return few if small_tp else many
    return 512


def _pcie_ipc(b: Box, f: FactSet, w: Workload) -> Gate:
    sizes = f.value("pcie_ipc_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    if w.dtype != "bf16":
        return Gate(False, f"bf16 only (its tuning is keyed by dtype), not {w.dtype}")
    if w.deterministic:
        return Gate(False, DETERMINISTIC_OFF)
    if b.multi_node or not b.p2p_ok:
        return Gate(False, "needs working P2P between the GPUs of one node")
    batch = decode_max_bs(b)
    said = (f"bf16 over PCIe peer-to-peer, right after the custom allreduce; up to the decode CUDA graph's largest "
            f"batch ({batch} here by default) x hidden")
    if w.hidden:
        cap = batch * w.hidden * bytes_per(w.dtype)
        return Gate(True, f"{said}: {size_text(cap)} (SGLANG_PCIE_IPC_MAX_NUMEL overrides)", cap)
    return Gate(True, f"{said} (SGLANG_PCIE_IPC_MAX_NUMEL overrides)")


def _mscclpp(b: Box, f: FactSet, w: Workload) -> Gate:
    sizes = f.value("mscclpp_world_sizes")
    if b.world_size not in sizes:
        return Gate(False, f"world size {b.world_size} is not one of {tuple(sizes)}")
    if w.mode == EAGER:
        return Gate(False, f"runs only inside CUDA graphs: off under {WORDS.eager}")
    if not b.p2p_ok:
        return Gate(False, "P2P does not work here")
    return Gate(True, "runs only inside CUDA graphs, and only with the `mscclpp` package installed (without it: a "
                      "warning and nothing runs); where it takes a message it goes ahead of custom allreduce")


def gate(rule: PathRule, b: Box, f: FactSet, w: Workload) -> Gate:
    if rule.path in (FLASHINFER_AR, FLASHINFER_FUSED):
        return _flashinfer(b, f, rule.path == FLASHINFER_FUSED, w)
    if not b.fabric_known:
        return Gate(None, FROM_IMPORT)
    return {CUSTOM_AR: lambda: _custom_ar(b, f),
            TORCH_SYMM_MEM: lambda: libs.symm_mem_gate(
                b, f.value("torch_symm_mem_max_bytes"), f.value("torch_symm_mem_multimem"), b.major,
                "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES", "custom allreduce, PCIe IPC and MSCCL++", w.dtype, False),
            NCCL_SYMM: lambda: libs.nccl_symm_fabric(b) or Gate(
                True, "NCCL's symmetric kernels for every message custom allreduce and MSCCL++ do not take, ahead of "
                      "FlashInfer"),
            FLASHINFER_PCIE_IPC: lambda: _pcie_ipc(b, f, w),
            MSCCLPP: lambda: _mscclpp(b, f, w)}[rule.path]()


# --- the prefill chunk: SGLang 0.5.23 sglang/srt/arg_groups/memory_hook.py:89-180 (< 20 GiB 2048,
# < 60 GiB 4096, < 160 GiB 8192, else 16384; 4096 when the memory is unknown)

def prefill_tokens(b: Box, f: FactSet) -> tuple[int, str]:
    mib = b.memory_mib
    tokens = (4096 if mib is None else 2048 if mib < 20 * 1024 else 4096 if mib < 60 * 1024
              else 8192 if mib < 160 * 1024 else 16384)
    seen = f"{mib / 1024:.0f} GiB GPUs" if mib else "GPU memory not recorded"
    return tokens, (f"{f.name} {f.version} chunked_prefill_size default, {seen} "
                    "(sglang/srt/arg_groups/memory_hook.py)")


# --- settings that do nothing on a probed box ----------------------------------------------------

def inert(b: Box, f: FactSet) -> list[InertSetting]:
    """SGLang settings that change nothing at this world size on this box, each with why and source."""
    if not b.has_gpus or b.multi_node:
        return []
    out = []
    if b.cc.startswith("12."):
        out.append(InertSetting("SGLang --enable-flashinfer-allreduce-fusion",
                                f"an alias of --flashinfer-allreduce-fusion-backend=auto, which needs SM90 or SM10x: "
                                f"on compute capability {b.cc} the server fails at start-up ('FlashInfer allreduce "
                                "fusion requires SM90 or SM10X NVIDIA GPUs', raised while it sets up the workspaces); "
                                "leave the flag out",
                                f"SGLang {f.version} srt/layers/flashinfer_comm_fusion.py, "
                                "srt/arg_groups/serving_hook.py", ((KEY, FLASHINFER_FUSED),)))
    if not b.multicast:
        out.append(InertSetting(f"SGLang {TORCH_SYMM_MEM_FLAG}",
                                "the communicator disables itself when the GPUs have no multicast (PCIe GPUs never do)",
                                f"SGLang {f.version} distributed/device_communicators/torch_symm_mem.py",
                                ((KEY, TORCH_SYMM_MEM),)))
    if b.shares_gpus:
        return out
    if b.world_size > 2 and not b.nvlink_all:
        out.append(InertSetting("SGLang custom allreduce (on by default: no --disable-custom-all-reduce needed to "
                                "turn it off here)",
                                f"above 2 GPUs it needs NVLink between every pair (like vLLM's); at TP "
                                f"{b.world_size} without full NVLink it falls back to NCCL",
                                f"SGLang {f.version} custom_all_reduce.py", ((KEY, CUSTOM_AR),)))
    symmetric = libs.nccl_symmetric_inert(b)
    if symmetric:
        out.append(InertSetting(f"NCCL symmetric kernels (SGLang {NCCL_SYMM_FLAG}, NCCL_SYM_KERNEL)", *symmetric,
                                ((KEY, NCCL_SYMM),)))
    return out


# --- its gates and order, compared with its own functions by `engines --check` ----------------------
# Each `theirs` runs in the check's child process with torch and the named modules imported from
# the wheel (gates.py); it sets on the engine's objects only what the function reads.

_MOD = "sglang.srt.distributed.device_communicators."
_OUTPLACE = {"ca": CUSTOM_AR, "pcie_ipc": FLASHINFER_PCIE_IPC, "pymscclpp": MSCCLPP, "torch_symm_mem": TORCH_SYMM_MEM,
             "pynccl": NCCL_PATH, "qr": "quick reduce"}


def _rule(path: str) -> PathRule:
    return next(r for r in RULES if r.path == path)


def _takes(g: Gate, path: str, message_bytes: int) -> bool:
    return g.available is True and PathState(_rule(path), True, "", g.cap, g.inclusive).admits(message_bytes)


def _ours_dispatch(point: dict, f: FactSet) -> str | None:
    return pick([r for r in RULES if r.op == ALLREDUCE], {*point["takers"], NCCL_PATH})


def _theirs_dispatch(load, torch):
    mod = load("sglang.srt.distributed.parallel_state")
    calls: list[str] = []
    mod.torch = probes.Proxy(torch, compiler=types.SimpleNamespace(is_compiling=lambda: False))
    mod.is_in_tc_piecewise_cuda_graph = lambda: False
    mod.flashinfer_allreduce = lambda x, group_name: calls.append(FLASHINFER_AR)
    mod.outplace_all_reduce = lambda x, group_name, outplace_all_reduce_method: calls.append(
        _OUTPLACE.get(outplace_all_reduce_method, outplace_all_reduce_method))
    mod.inplace_all_reduce = lambda x, group_name: calls.append(NCCL_PATH)
    tensor = probes.meta(torch, 64 * 1024)

    def ask(point: dict) -> str | None:
        takers = set(point["takers"])
        me = types.SimpleNamespace(
            world_size=8, unique_name="tp:0", hpu_communicator=None, xpu_communicator=None, qr_comm=None,
            pymscclpp_comm=probes.Comm(MSCCLPP, MSCCLPP in takers, calls),
            ca_comm=probes.Comm(CUSTOM_AR, CUSTOM_AR in takers, calls),
            pcie_ipc_comm=probes.Comm(FLASHINFER_PCIE_IPC, FLASHINFER_PCIE_IPC in takers, calls),
            torch_symm_mem_comm=probes.Comm(TORCH_SYMM_MEM, TORCH_SYMM_MEM in takers, calls),
            pynccl_comm=probes.Comm(NCCL_SYMM, True, calls, change_state=lambda **k: probes.nothing()),
            is_symmetric_memory_enabled=lambda: NCCL_SYMM in takers, debug_check_symmetric_mempool=lambda *a: None,
            _can_use_flashinfer_allreduce=lambda x: FLASHINFER_AR in takers)
        me._resolve_outplace_all_reduce_method = functools.partial(
            mod.GroupCoordinator._resolve_outplace_all_reduce_method, me)
        calls.clear()
        mod.GroupCoordinator.all_reduce(me, tensor)
        return calls[0] if calls else None
    return ask


def _ours_torch_symm(point: dict, f: FactSet) -> bool:
    g = libs.symm_mem_gate(probes.probe_box(point["tp"], point["cc"]), f.value("torch_symm_mem_max_bytes"),
                           f.value("torch_symm_mem_multimem"), int(point["cc"].split(".")[0]), "", "", point["dtype"],
                           False)
    return _takes(g, TORCH_SYMM_MEM, point["bytes"])


def _theirs_torch_symm(load, torch):
    mod = load(_MOD + "torch_symm_mem")
    table = load(_MOD + "all_reduce_utils").TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES

    def ask(p: dict) -> bool:
        t = probes.meta(torch, p["bytes"], p["dtype"])
        return mod.TorchSymmMemCommunicator.should_torch_symm_mem_allreduce(types.SimpleNamespace(
            disabled=False, device=t.device, dtype=torch.bfloat16, max_size=table[int(p["cc"].split(".")[0])][p["tp"]]),
            t)
    return ask


def _ours_legacy(point: dict, f: FactSet) -> bool:
    return _takes(_custom_ar(probes.probe_box(point["tp"], nvlink=False), f), CUSTOM_AR, point["bytes"])


def _theirs_legacy(load, torch):
    mod = load(_MOD + "custom_all_reduce")
    mod._is_hip = False
    mod.is_weak_contiguous = lambda inp: inp.is_contiguous()
    return lambda p: mod.CustomAllreduce.should_custom_ar(types.SimpleNamespace(
        disabled=False, world_size=p["tp"], full_nvlink=False, max_size=mod.CustomAllreduce._MAX_CAR_SIZE),
        probes.meta(torch, p["bytes"]))


def _ours_v2_sizes(point: dict, f: FactSet) -> list[int]:
    return list(v2_world_sizes(point["cc"]))


def _theirs_v2_sizes(load, torch):
    mod = load(_MOD + "configs.custom_all_reduce_v2")

    def ask(p: dict) -> list[int]:
        major, minor = (int(x) for x in p["cc"].split("."))
        mod.torch = probes.Proxy(torch, cuda=types.SimpleNamespace(
            get_device_capability=lambda *a: (major, minor),
            get_device_properties=lambda *a: types.SimpleNamespace(multi_processor_count=132)))
        for cached in (mod.get_supported_world_sizes, mod._get_all_reduce_configs, mod._sm90_configs,
                       mod._sm100_configs, mod._sm107_configs):
            cached.cache_clear()
        return str(list(mod.get_supported_world_sizes()))
    return ask


def _ours_pcie_ipc(point: dict, f: FactSet) -> bool:
    w = Workload(hidden=point["hidden"], dtype=point["dtype"], deterministic=point["deterministic"])
    return _takes(_pcie_ipc(probes.probe_box(point["tp"], "12.0", False, False, memory_mib=96 * 1024), f, w),
                  FLASHINFER_PCIE_IPC, point["bytes"])


def _theirs_pcie_ipc(load, torch):
    mod = load(_MOD + "pcie_ipc_ar")
    flag = types.SimpleNamespace(get=lambda: True)
    mod.envs = types.SimpleNamespace(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=flag)

    def ask(p: dict) -> bool:
        if not mod.eligible_group(group_name="tp", world_size=p["tp"], deterministic=p["deterministic"]):
            return False
        width = decode_max_bs(probes.probe_box(p["tp"], memory_mib=96 * 1024))
        me = types.SimpleNamespace(disabled=False, max_numel=width * p["hidden"], _ensure_workspace=lambda inp: True,
                                   _workspace=types.SimpleNamespace(supports=lambda inp: True))
        return mod.PcieIpcCommunicator.should_pcie_ipc_ar(me, probes.meta(torch, p["bytes"], p["dtype"], p["hidden"]))
    return ask


def _ours_auto(point: dict, f: FactSet) -> bool:
    if point["tp"] < 2:
        return False
    b = probes.probe_box(point["tp"], point["cc"], nodes=point["nodes"])
    g = _flashinfer(b, f, False, Workload(arch=point["arch"], hidden=6144))
    return g.available is True and bool(g.default)


def _theirs_auto(load, torch):
    mod = load("sglang.srt.arg_groups.overrides")
    mod.attn_dp_enabled_of = lambda view: False

    def ask(p: dict) -> bool:
        major = int(p["cc"].split(".")[0])
        mod.get_platform = lambda: types.SimpleNamespace(is_sm90=major == 9, is_sm100=major == 10,
                                                         is_blackwell=major == 10)
        mod.model_config_of = lambda view: types.SimpleNamespace(
            hf_config=types.SimpleNamespace(architectures=[p["arch"]], model_type="probe", hidden_size=6144))
        view = types.SimpleNamespace(flashinfer_allreduce_fusion_backend=None, tp_size=p["tp"], nnodes=p["nodes"],
                                     moe_a2a_backend="none", disable_custom_all_reduce=False)
        return bool(mod._flashinfer_allreduce_fusion_auto_enable(view).get("flashinfer_allreduce_fusion_backend"))
    return ask


def _ours_backend(point: dict, f: FactSet) -> str:
    return flashinfer_backend(int(point["cc"].split(".")[0]), point["multi_node"])


def _theirs_backend(load, torch):
    mod = load("sglang.srt.layers.flashinfer_comm_fusion")

    def ask(p: dict) -> str:
        major = int(p["cc"].split(".")[0])
        mod.get_platform = lambda: types.SimpleNamespace(is_sm90=major == 9, is_sm100=major == 10)
        try:
            return mod._resolve_backend("auto", p["multi_node"])
        except ValueError:
            return "raises ValueError"
    return ask


_FILE = "sglang/srt/distributed/device_communicators/"
PROBES = (
    GateProbe("dispatch_order", _STATE, "GroupCoordinator.all_reduce",
              "the path all_reduce calls for every set of paths that would take the message",
              lambda: probes.subsets((NCCL_SYMM, FLASHINFER_AR, CUSTOM_AR, FLASHINFER_PCIE_IPC, MSCCLPP,
                                     TORCH_SYMM_MEM)),
              _ours_dispatch, _theirs_dispatch, ("sglang.srt.distributed.parallel_state",)),
    GateProbe("torch_symm_mem_takes", _FILE + "torch_symm_mem.py",
              "TorchSymmMemCommunicator.should_torch_symm_mem_allreduce",
              "torch symmetric memory takes the message (capability, world size, dtype, size)",
              lambda: probes.grid(cc=("9.0", "10.0"), tp=(2, 4, 6, 8), dtype=("bf16", "fp16"), bytes=probes.SIZES),
              _ours_torch_symm, _theirs_torch_symm, (_MOD + "torch_symm_mem", _MOD + "all_reduce_utils")),
    GateProbe("legacy_custom_ar_takes", _FILE + "custom_all_reduce.py", "CustomAllreduce.should_custom_ar",
              "the legacy custom allreduce (no NVLink) takes the message (world size, size)",
              lambda: probes.grid(tp=(2, 4, 6, 8), bytes=probes.SIZES),
              _ours_legacy, _theirs_legacy, (_MOD + "custom_all_reduce",)),
    GateProbe("v2_world_sizes", _FILE + "configs/custom_all_reduce_v2.py", "get_supported_world_sizes",
              "the world sizes custom allreduce v2 runs at, per compute capability",
              lambda: probes.grid(cc=("9.0", "10.0", "10.3", "10.7", "12.0")),
              lambda p, f: str(_ours_v2_sizes(p, f)), _theirs_v2_sizes, (_MOD + "configs.custom_all_reduce_v2",)),
    GateProbe("pcie_ipc_takes", _FILE + "pcie_ipc_ar.py", "PcieIpcCommunicator.should_pcie_ipc_ar",
              "PCIe IPC is set up and takes the message (world size, deterministic mode, dtype, size for its "
              "decode width)",
              lambda: probes.grid(tp=(2, 4, 8), deterministic=(False, True), dtype=("bf16", "fp16"), hidden=(6144,),
                                 bytes=probes.SIZES),
              _ours_pcie_ipc, _theirs_pcie_ipc, (_MOD + "pcie_ipc_ar",)),
    GateProbe("flashinfer_default", _OVERRIDES, "_flashinfer_allreduce_fusion_auto_enable",
              "FlashInfer allreduce fusion is on by default (architecture, capability, TP, nodes)",
              lambda: probes.grid(arch=("GlmMoeDsaForCausalLM", "LlamaForCausalLM"), cc=("9.0", "10.0", "12.0"),
                                 tp=(1, 8), nodes=(1, 2)),
              _ours_auto, _theirs_auto, ("sglang.srt.arg_groups.overrides",)),
    GateProbe("flashinfer_backend", _FUSION, "_resolve_backend",
              "the FlashInfer fusion backend 'auto' resolves to (capability, nodes)",
              lambda: probes.grid(cc=("9.0", "10.0", "12.0"), multi_node=(False, True)),
              _ours_backend, _theirs_backend, ("sglang.srt.layers.flashinfer_comm_fusion",)),
)

ENGINE = Engine(KEY, NAME, FACTS, CHECKED, RULES, gate, WORDS, prefill_tokens, inert, probes=PROBES)
