"""vLLM's allreduce facts, built in: read at vLLM 0.34.0 and the same in 0.33.0 (results/reference/
engine-rules/ has `commbench engines --check` on both wheels). Updating to a new release is an
edit of this list and one `commbench engines --check` run against its wheel."""

from __future__ import annotations

from commbench.engines.facts import ENV, PARAM, TEXT, Fact, FactSet

VERSION = "0.34.0"
CHECKED = ("0.33.0", "0.34.0")     # releases whose source gives every fact below

MiB, KiB = 1 << 20, 1 << 10
# Not in the list because no Python file states it: VLLM_CUSTOM_ALLREDUCE_ALGO=1stage|2stage forces
# the custom allreduce's stage. Its kernel (csrc/custom_all_reduce.cuh) reads it: the name is in
# vllm/_C_stable_libtorch.abi3.so of both 0.33.0 and 0.34.0, and 0.33.0's batch_invariant.py sets it.
_COMM = "vllm/distributed/device_communicators/"
_FUSION = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"

FACTS = FactSet("vllm", "vLLM", VERSION, (
    Fact("dispatch_order", ["FLASHINFER_PCIE_IPC", "FLASHINFER", "NCCL_SYMM_MEM", "QUICK_REDUCE", "AITER_CUSTOM",
                            "CUSTOM", "SYMM_MEM", "PYNCCL"],
         _COMM + "cuda_communicator.py", "CudaCommunicator._log_all_reduce_backend_selection.all_potential_ar_backends",
         meaning="the all-reduce backends in dispatch order, as vLLM logs them at start-up (FlashInfer's size check "
                 "runs first: NCCL symmetric memory takes a message only where FlashInfer does not)"),
    Fact("dispatch_log", True, _COMM + "cuda_communicator.py", "all-reduce backends (in dispatch order) for group",
         TEXT, "the start-up log line naming the backends set up for each group (--engine-log reads it)"),
    Fact("custom_ar_world_sizes", [2, 4, 6, 8, 16], _COMM + "custom_all_reduce.py",
         "CustomAllreduce._SUPPORTED_WORLD_SIZES", meaning="world sizes the custom allreduce starts at"),
    Fact("custom_ar_max_bytes", 8 * MiB, _COMM + "custom_all_reduce.py", "CustomAllreduce.__init__.max_size", PARAM,
         "the custom allreduce takes messages below this size (inp_size < max_size)"),
    Fact("custom_ar_max_with_symm_mem", {
        "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 512 * KiB, 8: 256 * KiB},
        "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB},
        "10.3": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB},
        "10.7": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB}},
        _COMM + "all_reduce_utils.py", "CUSTOM_ALL_REDUCE_MAX_SIZES",
        meaning="where torch symmetric memory is on, the custom allreduce's cap is min(this, max_size)"),
    Fact("symm_mem_max_bytes", {
        "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
        "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
        "10.3": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB},
        "10.7": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB}},
        _COMM + "all_reduce_utils.py", "SYMM_MEM_ALL_REDUCE_MAX_SIZES",
        meaning="torch symmetric memory takes messages up to this size (inclusive) per compute capability"),
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
    Fact("nccl_symm_config", {"min_world_size": 4, "custom_ar_preferred_ranges": {4: (16 * KiB, 512 * KiB),
                                                                                 8: (16 * KiB, 128 * KiB)},
                              "always_use_above_world_size": 8},
         _COMM + "all_reduce_utils.py", "NCCL_SYMM_MEM_ALL_REDUCE_CONFIG",
         meaning="NCCL symmetric memory: from 4 ranks, not for sizes strictly inside the custom allreduce's range"),
    Fact("pcie_ipc_world_sizes", (2, 4, 8), _COMM + "flashinfer_pcie_ipc_all_reduce.py", "_SUPPORTED_WORLD_SIZES"),
    Fact("pcie_ipc_needs_graphs", True, _COMM + "flashinfer_pcie_ipc_all_reduce.py",
         "capture_sizes = worker.vllm_config.compilation_config.cudagraph_capture_sizes", TEXT,
         "the PCIe IPC workspace is set up for the CUDA-graph capture sizes only: nothing under --enforce-eager, "
         "and no message above the largest captured batch x hidden"),
    Fact("default_max_capture_tokens", True, "vllm/config/vllm.py",
         "1024 if current_platform.is_device_capability_family(100) else 512", TEXT,
         "the largest captured batch by default: min(2 x max_num_seqs, 512; 1024 on SM10x)"),
    Fact("fusion_on_at_O2", True, "vllm/config/vllm.py", '"fuse_allreduce_rms": enable_allreduce_rms_fusion', TEXT,
         "-O2 and -O3 turn fuse_allreduce_rms on through enable_allreduce_rms_fusion"),
    Fact("default_O2", True, "vllm/config/vllm.py", "optimization_level: OptimizationLevel = OptimizationLevel.O2",
         TEXT, "the default optimization level is -O2"),
    Fact("fusion_archs", True, "vllm/config/vllm.py", "current_platform.is_device_capability_family(100)", TEXT,
         "enable_allreduce_rms_fusion: TP > 1, CUDA, FlashInfer installed, SM90 or any SM10x"),
    Fact("env_use_flashinfer", "1", "vllm/envs.py", "VLLM_ALLREDUCE_USE_FLASHINFER", ENV),
    Fact("env_use_symm_mem", "1", "vllm/envs.py", "VLLM_ALLREDUCE_USE_SYMM_MEM", ENV),
    Fact("env_use_pcie_ipc", "0", "vllm/envs.py", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", ENV),
    Fact("env_use_nccl_symm_mem", "0", "vllm/envs.py", "VLLM_USE_NCCL_SYMM_MEM", ENV),
    Fact("env_skip_p2p_check", "1", "vllm/envs.py", "VLLM_SKIP_P2P_CHECK", ENV),
))
