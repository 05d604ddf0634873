"""p2p: commbench's own CUDA-IPC allreduce (Lamport one-shot and two-shot, flag one-shot push and
pull, flag two-shot, auto).

The kernels (p2p_allreduce.cu beside this file) are compiled at run time by NVRTC through
CuPy, once per process, device, dtype and world size, and launched on torch's current
stream, so they are captured by CUDA graphs like any torch kernel.

Design (the ideas of vLLM's and TRT-LLM's custom allreduce, our own code):

* One device allocation per rank holds the flags and data areas; its CUDA-IPC handle goes to
  every rank over the gloo control group and each rank opens its peers' allocations.
* The kernels' table of buffers (Layout) is a kernel parameter passed by value, built once per
  buffer; peer loops are unrolled at compile time (the world size is a template parameter).
* Every kernel kind counts its calls in device memory, one counter per block, advanced by the
  kernel itself, because a graph replay re-launches with the arguments fixed at capture time.
  Every call is collective, so all ranks agree on the count. A peer never runs more than one
  call ahead (finishing a call needs this rank's data of it), so buffers that rotate by count
  are never overwritten while this rank still reads them, and no end-of-call barrier is
  needed. Only plain stores and loads cross the fabric; PCIe systems often lack peer atomics.
* Lamport kernels (``p2p:oneshot_lamport``, ``p2p:twoshot_lamport``; the idea of TRT-LLM's and
  FlashInfer's Lamport one-shot and of MSCCL++'s LL packets, our own code): the data is its own
  arrival flag. Buffers start filled with a 32-bit word no input can hold (the bits of fp32
  -0.0, mapped to +0.0 on the way in, which changes no value); writers push 16-byte vectors,
  readers poll their own memory until no word is empty. Three buffers rotate; each call empties
  the one of the previous call while it waits. No fence and no flag round trip per call.
* Flag kernels (``p2p:oneshot``, ``p2p:oneshot_pull``, ``p2p:twoshot``): data, then a system
  fence and a flag per peer, then a wait for every peer's flag; data areas alternate by parity.
* Staging happens inside the kernel, in eager and graph mode alike: the first step of every
  call copies the caller's input into the IPC buffers (push variants write it straight into
  the peers' receive areas, so there the copy is the transfer itself). We do not register
  captured input addresses: that needs IPC handles for blocks of torch's caching allocator
  or graph pool (wrong or impossible for expandable segments and cuMem pools) and a
  collective after every capture, which the sweep's capture does not make. The fused copy
  costs no extra launch or graph node, and one local read and write of the message.
* Push is the default: every byte crosses the fabric as a posted write. Reads of peer
  memory are the pattern that never completes on some PCIe systems, and such a read cannot
  be bounded by a timeout, so the pull variant (``p2p:oneshot_pull``) runs only when asked
  for, two-shot never reads peer memory, and ``p2p:auto`` adds the pull kernel to its
  candidates only where a peer's memory is known to answer reads: every rank on one GPU, or
  every pair of GPUs joined by NVLink in the probe's snapshot (``peer_reads_reason``; rows
  say why not in ``p2p_auto_pull_reason``), or when a forced rule names it.
* Waits are bounded: a peer missing for ``p2p_timeout_ms`` makes the kernel give up, record
  the peer in host-mapped memory and mark this rank's state broken; every later call returns
  at once on the GPU and raises ``P2PTimeoutError`` on the host.
* Block b of a rank spins until block b of every peer arrives, so every block of every rank
  must be resident on its GPU at once. The grid is capped at setup by what fits: the kernels'
  occupancy (blocks per SM) times the SMs a rank may count on (grid_capacity), the smallest
  rank's answer, so that every rank launches the same grid.
* ``p2p:auto`` picks among the Lamport and flag kernels by size (the four push kernels, and
  the pull one-shot where reads are safe, above). The rule is measured at setup:
  every kernel is graph-replayed at sizes from 4 KiB up by factors of 2 on every rank (the
  median of several replays of up to 100 calls), the slowest rank's time counts, the fastest
  kernel wins each size (a kernel with fewer round trips keeps ties), and every rank applies
  the same rule to the same gathered numbers. ``p2p_auto_rule`` in the options skips the
  measurement.
* Programmatic dependent launch (PDL, ``p2p_pdl``, on by default): the kernels are launched
  through cuLaunchKernelEx (cuda-python) with programmatic stream serialization, so a call's
  blocks may start while the previous kernel in the stream finishes; every kernel waits
  (``griddepcontrol.wait``) before it touches global memory. Used only where every rank can:
  cuda-python imports, SM 9.0+, and no ranks that run concurrently on one GPU without SM shares
  of their own (a next call's waiting blocks could hold the SMs a peer's blocks need). Otherwise
  CuPy launches plainly; rows record ``p2p_pdl`` and, when off, ``p2p_pdl_reason``.

World size 1 runs only the one-shot kernels (``p2p:oneshot_lamport``, ``p2p:oneshot``): the
kernels with no peers, as the launch-and-copy floor of our kernels (rows carry
``extra.p2p_kernel_floor``).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy
import torch

from commbench import engines
from commbench.backends.base import (ALL_DTYPES, Backend, BackendFactory, BackendTimeout, BackendUnavailable, voted,
                                     voted_gather)
from commbench.runtime.context import MPS_PERCENT_VAR, Emulation, competes_for_sms, own_sms
from commbench.errors import UsageError
from commbench.runtime.timing import capture_graph, per_step_us
from commbench.units import format_bytes, parse_bytes
from commbench.runtime.workload import AllreduceWorkload, PassCheck
from commbench.topology.selection import non_nvlink_pairs

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

KERNEL_SOURCE = Path(__file__).with_name("p2p_allreduce.cu")

# These mirror P2P_MAX_RANKS / P2P_MAX_BLOCKS / LL_BUFFERS / LL_EMPTY and the Layout and Ctrl
# structs in p2p_allreduce.cu.
MAX_RANKS = 8
MAX_BLOCKS = 64
FLAG_PHASES = 2
FLAG_AREA_BYTES = FLAG_PHASES * MAX_BLOCKS * MAX_RANKS * 4
LAYOUT_AREAS = ("flags", "recv", "gather", "stage", "ll", "ll_rs", "ll_ag")   # one pointer per rank each
LAYOUT_SCALARS = ("slot_bytes", "slice_bytes", "timeout_ns", "ctrl", "report", "rank", "nranks")
LAYOUT_WORDS = len(LAYOUT_AREAS) * MAX_RANKS + len(LAYOUT_SCALARS)
LL_BUFFERS = 3
LL_EMPTY = 0x80000000
CTRL_WORDS = 8 + 3 * MAX_BLOCKS        # abort, units per Lamport buffer, three counters per block
THREADS_PER_BLOCK = 512
WARP_THREADS = 32                      # also more than MAX_RANKS: the flag barrier's threads 0..N-1
MAX_VECTORS_PER_THREAD = 16
SPREAD_THREADS = (128, 256, THREADS_PER_BLOCK)
VECTOR_BYTES = 16                      # every thread moves 16-byte vectors
AREA_ALIGN_BYTES = 4096
PARITIES = 2

DEFAULT_MAX_BYTES = 8 << 20
# Far above any scheduling or host delay between healthy ranks (ranks sharing one GPU
# included), far below a frozen job.
DEFAULT_TIMEOUT_MS = 5000.0

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

ONESHOT_LL, TWOSHOT_LL = "oneshot_lamport", "twoshot_lamport"
ONESHOT_PUSH, ONESHOT_PULL, TWOSHOT = "oneshot_push", "oneshot_pull", "twoshot_push"
KERNEL_NAMES = {ONESHOT_LL: "p2p_ll_oneshot", TWOSHOT_LL: "p2p_ll_twoshot", ONESHOT_PUSH: "p2p_oneshot_push",
                ONESHOT_PULL: "p2p_oneshot_pull", TWOSHOT: "p2p_twoshot_push"}
TWO_SHOT_KERNELS = (TWOSHOT_LL, TWOSHOT)     # each rank reduces one slice
# variant -> kernels it may launch
VARIANTS: dict[str, tuple[str, ...]] = {
    "oneshot_lamport": (ONESHOT_LL,),
    "oneshot": (ONESHOT_PUSH,),
    "oneshot_pull": (ONESHOT_PULL,),
    "twoshot_lamport": (TWOSHOT_LL,),
    "twoshot": (TWOSHOT,),
    # In order of preference on a tie: fewer round trips first.
    "auto": (ONESHOT_LL, ONESHOT_PUSH, TWOSHOT_LL, TWOSHOT),
}
# What p2p:auto adds, last (it must win by the margin), where reads of peer memory complete.
AUTO_READ_KERNELS = (ONESHOT_PULL,)
DEFAULT_VARIANTS = ("oneshot_lamport", "oneshot", "twoshot_lamport", "twoshot", "auto")
FLOOR_VARIANTS = ("oneshot_lamport", "oneshot")      # the variants that also run at world size 1
# The name a rule or a row gives a kernel: the variant that runs it alone.
KERNEL_VARIANT = {kernels[0]: name for name, kernels in VARIANTS.items() if len(kernels) == 1}

# Auto calibration: graph-replayed kernel time at these sizes (up to the buffer size).
CALIBRATION_SIZES = tuple(4096 << k for k in range(12))   # 4 KiB ... 8 MiB
# Calls per graph: enough that launch and timer noise average out at small sizes, fewer at
# large ones, where one call is long already (4 MiB: 16 calls).
CALIBRATION_MAX_CALLS, CALIBRATION_MIN_CALLS = 100, 10
CALIBRATION_GRAPH_BYTES = 64 << 20
CALIBRATION_REPLAYS = 10          # timed per kernel and size; their median counts
# A kernel later in the preference order must be faster by this fraction to win a size.
TIE_MARGIN = 0.03

HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02   # cudaHostAllocPortable | cudaHostAllocMapped
PHASE_NAMES = ("first barrier", "second barrier", "one-shot data", "reduce-scatter data", "all-gather data")
_REPORT = ctypes.c_uint32 * 4     # {1 = timeout, peer, epoch, phase}, read on every call


class P2PTimeoutError(BackendTimeout):
    """A peer never reached a barrier; this rank's p2p state is broken until setup() again."""


