"""The one interface every allreduce backend implements.

A backend module holds one family ("nccl", "p2p", ...) and exposes a ``FACTORY`` that turns a
variant spec (the text after ``family:``) into backend objects. The harness owns timing,
checking, voting and watchdogs; a backend only sets itself up, says when it cannot run and
why, and reduces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from commbench.sweep.context import RunContext
    from commbench.sweep.workload import Workload

ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class BackendUnavailable(Exception):
    """Raised by setup() with a reason a user can act on ("flashinfer not installed", ...)."""


class BackendTimeout(RuntimeError):
    """Raised by a call whose bounded wait gave up (a peer never arrived): recorded as a hang."""


class Backend(ABC):
    """One backend variant, e.g. ``nccl:proto=LL,algo=Ring`` or ``p2p:oneshot``.

    Lifecycle per sweep: check() -> setup(dtype) [-> setup(other dtype) ...] -> close().
    setup() may be called again with another dtype before close(); close() must release
    everything, also after a failed setup().

    What the harness expects around collectives: every rank calls setup(), allreduce() and
    close() the same number of times in the same order, and a rank that raises does so before
    the collective step its peers would wait in (vote first: raise_unless_all_ranks_ok), or the
    peers stay in that step until the watchdog ends the row as a hang.
    """

    name: str = ""
    family: str = ""
    graph_capturable: bool = True
    node_local: bool = False        # needs every rank in one node (CUDA IPC, P2P)
    in_place: bool = False          # the sum overwrites the input (torch ProcessGroups)
    op: str = "allreduce"           # what one call computes; see commbench.sweep.workload
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    min_world_size: int = 1
    max_world_size: int | None = None

    def world_size_reason(self, world_size: int, nodes: int) -> str | None:
        """Static rule: can this backend ever run at this world size? None = yes."""
        if world_size < self.min_world_size:
            return f"needs at least {self.min_world_size} ranks, this run has {world_size}"
        if self.max_world_size is not None and world_size > self.max_world_size:
            return f"supports at most {self.max_world_size} ranks, this run has {world_size}"
        if self.node_local and nodes > 1:
            return f"node-local backend: this run spans {nodes} nodes (P2P/IPC only works within one node)"
        return None

    def check(self, ctx: "RunContext") -> str | None:
        """Can this rank run the backend at all? None = yes, else the reason (no side effects)."""
        return self.world_size_reason(ctx.world_size, ctx.nodes)

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        """Per-shape rule. None = this size and dtype can run, else the reason."""
        if dtype not in self.dtypes:
            return f"dtype {str(dtype).replace('torch.', '')} not supported"
        return None

    @abstractmethod
    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        """Allocate and connect. Raise BackendUnavailable (or anything) to be voted out."""

    @abstractmethod
    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write the sum of x over all ranks into out, on the current stream.

        The harness owns both tensors and keeps every call's output until it has checked it,
        so a backend must not hand back a buffer of its own. An in_place backend is given
        out = x (and a fresh x for every call); any other gets an out distinct from x."""

    def close(self) -> None:
        """Release everything (buffers, groups, IPC handles)."""

    def make_workload(self, ctx: "RunContext", count: int, dtype: torch.dtype,
                      shape: tuple[int, int] | None, pairs: int) -> "Workload":
        """The inputs, calls and check for one row: `pairs` input/output pairs. Plain
        allreduce by default."""
        from commbench.sweep.workload import AllreduceWorkload

        return AllreduceWorkload(self, ctx, count, dtype, pairs)

    def process_env(self, allow_multicast: bool) -> dict[str, str] | None:
        """Environment this backend needs in a child torchrun of its own (e.g. a preloaded
        library); None when it runs in any process. The sweep's driver (--nproc) starts it."""
        return None

    def row_fields(self) -> dict[str, Any]:
        """Fields recorded on every row of this variant (Measurement attributes or 'extra')."""
        return {}

    def observe(self, call: Callable[[], None], message_bytes: int) -> dict[str, Any]:
        """Fields known only from calls of this size (e.g. what NCCL chose). Run on every rank
        before the row's timed passes and outside them; ``call`` makes one more call of the
        row's size (collective: every rank makes the same number). Rank 0's answer is recorded."""
        return {}


def raise_unless_all_ranks_ok(ctx: "RunContext", local_error: str | None, what: str) -> None:
    """Vote on a local step before the next collective one: every rank raises, naming the first
    rank that failed, so no rank is left waiting in a rendezvous that a failed peer never joins."""
    errors = ctx.all_gather_objects(local_error)
    failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
    if failed:
        rank, err = failed[0]
        others = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise BackendUnavailable(f"{what} failed on rank {rank}{others}: {err}")


class ProcessGroupBackend(Backend):
    """A backend that is one torch.distributed group: all_reduce in place, destroy on close."""

    group: Any = None
    in_place = True

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


@dataclass
class BackendFactory:
    """How a family turns specs into variants.

    make(variant, options) -> list of backends; variant is the text after ``family:`` or None
    for the family's default variants. options carries sweep flags (nccl_proto, nccl_algo, ...).
    """

    family: str
    make: Callable[[str | None, dict[str, Any]], list[Backend]]
    on_gpu_by_default: bool = True
    on_cpu_by_default: bool = False
    summary: str = ""
    variants_help: list[str] = field(default_factory=list)


def parse_variant_options(variant: str | None) -> dict[str, str]:
    """'proto=LL,algo=Ring' -> {'proto': 'LL', 'algo': 'Ring'}; a bare word maps to itself."""
    out: dict[str, str] = {}
    for part in (variant or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip() if value else key.strip()
    return out
