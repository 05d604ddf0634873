"""The run context: who am I under torchrun, which device, which groups, what policy.

One process per GPU; the device comes from LOCAL_RANK. Without CUDA every rank runs on
the CPU with gloo. Without torchrun the process is a world of one.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from commbench.launch_env import torchrun_env, under_torchrun
from commbench.policy import multicast_policy_reason

MPS_PERCENT_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


class ControlGroupLost(RuntimeError):
    """A vote, gather or barrier of the control group failed: a peer is gone (its sockets
    closed) or unreachable. The run cannot go on in this process."""


@dataclass(frozen=True)
class Emulation:
    """Several ranks on fewer GPUs: what the rows of such a run measure (the protocol, with no
    fabric between the ranks), recorded in run.json and on every row."""

    gpus: int                   # GPUs this node's ranks use
    ranks: int                  # ranks of this node
    mps: bool | None            # contexts shared through an MPS daemon (None: unknown)
    sm_percent: float | None    # this client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, if set

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "ranks": self.ranks, "mps": self.mps, "sm_percent": self.sm_percent}

    @property
    def ranks_per_gpu(self) -> int:
        return -(-self.ranks // self.gpus)

    def label(self) -> str:
        from commbench.results import describe_emulation

        return describe_emulation(self.to_dict())


def competes_for_sms(emulation: Emulation | None) -> bool:
    """Whether ranks run concurrently on one GPU (MPS, or an unknown answer) without SM shares that
    give each its own SMs, so that one rank's blocks can take the SMs another rank's blocks need."""
    if emulation is None or emulation.mps is False:
        return False
    share = emulation.sm_percent
    return share is None or share * emulation.ranks_per_gpu > 100


def own_sms(sm_count: int, emulation: Emulation | None) -> int:
    """The SMs one rank's blocks may count on while every rank's blocks are resident, for kernels
    whose blocks wait for their peers' (with no timeout, a block that finds no SM hangs them all).

    sm_count is what CUDA reports to this process: under MPS with an SM share it is already the
    client's share (14 of an H200's 132 SMs at 12%). One GPU per rank, or ranks taking turns on
    a shared GPU (time slicing preempts a spinning rank, and while a rank runs the GPU is its
    own): the whole GPU. Ranks running concurrently under MPS with shares that add up to at most
    the GPU: the client's own SMs. Any other concurrent sharing (no share, shares that overlap,
    an unknown MPS answer): a fair split of the GPU."""
    if emulation is None or not competes_for_sms(emulation):
        return sm_count
    share, ranks = emulation.sm_percent, emulation.ranks_per_gpu
    whole_gpu = sm_count if share is None else int(sm_count * 100 / share)
    return min(sm_count, whole_gpu // ranks)


def mps_sm_percent() -> float | None:
    """This process's MPS SM share, when CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is a number."""
    try:
        value = float(os.environ[MPS_PERCENT_VAR])
    except (KeyError, ValueError):
        return None
    return value if 0 < value <= 100 else None


@dataclass(frozen=True)
class RunContext:
    """Who this rank is, on which device, with which groups and policy; with_probe() adds what the
    probe found, once, before any backend runs. Nothing in it changes during a run: the rows
    measured so far go only to the backends that ask for them (Backend.reads_rows)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    control_group: Any                 # gloo group for votes, gathers and barriers
    allow_multicast: bool = False
    shares_gpus: bool = False          # several ranks on one GPU (emulation: no fabric between them)
    emulation: Emulation | None = None  # set when shares_gpus
    snapshot: dict[str, Any] | None = None   # probe snapshot (topology), when taken
    verdicts: Mapping[str, str | None] = field(default_factory=dict)  # backend name -> reason or None
    hostname: str = field(default_factory=socket.gethostname)

    def with_probe(self, snapshot: dict[str, Any] | None, verdicts: Mapping[str, str | None]) -> "RunContext":
        return replace(self, snapshot=snapshot, verdicts=dict(verdicts))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def single_node(self) -> bool:
        return self.nodes == 1

    @property
    def multicast_reason(self) -> str | None:
        return multicast_policy_reason(self.allow_multicast)

    @property
    def resident_sms(self) -> int:
        """The SMs this rank's blocks may count on while every rank's blocks are resident (own_sms)."""
        return own_sms(torch.cuda.get_device_properties(self.device).multi_processor_count, self.emulation)

    def barrier(self) -> None:
        with _control_group():
            dist.barrier(group=self.control_group)

    def all_gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with _control_group():
            dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        with _control_group():
            dist.broadcast_object_list(box, src=src, group=self.control_group)
        return box[0]


@contextmanager
def _control_group() -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # gloo's "Connection closed by peer", timeouts (DistBackendError is one)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ControlGroupLost(f"{type(exc).__name__}: {first}") from exc


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_context(allow_multicast: bool = False, force_cpu: bool = False, share_gpus: bool = False,
                 timeout_s: float = 600.0) -> tuple[RunContext, str | None]:
    """Initialise the default (gloo) process group and pick the device.

    Returns the context and, when CUDA is not usable, the one line that says so.
    share_gpus maps several ranks onto one GPU (LOCAL_RANK modulo the device count): IPC
    backends then run on one machine with no fabric between the ranks (concurrently under an
    MPS daemon, else taking turns), and every row says so.
    The default group is gloo on purpose: it carries the harness's own votes and gathers,
    and every NCCL variant gets its own new group, created after its env is set.
    """
    rank, world, local_rank, local_world = torchrun_env()
    # Under torchrun the rendezvous comes from its environment; a world of one gets a private
    # store on a free local port (and leaves the process environment alone).
    init_method = "env://" if under_torchrun() else f"tcp://127.0.0.1:{_free_port()}"
    note = None
    emulation = None
    if not force_cpu and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count and not share_gpus:
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {count} CUDA devices are visible "
                               "(--share-gpus runs several ranks on one GPU, with no fabric between them)")
        index = local_rank % count
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        if local_world > count:
            from commbench.topology.cudadrv import mps_enabled

            emulation = Emulation(gpus=min(count, local_world), ranks=local_world, mps=mps_enabled(index),
                                  sm_percent=mps_sm_percent())
            note = emulation.label()
    else:
        device = torch.device("cpu")
        note = ("no CUDA device: running on the CPU with gloo" if not force_cpu
                else "running on the CPU with gloo (--cpu)")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    ctx = RunContext(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                     device=device, control_group=dist.group.WORLD, allow_multicast=allow_multicast,
                     shares_gpus=emulation is not None, emulation=emulation)
    return ctx, note


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
