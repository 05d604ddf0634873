"""p2p's rules that need no GPU: its variants, its options (P2POptions, p2p:auto's rule), when it
cannot run (size, tensors, PDL, peer reads), and how p2p:auto's calibration picks a kernel per
size from the times every rank measured."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from commbench.backends.p2p.layout import (FUSED_ONESHOT, FUSED_TWOSHOT, GRAPH_FALLBACK, MAX_VECTORS_PER_THREAD,
                                           ONESHOT_GRAPH, ONESHOT_LL,
                                           ONESHOT_PULL, ONESHOT_PUSH, THREADS_PER_BLOCK, TWOSHOT, TWOSHOT_GRAPH,
                                           TWOSHOT_LL, VECTOR_BYTES, WARP_THREADS, LaunchShape)
from commbench.errors import UsageError
from commbench.runtime.context import Emulation, competes_for_sms
from commbench.topology.selection import non_nvlink_pairs
from commbench.units import format_bytes, parse_bytes


DEFAULT_MAX_BYTES = 8 << 20


# Far above any scheduling or host delay between healthy ranks (ranks sharing one GPU
# included), far below a frozen job.
DEFAULT_TIMEOUT_MS = 5000.0


# variant -> kernels it may launch
VARIANTS: dict[str, tuple[str, ...]] = {
    "oneshot_lamport": (ONESHOT_LL,),
    "oneshot": (ONESHOT_PUSH,),
    "oneshot_pull": (ONESHOT_PULL,),
    "twoshot_lamport": (TWOSHOT_LL,),
    "twoshot": (TWOSHOT,),
    "oneshot_graph": (ONESHOT_GRAPH,),
    "twoshot_graph": (TWOSHOT_GRAPH,),
    # In order of preference on a tie: fewer round trips first.
    "auto": (ONESHOT_LL, ONESHOT_PUSH, TWOSHOT_LL, TWOSHOT),
    # Allreduce + residual add + RMSNorm in one kernel (model shapes only): by size, or one form.
    "fused": (FUSED_ONESHOT, FUSED_TWOSHOT),
    "fused_oneshot": (FUSED_ONESHOT,),
    "fused_twoshot": (FUSED_TWOSHOT,),
}


# The variants that compute the fused pattern (backends/p2p/fused.py), made only for model shapes.
FUSED_VARIANTS = ("fused", "fused_oneshot", "fused_twoshot")


# What p2p:auto adds, last (it must win by the margin), where reads of peer memory complete.
AUTO_READ_KERNELS = (ONESHOT_PULL, ONESHOT_GRAPH, TWOSHOT_GRAPH)


DEFAULT_VARIANTS = ("oneshot_lamport", "oneshot", "twoshot_lamport", "twoshot", "auto")


# p2p:fused's one-shot up to this message size per world size, its two-shot above. Provisional, not yet
# measured for the fused kernels: where the Lamport one-shot hands over to another kernel in p2p:auto's
# eager rules (no graph kernels, as the fused kernels have none) in the engine-kernel reference under
# MPS (results/reference/h200-mps-engine-kernels/, 2026-12-03): 2M at 2 ranks, 256K at 4, 64K at 8.
FUSED_ONESHOT_MAX_BYTES = {2: 2 << 20, 4: 256 << 10, 8: 64 << 10}


def fused_kernel(world_size: int, message_bytes: int) -> str:
    """The fused kernel p2p:fused runs for a message of this size."""
    return FUSED_ONESHOT if message_bytes <= FUSED_ONESHOT_MAX_BYTES.get(world_size, 64 << 10) else FUSED_TWOSHOT


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


def choose_rules(sizes: list[int], times_us: dict[str, list[float]]) -> tuple[AutoRule, AutoRule]:
    """p2p:auto's rule in CUDA graphs and its rule outside them, where the graph kernels cannot
    run (their buffers are registered only after a capture): the same choice without them."""
    eager = {kernel: times for kernel, times in times_us.items() if kernel not in GRAPH_FALLBACK}
    return choose_rule(sizes, times_us), choose_rule(sizes, eager)


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