# ---------------------------------------------------------------------------------------
# Rules that need no GPU


@dataclass(frozen=True)
class LaunchShape:
    """How a launch covers its vectors (options p2p_threads and p2p_vectors_per_thread):
    `threads` per block (None: by size, see spread_threads), each thread taking
    `vectors_per_thread` of them before another block is added."""

    threads: int | None = None
    vectors_per_thread: int = 1


# p2p:auto's rule: (largest message in bytes or None for "any larger", kernel), in size order.
AutoRule = tuple[tuple[int | None, str], ...]


@dataclass(frozen=True)
class P2POptions:
    max_bytes: int = DEFAULT_MAX_BYTES
    auto_rule: AutoRule | None = None       # None: measure at setup
    timeout_ms: float = DEFAULT_TIMEOUT_MS
    shape: LaunchShape = LaunchShape()
    pdl: bool = True                        # launch with PDL where it can work

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "P2POptions":
        max_bytes = _as_bytes(options.get("p2p_max_bytes"), "p2p_max_bytes", DEFAULT_MAX_BYTES)
        if max_bytes % VECTOR_BYTES:
            raise UsageError(f"p2p_max_bytes {max_bytes} is not a multiple of {VECTOR_BYTES} bytes")
        rule = options.get("p2p_auto_rule")
        auto_rule = None if rule is None else parse_auto_rule(rule)
        timeout = options.get("p2p_timeout_ms")
        timeout_ms = DEFAULT_TIMEOUT_MS if timeout is None else float(timeout)
        if not (0 < timeout_ms < float("inf")):   # also refuses NaN
            raise UsageError(f"p2p_timeout_ms must be positive and finite, got {timeout!r}")
        threads = options.get("p2p_threads")
        threads = None if threads is None else _as_int(threads, "p2p_threads", THREADS_PER_BLOCK)
        if threads is not None and (threads % WARP_THREADS or not WARP_THREADS <= threads <= THREADS_PER_BLOCK):
            raise UsageError(f"p2p_threads must be a multiple of {WARP_THREADS} from {WARP_THREADS} to "
                             f"{THREADS_PER_BLOCK}, got {threads}")
        vectors = _as_int(options.get("p2p_vectors_per_thread"), "p2p_vectors_per_thread", 1)
        if not 1 <= vectors <= MAX_VECTORS_PER_THREAD:
            raise UsageError(f"p2p_vectors_per_thread must be from 1 to {MAX_VECTORS_PER_THREAD}, got {vectors}")
        return cls(max_bytes, auto_rule, timeout_ms, LaunchShape(threads, vectors),
                   pdl=_as_switch(options.get("p2p_pdl"), "p2p_pdl", True))


