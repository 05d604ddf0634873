"""FlashInfer allreduce (optional: ``pip install 'commbench[flashinfer]'``).

Checked against FlashInfer 0.7.4's source (``flashinfer/comm/allreduce.py``, ``trtllm_ar.py``,
``pcie_ipc_ar.py``, ``pcie_ipc_policy.py``, ``pcie_ipc_tuning.py``, ``jit/comm.py``); older
0.6-0.7 releases have the same calls where named below.

- ``trtllm_oneshot`` / ``trtllm_twoshot``: plain allreduce through the TRT-LLM fusion
  kernels (pattern kAllReduce). Workspace from ``create_allreduce_fusion_workspace`` with
  ``backend="trtllm"`` named explicitly: "auto" picks MNNVL, which creates multicast objects,
  whenever every rank reports multicast support. Its buffers are ``SymmDeviceMemory``
  (cuMemCreate, POSIX-fd handles swapped over ``group``) unless confidential computing is on.
- ``fused_oneshot`` / ``fused_twoshot``: the same kernels doing allreduce + residual add +
  RMSNorm (pattern kARResidualRMSNorm) on (tokens x hidden) shapes; compared with
  ``unfused:best`` by commbench.analysis.fusion.
- ``pcie_ipc``: ``PcieIpcAllReduceWorkspace`` (0.7.2+), tuned at setup the way its docstring
  asks (``tune_batches`` = the run's size buckets, ``tune([hidden])``, then ``prepare(shapes)``
  so that CUDA graphs capture no collective); every row records the launch configuration it ran.
- ``mnnvl``: the multicast backend, only with --allow-multicast and no policy variable set.

Limits that are checked before anything runs: world sizes 2/4/8/16 (the kernels are
instantiated for those rank counts), SM 9.x/10.x/12.x (``gen_trtllm_comm_module`` builds for
those majors only), hidden a multiple of 16 bytes, two-shot needs tokens > world size (an
assert in ``trtllm_allreduce_fusion``), one-shot needs its Lamport buffer under MAX_COMM_SIZE
(FlashInfer would silently run two-shot instead). PCIe IPC: 2/4/8 ranks, bf16/fp16, whole
16-byte packs and at least one pack per rank (``pcie_ipc_policy._admits``).

Plain message sizes run as (count / 4096) tokens x 4096 when count is a multiple of 4096
elements, else as one token of count elements: FlashInfer reduces 2-D (tokens, hidden) inputs,
its two-shot splits tokens across ranks, and PCIe IPC's tune buckets are token counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from commbench import engines
from commbench.backends.base import Backend, MakeOptions, Requires
from commbench.engines import flashinfer as released   # FlashInfer's facts, checked against its wheel

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

DISTRIBUTION = "flashinfer-python"
REQUIRES = Requires(DISTRIBUTION, "flashinfer.comm", "pip install 'commbench[flashinfer]'",
                    min_version=(0, 6), min_version_for="create_allreduce_fusion_workspace")
# What FlashInfer's release states (commbench/engines/flashinfer.py, each with its file; `commbench
# engines --check` reads them again from a wheel).
TRTLLM_WORLD_SIZES = released.WORLD_SIZES
TRTLLM_SM_MAJORS = released.SM_MAJORS
MNNVL_SM_MAJORS = released.MNNVL_SM_MAJORS
PCIE_WORLD_SIZES = released.PCIE_IPC_WORLD_SIZES      # pcie_ipc_ar._SUPPORTED_WORLD_SIZES
PCIE_PACK_BYTES = released.PCIE_IPC_PACK_BYTES        # pcie_ipc_collectives._constants.PACK_BYTES
BARRIER_FLAGS = released.BARRIER_FLAGS                # trtllm_ar.BarrierFlagCount, for the allocation probe
MAX_COMM_SIZE = released.MAX_COMM_SIZE                # trtllm_ar.MAX_COMM_SIZE: the Lamport buffer's cap
K_ALLREDUCE = released.PATTERN_ALLREDUCE              # AllReduceFusionPattern.kAllReduce
K_AR_RESIDUAL_RMSNORM = released.PATTERN_RESIDUAL_RMSNORM   # AllReduceFusionPattern.kARResidualRMSNorm
PCIE_DTYPES = (torch.bfloat16, torch.float16)
PCIE_TUNE_DIR = "flashinfer-pcie-ipc"   # tune caches, inside the run dir
PLAIN_HIDDEN = 4096             # elements per token when a plain size is reshaped
BYTES_PER_ACCESS = 16           # the kernels load 16 bytes per thread: hidden must be a multiple
WORKSPACE_ROW = 256             # workspace sized as rows of this many elements (only the product counts)


@dataclass(frozen=True)
class FlashinferOptions:
    """The flashinfer family's flags, read once."""

    pcie_tune: bool = True    # --flashinfer-pcie-tune measure (True) or seed (False)
    pdl: bool = True          # --flashinfer-pdl on (True) or off


FlashinferMake = MakeOptions[FlashinferOptions]   # what make() hands this family

