"""FlashInfer's PCIe IPC allreduce (flashinfer:pcie_ipc) and its tuner: the shapes a run will reduce, the
buckets tuned at setup and the grid cap where ranks share a GPU."""

from __future__ import annotations

import importlib
import inspect
import json
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

from commbench import engines
from commbench.backends.base import BackendUnavailable, voted_gather
from commbench.backends.flashinfer.autotune_log import describe_config, failure_summary, launch_choice, \
    profiling_failures, saved_configs
from commbench.backends.flashinfer.common import (DISTRIBUTION, PCIE_DTYPES, PCIE_PACK_BYTES, PCIE_TUNE_DIR,
                                                  PCIE_WORLD_SIZES, FlashinferMake, FlashInferBase, plain_shape)

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext


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


class PcieIpcAllreduce(FlashInferBase):
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
        sms = voted_gather(ctx, "SM count", lambda: ctx.resident_sms)
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
