"""Waiting or moving: the ranks' traces of one group side by side, each allreduce call split into
the wait for the last rank and the transfer after it (`commbench attribute` with several ranks).

A one-shot or Lamport kernel on an early rank spins until the slowest rank arrives, so its
duration holds the ranks' arrival skew. Given every rank's trace:

1. Calls are matched across ranks by their order within the step (steps as each rank's rule
   found them), checked against the kernel's name and the recorded size; a mismatch is bad
   input, never guessed over.
2. Clocks: traces of one host share a clock; when the calls' end times agree as recorded
   (every rank of an allreduce ends within a small window) that clock is used as it is. Else
   each rank is shifted by the median difference of its calls' ends from the first rank's
   (the offset), and what is left (the residual: the p90 spread of the aligned ends) is
   reported; an alignment whose residual is larger than the skew it would measure beyond its own
   error (the median skew of the aligned calls less the residual) is refused.
3. Per call and rank: wait = the last rank's arrival (its kernel start) minus this rank's
   start; transfer = this rank's end minus the last arrival (wait + transfer = the kernel's
   duration). The call's late rank is the last to arrive; its wait is the mean wait of the
   other ranks (how much later than them the late rank came), its skew the last arrival minus
   the first (the longest wait, which also holds the earliest rank's own jitter).
4. Where a call is notably late, what the trace shows on the late rank before it: between the
   end of the previous call and this call's start, its GPU work and its idle time set against
   the other ranks' median, and the kernels it ran there that no other rank ran.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from commbench.analysis.attribution import Call, RankResult, Step, union_length
from commbench.analysis.trace_read import Kernel
from commbench.errors import UsageError
from commbench.results import percentile

CLOCK_MODES = ("auto", "shared", "align")
# Ends that agree within the aligned residual plus this much need no offset: the ranks share a clock.
SHARED_CLOCK_SLACK_US = 1.0
# The residual an alignment leaves: this percentile of the aligned ends' spread over the calls
# (a median would hide a clock that jumps on a minority of the calls).
RESIDUAL_PERCENTILE = 90
# A call is notably late (and its cause looked for) when its wait is at least this much and at
# least this many times the median wait of all calls.
NOTABLE_SKEW_US = 10.0
NOTABLE_SKEW_FACTOR = 2.0
CAUSE_KERNELS = 3


@dataclass
class Clock:
    mode: str                       # "shared" | "aligned" | "refused"
    offsets_us: dict[int, float]    # rank -> subtracted from its times (0 on a shared clock)
    residual_us: float              # p90 spread of the calls' (aligned) end times
    raw_spread_us: float            # median spread of the calls' end times as recorded
    skew_us: float                  # median skew of the calls after alignment
    text: str


@dataclass
class Cause:
    """What the late rank did before a late call, against the other ranks' median."""
    extra_busy_us: float
    extra_idle_us: float
    kernels: list[str]              # kernels only the late rank ran in that window

    @property
    def kind(self) -> str:
        return "GPU work" if self.extra_busy_us >= self.extra_idle_us else "GPU idle (host-side)"


@dataclass(slots=True)   # one per call of the group: 10^6 and more in a long trace
class Matched:
    """One allreduce call on every rank given."""
    step: int
    index: int                      # order within the step
    phase: str
    library: str
    name: str
    message_bytes: int | None
    calls: list[Call]               # one per rank, in the order of `ranks`
    ranks: list[int]                # the group's, one list shared by every call
    late_rank: int = -1
    wait_us: float = 0.0            # the mean wait of the ranks other than the late one
    skew_us: float = 0.0
    transfer_us: float = 0.0        # median over ranks of (end - last arrival)
    cause: Cause | None = None


@dataclass
class Skew:
    ranks: list[int]
    world_size: int | None
    clock: Clock
    calls: list[Matched]
    notable_us: float
    late: list["LateRow"] = field(default_factory=list)


@dataclass
class LateRow:
    rank: int
    last_share: float               # share of the matched calls where it arrived last
    last_calls: int
    late_by_p50_us: float | None    # median wait (of the other ranks, for it) of those calls
    notable_calls: int              # of them, notably late
    causes: dict[str, int]          # Cause.kind -> notable calls
    extra_busy_p50_us: float | None
    extra_idle_p50_us: float | None
    kernels: dict[str, int]         # kernels only it ran before its notable calls -> count


