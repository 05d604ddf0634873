"""Latency curves from a results dir: which rows count, interpolation, winners per size.

Every analysis command goes through here so that they agree on three rules:
- a row is *trusted* only when its status is "ok" and it has no wrong elements; only trusted
  rows make curve points, so a backend that returned wrong data, hung or crashed never wins;
- between measured sizes, latency is interpolated linearly in log(bytes)-log(us) space, and a
  size outside the measured range is reported as out of range, never extrapolated;
- a difference is "beyond the spread" when it is larger than the p10-p90 width of either
  side (the call-to-call spread each run measured for itself in its jitter pass);
- a winner that failed its check at some other size comes with a caution wherever it is shown.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, overload

from commbench.analysis import next_steps
from commbench.errors import UsageError
from commbench.models import Model
from commbench.ops import ALLREDUCE, SHAPED_OPS
from commbench.results import CRASHED, HANG, OK, WRONG, Cell, Measurement, Run, is_checked
from commbench.units import DTYPE_BYTES, format_bytes

DEFAULT_BASELINE = "nccl"
# When a run has no NCCL rows (a CPU run), speedups are shown over this backend instead.
FALLBACK_BASELINE = "gloo"


def is_trusted(row: Measurement) -> bool:
    """An ok row whose outputs were checked and right: an unchecked time may be a no-op's."""
    return row.status == OK and is_checked(row) and not row.wrong_elements


def is_failed_check(row: Measurement) -> bool:
    """Rows a reader must see in red: wrong data, a hang or a crash."""
    return row.status in (WRONG, HANG, CRASHED) or (row.wrong_elements or 0) > 0


def variant_label(row: Measurement) -> str:
    """Backend name plus the process-level settings it ran under, e.g. 'nccl[NCCL_NTHREADS=256]'."""
    if not row.env_setting:
        return row.backend
    knobs = ",".join(f"{k}={v}" for k, v in sorted(row.env_setting.items()))
    return f"{row.backend}[{knobs}]"


@dataclass(frozen=True, slots=True)   # one per measured size of every curve: 10^5 of them
class Point:
    message_bytes: int
    latency_us: float
    p10_us: float | None = None
    p90_us: float | None = None
    p99_us: float | None = None
    busbw_gbps: float | None = None

    @property
    def spread_us(self) -> float | None:
        if self.p10_us is None or self.p90_us is None:
            return None
        return self.p90_us - self.p10_us


@dataclass(frozen=True)
class CurveKey:
    """Everything that makes a curve a different experiment: rows of one key are one curve, and
    two keys never share a table cell, a bold 'fastest' or a comparison."""

    variant: str       # variant_label(): backend (incl. lib=) and its env_setting
    mode: str          # eager | graph
    dtype: str
    op: str
    world_size: int | None = None
    library: str | None = None     # the NCCL the rows' processes loaded, where they recorded it
    emulation: str | None = None   # emulation_text() of ranks sharing GPUs; None on real GPUs
    # What tells this key from another of the same variant, mode, dtype and op in the same
    # output (set by distinguish()); not part of the identity.
    qualifier: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        """The variant, plus the qualifier where one is needed to tell curves apart."""
        return f"{self.variant} {{{self.qualifier}}}" if self.qualifier else self.variant

    @property
    def label(self) -> str:
        op = "" if self.op == ALLREDUCE else f" {self.op}"
        if not self.mode:   # a latency table: no mode to tell apart
            return self.name
        return f"{self.name} ({self.mode}{op})"

    def setting(self) -> tuple[int | None, str | None, str | None]:
        """The part of the key outside variant, mode, dtype and op."""
        return (self.world_size, self.library, self.emulation)


