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

import argparse
import importlib
import inspect
import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from commbench import engines
from commbench.backends.base import Backend, BackendFactory, BackendUnavailable, MakeOptions, voted, voted_gather
from commbench.backends.fused import RMS_EPS, TOLERANCE, FusedBackend
from commbench.runtime.context import own_sms

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

DISTRIBUTION = "flashinfer-python"
INSTALL_HINT = "pip install 'commbench[flashinfer]'"
MIN_VERSION = (0, 6)            # create_allreduce_fusion_workspace / allreduce_fusion
TRTLLM_WORLD_SIZES = (2, 4, 8, 16)
TRTLLM_SM_MAJORS = (9, 10, 12)
MNNVL_SM_MAJORS = (9, 10)
PCIE_WORLD_SIZES = (2, 4, 8)    # pcie_ipc_ar._SUPPORTED_WORLD_SIZES
PCIE_DTYPES = (torch.bfloat16, torch.float16)
PCIE_PACK_BYTES = 16            # pcie_ipc_collectives._constants.PACK_BYTES
PCIE_TUNE_DIR = "flashinfer-pcie-ipc"   # tune caches, inside the run dir
PLAIN_HIDDEN = 4096             # elements per token when a plain size is reshaped
BYTES_PER_ACCESS = 16           # the kernels load 16 bytes per thread: hidden must be a multiple
WORKSPACE_ROW = 256             # workspace sized as rows of this many elements (only the product counts)
BARRIER_FLAGS = 256             # trtllm_ar.BarrierFlagCount, for the allocation probe


@dataclass(frozen=True)
class FlashinferOptions:
    """The flashinfer family's flags, read once."""

    pcie_tune: bool = True    # --flashinfer-pcie-tune measure (True) or seed (False)
    pdl: bool = True          # --flashinfer-pdl on (True) or off


FlashinferMake = MakeOptions[FlashinferOptions]   # what make() hands this family

# Kernel names this family's allreduce leaves in a profiler trace, read by `commbench attribute`
# with ast, without importing this module (docs/attribute.md): (regex searched in the demangled
# name, library, regex over this family's run variants that are its floor, note).
# FlashInfer csrc/ and include/flashinfer/comm/: trtllm_allreduce_fusion.cuh (fusion kernels,
# template Pattern: 0 plain allreduce, else + residual/RMSNorm), trtllm_moe_allreduce_fusion.cuh,
# trtllm_mnnvl_allreduce.cuh, trtllm_allreduce.cuh (legacy), flashinfer/comm/pcie_ipc_* (PCIe IPC).
TRACE_KERNELS = (
    (r"\bflashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport\b", "FlashInfer TRT-LLM fusion one-shot",
     r"^flashinfer:trtllm_oneshot$", "a fused pattern also adds the residual and RMSNorm"),
    (r"\bflashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync\b", "FlashInfer TRT-LLM fusion two-shot",
     r"^flashinfer:trtllm_twoshot$", "a fused pattern also adds the residual and RMSNorm"),
    (r"\bmoereduce_allreduce_fusion_kernel", "FlashInfer MoE allreduce fusion", "", ""),
    (r"\b(oneshotAllreduceFusionKernel|twoshotAllreduceKernel|rmsNormLamport)\b", "FlashInfer MNNVL",
     r"^flashinfer:mnnvl$", ""),
    (r"\btrtllm_allreduce::\w*(oneShotAllReduceKernel|twoShotAllReduceKernel|lamport_style_one_shot_all_reduce)",
     "FlashInfer legacy TRT-LLM allreduce", "", ""),
    (r"\bflashinfer::comm::pcie_ipc::", "FlashInfer PCIe IPC", r"^flashinfer:pcie_ipc$", ""),
)
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)   # trtllm_ar.MAX_COMM_SIZE (2145386496): Lamport buffer cap
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
    world_sizes = TRTLLM_WORLD_SIZES
    sm_majors: tuple[int, ...] = TRTLLM_SM_MAJORS

    def __init__(self) -> None:
        self._world_size = 0

    def software_reason(self) -> str | None:
        return import_reason()

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


