"""FlashInfer allreduce (optional: ``pip install 'commbench[flashinfer]'``).

Variants (facts from FlashInfer 0.6-0.7's ``flashinfer.comm`` source and docs):

- ``trtllm_oneshot`` / ``trtllm_twoshot``: plain allreduce through the TRT-LLM fusion
  kernels (pattern kAllReduce). Workspace from ``create_allreduce_fusion_workspace`` with
  ``backend="trtllm"`` named explicitly: "auto" picks MNNVL, which creates multicast objects,
  whenever the device reports multicast support.
- ``fused_oneshot`` / ``fused_twoshot``: the same kernels doing allreduce + residual add +
  RMSNorm (pattern kARResidualRMSNorm) on (tokens x hidden) shapes; compared with
  ``unfused:best`` by commbench.analysis.fusion.
- ``pcie_ipc``: ``PcieIpcAllReduceWorkspace`` where the installed version has it (0.7.2+).
- ``mnnvl``: the multicast backend, only with --allow-multicast and no policy variable set.

Limits that are checked before anything runs: world sizes 2/4/8/16, SM 9.x/10.x/12.x (the
TRT-LLM kernels use thread-block clusters and PDL, so FlashInfer JIT-builds them for those
archs only), hidden a multiple of 16 bytes, two-shot needs tokens > world size, one-shot needs
its Lamport buffer under MAX_COMM_SIZE (FlashInfer would silently run two-shot instead).

Plain message sizes run as (count / 4096) tokens x 4096 when count is a multiple of 4096
elements, else as one token of count elements: FlashInfer reduces 2-D (tokens, hidden) inputs
and its two-shot splits tokens across ranks.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch

from commbench import engines
from commbench.backends.base import Backend, BackendFactory, voted
from commbench.backends.fused import RMS_EPS, TOLERANCE, FusedBackend

if TYPE_CHECKING:
    from commbench.sweep.context import RunContext

DISTRIBUTION = "flashinfer-python"
INSTALL_HINT = "pip install 'commbench[flashinfer]'"
MIN_VERSION = (0, 6)            # create_allreduce_fusion_workspace / allreduce_fusion
TRTLLM_WORLD_SIZES = (2, 4, 8, 16)
TRTLLM_SM_MAJORS = (9, 10, 12)
MNNVL_SM_MAJORS = (9, 10)
PCIE_WORLD_SIZES = (2, 4, 8)
PCIE_DTYPES = (torch.bfloat16, torch.float16)
PLAIN_HIDDEN = 4096             # elements per token when a plain size is reshaped
BYTES_PER_ACCESS = 16           # the kernels load 16 bytes per thread: hidden must be a multiple
WORKSPACE_ROW = 256             # workspace sized as rows of this many elements (only the product counts)
BARRIER_FLAGS = 256             # FlashInfer trtllm_ar.BarrierFlagCount, for the allocation probe
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)   # trtllm_ar.MAX_COMM_SIZE: Lamport buffer cap
K_ALLREDUCE = 0                 # AllReduceFusionPattern.kAllReduce
K_AR_RESIDUAL_RMSNORM = 1       # AllReduceFusionPattern.kARResidualRMSNorm


def _version_tuple(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def import_reason() -> str | None:
    """Why flashinfer.comm cannot be used here, or None."""
    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return f"flashinfer-python not installed ({INSTALL_HINT})"
    if _version_tuple(version) < MIN_VERSION:
        return (f"flashinfer-python {version} is too old: needs >= {'.'.join(map(str, MIN_VERSION))} "
                f"(create_allreduce_fusion_workspace)")
    try:
        importlib.import_module("flashinfer.comm")
    except Exception as exc:  # a missing dependency or a broken install: say which
        return f"flashinfer-python {version} is installed but does not import: {type(exc).__name__}: {exc}"
    return None


def plain_shape(count: int) -> tuple[int, int]:
    """(tokens, hidden) for a plain message of count elements (see the module docstring)."""
    hidden = PLAIN_HIDDEN if count % PLAIN_HIDDEN == 0 else count
    return count // hidden, hidden


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


class _FlashInferBase(Backend):
    """Checks shared by every FlashInfer variant."""

    family = "flashinfer"
    needs: tuple[str, ...] = ("cuda", "node", "p2p", "ipc", "vmm")   # cuMemCreate workspaces
    min_world_size = 2
    world_sizes: tuple[int, ...] = TRTLLM_WORLD_SIZES
    sm_majors: tuple[int, ...] = TRTLLM_SM_MAJORS

    def __init__(self) -> None:
        self._world_size = 0

    def world_size_reason(self, world_size: int) -> str | None:
        reason = super().world_size_reason(world_size)
        if reason is None and world_size not in self.world_sizes:
            return f"world size {world_size} not supported (needs one of {', '.join(map(str, self.world_sizes))})"
        return reason

    def software_reason(self) -> str | None:
        return import_reason()

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engines.Settings(self.name, vllm_env=dict(engines.VLLM_FLASHINFER_TRTLLM_ENV),
                                sglang_flags=list(engines.SGLANG_FLASHINFER_TRTLLM),
                                notes=[engines.FLASHINFER_NEVER_AUTO, engines.FLASHINFER_ARCHS])

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


class _TrtllmWorkspaceBackend(_FlashInferBase):
    """A ``create_allreduce_fusion_workspace`` workspace and one ``allreduce_fusion`` call."""

    workspace_backend = "trtllm"

    def __init__(self, oneshot: bool | None):
        super().__init__()
        self.oneshot = oneshot
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
            # As in serving: PDL on, fp32 accumulation; completion triggered at the end of the
            # kernel, the setting that is safe for every token count (vLLM, flashinfer#1223).
            launch_with_pdl=True, trigger_completion_at_end=True, fp32_acc=True,
            use_oneshot=self.oneshot, output=output, **outputs)

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        tokens, hidden = plain_shape(x.numel())
        self._fusion(x.reshape(tokens, hidden), K_ALLREDUCE, out.view(tokens, hidden))

    def _destroy(self) -> None:
        if self._workspace is not None:
            self._workspace.destroy()
        self._workspace = None
        self._scratch = None

    def close(self) -> None:
        self._destroy()


class TrtllmAllreduce(_TrtllmWorkspaceBackend):
    def __init__(self, oneshot: bool):
        super().__init__(oneshot)
        self.name = f"flashinfer:trtllm_{'oneshot' if oneshot else 'twoshot'}"

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        reason = super().supports(message_bytes, dtype)
        if reason:
            return reason
        count = message_bytes // dtype.itemsize
        return trtllm_shape_reason(self._world_size, *plain_shape(count), dtype, bool(self.oneshot))

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"workspace_backend": "trtllm", "pattern": "kAllReduce", "oneshot": self.oneshot,
                          "plain_hidden": PLAIN_HIDDEN}}


class TrtllmFused(_TrtllmWorkspaceBackend, FusedBackend):
    def __init__(self, oneshot: bool):
        super().__init__(oneshot)
        self.name = f"flashinfer:fused_{'oneshot' if oneshot else 'twoshot'}"

    def shape_reason(self, world_size: int, tokens: int, hidden: int, dtype: torch.dtype) -> str | None:
        return trtllm_shape_reason(world_size, tokens, hidden, dtype, bool(self.oneshot))

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        settings = super().engine_settings(world_size)
        settings.vllm_flags = list(engines.VLLM_FUSE_ALLREDUCE_RMS)
        settings.notes.insert(1, engines.FUSED_TIMING)
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
                          "oneshot": self.oneshot, "rms_eps": RMS_EPS,
                          "tolerance": {str(k).replace("torch.", ""): v for k, v in TOLERANCE.items()}}}


class MnnvlAllreduce(_TrtllmWorkspaceBackend):
    """FlashInfer's multicast allreduce; FlashInfer picks one- or two-shot itself."""

    name = "flashinfer:mnnvl"
    workspace_backend = "mnnvl"
    sm_majors = MNNVL_SM_MAJORS
    # Multicast across ranks that share a GPU means nothing.
    needs = ("cuda", "multicast", "own_gpu", "node", "p2p", "vmm")

    def __init__(self) -> None:
        super().__init__(oneshot=None)

    def _build_kernels(self) -> None:
        importlib.import_module("flashinfer.comm.trtllm_mnnvl_ar").get_trtllm_mnnvl_comm_module()

    def _exchange(self, ctx: "RunContext") -> dict[str, Any]:
        # Without a comm backend the MNNVL workspace falls back to MPI.
        backend = importlib.import_module("flashinfer.comm.comm_backend").TorchDistBackend(group=ctx.control_group)
        return {"comm_backend": backend}

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"workspace_backend": "mnnvl", "pattern": "kAllReduce", "plain_hidden": PLAIN_HIDDEN}}


