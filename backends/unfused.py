"""The unfused baseline of allreduce + residual add + RMSNorm.

``unfused:best`` does the same work as a fused kernel the way a serving engine does without
fusion: the fastest plain allreduce measured earlier in this run at that message size and
dtype (it declares reads_rows: the sweep runs it after the backends that do not and hands it
their rows), then torch's residual add and RMSNorm. In graph mode all three are captured in the
same CUDA graph, so the comparison with a fused kernel is call for call. Which allreduce backend it used, and that
backend's own time, are recorded on every row.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from commbench.backends.base import Backend, BackendFactory, BackendUnavailable, MakeOptions, reduce_into
from commbench import engines
from commbench.backends.fused import RMS_EPS, FusedBackend, residual_rmsnorm
from commbench.ops import ALLREDUCE
from commbench.results import OK, Measurement
from commbench.runtime.dtypes import dtype_name

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext
    from commbench.runtime.workload import Workload


def best_allreduce_rows(rows: list[Measurement], dtype: str, world_size: int) -> dict[int, Measurement]:
    """message_bytes -> the fastest correct plain allreduce row measured in this process.

    Graph-mode rows when there are any (decode runs in graphs), else eager rows. Rows measured
    under another process-level env (a driver run) cannot be rebuilt here and are left out.
    """
    candidates = [r for r in rows if r.op == ALLREDUCE and r.status == OK and r.dtype == dtype
                  and r.world_size == world_size and not r.env_setting and r.latency_us is not None
                  and r.backend.partition(":")[0] != UnfusedBest.family]
    graph = [r for r in candidates if r.mode == "graph"]
    chosen = graph or candidates
    best: dict[int, Measurement] = {}
    for row in chosen:
        current = best.get(row.message_bytes)
        if current is None or row.latency_us < current.latency_us:  # type: ignore[operator]
            best[row.message_bytes] = row
    return best


class UnfusedBest(FusedBackend):
    family = "unfused"
    name = "unfused:best"
    reads_rows = True

    def __init__(self, build: Callable[[str], Backend] | None):
        self._build = build
        self._inner: dict[str, Backend] = {}
        self._rows: tuple[Measurement, ...] = ()
        self._best: dict[int, Measurement] = {}
        self._current: Measurement | None = None
        self._summed: torch.Tensor | None = None

    def take_rows(self, rows: Sequence[Measurement]) -> None:
        self._rows = tuple(rows)

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        best = best_allreduce_rows(list(self._rows), dtype_name(dtype), ctx.world_size)
        self._best = {size: row for size, row in best.items() if size <= max_bytes}
        if not self._best:
            raise BackendUnavailable(
                f"no plain allreduce was measured correct at {dtype_name(dtype)} on {ctx.world_size} ranks "
                "in this run: nothing to build the unfused baseline from (run allreduce variants too)")
        # Every rank was handed the same rows, so every rank sets up the same backends in
        # the same order (their setups are collective).
        for name in sorted({row.backend for row in self._best.values()}):
            backend = self._inner.get(name) or self._rebuild(name)
            reason = backend.check(ctx)
            if reason:
                raise BackendUnavailable(f"allreduce backend {name} of the baseline cannot run: {reason}")
            backend.setup(ctx, max_bytes, dtype)
            self._inner[name] = backend
        self.graph_capturable = all(b.graph_capturable for b in self._inner.values())

    def _rebuild(self, name: str) -> Backend:
        """The allreduce behind a measured row's name, made the way the sweep made it."""
        if self._build is None:
            raise BackendUnavailable(f"cannot rebuild allreduce backend {name!r} for the unfused baseline "
                                     "outside a sweep")
        return self._build(name)

    def make_workload(self, ctx: "RunContext", count: int, dtype: torch.dtype,
                      shape: tuple[int, int] | None, pairs: int) -> "Workload":
        message_bytes = count * dtype.itemsize
        row = self._best.get(message_bytes)
        if row is None:
            raise BackendUnavailable(
                f"no plain allreduce was measured correct at {message_bytes} bytes {dtype_name(dtype)}: "
                "run the allreduce variants on the same shapes")
        self._current = row
        # An in-place allreduce (NCCL) consumes x, as it does in an engine's decoder layer.
        self.in_place = self._allreduce_backend().in_place
        self._summed = None if self.in_place else torch.empty(count, dtype=dtype, device=ctx.device)
        return super().make_workload(ctx, count, dtype, shape, pairs)

    def _allreduce_backend(self) -> Backend:
        assert self._current is not None, "make_workload() first"
        return self._inner[self._current.backend]

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        return self._allreduce_backend().allreduce(x, out)

    # The allreduce it delegates to is captured, and fails, as that backend's own calls do: a
    # kernel whose captured calls read buffers registered when its capture ends (p2p's graph
    # kernels, the engines' custom allreduce) needs its own graph_capture() around them.
    def graph_capture(self) -> AbstractContextManager[Any]:
        return self._allreduce_backend().graph_capture()

    def raise_if_failed(self) -> None:
        if self._current is not None:
            self._allreduce_backend().raise_if_failed()

    def allreduce_residual_rmsnorm(self, x: torch.Tensor, residual_in: torch.Tensor, gamma: torch.Tensor,
                                   residual_out: torch.Tensor, norm_out: torch.Tensor) -> None:
        # The sum is consumed at once by the add on the same stream, so one buffer serves every call.
        summed = x if self._summed is None else self._summed[: x.numel()].view(x.shape)
        summed = reduce_into(self._allreduce_backend(), x, summed)
        residual_rmsnorm(summed, residual_in, gamma, RMS_EPS, residual_out, norm_out)

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engines.none_selects(self.name, engines.UNFUSED_BASELINE)

    def row_fields(self) -> dict[str, Any]:
        """Describes the row of the latest make_workload(): the allreduce used and its own time."""
        if self._current is None:
            return {}
        return {"extra": {"allreduce_backend": self._current.backend,
                          "allreduce_mode": self._current.mode,
                          "allreduce_us": self._current.latency_us}}

    def close(self) -> None:
        for backend in self._inner.values():
            backend.close()
        self._inner.clear()
        self._best.clear()
        self._current = None
        self._summed = None


def make(variant: str | None, options: MakeOptions[None]) -> list[Backend]:
    if variant is None:
        # Only model-shape sweeps have fused work to compare against.
        return [UnfusedBest(options.build)] if options.sweep.hidden else []
    if variant != "best":
        from commbench.errors import UsageError

        raise UsageError(f"unfused: unknown variant {variant!r}; choose 'best'")
    return [UnfusedBest(options.build)]


FACTORY = BackendFactory(
    family="unfused",
    make=make,
    on_gpu_by_default=True,
    summary="unfused baseline of allreduce + residual add + RMSNorm (best measured allreduce, then torch)",
    variants_help=["unfused:best   fastest plain allreduce measured in this run + torch add + rms_norm"],
    trace_kernels_of="",
)