class _TrtllmWorkspaceBackend(_FlashInferBase):
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


def pcie_shapes(message_bytes: Iterable[int], itemsize: int, hidden: int | None) -> list[tuple[int, int]]:
    """The (tokens, hidden) shapes PCIe IPC will reduce for these message sizes, sorted: model
    shapes keep their hidden, plain sizes are reshaped like every FlashInfer variant's."""
    shapes = set()
    for nbytes in message_bytes:
        count = nbytes // itemsize
        shapes.add((count // hidden, hidden) if hidden and count % hidden == 0 else plain_shape(count))
    return sorted(shapes)


def pcie_admits(world_size: int, numel: int, itemsize: int) -> bool:
    """pcie_ipc_policy._admits: whole 16-byte packs and at least one pack per rank."""
    pack = PCIE_PACK_BYTES // itemsize
    return world_size in PCIE_WORLD_SIZES and numel % pack == 0 and numel >= pack * world_size


def pcie_tune_plan(shapes: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(hiddens, batches) for ``tune(hiddens)`` and the workspace's ``tune_batches``: one bucket
    per token count the run will capture, so every row's shape is measured, none inferred from a
    neighbouring bucket (buckets map downwards)."""
    return tuple(sorted({h for _, h in shapes})), tuple(sorted({t for t, _ in shapes}))


def pcie_max_blocks(default_blocks: int, sms_by_rank: list[int], shares_gpu: bool) -> tuple[int, str | None]:
    """The workspace's ``max_blocks`` and why it differs from FlashInfer's default (None: it does
    not). PCIe IPC's kernels wait for their peers' blocks with no timeout (block_barrier), so a
    grid should be resident at once; the default (128) fits a GPU of one's own. Ranks that share
    a GPU each count on part of its SMs (sms_by_rank, runtime.context.own_sms), so the grid is capped
    at one block per SM of the smallest part: the kernels are built with __launch_bounds__(1024, 1),
    which promises one 1024-thread block per SM and no more (ptxas on 0.7.4's: 26 registers a
    thread for the 2-rank kernels, 42-64 for the 4- and 8-rank ones, i.e. one such block per SM)."""
    sms = min(sms_by_rank)
    if not shares_gpu or sms >= default_blocks:
        return default_blocks, None
    return sms, (f"ranks share a GPU: one block per SM a rank may count on ({sms}; FlashInfer's default is "
                 f"{default_blocks}), so that every block of every rank is resident at once")


PROFILE_FAILURE = "due to failure while profiling: "   # the autotuner's DEBUG line for a candidate that raised


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("[Autotuner]: Skipping tactic") and PROFILE_FAILURE in message:
            self.errors.append(message.split(PROFILE_FAILURE, 1)[1])


def _set_level(logger: logging.Logger, level: int) -> None:
    # FlashInfer's logger is built directly, not by logging.getLogger, so setLevel cannot reach
    # its cache of isEnabledFor answers: clear it, or an earlier answer outlives the new level.
    logger.setLevel(level)
    getattr(logger, "_cache", {}).clear()


@contextmanager
def profiling_failures(logger: logging.Logger) -> Iterator[list[str]]:
    """The errors of the candidates FlashInfer's autotuner failed to profile, collected while the
    block runs: it says why only at DEBUG, so the logger goes to DEBUG for the block while its
    own handlers keep printing what they printed before."""
    collect = _Collect()
    saved_level = logger.level
    saved_handlers = [(handler, handler.level) for handler in logger.handlers]
    for handler, level in saved_handlers:
        handler.setLevel(max(level, logger.getEffectiveLevel()))
    logger.addHandler(collect)
    _set_level(logger, logging.DEBUG)
    try:
        yield collect.errors
    finally:
        logger.removeHandler(collect)
        _set_level(logger, saved_level)
        for handler, level in saved_handlers:
            handler.setLevel(level)


PROFILE_ERROR_CHARS = 1000     # per distinct error kept on a row: a failed JIT build's is ninja's whole output


def clip(text: str, limit: int = PROFILE_ERROR_CHARS) -> str:
    """The text, or its start and end when longer than limit (a compiler's first error comes
    first, ninja's verdict last)."""
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


def failure_summary(errors: list[str]) -> dict[str, Any]:
    """How many candidate profiles failed, and the distinct errors (the first three, clipped)."""
    return {"profile_failures": len(errors), "profile_errors": [clip(e) for e in list(dict.fromkeys(errors))[:3]]}


def saved_configs(cache: str | None) -> int | None:
    """How many tuned configurations FlashInfer's tune cache holds (its keys other than the
    ``_metadata``-style ones); 0 when it wrote none or no file. None without a path of ours:
    FlashInfer's default file may hold other runs' entries, so its count would not say what
    this tuning kept."""
    if cache is None:
        return None
    try:
        table = json.loads(Path(cache).read_text())
    except (OSError, ValueError):
        return 0
    return sum(1 for key in table if not key.startswith("_")) if isinstance(table, dict) else 0


def describe_config(config: Any) -> str | None:
    """An IpcLaunchConfig (blocks, threads, variant) as one short string; None if unsupported."""
    if config is None:
        return None
    variant = getattr(config.variant, "name", config.variant)
    return f"{variant} blocks={config.blocks} threads={config.threads}"


def launch_choice(config: Any, seed: Any) -> dict[str, Any]:
    """A shape's row fields: the configuration it runs, the seed, and whether they are one.
    tune() hands back the seed for a bucket whose every candidate failed, so "runs the seed" is
    what holds whether the seed won or nothing did."""
    ran, seeded = describe_config(config), describe_config(seed)
    return {"pcie_ipc_config": ran, "pcie_ipc_seed": seeded, "pcie_ipc_runs_seed": ran == seeded}


class PcieIpcAllreduce(_FlashInferBase):
    """FlashInfer's PCIe IPC allreduce (for GPUs without NVLink), tuned per size bucket.

    FlashInfer's seed launch configurations are "workable rather than fast" (pcie_ipc_policy;
    vLLM warns its untuned seed was slower than NCCL at TP4), and the workspace warns when it
    runs them. So setup builds the workspace with ``tune_batches`` = the token counts of this
    run's shapes, calls ``tune(hiddens)`` (collective: every candidate is checked for the right
    answer, timed with TUNE_WARMUP/TUNE_REPEAT = 10/50 calls, the ranks agree over a gloo
    group) and then ``prepare(shapes)``, which resolves each shape's configuration ahead of
    time: a shape first met inside a capture would need a host-side collective and fails to
    capture, a prepared one captures no collective (``_check_stream`` exempts capture). The
    tuned table is saved as ``RUN/flashinfer-pcie-ipc/w<N>-<dtype>.json`` (``tune_cache``).
    Where ranks share a GPU, ``max_blocks`` is capped to what a rank's SMs hold (pcie_max_blocks;
    the row's ``pcie_ipc_tuning`` says so). ``--flashinfer-pcie-tune seed`` skips the tuning, to
    measure FlashInfer's seed policy."""

    name = "flashinfer:pcie_ipc"
    world_sizes = PCIE_WORLD_SIZES
    needs = ("cuda", "node", "p2p", "ipc")     # cudaMalloc + cudaIpcGetMemHandle buffers, no cuMemCreate

    def __init__(self, options: FlashinferMake) -> None:
        super().__init__()
        self._hidden: int | None = options.sweep.hidden
        self._planned_bytes: list[int] = list(options.sweep.message_bytes)
        self._run_dir: Path | None = options.sweep.run_dir
        self.tune = options.own.pcie_tune
        self._workspace: Any = None
        self._itemsize = 2
        self._tuning: dict[str, Any] = {}
        self._choices: dict[tuple[int, int], dict[str, Any]] = {}
        self._stream: Any = None       # the stream of the last eager call

    def software_reason(self) -> str | None:
        reason = super().software_reason()
        if reason is None and not hasattr(importlib.import_module("flashinfer.comm"), "PcieIpcAllReduceWorkspace"):
            return (f"flashinfer-python {metadata.version(DISTRIBUTION)} has no PcieIpcAllReduceWorkspace "
                    "(added in 0.7.2)")
        return reason

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engines.pcie_ipc(self.name, [])

    def _shape(self, message_bytes: int) -> tuple[int, int]:
        return pcie_shapes([message_bytes], self._itemsize, self._hidden)[0]

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        if dtype not in PCIE_DTYPES:
            return "PCIe IPC allreduce takes bf16 and fp16 only"
        count = message_bytes // dtype.itemsize
        if not pcie_admits(self._world_size or 2, count, dtype.itemsize):
            pack = PCIE_PACK_BYTES // dtype.itemsize
            return (f"PCIe IPC needs whole 16-byte packs and at least one per rank "
                    f"({count} elements, {pack} per pack, {self._world_size} ranks)")
        return None

    def _cache_path(self, world_size: int, dtype: torch.dtype) -> str | None:
        if self._run_dir is None:
            return None     # FlashInfer's default: FLASHINFER_AUTOTUNE_DIR or its workspace dir
        return str(Path(self._run_dir) / PCIE_TUNE_DIR / f"w{world_size}-{str(dtype).replace('torch.', '')}.json")

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        self.close()
        comm = importlib.import_module("flashinfer.comm")
        self._itemsize = dtype.itemsize
        planned = [b for b in self._planned_bytes if b <= max_bytes] or [max_bytes]
        shapes = [s for s in pcie_shapes(planned, dtype.itemsize, self._hidden)
                  if pcie_admits(ctx.world_size, s[0] * s[1], dtype.itemsize)]
        if not shapes:
            raise BackendUnavailable("no planned size is one PCIe IPC admits (whole 16-byte packs, one per rank)")
        hiddens, batches = pcie_tune_plan(shapes)
        cache = self._cache_path(ctx.world_size, dtype)
        # Sized to the largest shape: the epoch double buffer's halves sit world * max_numel
        # elements apart, and FlashInfer warns that an oversized workspace costs time.
        max_numel = max(t * h for t, h in shapes)
        sms = voted_gather(ctx, "SM count", lambda: own_sms(
            torch.cuda.get_device_properties(ctx.device).multi_processor_count, ctx.emulation))
        default_blocks = inspect.signature(comm.PcieIpcAllReduceWorkspace).parameters["max_blocks"].default
        max_blocks, max_blocks_reason = pcie_max_blocks(default_blocks, sms, ctx.emulation is not None)
        # The constructor validates jointly on every rank and raises on all of them together.
        self._workspace = comm.PcieIpcAllReduceWorkspace(
            group=ctx.control_group, max_numel=max_numel, dtype=dtype, max_blocks=max_blocks, tune_batches=batches,
            tune_cache=cache)
        # tune() returns {(hidden, batch): config} for what it measured; what it saved is in the file.
        measured: dict[tuple[int, int], Any] = {}
        failures: list[str] = []
        if self.tune:
            with profiling_failures(importlib.import_module("flashinfer.jit.core").logger) as failures:
                measured = self._workspace.tune(list(hiddens), dtype=dtype, cache=cache)
        resolved = self._workspace.prepare(shapes, dtype=dtype)
        policy = importlib.import_module("flashinfer.comm.pcie_ipc_policy")
        self._choices = {
            shape: launch_choice(config, policy.get_pcie_ipc_launch_config(
                ctx.world_size, shape[0] * shape[1], dtype.itemsize, self._workspace.max_blocks))
            for shape, config in resolved.items()}
        self._tuning = {"tuned": self.tune, "tune_cache": cache, "tune_batches": list(batches),
                        "tune_hiddens": list(hiddens), "max_numel": max_numel,
                        "max_blocks": max_blocks, "max_blocks_reason": max_blocks_reason,
                        "profile": self._workspace.profile,
                        "tune_result": {f"{batch}x{hidden}": describe_config(config)
                                        for (hidden, batch), config in sorted(measured.items())},
                        "saved_configs": saved_configs(cache) if self.tune else None,
                        **(failure_summary(failures) if self.tune else {})}

    def observe(self, call: Any, message_bytes: int) -> dict[str, Any]:
        choice = self._choices.get(self._shape(message_bytes))
        if choice is None:      # not in the setup's plan: resolved by the first (eager) call
            choice = {"pcie_ipc_config": "resolved lazily by FlashInfer (shape not in the tuned plan)"}
        return {"extra": {**choice, "pcie_ipc_shape": list(self._shape(message_bytes))}}

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        assert self._workspace is not None, "setup() first"
        self._follow_stream(x.device)
        tokens, hidden = self._shape(x.numel() * x.element_size())
        self._workspace.all_reduce(x.view(tokens, hidden), out=out.view(tokens, hidden))

    def _follow_stream(self, device: torch.device) -> None:
        """A workspace serves one stream and refuses a call from another (0.7.4's bind_stream),
        but graph capture warms up on a side stream first. Calls from a new stream are first
        ordered after everything queued on the old one, which is what rebind_stream() asks of
        its caller; capture itself is exempt and binds nothing."""
        if torch.cuda.is_current_stream_capturing():
            return
        current = torch.cuda.current_stream(device)
        if self._stream is not None and current != self._stream:
            current.wait_stream(self._stream)
            self._workspace.rebind_stream()
        self._stream = current

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"pcie_ipc_tuning": dict(self._tuning)}} if self._tuning else {}

    def close(self) -> None:
        if self._workspace is not None:
            self._workspace.destroy()
        self._workspace = None
        self._choices = {}
        self._stream = None


VARIANTS = ("trtllm_oneshot", "trtllm_twoshot", "fused_oneshot", "fused_twoshot", "pcie_ipc", "mnnvl")


def _build(variant: str, options: FlashinferMake) -> Backend:
    if variant.startswith("trtllm_"):
        return TrtllmAllreduce(variant.endswith("oneshot"), options)
    if variant.startswith("fused_"):
        return TrtllmFused(variant.endswith("oneshot"), options)
    if variant == "pcie_ipc":
        return PcieIpcAllreduce(options)
    return MnnvlAllreduce(options)


def make(variant: str | None, options: FlashinferMake) -> list[Backend]:
    if variant is None:
        # The fused variants only make sense on model shapes.
        names = [v for v in VARIANTS if options.sweep.hidden or not v.startswith("fused_")]
        return [_build(v, options) for v in names]
    if variant not in VARIANTS:
        from commbench.errors import UsageError

        raise UsageError(f"flashinfer: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return [_build(variant, options)]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--flashinfer-pcie-tune", choices=("measure", "seed"), default="measure",
                       help="flashinfer:pcie_ipc: tune every size bucket at setup (measure, the default) or run "
                            "FlashInfer's untuned seed configurations (seed)")
    group.add_argument("--flashinfer-pdl", choices=("on", "off"), default="on",
                       help="flashinfer trtllm and fused variants: launch with programmatic dependent launch "
                            "(on, the default, as vLLM and SGLang serve) or without it (off), to see what it saves")


def read_options(args: argparse.Namespace) -> FlashinferOptions:
    return FlashinferOptions(pcie_tune=args.flashinfer_pcie_tune == "measure", pdl=args.flashinfer_pdl == "on")


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
        "flashinfer:pcie_ipc        PcieIpcAllReduceWorkspace, tuned per size bucket at setup (flashinfer >= 0.7.2)",
        "flashinfer:mnnvl           multicast allreduce (needs --allow-multicast)",
    ],
    probe_specs=VARIANTS,
    packages=(DISTRIBUTION,),
    add_arguments=add_arguments, read_options=read_options,
)
