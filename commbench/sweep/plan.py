"""The sweep plan: message sizes, dtypes, modes and iteration counts, validated up front.

Everything here is checked before any process group exists, so bad input costs nothing and
writes nothing.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from commbench.errors import UsageError
from commbench.sweep.dtypes import dtype_name, parse_dtypes
from commbench.units import (MAX_MESSAGE_BYTES, format_bytes, parse_bytes, parse_int_list, parse_list,
                             positive_finite)

MODES = ("eager", "graph")

# Defaults: decode to prefill on GPUs; a short sweep on CPUs so a laptop run takes seconds.
GPU_MIN_BYTES, GPU_MAX_BYTES = 4 << 10, 256 << 20
CPU_MIN_BYTES, CPU_MAX_BYTES = 1 << 10, 256 << 10
GPU_ITERATIONS, CPU_ITERATIONS = (20, 200), (5, 20)  # (at the largest size, at small sizes)
ITERATION_BYTES_BUDGET = 256 << 20   # iterations = budget / size, clamped to the range above
# Every timed call's output is kept until the pass is checked: at most this much of them, so
# default iterations drop below the range above only for the largest messages (8 at 256 MiB).
CHECK_BYTES_BUDGET = 2 << 30
MIN_CHECKED_CALLS = 3
# Calls captured per CUDA graph: replaying a graph costs ~3 us of its own (H200, from graphs of
# 10 and 100 calls), so 128 calls keep that below 2% of any call above ~1.1 us; larger messages
# take longer per call and need fewer (256 MiB of messages per graph, at least one call).
MAX_GRAPH_OPS = 128
GRAPH_BYTES_BUDGET = 256 << 20
GRAPH_REPLAYS = (20, 50)             # replays per pass: a quarter of the eager calls, in this range


@dataclass(frozen=True)
class Shape:
    """One planned message: bytes per rank, and the (tokens, hidden) it came from, if any."""

    message_bytes: int
    tokens: int | None = None
    hidden: int | None = None


@dataclass
class SweepPlan:
    shapes: list[Shape]
    dtypes: list[torch.dtype]
    modes: list[str]
    warmup: int
    iterations: int | None        # None: scale with size
    min_iterations: int
    max_iterations: int
    graph_ops: int | None         # None: by size (graph_ops_for)
    timeout_s: float              # watchdog per row
    setup_timeout_s: float        # watchdog per backend setup: first-use kernel builds take minutes
    notes: list[str] = field(default_factory=list)

    def sizes_for(self, dtype: torch.dtype) -> list[Shape]:
        """Shapes whose byte count is a whole number of elements of dtype."""
        return [s for s in self.shapes if s.message_bytes % dtype.itemsize == 0]

    def iterations_for(self, message_bytes: int) -> int:
        """Timed eager calls per pass."""
        if self.iterations is not None:
            return self.iterations
        scaled = ITERATION_BYTES_BUDGET // max(1, message_bytes)
        calls = min(self.max_iterations, max(self.min_iterations, scaled))
        return int(max(MIN_CHECKED_CALLS, min(calls, CHECK_BYTES_BUDGET // max(1, message_bytes))))

    def graph_ops_for(self, message_bytes: int) -> int:
        """Calls captured per CUDA graph."""
        if self.graph_ops is not None:
            return self.graph_ops
        return int(max(1, min(MAX_GRAPH_OPS, GRAPH_BYTES_BUDGET // max(1, message_bytes))))

    def graph_replays_for(self, message_bytes: int) -> int:
        """Timed replays of the graph per pass."""
        if self.iterations is not None:
            return self.iterations
        low, high = GRAPH_REPLAYS
        return int(min(high, max(low, self.iterations_for(message_bytes) // 4)))

    @property
    def max_bytes(self) -> int:
        return max(s.message_bytes for s in self.shapes)

    def record(self) -> dict[str, Any]:
        """The plan as run.json records it (results.MEASURED_PLAN_KEYS must match on a resume)."""
        return {"message_bytes": [s.message_bytes for s in self.shapes],
                "shapes": [[s.tokens, s.hidden] for s in self.shapes if s.tokens],
                "dtypes": [dtype_name(d) for d in self.dtypes], "modes": self.modes,
                "warmup": self.warmup, "iterations": self.iterations, "graph_ops": self.graph_ops,
                "timeout_s": self.timeout_s, "setup_timeout_s": self.setup_timeout_s}


def geometric_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes > max_bytes:
        raise UsageError(f"min size {format_bytes(min_bytes)} is larger than max size {format_bytes(max_bytes)}")
    if factor < 2:
        raise UsageError(f"step factor must be an integer >= 2 (got {factor})")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def _mode(text: str) -> str:
    if text not in MODES:
        raise UsageError(f"unknown mode {text!r}: choose from {', '.join(MODES)}")
    return text


def timeout_s(value: float, flag: str) -> float:
    """A watchdog limit in seconds: positive, finite and no longer than a thread timer can wait
    (past that, starting the timer raises in its own thread and the watchdog is silently off)."""
    return positive_finite(value, flag, "seconds", at_most=threading.TIMEOUT_MAX)


def build_plan(args: argparse.Namespace, on_gpu: bool) -> SweepPlan:
    dtypes = parse_dtypes(args.dtype if args.dtype is not None else ("bf16" if on_gpu else "fp32"))
    modes = parse_list(args.mode if args.mode is not None else ("eager,graph" if on_gpu else "eager"), "--mode", _mode)
    if "graph" in modes and not on_gpu:
        raise UsageError("graph mode needs CUDA GPUs; on the CPU use --mode eager")

    shapes = _shapes(args, on_gpu, dtypes)
    low, high = GPU_ITERATIONS if on_gpu else CPU_ITERATIONS
    for name in ("iters", "warmup", "graph_ops"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be positive (got {value})")
    plan = SweepPlan(shapes=shapes, dtypes=dtypes, modes=modes,
                     warmup=args.warmup if args.warmup is not None else (5 if on_gpu else 2),
                     iterations=args.iters, min_iterations=low, max_iterations=high,
                     graph_ops=args.graph_ops, timeout_s=timeout_s(args.timeout, "--timeout"),
                     setup_timeout_s=timeout_s(args.setup_timeout, "--setup-timeout"))
    for dtype in dtypes:
        if not plan.sizes_for(dtype):   # the sweep would run nothing for it and say nothing
            raise UsageError(f"no message size ({', '.join(format_bytes(s.message_bytes) for s in shapes)}) is a "
                             f"whole number of {dtype_name(dtype)} elements ({dtype.itemsize} bytes each)")
        # Some sizes only: each would be dropped for this dtype without a word.
        dropped = [format_bytes(s.message_bytes) for s in shapes if s.message_bytes % dtype.itemsize]
        if dropped:
            raise UsageError(f"message size {', '.join(dropped)} is not a whole number of {dtype_name(dtype)} "
                             f"elements ({dtype.itemsize} bytes each): drop it or pick a multiple")
    return plan


def _shapes(args: argparse.Namespace, on_gpu: bool, dtypes: list[torch.dtype]) -> list[Shape]:
    chosen = [name for name, value in (("--sizes", args.sizes), ("--tokens", args.tokens)) if value is not None]
    if (args.min_bytes or args.max_bytes) and chosen:
        raise UsageError(f"-b/-e and {chosen[0]} choose sizes in two ways: use one")
    if len(chosen) == 2:
        raise UsageError("--sizes and --tokens choose sizes in two ways: use one")
    if args.tokens is not None or args.hidden is not None:
        if args.tokens is None or args.hidden is None:
            raise UsageError("model shapes need both --tokens and --hidden")
        if len(dtypes) != 1:
            raise UsageError("model shapes (--tokens/--hidden) take one --dtype")
        item = dtypes[0].itemsize
        hidden = parse_int_list(str(args.hidden), "--hidden")
        if len(hidden) != 1:
            raise UsageError("--hidden takes one value")
        shapes = [Shape(t * hidden[0] * item, t, hidden[0]) for t in parse_int_list(args.tokens, "--tokens")]
        largest = max(shapes, key=lambda s: s.message_bytes)
        if largest.message_bytes > MAX_MESSAGE_BYTES:
            raise UsageError(f"--tokens {largest.tokens} x --hidden {largest.hidden} is {largest.message_bytes} bytes "
                             f"per rank, more than {format_bytes(MAX_MESSAGE_BYTES)}")
        return shapes
    if args.sizes is not None:
        return [Shape(s) for s in sorted(parse_list(args.sizes, "--sizes", parse_bytes))]
    min_bytes = parse_bytes(args.min_bytes) if args.min_bytes else (GPU_MIN_BYTES if on_gpu else CPU_MIN_BYTES)
    max_bytes = parse_bytes(args.max_bytes) if args.max_bytes else (GPU_MAX_BYTES if on_gpu else CPU_MAX_BYTES)
    factor = args.step_factor if args.step_factor is not None else (2 if on_gpu else 4)
    return [Shape(s) for s in geometric_sizes(min_bytes, max_bytes, factor)]