# Kernel names this family's allreduce leaves in a profiler trace, read by `commbench attribute`
# with ast, without importing this module (docs/attribute.md): (regex searched in the demangled
# name, library, regex over this family's run variants that are its floor, note[, op]).
# The names, namespaces and pattern numbers these regexes rely on are FlashInfer facts
# (commbench/engines/flashinfer.py: fusion_kernels, fusion_namespace, fusion_pattern_argument,
# fusion_pattern_numbers, mnnvl_kernels, pcie_ipc_namespace, pcie_ipc_kernels), read from the
# release's kernel sources by `commbench engines --check`; a test classifies every one of them here.
# The fusion kernels' first template argument is AllReduceFusionPattern: 0 plain allreduce, 1
# + residual + RMSNorm (the op the fused variants measure, so its own entries), 2 and up + a
# quantised output. Not among the facts (their entries stay as read at 0.7.4, unchecked): the MoE
# fusion (trtllm_moe_allreduce_fusion.cuh) and the legacy kernels (trtllm_allreduce.cuh), which
# neither engine calls (vLLM 0.34.0 and SGLang 0.5.23 call no trtllm_moe_*allreduce_fusion).
TRACE_KERNELS = (
    (r"\bflashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport\b"
     r"(?!<\((?:\w+::)*AllReduceFusionPattern\)1\b)", "FlashInfer TRT-LLM fusion one-shot",
     r"^flashinfer:trtllm_oneshot$", "a quantising fused pattern also adds the residual, RMSNorm and the quantisation"),
    (r"\bflashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync\b"
     r"(?!<\((?:\w+::)*AllReduceFusionPattern\)1\b)", "FlashInfer TRT-LLM fusion two-shot",
     r"^flashinfer:trtllm_twoshot$", "a quantising fused pattern also adds the residual, RMSNorm and the quantisation"),
    (r"\bflashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport"
     r"<\((?:\w+::)*AllReduceFusionPattern\)1\b", "FlashInfer allreduce+RMSNorm fusion one-shot",
     r"^flashinfer:fused_oneshot$", "allreduce + residual add + RMSNorm in one kernel", "allreduce_residual_rmsnorm"),
    (r"\bflashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync"
     r"<\((?:\w+::)*AllReduceFusionPattern\)1\b", "FlashInfer allreduce+RMSNorm fusion two-shot",
     r"^flashinfer:fused_twoshot$", "allreduce + residual add + RMSNorm in one kernel", "allreduce_residual_rmsnorm"),
    (r"\bmoe(?:reduce|finalize)_allreduce_fusion_kernel", "FlashInfer MoE allreduce fusion", "",
     "the MoE reduction (or finalize) and the residual, RMSNorm and any quantisation in the same kernel"),
    (r"\b(oneshotAllreduceFusionKernel|twoshotAllreduceKernel|rmsNormLamport)\b", "FlashInfer MNNVL",
     r"^flashinfer:mnnvl$", ""),
    (r"\btrtllm_allreduce::\w*(oneShotAllReduceKernel|twoShotAllReduceKernel|lamport_style_one_shot_all_reduce)",
     "FlashInfer legacy TRT-LLM allreduce", "", ""),
    (r"\bflashinfer::comm::pcie_ipc::", "FlashInfer PCIe IPC", r"^flashinfer:pcie_ipc$", ""),
)


def plain_shape(count: int) -> tuple[int, int]:
    """(tokens, hidden) for a plain message of count elements (see the module docstring)."""
    hidden = PLAIN_HIDDEN if count % PLAIN_HIDDEN == 0 else count
    return count // hidden, hidden


class FlashInferBase(Backend):
    """Checks shared by every FlashInfer variant."""

    family = "flashinfer"
    needs: tuple[str, ...] = ("cuda", "node", "p2p", "ipc", "vmm")   # cuMemCreate workspaces
    min_world_size = 2
    world_sizes = TRTLLM_WORLD_SIZES
    sm_majors: tuple[int, ...] = TRTLLM_SM_MAJORS
    requires = REQUIRES

    def __init__(self) -> None:
        self._world_size = 0

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engines.Settings(self.name, vllm_env=dict(engines.VLLM_FLASHINFER_TRTLLM_ENV),
                                sglang_flags=list(engines.SGLANG_FLASHINFER_TRTLLM),
                                notes=[engines.FLASHINFER_NEVER_AUTO, engines.FLASHINFER_ARCHS],
                                engine_paths=engines.claim(engines.FLASHINFER_AR, engines.VLLM, engines.SGLANG))

    def check(self, ctx: "RunContext") -> str | None:
        reason = super().check(ctx)
        if reason:
            return reason
        major, minor = torch.cuda.get_device_capability(ctx.device)
        if major not in self.sm_majors:
            archs = "/".join(f"{m}.x" for m in self.sm_majors)
            return f"kernels are built for SM {archs} only; this GPU is SM {major}.{minor}"
        self._world_size = ctx.world_size
        return None
