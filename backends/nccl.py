"""NCCL through torch's ProcessGroupNCCL, one new process group per protocol x algorithm variant.

NCCL reads NCCL_PROTO and NCCL_ALGO at every communicator init, so each variant sets them,
creates a fresh group and forces its communicator to initialise before restoring the
environment. Process-level knobs (NCCL_NTHREADS, NCCL_BUFFSIZE, NCCL_MAX_CTAS, ...) are read
once per process: those are swept by the driver (`commbench sweep --nproc N --env ...`).
What NCCL chose is read from its log, which rank 0 switches on only around that init and
around observe()'s untimed calls (commbench.backends.nccl_log).
"""

from __future__ import annotations

import argparse
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from commbench import engines
from commbench.backends.base import (Backend, BackendFactory, BackendUnavailable, ProcessGroupBackend,
                                     parse_variant_options)
from commbench.backends.nccl_log import (ALGORITHMS, PROTOCOLS, InitEvidence, process_switch, read_lines,
                                         setting_applied, used_algo_proto)
from commbench.errors import UsageError
from commbench.sweep.context import RunContext
from commbench.topology.needs import full_nvlink

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

    @property
    def needs(self) -> tuple[str, ...]:  # type: ignore[override]
        # NCCL refuses two ranks on one GPU; NVLS algorithms create multicast objects.
        return ("cuda", "own_gpu", "multicast") if self.algo in MULTICAST_ALGORITHMS else ("cuda", "own_gpu")

    def software_reason(self) -> str | None:
        if not dist.is_nccl_available():
            return f"torch {torch.__version__} has no NCCL (a CPU-only build; NCCL needs CUDA)"
        return None

    def snapshot_warning(self, snapshot: dict[str, Any]) -> str | None:
        """LL128 forced on a machine without NVLink can corrupt data (NCCL's environment docs)."""
        gpus = [g["index"] for g in snapshot.get("gpus") or []]
        if self.proto == "LL128" and len(gpus) > 1 and not full_nvlink(snapshot, gpus):
            return "LL128 forced without NVLink: may corrupt data"
        return None

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        requested = self.requested()
        notes = [engines.LL128_OFF_NVLINK] if self.proto == "LL128" else []
        if requested:
            notes.append(engines.NCCL_ENV_IS_PROCESS_WIDE)
        return engines.Settings(self.name, nccl_env=requested, vllm_env=dict(engines.VLLM_ONLY_NCCL),
                                vllm_flags=[engines.DISABLE_CUSTOM_ALLREDUCE],
                                sglang_flags=[engines.DISABLE_CUSTOM_ALLREDUCE], notes=notes)

    def requested(self) -> dict[str, str]:
        """What this variant asks NCCL for, by the variables that ask it."""
        return {var: value for var, value in (("NCCL_PROTO", self.proto), ("NCCL_ALGO", self.algo)) if value}

    def setup(self, ctx: RunContext, max_bytes: int, dtype: torch.dtype) -> None:
        if self.group is not None:
            return  # one communicator serves every dtype
        self.unsafe = self.snapshot_warning(ctx.snapshot) if ctx.snapshot else None
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
        return {"requested": self.requested(), "unsafe": self.unsafe}

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
        used = {"NCCL_PROTO": proto, "NCCL_ALGO": algo}
        return {"observed": used, "setting_applied": setting_applied(self.requested(), used, self._init)}

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


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--nccl-proto", help="sweep NCCL protocols, e.g. LL,LL128,Simple (one group per variant)")
    group.add_argument("--nccl-algo", help="sweep NCCL algorithms, e.g. Ring,Tree")
    group.add_argument("--no-nccl-log", action="store_true",
                       help="do not record the algorithm/protocol NCCL used (logged only around untimed calls)")


def read_options(args: argparse.Namespace) -> dict[str, Any]:
    split = lambda text: [v.strip() for v in text.split(",") if v.strip()] if text else []  # noqa: E731
    protos = _normalise(split(args.nccl_proto), PROTOCOLS, "protocol")
    algos = _normalise(split(args.nccl_algo), ALGORITHMS, "algorithm")
    return {"nccl_proto": protos, "nccl_algo": algos, "nccl_log": not args.no_nccl_log}


def _log_dir(options: dict[str, Any]) -> Path | None:
    """Where NCCL's log goes: RUN/nccl-logs, unless the user turned it off or nothing is written."""
    run_dir = options.get("run_dir")
    return Path(run_dir) / "nccl-logs" if run_dir and options.get("nccl_log", True) else None


def make(variant: str | None, options: dict[str, Any]) -> list[Backend]:
    log_dir = _log_dir(options)
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
    probe_specs=(None, "proto=LL", "proto=LL128", "proto=Simple",
                 *(f"proto={p},algo={a}" for p in PROTOCOLS for a in ("Ring", "Tree", "NVLS", "NVLSTree"))),
    packages=("nvidia-nccl-cu12", "nvidia-nccl-cu13"),
    add_arguments=add_arguments, read_options=read_options,
)
