"""p2p's side of its kernels' contract: the constants and structs allreduce.cu is built
with, the kernels by name, how a launch covers a message (launch shapes, the grid cap), where each
area lives in the shared allocation (the buffer plan) and the Layout parameter every kernel takes.
Pure: no GPU, no CuPy."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from commbench.runtime.context import MPS_PERCENT_VAR, Emulation, competes_for_sms, own_sms


# These mirror P2P_MAX_RANKS / P2P_MAX_BLOCKS / LL_BUFFERS / LL_ONESHOT_BUFFERS / SEMAPHORE_WORDS /
# LL_EMPTY / PEER_UNKNOWN and the Layout and Ctrl structs in allreduce.cu.
MAX_RANKS = 8


MAX_BLOCKS = 64


FLAG_PHASES = 2


SEMAPHORE_WORDS = 32     # the graph one-shot's counter barrier: one 128-byte line per block


# The flags, then the semaphores.
FLAG_AREA_BYTES = FLAG_PHASES * MAX_BLOCKS * MAX_RANKS * 4 + MAX_BLOCKS * SEMAPHORE_WORDS * 4


LAYOUT_AREAS = ("flags", "recv", "gather", "stage", "ll", "ll_rs", "ll_ag")   # one pointer per rank each


LAYOUT_SCALARS = ("slot_bytes", "slice_bytes", "timeout_ns", "ctrl", "report", "rank", "nranks")


LAYOUT_WORDS = len(LAYOUT_AREAS) * MAX_RANKS + len(LAYOUT_SCALARS)


LL_BUFFERS = 3           # the Lamport two-shot's


LL_ONESHOT_BUFFERS = 2   # the Lamport one-shot's


LL_EMPTY = 0x80000000


CTRL_WORDS = 8 + 3 * MAX_BLOCKS        # abort, units per Lamport two-shot buffer, spare, three counters per block


THREADS_PER_BLOCK = 512


WARP_THREADS = 32                      # also more than MAX_RANKS: the flag barrier's threads 0..N-1


MAX_VECTORS_PER_THREAD = 16


SPREAD_THREADS = (128, 256, THREADS_PER_BLOCK)


VECTOR_BYTES = 16                      # every thread moves 16-byte vectors


AREA_ALIGN_BYTES = 4096


PARITIES = 2


DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


ONESHOT_LL, TWOSHOT_LL = "oneshot_lamport", "twoshot_lamport"


ONESHOT_PUSH, ONESHOT_PULL, TWOSHOT = "oneshot_push", "oneshot_pull", "twoshot_push"


# Run only inside a CUDA graph, over the peers' captured buffers registered after capture;
# an eager call runs its fallback kernel instead (GRAPH_FALLBACK): the fastest kernel of the
# same shape that stages its input.
ONESHOT_GRAPH, TWOSHOT_GRAPH = "oneshot_graph", "twoshot_graph"


GRAPH_FALLBACK = {ONESHOT_GRAPH: ONESHOT_LL, TWOSHOT_GRAPH: TWOSHOT}


# The fused kernels (allreduce, residual add and RMSNorm in one launch, p2p:fused): each runs over the
# buffers and call count of the Lamport kernel of its shape (FUSED_AREAS), so a plan that holds them
# holds those kernels' areas.
FUSED_ONESHOT, FUSED_TWOSHOT = "fused_oneshot", "fused_twoshot"
FUSED_AREAS = {FUSED_ONESHOT: ONESHOT_LL, FUSED_TWOSHOT: TWOSHOT_LL}
FUSED_KERNELS = tuple(FUSED_AREAS)


# The graph table: one row per captured call of a graph kernel, every rank's input then every
# rank's output (MAX_RANKS words each), as opened in this process.
GRAPH_ROW_WORDS = 2 * MAX_RANKS


GRAPH_ROWS = 16384        # 2 MiB: p2p:auto's calibration captures about 900 calls per dtype


# The Lamport one-shot's second shape (SGLang's push shape: it also pushes into its own slot and
# polls every slot alike), a kernel of its own that a launch of ONESHOT_LL runs above 2 ranks up
# to LL_OWN_SLOT_UNITS (kernel_form). Measured under MPS (results/reference/h200-mps-p2p-tune/):
# 9-19% faster at 8 ranks 4K-32K and 3-8% at 4 ranks 4K-64K; its extra write costs bandwidth
# above (up to 21% slower at 4 ranks 256K) and it wins nothing at 2 ranks.
ONESHOT_LL_OWN_SLOT = "oneshot_lamport_own_slot"
LL_OWN_SLOT_UNITS = 4096   # 64 KiB


# Every compiled kernel: the algorithms' and the Lamport one-shot's second shape.
KERNEL_NAMES = {ONESHOT_LL: "p2p_ll_oneshot", TWOSHOT_LL: "p2p_ll_twoshot", ONESHOT_PUSH: "p2p_oneshot_push",
                ONESHOT_PULL: "p2p_oneshot_pull", TWOSHOT: "p2p_twoshot_push", ONESHOT_GRAPH: "p2p_oneshot_graph",
                TWOSHOT_GRAPH: "p2p_twoshot_graph", ONESHOT_LL_OWN_SLOT: "p2p_ll_oneshot_own_slot",
                FUSED_ONESHOT: "p2p_fused_oneshot", FUSED_TWOSHOT: "p2p_fused_twoshot"}


def kernel_form(algorithm: str, units: int, nranks: int) -> str:
    """The key of KERNEL_NAMES whose kernel one launch of `algorithm` runs."""
    if algorithm == ONESHOT_LL and nranks > 2 and units <= LL_OWN_SLOT_UNITS:
        return ONESHOT_LL_OWN_SLOT
    return algorithm


TWO_SHOT_KERNELS = (TWOSHOT_LL, TWOSHOT, TWOSHOT_GRAPH)     # each rank reduces one slice


@dataclass(frozen=True)
class LaunchShape:
    """How a launch covers its vectors (options p2p_threads and p2p_vectors_per_thread):
    `threads` per block (None: by size, see spread_threads), each thread taking
    `vectors_per_thread` of them before another block is added."""

    threads: int | None = None
    vectors_per_thread: int = 1


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


def warp_spread(units: int, cap_blocks: int, sms: int) -> tuple[int, int] | None:
    """SGLang's push shape (its 1shot_push hands warp w to block w mod grid): a message's warps
    one per block over the SMs first, then a second warp in every block, and so on; only the
    blocks that hold a vector. None once that takes more than THREADS_PER_BLOCK threads."""
    warps = -(-units // WARP_THREADS)
    threads = WARP_THREADS * -(-warps // max(1, min(cap_blocks, MAX_BLOCKS, sms, warps)))
    return (-(-units // threads), threads) if threads <= THREADS_PER_BLOCK else None


def launch_dims(algorithm: str, units: int, nranks: int, cap_blocks: int, sms: int,
                shape: LaunchShape = LaunchShape()) -> tuple[int, int]:
    """(blocks, threads per block) of one launch; the same on every rank, since it depends only
    on size, world, the options and the cap and SM count that all ranks agreed on at setup. A
    launch of one block takes only the whole warps its work needs. The Lamport one-shot in its
    own-slot form (above 2 ranks up to 64 KiB) spreads its warps over the SMs (warp_spread):
    measured under MPS (results/reference/h200-mps-p2p-tune/, study of 20:27) 11% faster at 8
    ranks 4K and 10% at 64K, 2-4% at 4 ranks 4K-8K; at 2 ranks (the other form) 7-24% slower
    at 4K-8K, so not there."""
    if shape == LaunchShape() and kernel_form(algorithm, units, nranks) == ONESHOT_LL_OWN_SLOT:
        spread = warp_spread(units, cap_blocks, sms)
        if spread is not None:
            return spread
    return size_dims(_work_units(algorithm, units, nranks), cap_blocks, sms, shape)


def size_dims(work_units: int, cap_blocks: int, sms: int, shape: LaunchShape = LaunchShape()) -> tuple[int, int]:
    """(blocks, threads) for the vectors one rank's threads cover, by the shape's options or by
    spread_threads, one block per SM up to the cap."""
    thread_work = -(-work_units // shape.vectors_per_thread)
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


def launched_kernels(algorithms: tuple[str, ...]) -> tuple[str, ...]:
    """The algorithms a variant may launch: its own and the eager fallbacks of its graph kernels."""
    return (*algorithms, *(GRAPH_FALLBACK[a] for a in algorithms if a in GRAPH_FALLBACK))


def area_kernels(algorithms: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels whose areas a plan for these algorithms holds: the launched ones, a fused kernel
    standing for the Lamport kernel whose buffers it uses."""
    return tuple(FUSED_AREAS.get(a, a) for a in launched_kernels(algorithms))


