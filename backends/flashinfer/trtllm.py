"""FlashInfer's TRT-LLM workspace variants: plain allreduce (trtllm_oneshot / trtllm_twoshot), allreduce +
residual + RMSNorm in one kernel (fused_oneshot / fused_twoshot) and MNNVL's multicast allreduce (mnnvl)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

from commbench import engines
from commbench.backends.base import voted
from commbench.backends.flashinfer.common import (BARRIER_FLAGS, BYTES_PER_ACCESS, K_ALLREDUCE, K_AR_RESIDUAL_RMSNORM,
                                                  MAX_COMM_SIZE, MNNVL_SM_MAJORS, PLAIN_HIDDEN, WORKSPACE_ROW,
                                                  FlashinferMake, FlashInferBase, plain_shape)
from commbench.backends.fused import RMS_EPS, TOLERANCE, FusedBackend

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext


def trtllm_shape_reason(world_size: int, tokens: int, hidden: int, dtype: torch.dtype,
                        oneshot: bool) -> str | None:
    vector = BYTES_PER_ACCESS // dtype.itemsize
    if hidden % vector:
        return f"hidden {hidden} is not a multiple of {vector} (the kernels move 16 bytes per access)"
    if not oneshot and tokens <= world_size:
        return f"two-shot splits tokens across ranks: needs tokens > world size ({tokens} <= {world_size})"
    lamport_bytes = tokens * hidden * dtype.itemsize * world_size
    if oneshot and lamport_bytes > MAX_COMM_SIZE:
        return (f"one-shot needs tokens*hidden*world size*{dtype.itemsize} B <= {MAX_COMM_SIZE} B "
                f"(FlashInfer would run two-shot instead); this shape needs {lamport_bytes} B")
    return None


def probe_cumem(device_index: int, sizes_bytes: list[int]) -> None:
    """Allocate and release what the workspace will allocate (cuMemCreate, POSIX-fd handles),
    all at once, so a rank that cannot gets found before the collective workspace creation."""
    from commbench.topology.cudadrv import Driver

    driver = Driver()
    prop = driver.vmm_prop(device_index)
    granularity = driver.vmm_granularity(prop, recommended=True)
    handles = []
    try:
        for size in sizes_bytes:
            handles.append(driver.vmm_create(prop, -(-size // granularity) * granularity))
    finally:
        for handle in handles:
            driver.vmm_release(handle)


class _TrtllmWorkspaceBackend(FlashInferBase):
    """A ``create_allreduce_fusion_workspace`` workspace and one ``allreduce_fusion`` call."""

    workspace_backend = "trtllm"

    def __init__(self, oneshot: bool | None, options: FlashinferMake):
        super().__init__()
        self.oneshot = oneshot
        # PDL as in serving, unless --flashinfer-pdl off asks what it is worth.
        self.pdl = options.own.pdl
        self._workspace: Any = None
        self._scratch: torch.Tensor | None = None   # the fused pattern's allreduce output, unused

    def _build_kernels(self) -> None:
        """JIT-build (or load the cached build of) the kernels before any collective step, so
        a compiler failure is a reason on its rank and not a hang on the others."""
        importlib.import_module("flashinfer.comm.trtllm_ar").get_trtllm_comm_module()

    def _exchange(self, ctx: "RunContext") -> dict[str, Any]:
        """How the workspace's ranks swap memory handles: over the gloo control group."""
        return {"group": ctx.control_group}

    def _workspace_sizes(self, world_size: int, elements: int, dtype: torch.dtype) -> list[int]:
        elem = 4 if dtype == torch.float32 else 2
        lamport = min(world_size * elements * elem, MAX_COMM_SIZE)
        return [world_size * elements * elem, world_size * BARRIER_FLAGS * 4, 3 * lamport]

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        self._destroy()
        comm = importlib.import_module("flashinfer.comm")
        elements = -(-max_bytes // dtype.itemsize)
        rows = -(-elements // WORKSPACE_ROW)

        def build_and_probe() -> None:
            self._build_kernels()
            probe_cumem(ctx.device.index or 0, self._workspace_sizes(ctx.world_size, rows * WORKSPACE_ROW, dtype))

        voted(ctx, f"FlashInfer {self.workspace_backend} kernel build / workspace probe", build_and_probe)
        self._workspace = comm.create_allreduce_fusion_workspace(
            backend=self.workspace_backend, world_size=ctx.world_size, rank=ctx.rank,
            max_token_num=rows, hidden_dim=WORKSPACE_ROW, dtype=dtype, **self._exchange(ctx))
        self._scratch = torch.empty(elements, dtype=dtype, device=ctx.device)

    def _fusion(self, x2d: torch.Tensor, pattern: int, output: torch.Tensor, **outputs: Any) -> None:
        assert self._workspace is not None, "setup() first"
        comm = importlib.import_module("flashinfer.comm")
        comm.allreduce_fusion(
            input=x2d, workspace=self._workspace, pattern=pattern,
            # As in serving: fp32 accumulation; completion triggered at the end of the kernel,
            # the setting that is safe for every token count (vLLM, flashinfer#1223).
            launch_with_pdl=self.pdl, trigger_completion_at_end=True, fp32_acc=True,
            use_oneshot=self.oneshot, output=output, **outputs)

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        tokens, hidden = plain_shape(x.numel())
        self._fusion(x.reshape(tokens, hidden), K_ALLREDUCE, out.view(tokens, hidden))

    def _destroy(self) -> None:
        if self._workspace is not None:
            if self.workspace_backend == "trtllm":
                # destroy() only drops the workspace's attributes; trtllm_ar keeps its own
                # reference to the buffers (_symm_workspace_refs) until this call releases it.
                importlib.import_module("flashinfer.comm.trtllm_ar") \
                    .trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self._workspace.ipc_handles)
            self._workspace.destroy()
        self._workspace = None
        self._scratch = None

    def close(self) -> None:
        self._destroy()


class TrtllmAllreduce(_TrtllmWorkspaceBackend):
    def __init__(self, oneshot: bool, options: FlashinferMake):
        super().__init__(oneshot, options)
        self.name = f"flashinfer:trtllm_{'oneshot' if oneshot else 'twoshot'}"

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        reason = super().supports(message_bytes, dtype)
        if reason:
            return reason
        count = message_bytes // dtype.itemsize
        return trtllm_shape_reason(self._world_size, *plain_shape(count), dtype, bool(self.oneshot))

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"workspace_backend": "trtllm", "pattern": "kAllReduce", "oneshot": self.oneshot,
                          "plain_hidden": PLAIN_HIDDEN, "launch_with_pdl": self.pdl}}