class Points(Sequence[Point]):
    """A curve's points held as columns (8 bytes a number, NaN for None) and made into Point
    objects when read: a run of 10^5 sizes held ~0.2 KB a point as objects. Points with a
    number that is not a float (an int latency) are kept as they are."""

    _NUMBERS = ("latency_us", "p10_us", "p90_us", "p99_us", "busbw_gbps")

    def __init__(self, points: Iterable[Point] = ()):
        self._kept: list[Point] | None = None
        self._sizes = array("q")
        self._numbers = [array("d") for _ in self._NUMBERS]
        for point in points:
            self.append(point)

    def append(self, point: Point) -> None:
        if self._kept is None and point.message_bytes.__class__ is int and all(
                getattr(point, name).__class__ in (float, type(None)) for name in self._NUMBERS):
            self._sizes.append(point.message_bytes)
            for name, column in zip(self._NUMBERS, self._numbers):
                value = getattr(point, name)
                column.append(math.nan if value is None else value)
            return
        if self._kept is None:
            self._kept = list(self)
            self._sizes, self._numbers = array("q"), []
        self._kept.append(point)

    def settled(self, dropped: frozenset[int]) -> "Points":
        """One point per size, sorted by size: the one appended last; none at a dropped size."""
        last = {self.size_at(i): i for i in range(len(self))}
        return Points(self[i] for size, i in sorted(last.items()) if size not in dropped)

    def sizes(self) -> list[int]:
        return [p.message_bytes for p in self._kept] if self._kept is not None else self._sizes.tolist()

    def size_at(self, index: int) -> int:
        return self._kept[index].message_bytes if self._kept is not None else self._sizes[index]

    def __len__(self) -> int:
        return len(self._kept) if self._kept is not None else len(self._sizes)

    @overload
    def __getitem__(self, index: int) -> Point: ...
    @overload
    def __getitem__(self, index: slice) -> list[Point]: ...

    def __getitem__(self, index: int | slice) -> Point | list[Point]:
        if self._kept is not None:
            return self._kept[index]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        size = self._sizes[index]
        latency, p10, p90, p99, busbw = (column[index] for column in self._numbers)
        return Point(size, latency, *(None if v != v else v for v in (p10, p90, p99, busbw)))

    def __iter__(self) -> Iterator[Point]:
        return iter(self._kept) if self._kept is not None else (self[i] for i in range(len(self._sizes)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (Points, list)) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Points({list(self)!r})"


@dataclass
class Curve:
    key: CurveKey
    backend: str
    env_setting: dict[str, str]
    points: Points = field(default_factory=Points)   # sorted by message_bytes, one per size
    # Sizes where this variant returned wrong data, hung or crashed: never interpolated across.
    failed_sizes: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.points, Points):
            self.points = Points(self.points)

    @property
    def label(self) -> str:
        return self.key.label

    def sizes(self) -> list[int]:
        return self.points.sizes()

    def point(self, message_bytes: int) -> Point | None:
        index = self._index(message_bytes)
        return self.points[index] if index < len(self.points) and self.points.size_at(index) == message_bytes else None

    def _index(self, message_bytes: int) -> int:
        """Where message_bytes is, or would go, among the sorted sizes."""
        return bisect_left(range(len(self.points)), message_bytes, key=self.points.size_at)

    def covers(self, message_bytes: int) -> bool:
        return bool(self.points) and self.points[0].message_bytes <= message_bytes <= self.points[-1].message_bytes

    def at(self, message_bytes: int) -> Point | None:
        """Measured or log-log interpolated point; None when outside the measured range."""
        exact = self.point(message_bytes)
        if exact is not None:
            return exact
        if not self.covers(message_bytes):
            return None
        index = self._index(message_bytes)
        lo, hi = self.points[index - 1], self.points[index]
        if any(lo.message_bytes < f < hi.message_bytes for f in self.failed_sizes):
            return None

        def interp(a: float | None, b: float | None) -> float | None:
            if a is None or b is None:
                return None
            return loglog_interpolate(lo.message_bytes, a, hi.message_bytes, b, message_bytes)
        return Point(message_bytes, interp(lo.latency_us, hi.latency_us),  # type: ignore[arg-type]
                     interp(lo.p10_us, hi.p10_us), interp(lo.p90_us, hi.p90_us),
                     interp(lo.p99_us, hi.p99_us), interp(lo.busbw_gbps, hi.busbw_gbps))

    def range_text(self) -> str:
        if not self.points:
            return "no points"
        return f"{format_bytes(self.points[0].message_bytes)}-{format_bytes(self.points[-1].message_bytes)}"