def kernel_forms(algorithms: tuple[str, ...]) -> tuple[str, ...]:
    """The compiled kernels (keys of KERNEL_NAMES) these algorithms' launches may run."""
    return (*algorithms, *((ONESHOT_LL_OWN_SLOT,) if ONESHOT_LL in algorithms else ()))


def plan_areas(algorithms: tuple[str, ...], nranks: int, slot_bytes: int) -> AreaPlan:
    """Flags first, then only the data areas the variant's kernels use."""
    algorithms = area_kernels(algorithms)
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

    ll = take_lamport(LL_ONESHOT_BUFFERS * nranks * slot_bytes) if ONESHOT_LL in algorithms else None
    ll_rs = take_lamport(LL_BUFFERS * nranks * slice_bytes) if TWOSHOT_LL in algorithms else None
    ll_ag = take_lamport(LL_BUFFERS * slot_bytes) if TWOSHOT_LL in algorithms else None
    end = -(-offset // AREA_ALIGN_BYTES) * AREA_ALIGN_BYTES
    return AreaPlan(slot_bytes, slice_bytes, recv, gather, stage, ll, ll_rs, ll_ag, end, tuple(lamport))


@dataclass(frozen=True)
class KernelParams:
    """cuLaunchKernelEx's kernelParams: one void* per kernel argument, each pointing at that
    argument's bytes. It holds the values the pointers point into (`values`), so they live as long
    as it does (the driver copies them at the launch)."""

    values: tuple[Any, ...]
    array: Any             # ctypes c_void_p * len(arguments)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def kernel_params(layout: numpy.ndarray, in_ptr: int, out_ptr: int, units: int) -> KernelParams:
    """For (the kernel's table by value: Layout, or LamportLayout for the Lamport one-shot; const
    uint4* in, uint4* out, u32 units): the table's own bytes (the structured value, not a copy), the
    two u64 pointers, the u32 count."""
    pointers = (ctypes.c_uint64 * 2)(in_ptr, out_ptr)
    count = ctypes.c_uint32(units)
    size = ctypes.sizeof(ctypes.c_uint64)
    array = (ctypes.c_void_p * 4)(layout.ctypes.data, ctypes.addressof(pointers),
                                  ctypes.addressof(pointers) + size, ctypes.addressof(count))
    return KernelParams((layout, pointers, count), array)


def fused_params(layout: numpy.ndarray, args: numpy.ndarray) -> KernelParams:
    """For a fused kernel (its table by value, FusedArgs by value): both structured values' own bytes."""
    return KernelParams((layout, args), (ctypes.c_void_p * 2)(layout.ctypes.data, args.ctypes.data))


# ---- the fused kernels' arguments and launch shape ----

# These mirror FUSED_VECTORS / FUSED_MAX_GROUP / FUSED_GROUP_TOKENS and struct FusedArgs in allreduce.cu.
FUSED_VECTORS = 4           # a thread's most 16-byte vectors of one token (held in registers for the norm)
FUSED_MAX_GROUP = 32        # most blocks sharing one token
FUSED_GROUP_TOKENS = MAX_BLOCKS
FUSED_PARTIAL_WORDS = FUSED_GROUP_TOKENS * FUSED_MAX_GROUP   # u64 {call, sum of squares} slots
FUSED_ARGS = numpy.dtype([("pointers", numpy.uint64, (6,)), ("tokens", numpy.uint32), ("row_units", numpy.uint32),
                          ("group_blocks", numpy.uint32), ("eps", numpy.float32), ("inv_hidden", numpy.float32),
                          ("unused", numpy.uint32)])


@dataclass(frozen=True)
class FusedDims:
    """One fused launch: `blocks` of `threads`, in groups of `group_blocks` blocks that share a token
    (tokens g, g + groups, ... go to group g), each thread taking up to FUSED_VECTORS vectors of it."""

    blocks: int
    threads: int
    group_blocks: int


def fused_row_reason(row_units: int) -> str | None:
    """Why the fused kernels cannot take rows of this many 16-byte vectors; None when they can (a
    thread keeps its vectors of a token in registers until the norm: at most FUSED_VECTORS each, and
    a token may be alone in its block when the grid has fewer blocks than tokens)."""
    most = FUSED_VECTORS * THREADS_PER_BLOCK
    if row_units > most:
        return (f"a row of {row_units * VECTOR_BYTES} bytes exceeds the fused kernels' {most * VECTOR_BYTES} "
                f"({FUSED_VECTORS} vectors of {VECTOR_BYTES} bytes for each of {THREADS_PER_BLOCK} threads)")
    return None


def fused_dims(tokens: int, row_units: int, cap_blocks: int, sms: int, max_group: int = FUSED_MAX_GROUP) -> FusedDims:
    """The fused kernels' launch: as many blocks as the ranks may keep resident (the cap, one per SM),
    a token's vectors spread over up to `max_group` blocks while there are fewer tokens than blocks
    (then tokens * group blocks <= FUSED_GROUP_TOKENS, the partial slots), each thread taking as few
    vectors as fit 512 threads (one first: the most loads in flight). Whole warps, the same on every rank."""
    blocks = max(1, min(cap_blocks, MAX_BLOCKS, sms))
    group = max(1, min(max_group, blocks // tokens)) if tokens < blocks else 1
    groups = min(tokens, blocks // group)
    per_block = -(-row_units // group)
    for vectors in range(1, FUSED_VECTORS + 1):
        threads = WARP_THREADS * -(-per_block // (vectors * WARP_THREADS))
        if threads <= THREADS_PER_BLOCK:
            return FusedDims(groups * group, threads, group)
    raise ValueError(fused_row_reason(row_units) or "unreachable")


def fused_args(pointers: tuple[int, int, int, int, int, int], tokens: int, row_units: int, group_blocks: int,
               eps: float, hidden: int) -> numpy.ndarray:
    """FusedArgs by value: (in, residual_in, gamma, residual_out, norm_out, partials) and the shape."""
    value = numpy.zeros(1, dtype=FUSED_ARGS)
    value["pointers"][0] = pointers
    value["tokens"], value["row_units"], value["group_blocks"] = tokens, row_units, group_blocks
    value["eps"], value["inv_hidden"] = eps, 1.0 / hidden
    return value


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


def _structured(words: list[int]) -> numpy.ndarray:
    """uint64 words as one structured value, which CuPy passes to a kernel by value."""
    value = numpy.zeros(1, dtype=numpy.dtype([("words", numpy.uint64, (len(words),))]))
    value["words"][0] = words
    return value


def layout_parameter(plan: AreaPlan, bases: list[int], timeout_ns: int, ctrl: int, report: int,
                     rank: int) -> numpy.ndarray:
    """The Layout parameter of every kernel but the Lamport one-shot's."""
    return _structured(layout_words(plan, bases, timeout_ns, ctrl, report, rank))


# The Lamport one-shot's kernels take LamportLayout (allreduce.cu): only these of the Layout's
# fields, in this order (104 bytes by value against 504: measured 2-6% faster at 8 ranks, 2% at 4).
LAMPORT_LAYOUT_FIELDS = ("ll", "slot_bytes", "timeout_ns", "ctrl", "report", "rank")


LAMPORT_LAYOUT_KERNELS = (ONESHOT_LL, ONESHOT_LL_OWN_SLOT, FUSED_ONESHOT)


def lamport_parameter(layout: numpy.ndarray) -> numpy.ndarray:
    """LamportLayout's value: its fields picked from a Layout value's words."""
    words = [int(w) for w in layout["words"][0]]
    areas = len(LAYOUT_AREAS) * MAX_RANKS
    picked: list[int] = []
    for field in LAMPORT_LAYOUT_FIELDS:
        if field in LAYOUT_AREAS:
            start = LAYOUT_AREAS.index(field) * MAX_RANKS
            picked += words[start:start + MAX_RANKS]
        else:
            picked.append(words[areas + LAYOUT_SCALARS.index(field)])
    return _structured(picked)
