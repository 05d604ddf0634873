"""NCCL through torch's ProcessGroupNCCL, one new process group per protocol x algorithm variant.

NCCL reads NCCL_PROTO and NCCL_ALGO at every communicator init, so each variant sets them,
creates a fresh group and forces its communicator to initialise before restoring the
environment. Process-level knobs (NCCL_NTHREADS, NCCL_BUFFSIZE, NCCL_MAX_CTAS, ...) are read
once per process: those are swept by the driver (`commbench sweep --nproc N --env ...`).
What NCCL chose is read from its log, which rank 0 switches on only around that init and
around observe()'s untimed calls (commbench.backends.nccl_log).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from commbench.backends.base import (Backend, BackendFactory, BackendUnavailable, ProcessGroupBackend,
                                     parse_variant_options)
from commbench.sweep.context import RunContext
from commbench.errors import UsageError
from commbench.backends.nccl_log import (ALGORITHMS, PROTOCOLS, InitEvidence, process_switch, read_lines, setting_applied,
                                used_algo_proto)

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

    def __init__(self, proto: str | None = None, algo: str | None = None, log_dir: Path | None = None):
        self.proto = proto
        self.algo = algo
        parts = [f"proto={proto}" if proto else "", f"algo={algo}" if algo else ""]
        variant = ",".join(p for p in parts if p)
        self.name = f"nccl:{variant}" if variant else "nccl"
        self.log_dir = log_dir
        self.unsafe: str | None = None
        self._observe_calls = False       # alike on every rank, so every rank makes the same calls
        self._not_observed: str | None = None
        self._init = InitEvidence()
        self._passes = 0

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
        self._observe_calls = self.log_dir is not None and ctx.world_size > 1
        self._not_observed = self._why_not_observed(ctx)
        init_log = self._log_file("init")
        with _environment({"NCCL_PROTO": self.proto, "NCCL_ALGO": self.algo}), self._logging(init_log):
            self.group = dist.new_group(backend="nccl")
            # The communicator is created lazily at the first collective: do one now, while
            # the variant's environment is in place (and its init is logged).
            probe = torch.ones(4, device=ctx.device)
            dist.all_reduce(probe, group=self.group)
            torch.cuda.synchronize()
        if float(probe[0]) != ctx.world_size:
            raise BackendUnavailable(f"first NCCL allreduce returned {float(probe[0])}, expected {ctx.world_size}")
        if init_log is not None:
            self._init = InitEvidence.from_lines(read_lines(init_log))

    def row_fields(self) -> dict[str, Any]:
        return {"nccl_proto_requested": self.proto, "nccl_algo_requested": self.algo, "unsafe": self.unsafe}

    def observe(self, call: Callable[[], None], message_bytes: int) -> dict[str, Any]:
        if not self._observe_calls:
            return {"nccl_observed": self._not_observed}
        self._passes += 1
        log_file = self._log_file(f"{message_bytes}B.{self._passes}")
        with self._logging(log_file):
            # Two calls, so what is recorded is a choice NCCL repeats (the most common one wins).
            call()
            call()
            torch.cuda.synchronize()
        if log_file is None:
            return {"nccl_observed": self._not_observed}
        algo, proto = used_algo_proto(read_lines(log_file), message_bytes)
        if algo is None or proto is None:
            return {"nccl_observed": f"NCCL logged no 'AllReduce: {message_bytes} Bytes -> Algo' line ({log_file})"}
        requested = {var: value for var, value in (("NCCL_PROTO", self.proto), ("NCCL_ALGO", self.algo)) if value}
        verdict = setting_applied(requested, {"NCCL_PROTO": proto, "NCCL_ALGO": algo}, self._init)
        return {"nccl_algo_used": algo, "nccl_proto_used": proto, "setting_applied": verdict}

    def _why_not_observed(self, ctx: RunContext) -> str | None:
        """Why this rank records no NCCL choice; None where it logs and reads them."""
        if self.log_dir is None:
            return "NCCL's log was not asked for (--no-nccl-log)"
        if ctx.world_size == 1:
            return "world size 1: NCCL's tuner chooses no algorithm and logs none"
        if ctx.rank != 0:
            return "NCCL logs its choices on comm rank 0 only"
        return process_switch().unavailable

    def _log_file(self, step: str) -> Path | None:
        """Where this rank's NCCL logs `step`; None where nothing is logged."""
        if self.log_dir is None or self._not_observed is not None:
            return None
        variant = re.sub(r"[^\w=-]+", "_", self.name)
        # The pid keeps the children of one --env sweep, which share the run dir, apart.
        return self.log_dir / f"{variant}.{step}.pid{os.getpid()}.log"

    @contextmanager
    def _logging(self, log_file: Path | None) -> Iterator[None]:
        if log_file is None:
            yield
            return
        with process_switch().logging_to(log_file):
            yield


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
    log_dir = options.get("nccl_log_dir")
    if variant:
        opts = parse_variant_options(variant)
        unknown = set(opts) - {"proto", "algo"}
        if unknown:
            raise UsageError(f"unknown nccl option {sorted(unknown)[0]!r}: use nccl:proto=P,algo=A")
        proto = _normalise([opts["proto"]], PROTOCOLS, "protocol")[0] if "proto" in opts else None
        algo = _normalise([opts["algo"]], ALGORITHMS, "algorithm")[0] if "algo" in opts else None
        return [NcclBackend(proto, algo, log_dir)]
    protos = _normalise(options.get("nccl_proto") or [], PROTOCOLS, "protocol")
    algos = _normalise(options.get("nccl_algo") or [], ALGORITHMS, "algorithm")
    variants: list[Backend] = [NcclBackend(log_dir=log_dir)]
    for proto in protos or [None]:
        for algo in algos or [None]:
            if proto or algo:
                variants.append(NcclBackend(proto, algo, log_dir))
    return variants


FACTORY = BackendFactory(
    family="nccl", make=make, on_gpu_by_default=True, on_cpu_by_default=False,
    summary="NCCL via torch ProcessGroupNCCL; --nccl-proto/--nccl-algo sweep the protocol x algorithm matrix",
    variants_help=["nccl", "nccl:proto=LL", "nccl:proto=LL128,algo=Ring"],
)