class PcieIpcAllreduce(_FlashInferBase):
    """FlashInfer's PCIe IPC allreduce (for GPUs without NVLink).

    Not captured in graphs: a workspace serves one CUDA stream and rejects a second one, and a
    graph is captured on another stream than the eager calls."""

    name = "flashinfer:pcie_ipc"
    graph_capturable = False
    world_sizes = PCIE_WORLD_SIZES
    needs = ("cuda", "node", "p2p", "ipc")     # cudaMalloc + cudaIpcGetMemHandle buffers, no cuMemCreate

    def __init__(self) -> None:
        super().__init__()
        self._workspace: Any = None

    def software_reason(self) -> str | None:
        reason = super().software_reason()
        if reason is None and not hasattr(importlib.import_module("flashinfer.comm"), "PcieIpcAllReduceWorkspace"):
            return (f"flashinfer-python {metadata.version(DISTRIBUTION)} has no PcieIpcAllReduceWorkspace "
                    "(added in 0.7.2)")
        return reason

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engines.Settings(self.name, vllm_env=dict(engines.FLASHINFER_PCIE_IPC_ENV), sglang_supported=False,
                                notes=[engines.SGLANG_PCIE_IPC])

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        return None if dtype in PCIE_DTYPES else "PCIe IPC allreduce takes bf16 and fp16 only"

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        self.close()
        comm = importlib.import_module("flashinfer.comm")
        # The constructor validates jointly on every rank and raises on all of them together.
        self._workspace = comm.PcieIpcAllReduceWorkspace(
            group=ctx.control_group, max_numel=-(-max_bytes // dtype.itemsize), dtype=dtype)

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        assert self._workspace is not None, "setup() first"
        # The workspace returns its own result tensor: copied into the caller's out.
        out.copy_(self._workspace.all_reduce(x))

    def close(self) -> None:
        if self._workspace is not None:
            self._workspace.destroy()
        self._workspace = None


VARIANTS = ("trtllm_oneshot", "trtllm_twoshot", "fused_oneshot", "fused_twoshot", "pcie_ipc", "mnnvl")


def _build(variant: str) -> Backend:
    if variant.startswith("trtllm_"):
        return TrtllmAllreduce(oneshot=variant.endswith("oneshot"))
    if variant.startswith("fused_"):
        return TrtllmFused(oneshot=variant.endswith("oneshot"))
    if variant == "pcie_ipc":
        return PcieIpcAllreduce()
    return MnnvlAllreduce()


def make(variant: str | None, options: dict[str, Any]) -> list[Backend]:
    if variant is None:
        # The fused variants only make sense on model shapes.
        names = [v for v in VARIANTS if options.get("hidden") or not v.startswith("fused_")]
        return [_build(v) for v in names]
    if variant not in VARIANTS:
        from commbench.errors import UsageError

        raise UsageError(f"flashinfer: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return [_build(variant)]


FACTORY = BackendFactory(
    family="flashinfer",
    make=make,
    native=True,
    summary="FlashInfer TRT-LLM allreduce and allreduce+residual+RMSNorm fusion, PCIe IPC, MNNVL (optional)",
    variants_help=[
        "flashinfer:trtllm_oneshot  TRT-LLM Lamport one-shot allreduce (backend='trtllm')",
        "flashinfer:trtllm_twoshot  TRT-LLM two-shot allreduce (tokens > world size)",
        "flashinfer:fused_oneshot   allreduce + residual + RMSNorm, one kernel, one-shot (model shapes)",
        "flashinfer:fused_twoshot   allreduce + residual + RMSNorm, one kernel, two-shot (model shapes)",
        "flashinfer:pcie_ipc        PcieIpcAllReduceWorkspace (flashinfer >= 0.7.2; eager only)",
        "flashinfer:mnnvl           multicast allreduce (needs --allow-multicast)",
    ],
    probe_specs=VARIANTS,
    packages=(DISTRIBUTION,),
)
