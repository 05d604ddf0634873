"""FlashInfer, the library both engines' FlashInfer paths run (vLLM's FlashInfer allreduce and
fusion, SGLang's allreduce fusion, both engines' PCIe IPC): its facts with their sources, read at
FlashInfer 0.7.4. Its wheel ships its kernel sources (flashinfer/data/include) beside its Python,
so `commbench engines --check` reads these facts again from an unpacked wheel or a site-packages
as it reads an engine's: the kernel names a profiler trace shows (which `commbench attribute`
matches through backends/flashinfer/common.py TRACE_KERNELS), the namespaces and the fusion
pattern numbers those names carry, and the rank counts, architectures and limits that libs.py's
gates and the flashinfer backends keep. It has no dispatch order or gate functions of its own.

The constants below are the built-in values: the facts are made from them, and libs.py and the
backends read them from here, so a release that changes one is a difference under --check.
"""

from __future__ import annotations

from commbench.engines.facts import KERNELS, Fact, FactSet, Library

KEY, NAME = "flashinfer", "FlashInfer"
VERSION = "0.7.4"
DISTRIBUTION = "flashinfer_python"      # pip's flashinfer-python

# The rank counts the fusion kernels are instantiated for (the nranks switch of
# allreduce_fusion_op), and the GPU architectures its JIT modules build for.
WORLD_SIZES = (2, 4, 8, 16)
SM_MAJORS = (9, 10, 12)                 # gen_trtllm_comm_module
MNNVL_SM_MAJORS = (9, 10)               # gen_trtllm_mnnvl_comm_module
PCIE_IPC_WORLD_SIZES = (2, 4, 8)
PCIE_IPC_PACK_BYTES = 16                # the PCIe IPC kernels address whole 16-byte packs
BARRIER_FLAGS = 256                     # barrier flags per rank in the trtllm workspace
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)   # the Lamport buffer's cap (2145386496 bytes)
# AllReduceFusionPattern, the fusion kernels' first template argument: what a trace shows as
# `<(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, ...` and what a launch passes.
PATTERN_ALLREDUCE = 0                   # kAllReduce
PATTERN_RESIDUAL_RMSNORM = 1            # kARResidualRMSNorm

_COMM = "flashinfer/comm/"
_INCLUDE = "flashinfer/data/include/flashinfer/comm/"
_FUSION = _INCLUDE + "trtllm_allreduce_fusion.cuh"
_MNNVL = _INCLUDE + "trtllm_mnnvl_allreduce.cuh"
_PCIE_IPC = _INCLUDE + "pcie_ipc_all_reduce.cuh"
_JIT = "flashinfer/jit/comm.py"


def _listed(numbers: tuple[int, ...]) -> list[str]:
    return [", ".join(str(n) for n in numbers)]


def _majors_of(module: str) -> str:
    """The supported_major_versions=[...] a JIT module's generator passes (up to the next def)."""
    return rf"def {module}\(\)(?:(?!\ndef )[\s\S])*?supported_major_versions=\[([\d, ]+)\]"