def parse_auto_rule(text: str) -> AutoRule:
    """'oneshot_lamport<=64K,twoshot_lamport<=1M,twoshot': each kernel (named by its variant) up
    to its size, the last one for every larger message."""
    names = {KERNEL_VARIANT[k]: k for k in (*VARIANTS["auto"], *AUTO_READ_KERNELS)}
    entries: list[tuple[int | None, str]] = []
    parts = [part.strip() for part in str(text).split(",")]
    for i, part in enumerate(parts):
        name, sep, size = part.partition("<=")
        name = name.strip()
        if name not in names:
            raise UsageError(f"p2p auto rule {text!r}: unknown kernel {name!r} (choose from {', '.join(names)})")
        last = i == len(parts) - 1
        if last != (not sep):
            raise UsageError(f"p2p auto rule {text!r}: every kernel but the last needs '<=SIZE', the last none "
                             "(e.g. oneshot_lamport<=64K,twoshot_lamport)")
        limit = None if last else _as_bytes(size.strip(), "p2p auto rule size", 0)
        if limit is not None and entries and limit <= (entries[-1][0] or 0):
            raise UsageError(f"p2p auto rule {text!r}: sizes must grow from one kernel to the next")
        entries.append((limit, names[name]))
    return tuple(entries)


def format_auto_rule(rule: AutoRule) -> str:
    return ",".join(KERNEL_VARIANT[kernel] + ("" if limit is None else f"<={format_bytes(limit)}")
                    for limit, kernel in rule)


def auto_kernels(read_kernels: set[str] | tuple[str, ...]) -> tuple[str, ...]:
    """p2p:auto's kernels in preference order: the push kernels, then those of read_kernels
    that read peer memory."""
    return (*VARIANTS["auto"], *(k for k in AUTO_READ_KERNELS if k in read_kernels))


def rule_kernel(rule: AutoRule, message_bytes: int) -> str:
    for limit, kernel in rule:
        if limit is None or message_bytes <= limit:
            return kernel
    return rule[-1][1]


def _as_int(value: Any, key: str, default: int) -> int:
    if value is None:
        return default
    try:
        return int(str(value), 10)
    except ValueError:
        raise UsageError(f"{key} must be a whole number, got {value!r}") from None


def _as_switch(value: Any, key: str, default: bool) -> bool:
    """'on' or 'off' (booleans too)."""
    if value is None:
        return default
    if value is True or value == "on":
        return True
    if value is False or value == "off":
        return False
    raise UsageError(f"{key} must be on or off, got {value!r}")


def _as_bytes(value: Any, key: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, str):
        return parse_bytes(value)
    if isinstance(value, int) and value > 0:
        return value
    raise UsageError(f"{key} must be a positive number of bytes, got {value!r}")


def size_reason(message_bytes: int, max_bytes: int) -> str | None:
    """Why the kernels cannot take a message of this size; None when they can."""
    if message_bytes < VECTOR_BYTES:
        return f"p2p needs at least {VECTOR_BYTES} bytes, got {message_bytes}"
    if message_bytes % VECTOR_BYTES:
        return f"p2p moves {VECTOR_BYTES}-byte vectors: {message_bytes} B is not a multiple of {VECTOR_BYTES}"
    if message_bytes > max_bytes:
        return (f"{format_bytes(message_bytes)} exceeds the p2p buffer of {format_bytes(max_bytes)} "
                "(raise p2p_max_bytes)")
    return None


def tensor_reason(x: torch.Tensor, out: torch.Tensor, device: torch.device) -> str | None:
    """Why the kernels cannot take these tensors; None when they can. Checked before a launch:
    a misaligned or foreign pointer would fault and poison the CUDA context for every later row."""
    if out.dtype != x.dtype or out.numel() != x.numel():
        return f"out ({out.numel()} x {out.dtype}) does not match x ({x.numel()} x {x.dtype})"
    for name, t in (("x", x), ("out", out)):
        if t.device != device:
            return f"{name} is on {t.device}, this rank runs on {device}"
        if not t.is_contiguous():
            return f"{name} is not contiguous (the kernels move whole {VECTOR_BYTES}-byte vectors)"
        if t.data_ptr() % VECTOR_BYTES:
            return (f"{name} is not {VECTOR_BYTES}-byte aligned (address {t.data_ptr():#x}): "
                    f"the kernels load and store {VECTOR_BYTES}-byte vectors")
    return None


@dataclass(frozen=True)
class GridCapacity:
    """What bounds one rank's grid: block b spins until block b of every peer arrives, so every
    block of every rank must be resident at the same time."""

    blocks_per_sm: int     # occupancy of the most demanding launched kernel
    sms: int               # SMs this rank's blocks may count on

    @property
    def blocks(self) -> int:
        return self.blocks_per_sm * self.sms

    def refusal(self) -> str | None:
        """Why not even one block fits; None when it does."""
        if self.blocks >= 1:
            return None
        return (f"p2p needs every block of every rank resident at once, but this rank may count on "
                f"{self.sms} SMs ({self.blocks_per_sm} block(s) per SM): run fewer ranks per GPU or give "
                f"each MPS client a larger SM share ({MPS_PERCENT_VAR})")


def pdl_reason(enabled: bool, import_error: str | None, capability: tuple[int, int],
               emulation: Emulation | None) -> str | None:
    """Why this rank cannot launch with PDL; None when it can. import_error: why cuda-python's
    driver module did not import (None: it did)."""
    if not enabled:
        return "off (--p2p-pdl off)"
    if import_error is not None:
        return f"cuda-python not installed ({import_error})"
    if capability < (9, 0):
        return f"SM {capability[0]}.{capability[1]}: PDL needs SM 9.0+"
    if competes_for_sms(emulation):
        # A call's blocks start before the previous call ends and sit resident while they wait;
        # a peer's blocks of that previous call may then find no SM (see grid_capacity).
        return "ranks share a GPU concurrently without SM shares of their own: early blocks could starve a peer's"
    return None


def agreed_pdl_reason(reasons: list[str | None]) -> str | None:
    """All ranks launch alike: PDL only when no rank has a reason against it. Otherwise the first
    such rank's reason, naming the rank unless every rank gave the same one."""
    against = [(rank, reason) for rank, reason in enumerate(reasons) if reason is not None]
    if not against:
        return None
    rank, reason = against[0]
    return reason if len(set(reasons)) == 1 else f"rank {rank}: {reason}"


def grid_capacity(blocks_per_sm: int, sm_count: int, emulation: Emulation | None) -> GridCapacity:
    """The blocks one rank may launch so that every rank's blocks are resident at once: the
    occupancy on the SMs the rank may count on (runtime.context.own_sms), or one block per SM where
    ranks compete for SMs, because eight ranks under MPS with no share deadlocked with two blocks
    per SM where the occupancy API allowed them (blocks of different clients did not fill an SM
    together)."""
    return GridCapacity(1 if competes_for_sms(emulation) else blocks_per_sm, own_sms(sm_count, emulation))