def match(results: list[RankResult]) -> list[Matched]:
    """The calls of every rank's steps, matched by order; raises UsageError on any mismatch."""
    first = results[0]
    for r in results[1:]:
        if len(r.steps) != len(first.steps):
            raise UsageError(f"{r.source}: {len(r.steps)} steps against {len(first.steps)} in {first.source} "
                             "(calls cannot be matched across ranks: profile every rank over the same steps)")
    out: list[Matched] = []
    ranks = [r.rank for r in results]
    for i, step in enumerate(first.steps):
        steps = [r.steps[i] for r in results]
        for r, s in zip(results[1:], steps[1:]):
            if len(s.calls) != len(step.calls):
                raise UsageError(f"{r.source}: step {i} holds {len(s.calls)} allreduce calls against "
                                 f"{len(step.calls)} in {first.source} (unmatched call counts)")
        for j, call in enumerate(step.calls):
            calls = [s.calls[j] for s in steps]
            for r, c in zip(results[1:], calls[1:]):
                if c.name != call.name:
                    raise UsageError(f"{r.source}: call {j} of step {i} is {c.name[:60]!r}, in {first.source} "
                                     f"{call.name[:60]!r} (not the same collective: another group?)")
                if None not in (c.message_bytes, call.message_bytes) and c.message_bytes != call.message_bytes:
                    raise UsageError(f"{r.source}: call {j} of step {i} moves {c.message_bytes} bytes, in "
                                     f"{first.source} {call.message_bytes} (not the same collective)")
            out.append(Matched(i, j, step.phase, call.library, call.name, call.message_bytes, calls, ranks))
    return out


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


def align(calls: list[Matched], ranks: list[int], mode: str = "auto", one_file: bool = False) -> Clock:
    zero = {r: 0.0 for r in ranks}
    if not calls:
        return Clock("shared", zero, 0.0, 0.0, 0.0, "clock: no matched calls to compare")
    raw = statistics.median(_spread([c.end_us for c in m.calls]) for m in calls)
    offsets = {r: statistics.median(m.calls[k].end_us - m.calls[0].end_us for m in calls)
               for k, r in enumerate(ranks)}
    aligned = sorted(_spread([c.end_us - offsets[r] for r, c in zip(ranks, m.calls)]) for m in calls)
    residual = percentile(aligned, RESIDUAL_PERCENTILE)
    skew = statistics.median(_spread([c.ts_us - offsets[r] for r, c in zip(ranks, m.calls)]) for m in calls)
    shared = mode == "shared" or (mode == "auto" and (one_file or raw <= statistics.median(aligned)
                                                      + SHARED_CLOCK_SLACK_US))
    if mode == "shared" and not one_file:
        _refuse_unshared(calls, ranks)
    if shared:
        why = ("one file: one clock" if one_file else "as asked (--clock shared)" if mode == "shared" else
               f"the calls end within {raw:.1f} us of each other as recorded: one host's clock")
        raw_skew = statistics.median(_spread([c.ts_us for c in m.calls]) for m in calls)
        raw_residual = percentile(sorted(_spread([c.end_us for c in m.calls]) for m in calls), RESIDUAL_PERCENTILE)
        return Clock("shared", zero, raw_residual, raw, raw_skew, f"clock: shared, no offsets ({why})")
    offset_text = ", ".join(f"rank {r} {offsets[r]:+,.1f} us" for r in ranks[1:])
    # The aligned skew holds the alignment's own error (up to the residual): what it would measure
    # beyond that error is skew - residual.
    if residual > skew - residual:
        return Clock("refused", offsets, residual, raw, skew,
                     f"clock: not aligned: by the calls' end times the offsets would be {offset_text}, but the "
                     f"ends still spread {residual:.1f} us (p{RESIDUAL_PERCENTILE}) after it, more than the "
                     f"{max(0.0, skew - residual):.1f} us of skew it would measure beyond that error (median "
                     f"{skew:.1f} us); wait and transfer are not told apart")
    return Clock("aligned", offsets, residual, raw, skew,
                 f"clock: aligned by the calls' end times (the traces do not share a clock: as recorded the ends "
                 f"spread {raw:,.1f} us): offsets against rank {ranks[0]}: {offset_text}; residual "
                 f"{residual:.1f} us (p{RESIDUAL_PERCENTILE} spread of the aligned ends)")


def _refuse_unshared(calls: list[Matched], ranks: list[int]) -> None:
    """--clock shared on traces whose clocks plainly differ: no rank can finish an allreduce before
    the last one starts it, so on one clock every call's kernels overlap in time. Where the median
    call's last start comes after its first end (beyond the slack of clock granularity), the
    waits would be the clocks' offset (16,000,000,031 us on ranks 10^9 us apart): refused."""
    gaps = [max(c.ts_us for c in m.calls) - min(c.end_us for c in m.calls) for m in calls]
    gap = statistics.median(gaps)
    if gap > SHARED_CLOCK_SLACK_US:
        raise UsageError(f"--clock shared: the ranks' kernels of one call do not overlap in time as recorded (the "
                         f"last rank starts a median {gap:,.1f} us after the first rank's ends, over {len(gaps)} "
                         f"calls of ranks {', '.join(map(str, ranks))}): these traces do not share a clock; leave "
                         "--clock out (auto aligns them by the calls' ends) or give --clock align")


