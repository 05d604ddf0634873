"""NCCL through torch's ProcessGroupNCCL, one new process group per protocol x algorithm variant.

NCCL reads NCCL_PROTO and NCCL_ALGO at every communicator init, so each variant sets them,
creates a fresh group and forces its communicator to initialise before restoring the
environment. Process-level knobs (NCCL_NTHREADS, NCCL_BUFFSIZE, NCCL_MAX_CTAS, ...) are read
once per process: those are swept by the driver (`commbench sweep --nproc N --env ...`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

from commbench.backends.base import (Backend, BackendFactory, BackendUnavailable, ProcessGroupBackend,
                                     parse_variant_options)
from commbench.context import RunContext
from commbench.errors import UsageError
from commbench.nccl_log import NcclLogReader, canonical_algo, canonical_proto, used_algo_proto

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("Ring", "Tree", "NVLS", "NVLSTree", "PAT", "CollnetDirect", "CollnetChain")
MULTICAST_ALGORITHMS = ("NVLS", "NVLSTree")


def _normalise(values: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    by_lower = {a.lower(): a for a in allowed}
    out = []
    for value in values:
        if value.lower() not in by_lower:
            raise UsageError(f"unknown NCCL {what} {value!r}: choose from {', '.join(allowed)}")
        out.append(by_lower[value.lower()])
    return out


class NcclBackend(ProcessGroupBackend):
    family = "nccl"
    graph_capturable = True

    def __init__(self, proto: str | None = None, algo: str | None = None, log: NcclLogReader | None = None):
        self.proto = proto
        self.algo = algo
        parts = [f"proto={proto}" if proto else "", f"algo={algo}" if algo else ""]
        variant = ",".join(p for p in parts if p)
        self.name = f"nccl:{variant}" if variant else "nccl"
        self.log = log
        self.unsafe: str | None = None
        self._log_lines: list[str] = []

    def check(self, ctx: RunContext) -> str | None:
        if not ctx.is_cuda:
            return "NCCL needs CUDA GPUs; this run is on the CPU"
        if ctx.shares_gpus:
            return "NCCL refuses two ranks on one GPU and these ranks share a GPU"
        if self.algo in MULTICAST_ALGORITHMS and ctx.multicast_reason:
            return f"NCCL {self.algo} uses NVLink multicast: {ctx.multicast_reason}"
        return super().check(ctx)

    def setup(self, ctx: RunContext, max_bytes: int, dtype: torch.dtype) -> None:
        if self.group is not None:
            return  # one communicator serves every dtype
        self.unsafe = _unsafe_reason(self.name, ctx)
        with _environment({"NCCL_PROTO": self.proto, "NCCL_ALGO": self.algo}):
            self.group = dist.new_group(backend="nccl")
            # The communicator is created lazily at the first collective: do one now, while
            # the variant's environment is in place.
            probe = torch.ones(4, device=ctx.device)
            dist.all_reduce(probe, group=self.group)
            torch.cuda.synchronize()
        if float(probe[0]) != ctx.world_size:
            raise BackendUnavailable(f"first NCCL allreduce returned {float(probe[0])}, expected {ctx.world_size}")

    def row_fields(self) -> dict[str, Any]:
        return {"nccl_proto_requested": self.proto, "nccl_algo_requested": self.algo, "unsafe": self.unsafe}

    def observed_fields(self, message_bytes: int) -> dict[str, Any]:
        if self.log is None:
            return {}
        self._log_lines.extend(self.log.new_lines())
        algo, proto = used_algo_proto(self._log_lines, message_bytes)
        self._log_lines.clear()
        if algo is None:
            return {}
        applied = ((self.proto is None or canonical_proto(self.proto) == proto)
                   and (self.algo is None or canonical_algo(self.algo) == algo))
        return {"nccl_algo_used": algo, "nccl_proto_used": proto, "setting_applied": applied}


@contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) variables for the duration of the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}

    def apply(settings: dict[str, str | None]) -> None:
        for key, value in settings.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    apply(values)
    try:
        yield
    finally:
        apply(saved)


def _unsafe_reason(name: str, ctx: RunContext) -> str | None:
    """LL128 forced on a machine without NVLink can corrupt data (NCCL env docs)."""
    if "LL128" not in name or ctx.snapshot is None:
        return None
    try:
        from commbench.topology.verdicts import nccl_unsafe_reason
    except ImportError:
        return None
    return nccl_unsafe_reason(name, ctx.snapshot)


def make(variant: str | None, options: dict[str, Any]) -> list[Backend]:
    log = options.get("nccl_log")
    if variant:
        opts = parse_variant_options(variant)
        unknown = set(opts) - {"proto", "algo"}
        if unknown:
            raise UsageError(f"unknown nccl option {sorted(unknown)[0]!r}: use nccl:proto=P,algo=A")
        proto = _normalise([opts["proto"]], PROTOCOLS, "protocol")[0] if "proto" in opts else None
        algo = _normalise([opts["algo"]], ALGORITHMS, "algorithm")[0] if "algo" in opts else None
        return [NcclBackend(proto, algo, log)]
    protos = _normalise(options.get("nccl_proto") or [], PROTOCOLS, "protocol")
    algos = _normalise(options.get("nccl_algo") or [], ALGORITHMS, "algorithm")
    variants: list[Backend] = [NcclBackend(log=log)]
    for proto in protos or [None]:
        for algo in algos or [None]:
            if proto or algo:
                variants.append(NcclBackend(proto, algo, log))
    return variants


FACTORY = BackendFactory(
    family="nccl", make=make, on_gpu_by_default=True, on_cpu_by_default=False,
    summary="NCCL via torch ProcessGroupNCCL; --nccl-proto/--nccl-algo sweep the protocol x algorithm matrix",
    variants_help=["nccl", "nccl:proto=LL", "nccl:proto=LL128,algo=Ring"],
)
