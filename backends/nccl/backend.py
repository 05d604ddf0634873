"""NCCL through torch's ProcessGroupNCCL, one new process group per protocol x algorithm variant.

NCCL reads NCCL_PROTO and NCCL_ALGO at every communicator init, so each variant sets them,
creates a fresh group and forces its communicator to initialise before restoring the
environment. Process-level knobs (NCCL_NTHREADS, NCCL_BUFFSIZE, NCCL_MAX_CTAS, ...) are read
once per process: those are swept by the driver (`commbench sweep --nproc N --env ...`).
What NCCL chose is read from its log, which rank 0 switches on only around that init and
around observe()'s untimed calls (commbench.topology.nccl_log).

Every variant also runs, as ``...,lib=LABEL``, with each library given by ``--nccl-lib``: in a
child torchrun of its own with that libnccl preloaded (commbench.backends.nccl.libs). Every
row records the NCCL its process actually ran, as that library reports itself
(``extra.nccl_version_loaded``, ``extra.nccl_lib_loaded``). ``nccl:symm`` registers the row's
buffers as symmetric windows (commbench.backends.nccl.symm).
"""

from __future__ import annotations

import os
import re
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from commbench import engines
from commbench.backends.base import BackendUnavailable, ProcessGroupBackend
from commbench.backends.nccl.libs import NcclLibrary, preload_env, preloaded_here
from commbench.topology.nccl_log import (ALGO_VAR, PROTO_VAR, InitEvidence, process_nccl, process_switch,
                                         logged_choice, read_lines, setting_applied, version_text)
from commbench.runtime.context import RunContext
from commbench.topology.needs import full_nvlink

MULTICAST_ALGORITHMS = ("NVLS", "NVLSTree")

# Kernel names this family's allreduce leaves in a profiler trace, read by `commbench attribute`
# with ast, without importing this module (docs/attribute.md): (regex searched in the demangled
# name, library, regex over this family's run variants that are its floor, note).
# Names from NVIDIA/nccl src/device/generate.py (>= 2.19: ncclDevKernel_<Coll>_<Op>_<Ty>_<ALGO>_<PROTO>,
# only RING_LL/TREE_LL specialised; ncclDevKernel_Generic names no collective, so attribute lists it as
# unclassified communication), <= 2.18's ncclKernel_*,
# and src/enqueue.cc's oneRankReduce (world 1, PreMulSum ops such as AVG).
TRACE_KERNELS = (
    (r"\bncclDevKernel_AllReduce_", "NCCL", r"^nccl$",
     "the name does not tell the protocol that ran (Simple/LL128/NVLS run inside it; nccl#1595, #2196)"),
    (r"\bncclKernel_AllReduce_", "NCCL <= 2.18", r"^nccl$", ""),
    # The device symbol comes mangled, template arguments glued on ("..._onerank_cu_..._
    # oneRankReduceI13FuncPreMulSum...", recorded on an H200): no word boundary after the name.
    (r"[Oo]neRankReduce", "NCCL (one rank)", r"^nccl$", "world size 1: a local scale, no communication"),
)