class _Timeline:
    """One rank's GPU activity (kernels, copies, sets), by start, for the windows before calls."""

    def __init__(self, kernels: list[Kernel]):
        self.items = sorted(kernels, key=lambda k: k.ts_us)
        self.starts = [k.ts_us for k in self.items]

    def window(self, start_us: float, end_us: float) -> tuple[float, set[str]]:
        """GPU-busy time inside [start, end) and the names of the kernels that ran there."""
        lo = max(0, bisect.bisect_left(self.starts, start_us) - 1)
        hi = bisect.bisect_left(self.starts, end_us)
        spans, names = [], set()
        for k in self.items[lo:hi]:
            a, b = max(k.ts_us, start_us), min(k.end_us, end_us)
            if b > a:
                spans.append((a, b))
                if k.is_kernel:
                    names.add(k.name)
        return union_length(spans), names


def _cause(m: Matched, late: int, previous: Matched | None, steps: list[list[Step]],
           timelines: list[_Timeline]) -> Cause:
    busy, idle, names = [], [], []
    for k, call in enumerate(m.calls):
        start = previous.calls[k].end_us if previous is not None else steps[k][m.step].start_us
        window_busy, window_names = timelines[k].window(start, call.ts_us)
        busy.append(window_busy)
        idle.append(max(0.0, call.ts_us - start - window_busy))
        names.append(window_names)
    others = [k for k in range(len(m.calls)) if k != late]
    theirs = set().union(*(names[k] for k in others))
    return Cause(busy[late] - statistics.median(busy[k] for k in others),
                 idle[late] - statistics.median(idle[k] for k in others),
                 sorted(names[late] - theirs)[:CAUSE_KERNELS])


def split(results: list[RankResult], kernels: list[list[Kernel]], clock_mode: str = "auto",
          one_file: bool = False, world_size: int | None = None) -> Skew:
    """Matched calls with wait, transfer and late rank; each rank's Call gets its wait_us."""
    ranks = [r.rank for r in results]
    calls = match(results)
    clock = align(calls, ranks, clock_mode, one_file)
    skew = Skew(ranks, world_size, clock, calls, NOTABLE_SKEW_US)
    if clock.mode == "refused":
        return skew
    for m in calls:
        starts = [c.ts_us - clock.offsets_us[r] for r, c in zip(ranks, m.calls)]
        ends = [c.end_us - clock.offsets_us[r] for r, c in zip(ranks, m.calls)]
        last = max(starts)
        late = starts.index(last)
        m.late_rank, m.skew_us = ranks[late], last - min(starts)
        m.wait_us = statistics.fmean(last - s for k, s in enumerate(starts) if k != late)
        m.transfer_us = statistics.median(e - last for e in ends)
        for c, s in zip(m.calls, starts):
            c.wait_us = last - s
    if calls:
        skew.notable_us = max(NOTABLE_SKEW_US, NOTABLE_SKEW_FACTOR * statistics.median(m.wait_us for m in calls))
    timelines = [_Timeline(k) for k in kernels]
    steps = [r.steps for r in results]
    previous: Matched | None = None
    for m in calls:
        if m.wait_us >= skew.notable_us:
            m.cause = _cause(m, ranks.index(m.late_rank), previous, steps, timelines)
        previous = m
    skew.late = late_rows(skew)
    return skew


def late_rows(skew: Skew) -> list[LateRow]:
    by_rank: dict[int, list[Matched]] = defaultdict(list)
    for m in skew.calls:
        by_rank[m.late_rank].append(m)
    rows = []
    for rank in skew.ranks:
        mine = by_rank.get(rank, [])
        notable = [m for m in mine if m.cause is not None]
        causes: dict[str, int] = defaultdict(int)
        kernels: dict[str, int] = defaultdict(int)
        for m in notable:
            causes[m.cause.kind] += 1   # type: ignore[union-attr]
            for name in m.cause.kernels:   # type: ignore[union-attr]
                kernels[name] += 1
        rows.append(LateRow(rank, len(mine) / len(skew.calls) if skew.calls else 0.0, len(mine),
                            statistics.median(m.wait_us for m in mine) if mine else None, len(notable),
                            dict(causes),
                            statistics.median(m.cause.extra_busy_us for m in notable) if notable else None,  # type: ignore[union-attr]
                            statistics.median(m.cause.extra_idle_us for m in notable) if notable else None,  # type: ignore[union-attr]
                            dict(kernels)))
    return rows


@dataclass
class PhaseSplit:
    phase: str
    steps: int
    allreduce_us: float             # medians over the steps of every rank, each its own
    wait_us: float
    transfer_us: float
    wait_share: float               # median over steps and ranks of wait / allreduce


def phase_splits(results: list[RankResult]) -> list[PhaseSplit]:
    out = []
    for phase in ("decode", "prefill", "-"):
        steps = [s for r in results for s in r.steps if s.phase == phase and s.calls]
        if not steps or any(c.wait_us is None for s in steps for c in s.calls):
            continue
        waits = [sum(c.wait_us for c in s.calls) for s in steps]   # type: ignore[misc]
        totals = [s.allreduce_us for s in steps]
        out.append(PhaseSplit("other" if phase == "-" else phase, len({s.index for s in steps}),
                              statistics.median(totals), statistics.median(waits),
                              statistics.median(t - w for t, w in zip(totals, waits)),
                              statistics.median(w / t if t > 0 else 0.0 for w, t in zip(waits, totals))))
    return out
