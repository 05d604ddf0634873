"""NCCL called directly on torch tensors through nccl4py, NVIDIA's Python bindings (optional).

No torch ProcessGroup: rank 0 makes an NCCL unique id (``nccl.core.get_unique_id()``), the
gloo control group broadcasts its bytes, every rank joins with
``nccl.core.Communicator.init(nranks, rank, UniqueId.from_bytes(...))`` (ncclCommInitRankScalable)
and each call is ``comm.allreduce(x, x, nccl.core.SUM, stream=<torch's current stream>)`` (API
of nccl4py 0.6.0, bindings/nccl4py in NVIDIA/nccl; the package installs as ``nccl.core``).

It reduces in place, as torch's ProcessGroupNCCL does, so on the same NCCL its eager gap to
``nccl`` is the cost of each wrapper per call (nccl4py resolves the tensors' pointers, count,
dtype and device in Python on every call; torch's ProcessGroupNCCL does its bookkeeping in
C++); inside a CUDA graph that cost is paid once at capture. Rows record the nccl4py version
and the NCCL it calls, as that library reports itself (``nccl.core.get_version()``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from dataclasses import dataclass
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable

import torch

from commbench import engines
from commbench.backends.base import Backend, BackendFactory, BackendUnavailable, MakeOptions, Requires, voted
from commbench.backends.nccl.backend import logged_calls, nccl_log_dir, unlogged_reason
from commbench.topology.nccl_log import logged_choice, process_nccl, process_switch, read_lines
from commbench.errors import UsageError

if TYPE_CHECKING:
    from pathlib import Path

    from commbench.runtime.context import RunContext

REQUIRES = Requires("nccl4py", "nccl.core", "pip install nccl4py")
NO_ENGINE = ("no serving engine calls nccl4py; the nearest is vLLM's pynccl, its own ctypes wrapper of libnccl "
             "on torch's stream")


def library_facts(nccl: Any) -> dict[str, Any]:
    """nccl4py's version and the libnccl it calls, as nccl.core.get_version() reports them."""
    info = nccl.get_version()
    facts: dict[str, Any] = {"nccl4py": str(info.nccl4py), "nccl4py_bindings": str(info.nccl_bindings)}
    lib = info.libnccl
    facts["nccl_version_loaded"] = str(lib.version) if lib is not None else None
    facts["nccl_lib_loaded"] = str(lib.path) if lib is not None and lib.path is not None else None
    return facts


class Nccl4pyAllreduce(Backend):
    family = "nccl4py"
    name = "nccl4py"
    needs = ("cuda", "own_gpu")       # NCCL refuses two ranks on one GPU
    in_place = True                   # as torch's ProcessGroupNCCL: the gap to nccl is the wrapper
    graph_capturable = True
    requires = REQUIRES

    def __init__(self, log_dir: "Path | None" = None):
        self.log_dir = log_dir
        self._nccl: Any = None
        self._comm: Any = None
        self._sum: Any = None
        self._facts: dict[str, Any] = {}
        self._observed_by: str | None = "set up first"
        self._passes = 0

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engines.none_selects(self.name, NO_ENGINE)

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        if self._comm is not None:
            return   # one communicator serves every dtype
        nccl = voted(ctx, "importing nccl4py", lambda: importlib.import_module(REQUIRES.module))
        uid = voted(ctx, "nccl4py get_unique_id on rank 0",
                    lambda: bytes(nccl.get_unique_id()) if ctx.rank == 0 else None)
        uid = ctx.broadcast_object(uid)
        self._comm = voted(ctx, "nccl4py Communicator.init", lambda: nccl.Communicator.init(
            nranks=ctx.world_size, rank=ctx.rank, unique_id=nccl.UniqueId.from_bytes(uid)))
        self._nccl, self._sum = nccl, nccl.SUM
        probe = torch.ones(4, device=ctx.device)
        self.allreduce(probe, probe)
        torch.cuda.synchronize()
        if float(probe[0]) != ctx.world_size:
            raise BackendUnavailable(f"first nccl4py allreduce returned {float(probe[0])}, expected {ctx.world_size}")
        self._facts = library_facts(nccl)
        self._observed_by = self._why_not_observed(ctx)

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self._comm.allreduce(x, out, self._sum, stream=torch.cuda.current_stream().cuda_stream)

    def row_fields(self) -> dict[str, Any]:
        return {"extra": dict(self._facts)}

    def _why_not_observed(self, ctx: "RunContext") -> str | None:
        """Why this rank reads no NCCL choice: commbench's log switch controls the libnccl the
        process mapped first, so nccl4py's calls are observed only when they go to that one."""
        reason = unlogged_reason(self.log_dir, ctx)
        if reason:
            return reason
        mapped = process_nccl().path
        if self._facts.get("nccl_lib_loaded") not in (None, mapped):
            return f"nccl4py calls {self._facts['nccl_lib_loaded']}, commbench's log switch controls {mapped}"
        return process_switch().unavailable

    def observe(self, call: Callable[[], None], message_bytes: int) -> dict[str, Any]:
        if self.log_dir is None or self._comm is None or self._comm.nranks == 1:
            return {"nccl_observed": self._observed_by}   # alike on every rank: none of them calls
        self._passes += 1
        log_file = self.log_dir / f"nccl4py.{message_bytes}B.{self._passes}.log" if self._observed_by is None else None
        logged_calls(call, process_switch().logging_to(log_file) if log_file is not None else nullcontext())
        if log_file is None:
            return {"nccl_observed": self._observed_by}
        return logged_choice(read_lines(log_file), message_bytes, log_file)

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()   # every rank closes: NCCL's destroy is collective within a node
            self._comm = None


@dataclass(frozen=True)
class Nccl4pyOptions:
    log: bool = True    # the nccl family's --no-nccl-log covers NCCL called through nccl4py too


def read_options(args: argparse.Namespace) -> Nccl4pyOptions:
    return Nccl4pyOptions(log=not getattr(args, "no_nccl_log", False))   # absent: the nccl family is not loaded


def make(variant: str | None, options: MakeOptions[Nccl4pyOptions]) -> list[Backend]:
    if variant is not None:
        raise UsageError(f"nccl4py: unknown variant {variant!r}; the family has one variant, nccl4py")
    return [Nccl4pyAllreduce(nccl_log_dir(options.sweep.run_dir, options.own.log))]


FACTORY = BackendFactory(
    family="nccl4py",
    make=make,
    summary="NCCL called on torch tensors through nccl4py (NVIDIA's Python bindings), no torch ProcessGroup "
            "(optional: pip install nccl4py)",
    variants_help=["nccl4py             Communicator.init over the control group, allreduce in place on torch's stream"],
    packages=("nccl4py",),
    read_options=read_options,
    trace_kernels_of="nccl",
)