class TrtllmFused(_TrtllmWorkspaceBackend, FusedBackend):
    def __init__(self, oneshot: bool, options: FlashinferMake):
        super().__init__(oneshot, options)
        self.name = f"flashinfer:fused_{'oneshot' if oneshot else 'twoshot'}"

    def shape_reason(self, world_size: int, tokens: int, hidden: int, dtype: torch.dtype) -> str | None:
        return trtllm_shape_reason(world_size, tokens, hidden, dtype, bool(self.oneshot))

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        settings = super().engine_settings(world_size)
        settings.vllm_flags = list(engines.VLLM_FUSE_ALLREDUCE_RMS)
        settings.notes.insert(1, engines.FUSED_TIMING)
        settings.engine_paths = engines.claim(engines.FLASHINFER_FUSED, engines.VLLM, engines.SGLANG)
        return settings

    def allreduce_residual_rmsnorm(self, x: torch.Tensor, residual_in: torch.Tensor, gamma: torch.Tensor,
                                   residual_out: torch.Tensor, norm_out: torch.Tensor) -> None:
        # The fused pattern's outputs are the residual and the norm; its allreduce output goes
        # to a scratch buffer of this backend.
        assert self._scratch is not None, "setup() first"
        self._fusion(x, K_AR_RESIDUAL_RMSNORM, self._scratch[: x.numel()].view(x.shape), residual_in=residual_in,
                     residual_out=residual_out, norm_out=norm_out, rms_gamma=gamma, rms_eps=RMS_EPS)

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"workspace_backend": "trtllm", "pattern": "kARResidualRMSNorm",
                          "oneshot": self.oneshot, "rms_eps": RMS_EPS, "launch_with_pdl": self.pdl,
                          "tolerance": {str(k).replace("torch.", ""): v for k, v in TOLERANCE.items()}}}


class MnnvlAllreduce(_TrtllmWorkspaceBackend):
    """FlashInfer's multicast allreduce; FlashInfer picks one- or two-shot itself."""

    name = "flashinfer:mnnvl"
    workspace_backend = "mnnvl"
    sm_majors = MNNVL_SM_MAJORS
    # Multicast across ranks that share a GPU means nothing.
    needs = ("cuda", "multicast", "own_gpu", "node", "p2p", "vmm")

    def __init__(self, options: FlashinferMake) -> None:
        super().__init__(None, options)

    def _build_kernels(self) -> None:
        importlib.import_module("flashinfer.comm.trtllm_mnnvl_ar").get_trtllm_mnnvl_comm_module()

    def _exchange(self, ctx: "RunContext") -> dict[str, Any]:
        # Without a comm backend the MNNVL workspace falls back to MPI.
        backend = importlib.import_module("flashinfer.comm.comm_backend").TorchDistBackend(group=ctx.control_group)
        return {"comm_backend": backend}

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"workspace_backend": "mnnvl", "pattern": "kAllReduce", "plain_hidden": PLAIN_HIDDEN}}
