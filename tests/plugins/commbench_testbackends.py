"""Faulty backends for commbench's tests, loaded through the `commbench.backends` entry-point group
(tests put this folder on PYTHONPATH; the dist-info beside it declares the entry point).

Each variant is built on gloo so it runs on the CPU, and each fails in one specific way that the
harness must catch: returning its input, one wrong element, the previous call's answer, a
result that the next call overwrites (wrong only when calls come back to back), one wrong call
in every N, a rank that never arrives, a setup failure on one rank, a setup as slow as a
first-use kernel build, a node-local backend across nodes. And the faults that leave a peer
inside a collective: rank 1 raising in allreduce or in setup before its first collective,
rank 1 dying of SIGSEGV (a real invalid read, as a native library would) in setup or in
allreduce (rank 0 too: the rank that writes the rows), rank 0 hanging while it holds the GIL
(its watchdog thread cannot run). ``@N`` is the fault's number: bytes from which hang_rank1,
raise_rank1, segv_rank0/1 and hang_gil_rank0 fail, seconds slow_setup sleeps, the period of
wrong_every. The ``returns*`` variants hand back a tensor of their own, as an engine's kernel
does: exact (a fresh tensor per call), one buffer reused by every call, and a tensor one element
short. `slow` sleeps the
microseconds after @ before every call's correct allreduce (a node of a fleet made slower by a
known amount; slow@0 is exact).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import time
from typing import TYPE_CHECKING, Any

from commbench.backends.base import Backend, BackendFactory, BackendUnavailable, MakeOptions
from commbench.errors import UsageError

if TYPE_CHECKING:
    import torch

# torch is imported where a rank uses it, as the built-in backends do: the sweep's driver and
# --help import this module (for its flags) and never need torch.

VARIANTS = ("exact", "noop", "one_wrong", "stale", "back_to_back", "wrong_every", "hang_rank1", "setup_fails_rank1",
            "slow_setup", "nodelocal", "solo", "raise_rank1", "raise_setup_rank1", "segv_rank0", "segv_rank1",
            "segv_setup_rank1", "hang_gil_rank0", "returns", "returns_reused", "returns_short", "slow")


def segfault() -> None:
    """Die as a native library does: a read of address 0 (no core file left behind)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctypes.string_at(0)


def hang_holding_the_gil() -> None:
    """Block in C without releasing the GIL, deaf to SIGTERM and SIGINT (as a spinning native
    call is): no other thread of this process runs Python again; only SIGKILL ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    while True:
        ctypes.PyDLL(None).pause()


class FaultyBackend(Backend):
    family = "testfaults"
    graph_capturable = False

    def __init__(self, fault: str, number: int):
        self.fault = fault
        self.name = f"testfaults:{fault}"
        self.needs = ("node",) if fault == "nodelocal" else ()
        self.max_world_size = 1 if fault == "solo" else None
        self.number = number
        self.group: Any = None
        self.rank = 0
        self.calls = 0
        self._previous: torch.Tensor | None = None   # the last call's out (stale, back_to_back)
        self._previous_sum: torch.Tensor | None = None

    def setup(self, ctx, max_bytes: int, dtype: torch.dtype) -> None:
        self.rank = ctx.rank
        # Before the first collective, which rank 0 then waits in for good.
        if self.fault == "raise_setup_rank1" and ctx.rank == 1:
            raise RuntimeError("deliberate failure in setup on rank 1")
        if self.fault == "segv_setup_rank1" and ctx.rank == 1:
            segfault()
        if self.group is None:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # collective: every rank reaches it
        if self.fault == "setup_fails_rank1" and ctx.rank == 1:
            raise BackendUnavailable("this rank's workspace allocation failed (deliberate)")
        if self.fault == "slow_setup":
            time.sleep(self.number)

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        if self.fault.startswith("returns"):
            return self._returned(x)
        if self.fault == "noop":
            out.copy_(x)
            return
        faulty = x.numel() * x.element_size() >= self.number
        if self.fault == "hang_rank1" and self.rank == 1 and faulty:
            while True:  # never arrives: only the watchdog ends this
                time.sleep(1)
        if self.fault == "raise_rank1" and self.rank == 1 and faulty:
            raise RuntimeError("deliberate failure in allreduce on rank 1")   # rank 0 is in the collective
        if self.fault == f"segv_rank{self.rank}" and faulty:
            segfault()
        if self.fault == "hang_gil_rank0" and self.rank == 0 and faulty:
            hang_holding_the_gil()
        if self.fault == "slow" and self.number:
            time.sleep(self.number / 1e6)
        if self.fault == "back_to_back" and self._previous is not None:
            # The next call reuses what the last one handed back before anyone read it.
            self._previous.zero_()
        import torch.distributed as dist

        total = x.clone()
        dist.all_reduce(total, group=self.group)
        stale = self._previous_sum if self.fault == "stale" and self._previous_sum is not None else None
        self._previous_sum = total
        out.copy_(total if stale is None or stale.numel() != total.numel() else stale)
        if self.fault == "one_wrong" and self.rank == 0:
            out[out.numel() // 2] += 1
        if self.fault == "wrong_every" and self.calls % (self.number or 64) == 0:
            out[0] += 1
        self._previous = out
        return None

    def _returned(self, x: torch.Tensor) -> torch.Tensor:
        import torch
        import torch.distributed as dist

        total = x.clone()
        dist.all_reduce(total, group=self.group)
        if self.fault == "returns_short":
            return total[1:]
        if self.fault == "returns_reused":
            if self._previous is None or self._previous.numel() != total.numel():
                self._previous = torch.empty_like(total)
            return self._previous.copy_(total)
        return total

    def row_fields(self) -> dict[str, Any]:
        # Shows that a driver's --env setting reached this child process.
        return {"test_knob": os.environ.get("COMMBENCH_TEST_KNOB")}

    def close(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None


def make(variant: str | None, options: MakeOptions[None]) -> list[Backend]:
    fault, _, number = (variant or "exact").partition("@")
    if fault not in VARIANTS:
        raise UsageError(f"unknown testfaults variant {fault!r}")
    return [FaultyBackend(fault, int(number) if number else 0)]


FACTORY = BackendFactory(family="testfaults", make=make, on_gpu_by_default=False, on_cpu_by_default=False,
                         summary="deliberately faulty test backends", variants_help=list(VARIANTS))