FACTS = FactSet(KEY, NAME, VERSION, (
    Fact("fusion_kernels", ["allreduce_fusion_kernel_oneshot_lamport", "allreduce_fusion_kernel_twoshot_sync"],
         _FUSION, r"__global__ void (allreduce_fusion_kernel_\w+)\(", KERNELS,
         "the TRT-LLM fusion kernels both engines' FlashInfer allreduce and fusion run (one-shot Lamport, "
         "two-shot), as a trace names them"),
    Fact("fusion_namespace", ["trtllm_allreduce_fusion"], _FUSION, r"namespace flashinfer \{\s*namespace (\w+) \{",
         KERNELS, "their namespace: a trace names them flashinfer::trtllm_allreduce_fusion::..."),
    Fact("fusion_pattern_argument", ["AllReduceFusionPattern"], _FUSION,
         r"template <(\w+) Pattern,[^>]*>\s*__global__ void allreduce_fusion_kernel_\w+\(", KERNELS,
         "the fusion kernels' first template argument, which a trace shows as (...::AllReduceFusionPattern)N: "
         "how attribute tells the fused allreduce + residual + RMSNorm from a plain allreduce"),
    Fact("fusion_pattern_numbers", sorted([f"kARResidualRMSNorm = {PATTERN_RESIDUAL_RMSNORM}",
                                           f"kAllReduce = {PATTERN_ALLREDUCE}"]),
         _FUSION, r"\b(k(?:AllReduce|ARResidualRMSNorm) = \d+),", KERNELS,
         "the enum's numbers a trace shows: 0 a plain allreduce, 1 allreduce + residual add + RMSNorm (the "
         "TRACE_KERNELS regexes match (AllReduceFusionPattern)1)"),
    Fact("pattern_allreduce", PATTERN_ALLREDUCE, _COMM + "trtllm_ar.py", "AllReduceFusionPattern.kAllReduce",
         meaning="the pattern number the Python API passes for a plain allreduce"),
    Fact("pattern_residual_rmsnorm", PATTERN_RESIDUAL_RMSNORM, _COMM + "trtllm_ar.py",
         "AllReduceFusionPattern.kARResidualRMSNorm",
         meaning="the pattern number the Python API passes for allreduce + residual add + RMSNorm"),
    Fact("fusion_world_sizes", sorted(str(n) for n in WORLD_SIZES), _FUSION,
         r"case (\d+):\s*DISPATCH_PATTERN\(T, \1\);", KERNELS,
         "the rank counts the fusion kernels are instantiated for (any other is an error): the world sizes "
         "FlashInfer's allreduce workspace takes in either engine"),
    Fact("sm_majors", _listed(SM_MAJORS), _JIT, _majors_of("gen_trtllm_comm_module"), KERNELS,
         "the GPU architectures (compute capability majors) the trtllm allreduce module is built for"),
    Fact("mnnvl_sm_majors", _listed(MNNVL_SM_MAJORS), _JIT, _majors_of("gen_trtllm_mnnvl_comm_module"), KERNELS,
         "the architectures the MNNVL (multicast) allreduce module is built for"),
    Fact("mnnvl_kernels", ["oneshotAllreduceFusionKernel", "rmsNormLamport", "twoshotAllreduceKernel"], _MNNVL,
         r"__global__\s+(?:void\s+)?__launch_bounds__\(\d+\)\s+(?:void\s+)?(\w+)\(", KERNELS,
         "the MNNVL backend's kernels (multicast one-shot, two-shot and its RMSNorm), as a trace names them"),
    Fact("mnnvl_namespace", ["trtllm_mnnvl_allreduce"], _MNNVL, r"namespace flashinfer \{\s*namespace (\w+) \{",
         KERNELS, "their namespace: flashinfer::trtllm_mnnvl_allreduce::..."),
    Fact("pcie_ipc_namespace", ["pcie_ipc"], _PCIE_IPC,
         r"namespace flashinfer \{\s*namespace comm \{\s*namespace (\w+) \{", KERNELS,
         "the PCIe IPC allreduce's namespace, flashinfer::comm::pcie_ipc::, which attribute matches its kernels by"),
    Fact("pcie_ipc_kernels", ["ipc_rsag_push_param_kernel", "ipc_rsag_ring_push_param_kernel",
                              "ipc_topo_rsag8_block_param_kernel", "ipc_topo_rsag8_push_param_kernel",
                              "ipc_topo_rsag8_ring_push_param_kernel", "ipc_tp2_remote_push_kernel",
                              "push_oneshot_param_kernel"],
         _PCIE_IPC, r"__global__ __launch_bounds__\([^)]*\) void (\w+_kernel)\(", KERNELS,
         "the PCIe IPC allreduce's kernels, as a trace names them"),
    Fact("pcie_ipc_world_sizes", PCIE_IPC_WORLD_SIZES, _COMM + "pcie_ipc_ar.py", "_SUPPORTED_WORLD_SIZES",
         meaning="the world sizes the PCIe IPC workspace takes"),
    Fact("pcie_ipc_pack_bytes", PCIE_IPC_PACK_BYTES, _COMM + "pcie_ipc_collectives/_constants.py", "PACK_BYTES",
         meaning="PCIe IPC takes whole packs of this many bytes, at least one per rank"),
    Fact("barrier_flags", BARRIER_FLAGS, _COMM + "trtllm_ar.py", "BarrierFlagCount",
         meaning="barrier flags per rank in the trtllm workspace (its flag buffer is tp_size x this x 4 bytes)"),
    Fact("max_comm_size", MAX_COMM_SIZE, _COMM + "trtllm_ar.py", "MAX_COMM_SIZE",
         meaning="the Lamport buffer's cap: a one-shot that needs more is refused (the workspace is capped to it)"),
))

LIBRARY = Library(FACTS, DISTRIBUTION)