def loglog_interpolate(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    """y at x on the straight line through (x0, y0) and (x1, y1) in log-log space."""
    if not (x0 > 0 and x1 > 0 and x > 0 and y0 > 0 and y1 > 0):
        # A zero or negative value has no logarithm: fall back to a straight line.
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def point_of(row: Measurement) -> Point:
    assert row.latency_us is not None
    return Point(row.message_bytes, row.latency_us, row.jitter_p10_us, row.jitter_p90_us,
                 row.jitter_p99_us, row.busbw_gbps)


def emulation_text(emulation: dict | None) -> str | None:
    """'MPS, 8 ranks on 1 GPU' for rows whose ranks shared GPUs; None on real GPUs."""
    if not isinstance(emulation, dict):
        return None
    how = "MPS" if emulation.get("mps") else "time-sliced" if emulation.get("mps") is False else "shared"
    return f"{how}, {emulation.get('ranks')} ranks on {emulation.get('gpus')} GPU"


def library_of(row: Measurement) -> str | None:
    """The NCCL version the row's process loaded (extra.nccl_version_loaded), where recorded."""
    loaded = row.extra.get("nccl_version_loaded") if isinstance(row.extra, dict) else None
    return str(loaded) if loaded is not None else None


def key_of(row: Measurement) -> CurveKey:
    return CurveKey(variant_label(row), row.mode, row.dtype, row.op, row.world_size, library_of(row),
                    emulation_text(row.emulation))


def qualifier_text(key: CurveKey, fields: set[str]) -> str:
    words = {"world_size": f"{key.world_size} ranks", "library": f"NCCL {key.library or 'not recorded'}",
             "emulation": key.emulation or "real GPUs"}
    return ", ".join(words[name] for name in ("world_size", "library", "emulation") if name in fields)


def distinguish(keys: Iterable[CurveKey]) -> dict[CurveKey, CurveKey]:
    """Each key with its qualifier set where another key has the same variant, mode, dtype and op
    but another world size, NCCL library or emulation: the qualifier names what differs."""
    keys = list(dict.fromkeys(keys))
    by_slot: dict[tuple[str, str, str, str], list[CurveKey]] = {}
    for key in keys:
        by_slot.setdefault((key.variant, key.mode, key.dtype, key.op), []).append(key)
    out = {}
    for key in keys:
        siblings = by_slot[(key.variant, key.mode, key.dtype, key.op)]
        differs = {name for name in ("world_size", "library", "emulation")
                   if len({getattr(k, name) for k in siblings}) > 1}
        out[key] = replace(key, qualifier=qualifier_text(key, differs)) if differs else key
    return out


def build_curves(rows: Iterable[Measurement]) -> list[Curve]:
    """One curve per key_of() from trusted rows; the last row of a size wins (a resumed or
    repeated sweep appends a newer measurement of the same point)."""
    by_key: dict[CurveKey, tuple[Measurement, Points]] = {}   # points as columns: 48 bytes each
    failed: dict[CurveKey, set[int]] = {}
    for row in rows:
        if is_failed_check(row):
            failed.setdefault(key_of(row), set()).add(row.message_bytes)
        if not is_trusted(row) or row.latency_us is None:
            continue
        key = key_of(row)
        first, points = by_key.setdefault(key, (row, Points()))
        points.append(point_of(row))
    named = distinguish(by_key)
    curves = []
    for key, (first, points) in by_key.items():
        bad = frozenset(failed.get(key, set()))
        curves.append(Curve(named[key], first.backend, dict(first.env_setting), points.settled(bad), bad))
    curves.sort(key=lambda c: (c.key.dtype, c.key.mode, c.key.variant, c.key.op, c.key.qualifier))
    return curves


def select(curves: Iterable[Curve], dtype: str | None = None, mode: str | None = None,
           op: str | None = None) -> list[Curve]:
    return [c for c in curves
            if (dtype is None or c.key.dtype == dtype)
            and (mode is None or c.key.mode == mode)
            and (op is None or c.key.op == op)]


def prefer_graph(curves: Iterable[Curve]) -> list[Curve]:
    """One curve per variant and op: its graph curve when measured, else its eager one.
    Decode runs in CUDA graphs, so graph numbers are the ones that matter where they exist."""
    chosen: dict[tuple, Curve] = {}
    for curve in curves:
        slot = (curve.key.variant, curve.key.dtype, curve.key.op, curve.key.setting())
        current = chosen.get(slot)
        if current is None or (curve.key.mode == "graph" and current.key.mode != "graph"):
            chosen[slot] = curve
    return sorted(chosen.values(), key=lambda c: c.label)


def pick_mode(curves: list[Curve], mode: str) -> list[Curve]:
    """mode 'auto' = prefer_graph; 'graph' / 'eager' = only that mode."""
    if mode == "auto":
        return prefer_graph(curves)
    return select(curves, mode=mode)


def baseline_name(curves: Iterable[Curve], requested: str | None) -> str | None:
    """The backend speedups and margins are measured against.

    An explicit request must exist in the run; otherwise NCCL's default, or gloo on a CPU run.
    """
    names = {c.backend for c in curves if not c.env_setting}
    if requested is not None:
        if requested not in names:
            raise UsageError(f"baseline {requested!r} has no trusted rows in this run "
                             f"(backends: {', '.join(sorted(names)) or 'none'})")
        return requested
    for name in (DEFAULT_BASELINE, FALLBACK_BASELINE):
        if name in names:
            return name
    return None


def baseline_curve(curves: Iterable[Curve], name: str | None, like: Curve) -> Curve | None:
    """The baseline's curve in the same mode, dtype, plain-allreduce op, world size and emulation
    as `like` (its NCCL library is the baseline's own)."""
    if name is None:
        return None
    for curve in curves:
        if (curve.backend == name and not curve.env_setting and curve.key.mode == like.key.mode
                and curve.key.dtype == like.key.dtype and curve.key.op == ALLREDUCE
                and curve.key.world_size == like.key.world_size and curve.key.emulation == like.key.emulation):
            return curve
    return None


MEASURED, INTERPOLATED, OUT_OF_RANGE = "measured", "interpolated", "out of range"


@dataclass(frozen=True)
class CurvePrice:
    """A curve's price at one size: the point used and how it was found (measured there,
    interpolated between measured sizes, or out of the measured range: never extrapolated)."""

    curve: str
    message_bytes: int
    point: Point | None
    how: str
    range_text: str

    @property
    def latency_us(self) -> float | None:
        return self.point.latency_us if self.point is not None else None

    def said(self) -> str:
        return f"{OUT_OF_RANGE} {self.range_text}" if self.point is None else self.how


def price(curve: Curve, message_bytes: int) -> CurvePrice:
    """The one place a curve is priced at a size."""
    point = curve.at(message_bytes)
    how = OUT_OF_RANGE if point is None else MEASURED if curve.point(message_bytes) is not None else INTERPOLATED
    return CurvePrice(curve.label, message_bytes, point, how, curve.range_text())


@dataclass(frozen=True)
class Candidate:
    """A curve that covers a size, with its price there (never out of range)."""

    curve: Curve
    price: CurvePrice

    @property
    def point(self) -> Point:
        return self.price.point  # type: ignore[return-value]   # ranking keeps covered curves only

    @property
    def interpolated(self) -> bool:
        return self.price.how == INTERPOLATED


def ranking(curves: Iterable[Curve], message_bytes: int) -> list[Candidate]:
    """Every curve that covers the size, fastest first."""
    out = []
    for curve in curves:
        p = price(curve, message_bytes)
        if p.point is not None:
            out.append(Candidate(curve, p))
    out.sort(key=lambda c: (c.point.latency_us, c.curve.label))
    return out


def counterpart(before: Curve, b: list[Curve], a: list[Curve]) -> Curve | None:
    """B's curve of the same experiment as A's `before` (two runs compared): the same key, else
    the one curve of the same variant, mode, dtype and op where each run has exactly one (the
    runs then differ in world size, loaded NCCL or emulation, which compare says first)."""
    exact = [c for c in b if c.key == before.key]
    if exact:
        return exact[0]

    def slot(curve: Curve) -> tuple[str, str, str, str]:
        return (curve.key.variant, curve.key.mode, curve.key.dtype, curve.key.op)

    mine = [c for c in a if slot(c) == slot(before)]
    theirs = [c for c in b if slot(c) == slot(before)]
    return theirs[0] if len(mine) == 1 and len(theirs) == 1 else None


def exceeds_spread(delta_us: float, a: Point, b: Point) -> bool | None:
    """Is |delta| larger than the p10-p90 spread of both a and b? None when a spread is unknown."""
    if a.spread_us is None or b.spread_us is None:
        return None
    return abs(delta_us) > max(a.spread_us, b.spread_us)


@dataclass(frozen=True)
class Crossover:
    first_bytes: int
    last_bytes: int
    winner: str
    sizes: int          # measured sizes in this range


NO_DIFFERENCE = "no measurable difference"


def crossovers(curves: list[Curve]) -> list[Crossover]:
    """Size ranges with one winner, over every size any curve measured (same dtype and mode). A
    size where the fastest beats the runner-up by no more than both their p10-p90 spreads has no
    winner: NO_DIFFERENCE (a table alternating between two kernels at 1.00x says nothing)."""
    sizes = sorted({p.message_bytes for c in curves for p in c.points})
    out: list[Crossover] = []
    for size in sizes:
        ranked = ranking(curves, size)
        if not ranked:
            continue
        winner = ranked[0].curve.label
        if len(ranked) > 1 and exceeds_spread(ranked[1].point.latency_us - ranked[0].point.latency_us,
                                              ranked[0].point, ranked[1].point) is False:
            winner = NO_DIFFERENCE
        if out and out[-1].winner == winner:
            last = out[-1]
            out[-1] = Crossover(last.first_bytes, size, winner, last.sizes + 1)
        else:
            out.append(Crossover(size, size, winner, 1))
    return out


def cautions(rows: Iterable[Measurement], shown: Iterable[Curve]) -> list[str]:
    """A shown curve whose backend returned wrong data or hung at some other size is a risk at
    every size: one line per backend and settings (its failures in any dtype or mode), in the
    order shown. One pass over the rows, keeping the failures alone."""
    failures: dict[tuple[str, tuple[tuple[str, str], ...]], set[tuple[int, str]]] = {}
    for r in rows:
        if is_failed_check(r):
            failures.setdefault((r.backend, Cell.setting(r.env_setting)), set()).add(
                (r.message_bytes, r.status + (f" ({r.wrong_kind})" if r.wrong_kind else "")))
    out: list[str] = []
    for curve in shown:
        bad = sorted(failures.get((curve.backend, Cell.setting(curve.env_setting)), ()))
        if bad:
            where = ", ".join(f"{format_bytes(b)} {failure}" for b, failure in bad)
            line = f"{curve.key.variant} failed its check at {where}; its other sizes run the same code"
            if line not in out:
                out.append(line)
    return out


@dataclass(frozen=True)
class Group:
    """Curves whose winners may be compared: one dtype, one mode, one world size and emulation
    (NCCL libraries are compared with each other: that is what lib= variants are for)."""

    dtype: str
    mode: str
    world_size: int | None
    emulation: str | None

    def members(self, curves: Iterable[Curve]) -> list[Curve]:
        return [c for c in curves if (c.key.dtype, c.key.mode, c.key.world_size, c.key.emulation)
                == (self.dtype, self.mode, self.world_size, self.emulation)]


def groups(curves: list[Curve]) -> list[Group]:
    """The groups present, graph first within a dtype."""
    found = {Group(c.key.dtype, c.key.mode, c.key.world_size, c.key.emulation) for c in curves}
    return sorted(found, key=lambda g: (g.dtype, g.mode != "graph", g.world_size or 0, g.emulation or ""))


def run_world_size(run: Run) -> int | None:
    """The run's world size: run.json's, else the rows' (a run has one)."""
    if run.info.world_size:
        return run.info.world_size
    sizes = {r.world_size for r in run.rows}
    return sizes.pop() if len(sizes) == 1 else None


def of_shape(row: Measurement, hidden: int | None) -> bool:
    """Whether a decode question at `hidden` can use the row: a plain allreduce at any shape; a
    shaped op's row (ops.SHAPED_OPS) only at that hidden, its bytes those of its tokens x hidden (a
    row whose shape and bytes disagree says neither), so that its message size names its tokens."""
    if row.op not in SHAPED_OPS:
        return True
    return (hidden is not None and row.hidden == hidden and row.tokens is not None
            and row.message_bytes == row.tokens * hidden * DTYPE_BYTES.get(row.dtype, 0))


def decode_curves(run: Run, tp: int | None, dtype: str, mode: str, model: Model | None = None,
                  hidden: int | None = None) -> list[Curve]:
    """Trusted curves of one run for a decode question: the TP size must be the run's world
    size (latency at 4 ranks says little about 8), the dtype the model's activation dtype, and a
    shaped op's rows the model's hidden size (`hidden`, else the model's; neither: none of them)."""
    world = run_world_size(run)
    if tp is not None and world is not None and tp != world:
        sweep = next_steps.sweep_command(model, tp) if model is not None else next_steps.dtype_sweep_command(tp, dtype)
        raise UsageError(f"{run.path}: measured at world size {world}, not TP {tp}; "
                         f"{next_steps.inline(sweep)} on the TP {tp} box answers it")
    hidden = hidden if hidden is not None else model.hidden if model is not None else None
    curves = build_curves(r for r in run.rows   # streamed, never held
                          if (tp is None or r.world_size == tp) and of_shape(r, hidden))
    if not curves:
        statuses = sorted({r.status for r in run.rows})
        shapes = sorted({r.hidden for r in run.rows if is_trusted(r) and not of_shape(r, hidden)
                         and isinstance(r.hidden, int)})
        if shapes:
            at = ", ".join(map(str, shapes))
            raise UsageError(f"{run.path}: its trusted rows are of the fused pattern ({', '.join(SHAPED_OPS)}) at "
                             f"hidden {at}, " + (f"none at the model's hidden {hidden}" if hidden is not None else
                                                 "and the model's hidden size is not given (--model or --hidden)"))
        raise UsageError(f"{run.path}: no trusted (status ok, #wrong 0) rows to build a curve from "
                         f"(row statuses: {', '.join(statuses) or 'no rows'})")
    typed = select(curves, dtype=dtype)
    if not typed:
        have = sorted({c.key.dtype for c in curves})
        raise UsageError(f"{run.path}: no {dtype} rows (the run has {', '.join(have)}); "
                         f"pass --dtype {have[0]} to use that curve")
    chosen = pick_mode(typed, mode)
    if not chosen:
        raise UsageError(f"{run.path}: no {mode}-mode rows for {dtype}; use --mode auto")
    return chosen
