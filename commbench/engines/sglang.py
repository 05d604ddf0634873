"""SGLang's allreduce facts, built in: read at SGLang 0.5.23 (results/reference/engine-rules/ has
`commbench engines --check` on its wheel). Updating to a new release is an edit of this list and
one `commbench engines --check` run against its wheel."""

from __future__ import annotations

from commbench.engines.facts import ENV, RETURNS, TEXT, Fact, FactSet

VERSION = "0.5.23"
CHECKED = ("0.5.23",)

MiB = 1 << 20
_COMM = "sglang/srt/distributed/device_communicators/"

FACTS = FactSet("sglang", "SGLang", VERSION, (
    Fact("outplace_order", ["ca", "pcie_ipc", "qr", "pymscclpp", "torch_symm_mem", "pynccl"],
         "sglang/srt/distributed/parallel_state.py", "GroupCoordinator._resolve_outplace_all_reduce_method", RETURNS,
         "after NCCL symmetric memory and FlashInfer: custom allreduce (unless MSCCL++ takes the message, which then "
         "wins), PCIe IPC, MSCCL++, torch symmetric memory, else PyNccl"),
    Fact("symm_mem_before_flashinfer", True, "sglang/srt/distributed/parallel_state.py",
         "and not should_use_custom_allreduce", TEXT,
         "--enable-symm-mem: NCCL symmetric memory takes every message custom allreduce and MSCCL++ do not, before "
         "FlashInfer"),
    Fact("flashinfer_archs", frozenset({
        "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM", "GptOssForCausalLM",
        "GlmMoeDsaForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM",
        "Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration", "Qwen3NextForCausalLM",
        "Qwen4ExpForConditionalGeneration", "KimiK25ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM", "NemotronH_Omni_Reasoning_V3"}),
        "sglang/srt/arg_groups/overrides.py", "_FLASHINFER_ALLREDUCE_FUSION_ARCHS",
        meaning="architectures for which FlashInfer allreduce fusion is on by default (TP > 1, SM90/SM10x, one "
                "node, no attention-DP, no MoE all-to-all)"),
    Fact("flashinfer_max_tokens", 2048, "sglang/srt/layers/layer_boundary/residual/add_norm.py",
         "FUSE_ALLREDUCE_MAX_BATCH_SIZE",
         meaning="with fusion on, every tensor-parallel allreduce of up to this many tokens goes to FlashInfer"),
    Fact("flashinfer_needs_sm90_sm10x", True, "sglang/srt/layers/flashinfer_comm_fusion.py",
         "FlashInfer allreduce fusion requires SM90 or SM10X NVIDIA GPUs.", TEXT,
         "elsewhere (SM12) the fusion flag raises this error at start-up (pre_initialize_workspaces)"),
    Fact("enforce_disable_flag", True, "sglang/srt/arg_groups/overrides.py",
         "view.enforce_disable_flashinfer_allreduce_fusion", TEXT,
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
    Fact("skip_p2p_check", "0", _COMM + "custom_all_reduce_utils.py", "SGLANG_SKIP_P2P_CHECK", ENV,
         "SGLang runs a real P2P test by default (vLLM trusts cudaDeviceCanAccessPeer)"),
    Fact("legacy_world_sizes", [2, 4, 6, 8], _COMM + "custom_all_reduce.py", "CustomAllreduce._SUPPORTED_WORLD_SIZES"),
    Fact("legacy_max_bytes", 8 * MiB, _COMM + "custom_all_reduce.py", "CustomAllreduce._MAX_CAR_SIZE"),
    Fact("legacy_inclusive", True, _COMM + "custom_all_reduce.py", "return inp_size <= self.max_size", TEXT,
         "the legacy kernel's size limit is inclusive too"),
    Fact("pcie_ipc_env", False, "sglang/srt/environ.py", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", ENV,
         "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 turns FlashInfer's PCIe IPC allreduce on (bf16)"),
    Fact("pcie_ipc_world_sizes", (2, 4, 8), _COMM + "pcie_ipc_ar.py", "_SUPPORTED_WORLD_SIZES"),
    Fact("mscclpp_world_sizes", (4, 8, 16, 32, 64), _COMM + "pymscclpp.py", "_SUPPORTED_WORLD_SIZES"),
    Fact("torch_symm_mem_max_bytes", {9: {2: 64 * MiB, 4: 64 * MiB, 6: 128 * MiB, 8: 128 * MiB},
                                      10: {2: 64 * MiB, 4: 64 * MiB, 6: 128 * MiB, 8: 128 * MiB}},
         _COMM + "all_reduce_utils.py", "TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES"),
    Fact("torch_symm_mem_multimem", {9: [4, 6, 8], 10: [4, 6, 8]}, _COMM + "torch_symm_mem.py",
         "TorchSymmMemCommunicator._WORLD_SIZES_MULTIMEM"),
))