class NcclBackend(ProcessGroupBackend):
    family = "nccl"
    graph_capturable = True

    def __init__(self, proto: str | None = None, algo: str | None = None, log_dir: Path | None = None,
                 library: NcclLibrary | None = None):
        self.proto = proto
        self.algo = algo
        self.library = library
        self.name = variant_name(self._variant_parts())
        self.log_dir = log_dir
        self.unsafe: str | None = None
        self._observe_calls = False       # alike on every rank, so every rank makes the same calls
        self._not_observed: str | None = None
        self._init = InitEvidence()
        self._passes = 0

    def _variant_parts(self) -> list[str]:
        return [f"proto={self.proto}" if self.proto else "", f"algo={self.algo}" if self.algo else "",
                self.library.variant if self.library else ""]

    @property
    def needs(self) -> tuple[str, ...]:  # type: ignore[override]
        # NCCL refuses two ranks on one GPU; NVLS algorithms create multicast objects.
        return ("cuda", "own_gpu", "multicast") if self.algo in MULTICAST_ALGORITHMS else ("cuda", "own_gpu")

    def software_reason(self) -> str | None:
        if not dist.is_nccl_available():
            return f"torch {torch.__version__} has no NCCL (a CPU-only build; NCCL needs CUDA)"
        return None

    def process_env(self, allow_multicast: bool) -> dict[str, str] | None:
        """A --nccl-lib variant runs in a child torchrun with its library preloaded."""
        return preload_env(self.library) if self.library else None

    def check(self, ctx: RunContext) -> str | None:
        reason = super().check(ctx)
        if reason is None and self.library and not preloaded_here(self.library):
            return (f"runs in a child torchrun with LD_PRELOAD={self.library.path} "
                    "(started by the sweep's driver: commbench sweep --nproc N)")
        return reason

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
        # Another libnccl is part of the setting: priced apart from torch's, never as the default.
        return engines.nccl_path(self.name, requested, notes, preload=self.library.path if self.library else "")

    def requested(self) -> dict[str, str]:
        """What this variant asks NCCL for, by the variables that ask it."""
        return {var: value for var, value in ((PROTO_VAR, self.proto), (ALGO_VAR, self.algo)) if value}

    def setup(self, ctx: RunContext, max_bytes: int, dtype: torch.dtype) -> None:
        if self.group is not None:
            return  # one communicator serves every dtype
        self.unsafe = self.snapshot_warning(ctx.snapshot) if ctx.snapshot else None
        self._observe_calls = self.log_dir is not None and ctx.world_size > 1
        self._not_observed = self._why_not_observed(ctx)
        init_log = self._log_file("init")
        with _environment({PROTO_VAR: self.proto, ALGO_VAR: self.algo}), self._logging(init_log):
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
        if self.library:
            preload_mismatch = preloaded_library_reason(self.library, torch_nccl_code())
            if preload_mismatch:
                raise BackendUnavailable(preload_mismatch)

    def row_fields(self) -> dict[str, Any]:
        extra = process_nccl().row_extra()
        if self.library:
            extra.update(nccl_lib_label=self.library.label, nccl_lib_requested=self.library.path)
        return {"requested": self.requested(), "unsafe": self.unsafe, "extra": extra}

    def observe(self, call: Callable[[], None], message_bytes: int) -> dict[str, Any]:
        if not self._observe_calls:
            return {"nccl_observed": self._not_observed}
        self._passes += 1
        log_file = self._log_file(f"{message_bytes}B.{self._passes}")
        logged_calls(call, self._logging(log_file))
        if log_file is None:
            return {"nccl_observed": self._not_observed}
        seen = logged_choice(read_lines(log_file), message_bytes, log_file)
        if "observed" in seen:
            seen["setting_applied"] = setting_applied(self.requested(), seen["observed"], self._init)
        return seen

    def _why_not_observed(self, ctx: RunContext) -> str | None:
        """Why this rank records no NCCL choice; None where it logs and reads them."""
        return unlogged_reason(self.log_dir, ctx) or process_switch().unavailable

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


def unlogged_reason(log_dir: Path | None, ctx: RunContext) -> str | None:
    """Why NCCL logs no choice for this rank to read, whichever binding calls it; None if it may."""
    if log_dir is None:
        return "NCCL's log was not asked for (--no-nccl-log)"
    if ctx.world_size == 1:
        return "world size 1: NCCL's tuner chooses no algorithm and logs none"
    if ctx.rank != 0:
        return "NCCL logs its choices on comm rank 0 only"
    return None


def logged_calls(call: Callable[[], None], logging: AbstractContextManager[None]) -> None:
    """Two calls under NCCL's log, so what is recorded is a choice NCCL repeats (the most common
    one wins)."""
    with logging:
        call()
        call()
        torch.cuda.synchronize()


def variant_name(parts: list[str]) -> str:
    """'nccl' or 'nccl:' + the options that make the variant, in a fixed order."""
    variant = ",".join(p for p in parts if p)
    return f"nccl:{variant}" if variant else "nccl"


def torch_nccl_code() -> int | None:
    """NCCL_VERSION_CODE as torch's own calls see it (torch.cuda.nccl.version())."""
    try:
        major, minor, patch = torch.cuda.nccl.version()
    except Exception:  # a torch without NCCL: nothing to compare
        return None
    return major * 10000 + minor * 100 + patch


def preloaded_library_reason(library: NcclLibrary, torch_code: int | None) -> str | None:
    """Why this process does not run the preloaded library (None when it does): the mapped
    libnccl must be that file, and torch's calls must reach the same version."""
    loaded = process_nccl()
    if loaded.path is None or loaded.version_code is None:
        return f"--nccl-lib {library.label}: {loaded.error}"
    if loaded.path != library.path:
        return f"--nccl-lib {library.label}: this process maps {loaded.path}, not the preloaded {library.path}"
    if torch_code is not None and torch_code != loaded.version_code:
        return (f"--nccl-lib {library.label}: torch's calls report NCCL {version_text(torch_code)} but the "
                f"preloaded {library.path} is NCCL {loaded.version} (torch does not call the preloaded library)")
    return None


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


def nccl_log_dir(run_dir: Path | None, log: bool) -> Path | None:
    """Where NCCL's log goes: RUN/nccl-logs, unless the user turned it off or nothing is written."""
    return Path(run_dir) / "nccl-logs" if run_dir and log else None
