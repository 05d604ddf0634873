"""The sweep plan: message sizes, dtypes, modes and iteration counts, validated up front; the
cells each backend variant measures.

Everything here is checked before any process group exists, so bad input costs nothing and
writes nothing.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from commbench.models import DEFAULT_CONCURRENCIES, Model, lookup
from commbench.errors import UsageError
from commbench.results.schema import Cell, Shape
from commbench.runtime.dtypes import dtype_name, parse_dtypes
from commbench.units import format_bytes, parse_bytes, parse_int_list, parse_list, positive_finite, shape_bytes

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
# Eager jitter pass: per-call timers on at least this many calls, so p99 is a per-call tail (with
# fewer, it is the max of a few); run in rounds over the row's pairs when they are fewer.
JITTER_CALLS = 100


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
    graph_replays: int | None     # -G N: timed replays per pass; None: the iterations (graph_replays_for)
    timeout_s: float              # watchdog per row
    setup_timeout_s: float        # watchdog per backend setup: first-use kernel builds take minutes
    check: bool = True            # -c 0: no output is checked (every row says so)
    jitter_calls: int | None = None   # eager jitter pass: calls timed one by one; None: jitter_calls_for
    notes: list[str] = field(default_factory=list)

    def sizes_for(self, dtype: torch.dtype) -> list[Shape]:
        """Shapes whose byte count is a whole number of elements of dtype."""
        return [s for s in self.shapes if s.message_bytes % dtype.itemsize == 0]

    def cells(self, backend: str, op: str, env_setting: Mapping[str, str]) -> list[Cell]:
        """Every cell one backend variant measures, in the order they are measured (dtype, then
        size, then mode)."""
        setting = Cell.setting(env_setting)
        return [Cell(backend, op, dtype_name(dtype), shape, mode, setting) for dtype in self.dtypes
                for shape in self.sizes_for(dtype) for mode in self.modes]

    def iterations_for(self, message_bytes: int) -> int:
        """Timed eager calls per pass."""
        if self.iterations is not None:
            return self.iterations
        scaled = ITERATION_BYTES_BUDGET // max(1, message_bytes)
        calls = min(self.max_iterations, max(self.min_iterations, scaled))
        return int(max(MIN_CHECKED_CALLS, min(calls, CHECK_BYTES_BUDGET // max(1, message_bytes))))

    def jitter_calls_for(self, message_bytes: int) -> int:
        """Eager calls timed one by one in the jitter pass: --jitter-calls; else -n's count where
        given (both passes time what it asks, as nccl-tests' -n); else at least JITTER_CALLS."""
        if self.jitter_calls is not None:
            return self.jitter_calls
        if self.iterations is not None:
            return self.iterations
        return max(JITTER_CALLS, self.iterations_for(message_bytes))

    def graph_ops_for(self, message_bytes: int) -> int:
        """Calls captured per CUDA graph."""
        if self.graph_ops is not None:
            return self.graph_ops
        return int(max(1, min(MAX_GRAPH_OPS, GRAPH_BYTES_BUDGET // max(1, message_bytes))))

    def graph_replays_for(self, message_bytes: int) -> int:
        """Timed replays of the graph per pass."""
        if self.graph_replays is not None:
            return self.graph_replays
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
                "graph_replays": self.graph_replays, "check": self.check, "jitter_calls": self.jitter_calls,
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


def _graph_launches(args: argparse.Namespace) -> tuple[str | None, int | None, int | None, int | None]:
    """nccl-tests' -G N as (modes, iterations, graph ops, graph replays): -G 0 launches eagerly;
    -G N captures the -n calls in one graph and launches it N times per pass."""
    launches = args.graph_launches
    if launches is None:
        return args.mode, args.iters, args.graph_ops, None
    if args.mode is not None:
        raise UsageError(f"-G {launches} chooses the mode (graph; -G 0: eager): leave out --mode")
    if launches < 0:
        raise UsageError(f"-G must be 0 (eager) or a number of graph launches (got {launches})")
    if launches == 0:
        return "eager", args.iters, args.graph_ops, None
    if args.iters is not None and args.graph_ops is not None:
        raise UsageError("with -G, -n is the calls captured per graph: give -n or --graph-ops, not both")
    return "graph", None, args.iters if args.iters is not None else args.graph_ops, launches


def model_of(args: argparse.Namespace) -> Model | None:
    """The --model preset a sweep measures the decode sizes of, if any."""
    name = getattr(args, "model", None)
    return lookup(name) if name is not None else None


def build_plan(args: argparse.Namespace, on_gpu: bool, checked_bytes: list[int] | None = None) -> SweepPlan:
    """The plan from the size, dtype, mode and timing flags; `checked_bytes` are sizes a
    --qualify spec reads, added where the sizes asked for do not cover them."""
    model = model_of(args)
    notes: list[str] = []
    default_dtype = model.dtype if model else ("bf16" if on_gpu else "fp32")
    dtypes = parse_dtypes(args.dtype if args.dtype is not None else default_dtype)
    # Decode runs in CUDA graphs: a model's sizes are measured in graph mode where it exists.
    default_modes = ("graph" if model else "eager,graph") if on_gpu else "eager"
    mode, iterations, graph_ops, graph_replays = _graph_launches(args)
    modes = parse_list(mode if mode is not None else default_modes, "--mode", _mode)
    if "graph" in modes and not on_gpu:
        raise UsageError("graph mode needs CUDA GPUs; on the CPU use --mode eager")
    if model and not on_gpu and mode is None:
        notes.append(f"{model.name}: graph mode needs CUDA GPUs, so on the CPU its decode sizes run in eager mode")

    shapes = _shapes(args, on_gpu, dtypes, model)
    added = sorted(set(checked_bytes or []) - {s.message_bytes for s in shapes})
    if added:
        shapes += [Shape(b) for b in added]
        notes.append(f"--qualify: added {', '.join(format_bytes(b) for b in added)}, the size(s) its spec checks")
    low, high = GPU_ITERATIONS if on_gpu else CPU_ITERATIONS
    for name, value in (("iters", args.iters), ("warmup", args.warmup), ("graph-ops", args.graph_ops),
                        ("jitter-calls", args.jitter_calls)):
        if value is not None and value < (0 if name == "warmup" else 1):
            raise UsageError(f"--{name} must be positive (got {value})")
    if args.check < 0:
        raise UsageError(f"-c/--check is a count of checks, 0 or more (got {args.check})")
    plan = SweepPlan(shapes=shapes, dtypes=dtypes, modes=modes,
                     warmup=args.warmup if args.warmup is not None else (5 if on_gpu else 2),
                     iterations=iterations, min_iterations=low, max_iterations=high,
                     graph_ops=graph_ops, graph_replays=graph_replays,
                     timeout_s=timeout_s(args.timeout, "--timeout"),
                     setup_timeout_s=timeout_s(args.setup_timeout, "--setup-timeout"), check=bool(args.check),
                     jitter_calls=args.jitter_calls, notes=notes)
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


def _shapes(args: argparse.Namespace, on_gpu: bool, dtypes: list[torch.dtype], model: Model | None) -> list[Shape]:
    if model is not None:
        given = [flag for flag, value in (("-b", args.min_bytes), ("-e", args.max_bytes), ("-f", args.step_factor),
                                          ("--sizes", args.sizes), ("--hidden", args.hidden)) if value is not None]
        if given:
            raise UsageError(f"--model sets the sizes (decode tokens x its hidden size x dtype): leave out {given[0]}")
        if len(dtypes) != 1:
            raise UsageError("--model takes one --dtype (its activation dtype by default)")
        tokens = parse_int_list(args.tokens, "--tokens") if args.tokens is not None else DEFAULT_CONCURRENCIES
        return [Shape(t * model.hidden * dtypes[0].itemsize, t, model.hidden) for t in _with_prefill(tokens, args)]
    if getattr(args, "prefill_tokens", None) is not None and args.tokens is None:
        raise UsageError("--prefill-tokens adds a prefill chunk to model shapes: give it with --model, or with "
                         "--tokens and --hidden")
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
        return [Shape(shape_bytes(t, hidden[0], item), t, hidden[0])
                for t in _with_prefill(parse_int_list(args.tokens, "--tokens"), args)]
    if args.sizes is not None:
        return [Shape(s) for s in sorted(parse_list(args.sizes, "--sizes", parse_bytes))]
    min_bytes = parse_bytes(args.min_bytes) if args.min_bytes else (GPU_MIN_BYTES if on_gpu else CPU_MIN_BYTES)
    max_bytes = parse_bytes(args.max_bytes) if args.max_bytes else (GPU_MAX_BYTES if on_gpu else CPU_MAX_BYTES)
    factor = args.step_factor if args.step_factor is not None else (2 if on_gpu else 4)
    return [Shape(s) for s in geometric_sizes(min_bytes, max_bytes, factor)]


def _with_prefill(tokens: list[int], args: argparse.Namespace) -> list[int]:
    """The decode token counts and the prefill chunks (--prefill-tokens), each once, in order:
    the sizes recommend and floor price a prefill chunk at."""
    prefill = getattr(args, "prefill_tokens", None)
    extra = parse_int_list(prefill, "--prefill-tokens") if prefill is not None else []
    return sorted(set(tokens) | set(extra))