def _work_units(algorithm: str, units: int, nranks: int) -> int:
    """The vectors one rank's threads cover: two-shot kernels work on one slice at a time."""
    return -(-units // nranks) if algorithm in TWO_SHOT_KERNELS else units


def spread_threads(work_units: int, sms: int) -> int:
    """Threads per block when no option says: the fewest of SPREAD_THREADS whose blocks fit one
    per SM this rank may count on, else the most. Measured under MPS at 2, 4 and 8 ranks
    (tests/gpu/p2p_check.py tune; results/reference/h200-mps-p2p-tune/): against 512 threads
    everywhere this rule lost 1.1% on average to each size's best shape, 512 lost 3.9%."""
    for threads in SPREAD_THREADS:
        if -(-work_units // threads) <= sms:
            return threads
    return THREADS_PER_BLOCK


def launch_dims(algorithm: str, units: int, nranks: int, cap_blocks: int, sms: int,
                shape: LaunchShape = LaunchShape()) -> tuple[int, int]:
    """(blocks, threads per block) of one launch; the same on every rank, since it depends only
    on size, world, the options and the cap and SM count that all ranks agreed on at setup. A
    launch of one block takes only the whole warps its work needs."""
    thread_work = -(-_work_units(algorithm, units, nranks) // shape.vectors_per_thread)
    threads = shape.threads or spread_threads(thread_work, sms)
    blocks = max(1, min(cap_blocks, MAX_BLOCKS, -(-thread_work // threads)))
    if blocks == 1:
        threads = min(threads, max(WARP_THREADS, -(-thread_work // WARP_THREADS) * WARP_THREADS))
    return blocks, threads


@dataclass(frozen=True)
class AreaPlan:
    """Byte offsets of the areas in one rank's IPC allocation (None: not allocated)."""

    slot_bytes: int
    slice_bytes: int          # the largest two-shot slice of a slot_bytes message
    recv: int | None
    gather: int | None
    stage: int | None
    ll: int | None
    ll_rs: int | None
    ll_ag: int | None
    total_bytes: int
    lamport_spans: tuple[tuple[int, int], ...]   # (offset, bytes) of the areas that start LL_EMPTY

    def offsets(self) -> dict[str, int | None]:
        """Every data area's offset, by its Layout name (flags at 0)."""
        return {"flags": 0, "recv": self.recv, "gather": self.gather, "stage": self.stage,
                "ll": self.ll, "ll_rs": self.ll_rs, "ll_ag": self.ll_ag}


def plan_areas(algorithms: tuple[str, ...], nranks: int, slot_bytes: int) -> AreaPlan:
    """Flags first, then only the data areas the variant's kernels use."""
    offset = FLAG_AREA_BYTES

    def take(nbytes: int) -> int:
        nonlocal offset
        start = -(-offset // AREA_ALIGN_BYTES) * AREA_ALIGN_BYTES
        offset = start + nbytes
        return start

    slice_bytes = -(-slot_bytes // (nranks * VECTOR_BYTES)) * VECTOR_BYTES
    push = any(a in (ONESHOT_PUSH, TWOSHOT) for a in algorithms)
    recv = take(PARITIES * nranks * slot_bytes) if push else None
    gather = take(PARITIES * slot_bytes) if TWOSHOT in algorithms else None
    stage = take(PARITIES * slot_bytes) if ONESHOT_PULL in algorithms else None
    lamport: list[tuple[int, int]] = []

    def take_lamport(nbytes: int) -> int:
        lamport.append((take(nbytes), nbytes))
        return lamport[-1][0]

    ll = take_lamport(LL_BUFFERS * nranks * slot_bytes) if ONESHOT_LL in algorithms else None
    ll_rs = take_lamport(LL_BUFFERS * nranks * slice_bytes) if TWOSHOT_LL in algorithms else None
    ll_ag = take_lamport(LL_BUFFERS * slot_bytes) if TWOSHOT_LL in algorithms else None
    end = -(-offset // AREA_ALIGN_BYTES) * AREA_ALIGN_BYTES
    return AreaPlan(slot_bytes, slice_bytes, recv, gather, stage, ll, ll_rs, ll_ag, end, tuple(lamport))


def choose_rule(sizes: list[int], times_us: dict[str, list[float]], margin: float = TIE_MARGIN) -> AutoRule:
    """p2p:auto's rule from measured per-call times: at each size the fastest kernel, where a
    kernel later in `times_us`'s order must beat the earlier ones by `margin`. A message uses the
    choice of the smallest measured size at or above it (the largest size's above them all)."""
    if any(len(t) != len(sizes) for t in times_us.values()) or not sizes or not times_us:
        raise ValueError("one time per size and kernel expected")
    order = list(times_us)
    choices: list[tuple[int, str]] = []
    for i, size in sorted(enumerate(sizes), key=lambda item: item[1]):
        best = order[0]
        for kernel in order[1:]:
            if times_us[kernel][i] * (1 + margin) < times_us[best][i]:
                best = kernel
        choices.append((size, best))
    rule: list[tuple[int | None, str]] = []
    for size, kernel in choices:
        if rule and rule[-1][1] == kernel:
            rule[-1] = (size, kernel)
        else:
            rule.append((size, kernel))
    rule[-1] = (None, rule[-1][1])
    return tuple(rule)


def calibration_calls(message_bytes: int) -> int:
    """Calls per calibration graph at this size."""
    return max(CALIBRATION_MIN_CALLS, min(CALIBRATION_MAX_CALLS, CALIBRATION_GRAPH_BYTES // message_bytes))


def per_call_median_us(replay_us: list[float], calls_per_graph: int) -> float:
    """One kernel's per-call time on one rank: the median replay, so that a few replays
    delayed by the host or another process do not move it."""
    return statistics.median(replay_us) / calls_per_graph


def slowest_rank_times(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per kernel and size, the slowest rank's time: a collective is as fast as its last rank."""
    return {algo: [max(rank_times[algo][i] for rank_times in per_rank)
                   for i in range(len(per_rank[0][algo]))]
            for algo in per_rank[0]}


def quick_p2p_reason(local_world_size: int) -> str | None:
    """Without probe verdicts: can every pair of the GPUs this node's ranks use reach each other?"""
    count = torch.cuda.device_count()
    devices = sorted({rank % count for rank in range(local_world_size)})
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"no peer access from cuda:{a} to cuda:{b} (CUDA reports no P2P between them)"
    return None


def peer_reads_reason(snapshot: dict[str, Any] | None, world_size: int, emulation: Emulation | None) -> str | None:
    """Why p2p:auto leaves the kernels that read peer memory out here, or None where such reads
    are known to complete: every rank on one GPU (a peer's memory is this GPU's), or every pair
    of the GPUs the ranks use joined by NVLink in the probe's snapshot (the same on every rank:
    rank 0's, broadcast). A read over PCIe may never complete, and no timeout can bound it."""
    if emulation is not None and emulation.gpus == 1:
        return None
    if not snapshot or not snapshot.get("gpus"):
        return "no probe snapshot says how the GPUs are linked (reads of peer memory may never complete on PCIe)"
    pairs = non_nvlink_pairs(snapshot, world_size)
    if not pairs:
        return None
    a, b, label = pairs[0]
    return (f"GPU {a} and GPU {b} are linked by {label}, not NVLink: a read of peer memory may never "
            "complete there, and no timeout can bound it")


@lru_cache(maxsize=1)
def _cupy() -> Any:
    """The cupy module, or None when it is not installed (imported only when needed)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@dataclass(frozen=True)
class KernelParams:
    """cuLaunchKernelEx's kernelParams for (Layout L, const uint4* in, uint4* out, u32 units): one
    void* per argument, each pointing at that argument's bytes. It holds the values the pointers
    point into, so they live as long as it does (the driver copies them at the launch)."""

    layout: numpy.ndarray
    pointers: Any          # ctypes c_uint64 * 2: in, out
    units: ctypes.c_uint32
    array: Any             # ctypes c_void_p * 4

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def kernel_params(layout: numpy.ndarray, in_ptr: int, out_ptr: int, units: int) -> KernelParams:
    """The Layout's own bytes (the structured value, not a copy), the two u64 pointers, the u32 count."""
    pointers = (ctypes.c_uint64 * 2)(in_ptr, out_ptr)
    count = ctypes.c_uint32(units)
    size = ctypes.sizeof(ctypes.c_uint64)
    array = (ctypes.c_void_p * 4)(layout.ctypes.data, ctypes.addressof(pointers),
                                  ctypes.addressof(pointers) + size, ctypes.addressof(count))
    return KernelParams(layout, pointers, count, array)


@lru_cache(maxsize=1)
def _cuda_driver() -> tuple[Any, str | None]:
    """cuda-python's driver module and None, or None and why it did not import."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        try:
            from cuda import cuda as driver     # cuda-python before cuda.bindings (12.x)
        except ImportError:
            return None, str(exc)
    return driver, None


# ---------------------------------------------------------------------------------------
# Kernels and the shared area (GPU only)

_FUNCTIONS: dict[tuple[int, int, int], dict[str, Any]] = {}


def kernel_functions(device_index: int, dtype: torch.dtype, nranks: int) -> dict[str, Any]:
    """Compiled kernels for one device, dtype and world size; cached for the process."""
    key = (device_index, DTYPE_CODES[dtype], nranks)
    if key not in _FUNCTIONS:
        cupy = _cupy()
        names = {algo: f"{name}<{key[1]}, {nranks}>" for algo, name in KERNEL_NAMES.items()}
        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(code=KERNEL_SOURCE.read_text(), options=("--std=c++17",),
                                    name_expressions=list(names.values()))
            _FUNCTIONS[key] = {algo: module.get_function(name).kernel for algo, name in names.items()}
    return _FUNCTIONS[key]


def kernel_blocks_per_sm(device_index: int, functions: dict[str, Any], algorithms: tuple[str, ...]) -> int:
    """Resident blocks per SM of the most demanding of these kernels at THREADS_PER_BLOCK
    (cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory and threads)."""
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        return min(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(functions[a].ptr, THREADS_PER_BLOCK, 0)
                   for a in algorithms)


class _PdlLauncher:
    """Launches a CUfunction through cuLaunchKernelEx with programmatic stream serialization
    allowed: the kernel may start before the previous kernel in the stream ends (it waits for it
    in griddepcontrol.wait)."""

    def __init__(self, driver: Any):
        self.driver = driver
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        self.attrs = [attribute]
        # Built once per grid and stream, and once per kernel: filling them is host time on
        # every eager call, and a backend launches a handful of grids on one or two streams.
        self._configs: dict[tuple[int, int, int], Any] = {}
        self._functions: dict[int, Any] = {}

    def _config(self, blocks: int, threads: int, stream_ptr: int) -> Any:
        key = (blocks, threads, stream_ptr)
        config = self._configs.get(key)
        if config is None:
            driver = self.driver
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = blocks, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = 0
            config.hStream = driver.CUstream(stream_ptr)
            config.numAttrs = len(self.attrs)
            config.attrs = self.attrs
            self._configs[key] = config
        return config

    def launch(self, function_ptr: int, blocks: int, threads: int, stream_ptr: int, params: KernelParams) -> None:
        driver = self.driver
        function = self._functions.get(function_ptr)
        if function is None:
            function = self._functions[function_ptr] = driver.CUfunction(function_ptr)
        (result,) = driver.cuLaunchKernelEx(self._config(blocks, threads, stream_ptr), function, params.address, 0)
        if result != driver.CUresult.CUDA_SUCCESS:
            _, name = driver.cuGetErrorName(result)
            raise RuntimeError(f"p2p: cuLaunchKernelEx failed: {name.decode()}")


class _SharedArea:
    """One rank's IPC allocation, its peers' opened allocations, the kernels' Layout table,
    the private Ctrl words and the host-mapped timeout report."""

    def __init__(self, ctx: "RunContext", plan: AreaPlan, timeout_ms: float):
        self.ctx = ctx
        self.plan = plan
        self.timeout_ms = timeout_ms
        self.base = 0
        self.report = 0
        self.opened: list[int] = []
        self.exchanged = False
        self.layout: numpy.ndarray | None = None      # the kernels' by-value Layout parameter
        self.ctrl: torch.Tensor | None = None

    def allocate(self) -> bytes | None:
        """Local step: allocate, zero the flags, fill the Lamport areas with LL_EMPTY; returns the
        IPC handle to share (None at world size 1)."""
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        self.base = runtime.malloc(self.plan.total_bytes)
        runtime.memset(self.base, 0, self.plan.total_bytes)
        memory = cupy.cuda.UnownedMemory(self.base, self.plan.total_bytes, owner=None)
        for offset, nbytes in self.plan.lamport_spans:
            words = cupy.ndarray((nbytes // 4,), dtype=numpy.uint32, memptr=cupy.cuda.MemoryPointer(memory, offset))
            words.fill(LL_EMPTY)
        self.report = runtime.hostAlloc(16, HOST_ALLOC_PORTABLE_MAPPED)
        ctypes.memset(self.report, 0, 16)
        self.ctrl = torch.zeros(CTRL_WORDS, dtype=torch.int32, device=self.ctx.device)
        # Peers may write into this memory as soon as they hold the handle.
        runtime.deviceSynchronize()
        return runtime.ipcGetMemHandle(self.base) if self.ctx.world_size > 1 else None

    def connect(self, handles: list[bytes | None]) -> None:
        """Local step: open every peer's allocation and write the kernels' Layout table."""
        runtime = _cupy().cuda.runtime
        self.exchanged = True
        bases = []
        for rank, handle in enumerate(handles):
            if rank == self.ctx.rank:
                bases.append(self.base)
            else:
                self.opened.append(runtime.ipcOpenMemHandle(handle))
                bases.append(self.opened[-1])
        self.layout = layout_parameter(self.plan, bases, int(self.timeout_ms * 1e6), self.ctrl.data_ptr(),
                                       self.report, self.ctx.rank)

    def timeout_error(self) -> P2PTimeoutError | None:
        """The error the kernels recorded, read from host-mapped memory without a sync."""
        if not self.report:
            return None
        code, peer, epoch, phase = _REPORT.from_address(self.report)
        if not code:
            return None
        return P2PTimeoutError(
            f"p2p: peer rank {peer} did not arrive within {self.timeout_ms:g} ms "
            f"(rank {self.ctx.rank}, call {epoch}, {PHASE_NAMES[phase] if phase < len(PHASE_NAMES) else phase}); "
            "p2p is unusable until it is set up again")

    def release(self) -> None:
        """Collective: no peer may still touch this memory when it is freed."""
        runtime = _cupy().cuda.runtime
        torch.cuda.synchronize(self.ctx.device)   # our kernels are bounded, so this returns
        if self.exchanged and self.ctx.world_size > 1:
            self.ctx.barrier()
        for ptr in self.opened:
            runtime.ipcCloseMemHandle(ptr)
        self.opened = []
        if self.base:
            runtime.free(self.base)
            self.base = 0
        if self.report:
            runtime.freeHost(self.report)
            self.report = 0
        self.layout = self.ctrl = None


def layout_words(plan: AreaPlan, bases: list[int], timeout_ns: int, ctrl: int, report: int, rank: int) -> list[int]:
    """The Layout struct's uint64 words: each area's address in every rank's allocation (0 where
    not allocated), then the scalars, in the struct's order."""
    words = [0] * LAYOUT_WORDS
    for area, offset in enumerate(plan.offsets().values()):
        for peer, base in enumerate(bases):
            words[area * MAX_RANKS + peer] = base + offset if offset is not None else 0
    words[len(LAYOUT_AREAS) * MAX_RANKS:] = [plan.slot_bytes, plan.slice_bytes, timeout_ns, ctrl, report, rank,
                                             len(bases)]
    return words


def layout_parameter(plan: AreaPlan, bases: list[int], timeout_ns: int, ctrl: int, report: int,
                     rank: int) -> numpy.ndarray:
    """Layout as one structured value, which CuPy passes to the kernels by value."""
    value = numpy.zeros(1, dtype=numpy.dtype([("words", numpy.uint64, (LAYOUT_WORDS,))]))
    value["words"][0] = layout_words(plan, bases, timeout_ns, ctrl, report, rank)
    return value


# ---------------------------------------------------------------------------------------
# The backend


@dataclass
class _Calibration:
    sizes: list[int]
    calls_per_graph: list[int]
    times_us: dict[str, list[float]]    # kernel -> slowest rank's per-call time at each size
    rule: AutoRule


class P2PAllreduce(Backend):
    family = "p2p"
    needs = ("cuda", "node", "p2p", "ipc")
    graph_capturable = True
    dtypes = ALL_DTYPES
    max_world_size = MAX_RANKS

    def __init__(self, variant: str, options: P2POptions):
        self.variant = variant
        self.name = f"p2p:{variant}"
        self.algorithms = VARIANTS[variant]
        self.options = options
        # Why p2p:auto measures without the kernels that read peer memory, decided at its first
        # setup; None when they are in, or before, or when a forced rule picks the kernels.
        self._pull_reason: str | None = None
        if variant == "auto" and options.auto_rule is not None:
            self.algorithms = auto_kernels({kernel for _, kernel in options.auto_rule})
        # World size 1 is the kernel-only floor, measured with the one-shot kernels.
        self.min_world_size = 1 if variant in FLOOR_VARIANTS else 2
        self._ctx: RunContext | None = None
        self._area: _SharedArea | None = None
        self._functions: dict[torch.dtype, dict[str, Any]] = {}
        # (most blocks per launch, SMs a rank may count on), agreed by all ranks
        self._grids: dict[torch.dtype, tuple[int, int]] = {}
        self._calibrations: dict[torch.dtype, _Calibration] = {}
        self._dtype: torch.dtype | None = None
        self._streams: dict[int, Any] = {}
        # PDL, decided at the first setup by all ranks: the launcher when on, else why not.
        self._pdl_decided = False
        self._pdl: _PdlLauncher | None = None
        self._pdl_reason: str | None = None

    # -- eligibility --------------------------------------------------------------------

    def software_reason(self) -> str | None:
        return None if _cupy() is not None else "cupy not installed (pip install cupy-cuda12x or cupy-cuda13x)"

    def check(self, ctx: "RunContext") -> str | None:
        # Without a probe snapshot (--no-probe) CUDA's own peer-access answer stands in for it.
        return super().check(ctx) or (None if ctx.verdicts else quick_p2p_reason(ctx.local_world_size))

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        notes = [engines.CUSTOM_AR_ON_BY_DEFAULT]
        if world_size is None or world_size > 2:
            notes += [engines.CUSTOM_AR_PCIE_GATE, engines.FLASHINFER_PCIE_ALTERNATIVE]
        return engines.Settings(self.name, vllm_env=dict(engines.VLLM_ONLY_CUSTOM_ALLREDUCE), notes=notes)

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        return super().supports(message_bytes, dtype) or size_reason(message_bytes, self.options.max_bytes)

    # -- lifecycle ----------------------------------------------------------------------

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        if _cupy() is None:
            raise BackendUnavailable("cupy not installed")
        self._ctx = ctx
        self._dtype = dtype
        if self._area is None:
            self._choose_auto_kernels(ctx)
        slot_bytes = -(-min(max_bytes, self.options.max_bytes) // VECTOR_BYTES) * VECTOR_BYTES
        slot_bytes = max(slot_bytes, VECTOR_BYTES)
        area = self._area
        local_rebuild = (area is None or area.plan.slot_bytes < slot_bytes
                         or area.timeout_error() is not None)
        # Every rank takes the same path, so no rank waits in an exchange another skips.
        if any(ctx.all_gather_objects(local_rebuild)):
            self._release()
            self._connect(ctx, slot_bytes, dtype)
        else:
            self._functions[dtype] = voted(ctx, "p2p kernel compilation",
                                           lambda: kernel_functions(ctx.device.index, dtype, ctx.world_size))
        if dtype not in self._grids:
            self._grids[dtype] = self._agree_grid(ctx, dtype)
        if not self._pdl_decided:
            self._decide_pdl(ctx)
        if len(self.algorithms) > 1 and self.options.auto_rule is None and dtype not in self._calibrations:
            self._calibrations[dtype] = self._calibrate(dtype)

    def _choose_auto_kernels(self, ctx: "RunContext") -> None:
        """p2p:auto measuring its rule: add the kernels that read peer memory where reads
        complete (the same answer on every rank: the snapshot is rank 0's, broadcast)."""
        if self.variant == "auto" and self.options.auto_rule is None:
            self._pull_reason = peer_reads_reason(ctx.snapshot, ctx.world_size, ctx.emulation)
            self.algorithms = auto_kernels(() if self._pull_reason else AUTO_READ_KERNELS)

    def _connect(self, ctx: "RunContext", slot_bytes: int, dtype: torch.dtype) -> None:
        _cupy().cuda.Device(ctx.device.index).use()
        area = _SharedArea(ctx, plan_areas(self.algorithms, ctx.world_size, slot_bytes),
                           self.options.timeout_ms)
        self._area = area

        def compile_and_allocate() -> bytes | None:
            self._functions[dtype] = kernel_functions(ctx.device.index, dtype, ctx.world_size)
            return area.allocate()

        handles = voted_gather(ctx, "p2p buffer allocation", compile_and_allocate)
        voted(ctx, "opening peers' p2p buffers (CUDA IPC)", lambda: area.connect(handles))

    def _agree_grid(self, ctx: "RunContext", dtype: torch.dtype) -> tuple[int, int]:
        """Collective: the most blocks a launch may have and the SMs the block size is spread
        over. Every rank launches the same grid (block b meets block b), so the smallest rank's
        capacity counts."""
        def capacity() -> tuple[int, int]:
            cap = grid_capacity(kernel_blocks_per_sm(ctx.device.index, self._functions[dtype], self.algorithms),
                                torch.cuda.get_device_properties(ctx.device).multi_processor_count, ctx.emulation)
            refusal = cap.refusal()
            if refusal:
                raise BackendUnavailable(refusal)
            return cap.blocks, cap.sms

        caps = voted_gather(ctx, "p2p grid sizing", capacity)
        return min(MAX_BLOCKS, *(blocks for blocks, _ in caps)), min(sms for _, sms in caps)

    def _decide_pdl(self, ctx: "RunContext") -> None:
        """Collective: PDL on every rank or on none, so that no rank launches differently."""
        def local_reason() -> str | None:
            import_error = _cuda_driver()[1]
            return pdl_reason(self.options.pdl, import_error, torch.cuda.get_device_capability(ctx.device),
                              ctx.emulation)

        self._pdl_reason = agreed_pdl_reason(voted_gather(ctx, "p2p PDL check", local_reason))
        self._pdl = _PdlLauncher(_cuda_driver()[0]) if self._pdl_reason is None else None
        self._pdl_decided = True

    def _release(self) -> None:
        # A new buffer may allow larger calibration sizes: measure again after a rebuild.
        self._calibrations.clear()
        if self._area is not None:
            area, self._area = self._area, None
            area.release()

    def close(self) -> None:
        self._release()

    # -- calls --------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise the timeout the kernels recorded, if any (cheap: reads host-mapped memory).
        allreduce() calls it first; a harness may call it after synchronising."""
        error = self._area.timeout_error() if self._area is not None else None
        if error is not None:
            raise error

    def algorithm_for(self, message_bytes: int, dtype: torch.dtype) -> str:
        if len(self.algorithms) == 1:
            return self.algorithms[0]
        return rule_kernel(self._rule(dtype), message_bytes)

    def _rule(self, dtype: torch.dtype) -> AutoRule:
        if self.options.auto_rule is not None:
            return self.options.auto_rule
        return self._calibrations[dtype].rule

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self._area is None:
            raise RuntimeError(f"{self.name}: setup() first")
        self.raise_if_failed()
        message_bytes = x.numel() * x.element_size()
        # The buffer may be smaller than p2p_max_bytes when the sweep's largest size is.
        reason = (super().supports(message_bytes, x.dtype) or size_reason(message_bytes, self._area.plan.slot_bytes)
                  or tensor_reason(x, out, self._ctx.device))
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        if x.dtype not in self._grids:
            raise RuntimeError(f"{self.name}: not set up for {x.dtype}")
        self._launch(self.algorithm_for(message_bytes, x.dtype), x, out)

    def _launch(self, algorithm: str, x: torch.Tensor, out: torch.Tensor) -> None:
        units = x.numel() * x.element_size() // VECTOR_BYTES
        blocks, threads = launch_dims(algorithm, units, self._ctx.world_size, *self._grids[x.dtype], self.options.shape)
        function = self._functions[x.dtype][algorithm]
        if self._pdl is not None:
            self._pdl.launch(function.ptr, blocks, threads, torch.cuda.current_stream(self._ctx.device).cuda_stream,
                             kernel_params(self._area.layout, x.data_ptr(), out.data_ptr(), units))
            return
        function((blocks,), (threads,),
                 (self._area.layout, numpy.uint64(x.data_ptr()), numpy.uint64(out.data_ptr()), numpy.uint32(units)),
                 stream=self._stream())

    def _stream(self) -> Any:
        """torch's current stream as a CuPy stream, so launches are ordered with (and captured
        along with) torch's work."""
        ptr = torch.cuda.current_stream(self._ctx.device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)   # deprecated name in cupy 14
                stream = _cupy().cuda.ExternalStream(ptr, self._ctx.device.index)
            self._streams[ptr] = stream
        return stream

    # -- auto calibration -----------------------------------------------------------------

    def _calibrate(self, dtype: torch.dtype) -> _Calibration:
        """Collective: graph-replay every kernel at a few sizes on every rank; every rank then
        applies choose_rule() to the same gathered numbers, so all pick the same."""
        ctx, area = self._ctx, self._area
        sizes = [s for s in CALIBRATION_SIZES if s <= area.plan.slot_bytes]
        calls = [calibration_calls(s) for s in sizes]
        def measure() -> dict[str, list[float]]:
            times: dict[str, list[float]] = {algorithm: [] for algorithm in self.algorithms}
            x = torch.ones(area.plan.slot_bytes // dtype.itemsize, dtype=dtype, device=ctx.device)
            out = torch.empty_like(x)
            for size in sizes:
                count = size // dtype.itemsize
                for algorithm in times:
                    times[algorithm].append(self._kernel_us(algorithm, x[:count], out[:count]))
            self.raise_if_failed()
            return times

        slowest = slowest_rank_times(voted_gather(ctx, "p2p auto calibration", measure))
        return _Calibration(sizes, calls, slowest, choose_rule(sizes, slowest))

    def _kernel_us(self, algorithm: str, x: torch.Tensor, out: torch.Tensor) -> float:
        """This rank's per-call time of one kernel: timed replays of a graph of back-to-back calls."""
        calls = calibration_calls(x.numel() * x.element_size())
        # One eager call first: CuPy sets up its per-thread context state on a first launch,
        # which must not happen inside a capture.
        self._launch(algorithm, x, out)
        graph = capture_graph(lambda _: self._launch(algorithm, x, out), calls)
        self._ctx.barrier()
        # The first replay absorbs the ranks' start skew and is dropped.
        replay_us = per_step_us(self._ctx, lambda _: graph.replay(), CALIBRATION_REPLAYS + 1)[1:]
        return per_call_median_us(replay_us, calls)

    def make_workload(self, ctx: "RunContext", count: int, dtype: torch.dtype,
                      shape: tuple[int, int] | None, pairs: int) -> AllreduceWorkload:
        return _P2PWorkload(self, ctx, count, dtype, pairs)

    # -- what rows record -------------------------------------------------------------------

    def row_fields(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "p2p_kernels": list(self.algorithms),
            "p2p_max_bytes": self.options.max_bytes,
            "p2p_timeout_ms": self.options.timeout_ms,
            "p2p_staging": "in-kernel",
            "p2p_threads": self.options.shape.threads or "by size",
            "p2p_vectors_per_thread": self.options.shape.vectors_per_thread,
        }
        if self._ctx is not None and self._ctx.world_size == 1:
            extra["p2p_kernel_floor"] = True
        if self._pdl_decided:
            extra["p2p_pdl"] = self._pdl is not None
            if self._pdl_reason is not None:
                extra["p2p_pdl_reason"] = self._pdl_reason
        if self._dtype in self._grids:
            extra["p2p_grid_cap_blocks"], extra["p2p_grid_sms"] = self._grids[self._dtype]
        if self._pull_reason is not None:     # only p2p:auto decides one
            extra["p2p_auto_pull_reason"] = self._pull_reason
        if len(self.algorithms) > 1 and self._dtype is not None:
            extra["p2p_auto_rule"] = format_auto_rule(self._rule(self._dtype))
            calibration = self._calibrations.get(self._dtype)
            if self.options.auto_rule is not None or calibration is None:
                extra["p2p_auto_rule_source"] = "option"
            else:
                extra["p2p_auto_rule_source"] = "measured"
                extra["p2p_calibration"] = {"sizes": calibration.sizes,
                                            "calls_per_graph": calibration.calls_per_graph,
                                            "replays": CALIBRATION_REPLAYS,
                                            "per_call_us": {KERNEL_VARIANT[k]: [round(t, 3) for t in times]
                                                            for k, times in calibration.times_us.items()}}
        return {"extra": extra}


class _P2PWorkload(AllreduceWorkload):
    """The plain allreduce workload plus the timeout check. The harness calls verify() after
    it synchronised, so a wait that gave up anywhere in the row (graph replays included,
    which never pass through allreduce()) becomes BackendTimeout, a hang row, rather than
    a count of wrong values."""

    backend: P2PAllreduce

    def verify(self, first: int, calls: int) -> PassCheck:
        self.backend.raise_if_failed()
        return super().verify(first, calls)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--p2p-max-bytes", help="largest message for the p2p backends (default 8M)")
    group.add_argument("--p2p-auto-rule", metavar="RULE",
                       help="force p2p:auto's choice of kernel by size, e.g. "
                            "'oneshot_lamport<=256K,twoshot_lamport' (default: measured at setup); a rule that names "
                            "oneshot_pull asks for reads of peer memory")
    group.add_argument("--p2p-timeout-ms", type=float,
                       help="how long a p2p kernel waits for a peer before it gives up (default 5000)")
    group.add_argument("--p2p-threads", help="threads per p2p block, a multiple of 32 up to "
                                             f"{THREADS_PER_BLOCK} (default: by size)")
    group.add_argument("--p2p-vectors-per-thread",
                       help="16-byte vectors each p2p thread takes before another block is added (default 1)")
    group.add_argument("--p2p-pdl", choices=("on", "off"),
                       help="launch the p2p kernels with programmatic dependent launch where every rank can "
                            "(cuda-python, SM 9.0+; rows say why not) (default on)")


def read_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"p2p_max_bytes": args.p2p_max_bytes, "p2p_auto_rule": args.p2p_auto_rule,
               "p2p_timeout_ms": args.p2p_timeout_ms, "p2p_threads": args.p2p_threads,
               "p2p_vectors_per_thread": args.p2p_vectors_per_thread, "p2p_pdl": args.p2p_pdl}
    P2POptions.from_options(options)    # bad values are bad input, said before anything runs
    return options


def make(variant: str | None, options: dict[str, Any]) -> list[Backend]:
    opts = P2POptions.from_options(options)
    names = DEFAULT_VARIANTS if variant is None else (variant.strip(),)
    for name in names:
        if name not in VARIANTS:
            raise UsageError(f"unknown p2p variant {name!r}: choose from {', '.join(VARIANTS)}")
    return [P2PAllreduce(name, opts) for name in names]


FACTORY = BackendFactory(
    family="p2p",
    make=make,
    on_gpu_by_default=True,
    on_cpu_by_default=False,
    summary="commbench's own CUDA-IPC allreduce kernels (NVRTC via CuPy), graph-capturable, "
            "timeout-bounded",
    variants_help=[
        "p2p:oneshot_lamport  one-shot, Lamport: every rank pushes its input into every peer; the data is its own flag",
        "p2p:oneshot          one-shot, push, then a fence and a flag per peer; reduces locally",
        "p2p:oneshot_pull     one-shot, pull: every rank reads every peer's staged input (never by default)",
        "p2p:twoshot_lamport  two-shot, Lamport: reduce-scatter then all-gather, writes only, no flags",
        "p2p:twoshot          two-shot, push, a fence and a flag per peer after each half",
        "p2p:auto             the fastest of the four push kernels per size, measured at setup, and of the pull "
        "one-shot where peer reads are safe (one GPU, or NVLink between every pair) "
        "(--p2p-auto-rule, --p2p-max-bytes, --p2p-timeout-ms)",
    ],
    probe_specs=(None, "oneshot_pull"),
    packages=("cupy-cuda12x", "cupy-cuda13x", "cupy"),
    add_arguments=add_arguments, read_options=read_options,
)
