"""The sweep engine: per backend variant, vote -> setup (voted) -> per row: observe, warm up,
timed pass, jitter pass, check.

Every rank runs the same plan in the same order. A row has two passes over the same calls:
the timed pass puts one timer around the loop (the headline: total / calls, max over ranks,
as nccl-tests does) and the jitter pass a timer per call or replay (p10..p99, kept apart so the
per-call timer's cost never inflates the headline). In eager mode the jitter pass times at least
100 calls (plan.JITTER_CALLS), in rounds over the row's pairs where they are fewer, so its p99
is a per-call tail. Every output of every pass is checked.
Each row is measured inside a watchdog, the results of all ranks are gathered over the gloo
control group, and every rank builds the same row (so later decisions, like the unfused
baseline's choice of backend, agree everywhere). Rank 0 appends the row to measurements.jsonl
before the next starts.

Before each step of a backend (check, setup, row, close) every rank records what it is about to
run (commbench.inflight), and a rank that catches a backend's exception marks its record
before it goes to the vote: if its peers are inside a collective it never joins, their
watchdogs see the mark and end the row as an error naming it, within waits().peer_wait_s.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Callable, Iterator

import torch

from commbench.backends import is_builtin
from commbench.backends.base import Backend, BackendTimeout, BackendUnavailable, describe
from commbench.errors import Terminated
from commbench.inflight import ENDED, RAISED, PeerWatch, Recorder, Stop, launcher_gone, stop_line
from commbench.runtime.context import ControlGroupLost, RunContext
from commbench.sweep.outcome import Failed, Measured, Outcome, Skipped
from commbench.sweep.plan import SweepPlan
from commbench.sweep.state import RowSink, RunState, stopped_reason
from commbench.results import (CHECK_OFF, CRASHED, ERROR, HANG, NO_WORK, OK, SKIPPED, WRONG, Cell, Measurement,
                               stops_backend)
from commbench.runtime.timing import (Step, capture_graph, count_work_nodes, headline_us, jitter_stats,
                                      loop_total_us, per_step_us, synchronize)
from commbench.runtime.dtypes import TORCH_DTYPES, dtype_name
from commbench.units import format_bytes
from commbench.sweep.watchdog import Watchdog
from commbench.waits import waits
from commbench.runtime.workload import EPOCHS_PER_PASS, PassCheck, Workload, bandwidths_gbps

# First epochs of the exact input pattern per pass (each pass uses three, see workload.py), so
# an answer left from another pass is wrong too, never right by chance. The eager jitter pass's
# rounds take three each from JITTER_EPOCH on.
OBSERVE_EPOCH, WARMUP_EPOCH, TIMED_EPOCH, JITTER_EPOCH = 10, 20, 30, 40
MEASUREMENT_FIELDS = {f.name for f in fields(Measurement)}


class UnknownRowField(TypeError):
    """A built-in backend named a row field that does not exist: a bug in commbench, not data."""


class Engine:
    """One process's sweep: what the run holds so far (state), where rows go (sink), and what
    each rank is about to run (recorder)."""

    def __init__(self, ctx: RunContext, plan: SweepPlan, state: RunState, sink: RowSink, recorder: Recorder):
        self.ctx = ctx
        self.plan = plan
        self.state = state
        self.sink = sink
        self.recorder = recorder
        self.step = 0                    # steps so far: the same count on every rank
        self.stops = 0                   # rows that ended a backend, recorded by this process
        self._stop_lock = threading.Lock()

    # ---- bookkeeping -------------------------------------------------------------------

    def _open_cells(self, backend: Backend) -> list[Cell]:
        """The plan's cells of `backend` that have no row yet, in the order they are measured."""
        return [c for c in self.plan.cells(backend.name, backend.op, self.state.env_setting)
                if c not in self.state.done_cells]

    def _base_row(self, backend: Backend, cell: Cell, status: str, **extra_fields: Any) -> Measurement:
        item = TORCH_DTYPES[cell.dtype].itemsize
        row = Measurement.of(cell, self.ctx.world_size, status, count=cell.shape.message_bytes // item,
                             nodes=self.ctx.nodes,
                             emulation=self.ctx.emulation.to_dict() if self.ctx.emulation else None,
                             timestamp=time.time())
        self._apply_fields(row, backend.row_fields(), strict=backend.name if is_builtin(backend.family) else None)
        self._apply_fields(row, extra_fields)
        return row

    @staticmethod
    def _apply_fields(row: Measurement, values: dict[str, Any], strict: str | None = None) -> None:
        """Set row fields by name; 'extra' and, from a plug-in, any name a row has no field for
        go into extra. strict (a built-in backend's name): such a name is a typo, raised."""
        for name, value in values.items():
            if name == "extra":
                row.extra.update(value)
            elif name in MEASUREMENT_FIELDS:
                setattr(row, name, value)
            elif strict:
                raise UnknownRowField(f"{strict}: row_fields() sets {name!r}, which no row has; "
                                      "a built-in backend puts its own fields under 'extra'")
            else:
                row.extra[name] = value

    @staticmethod
    def _orphan_check() -> None:
        """No row once this rank's launcher has ended (torchrun killed, its group too): what an
        orphan measures or skips is no result (its next setup fails on torchrun's store with a
        Broken pipe), and a resume would take its `skipped` rows as done. It ends as if stopped."""
        if launcher_gone():
            raise Terminated(signal.SIGTERM)

    def emit(self, row: Measurement) -> None:
        self._orphan_check()
        self.state.add(row)
        self.sink.write(row)
        self.sink.table.row(row)

    def _skip_all(self, backend: Backend, cells: list[Cell], reason: str, failed_rank: int | None = None) -> None:
        """One row per planned cell, so every cell of the plan has an answer; one line printed."""
        self._orphan_check()
        self.sink.table.line(f"# {backend.name}: skipped: {reason}")
        for cell in cells:
            row = self._base_row(backend, cell, SKIPPED, reason=reason, failed_rank=failed_rank)
            self.state.add(row)
            self.sink.write(row)
        self.sink.table.advance(len(cells))

    def _vote(self, local_reason: str | None) -> tuple[int | None, str | None]:
        """All ranks learn the first failing rank and its reason, prefixed with the rank when
        there are several ((None, None) when every rank can go on)."""
        reasons = self.ctx.all_gather_objects(local_reason)
        for rank, reason in enumerate(reasons):
            if reason:
                return rank, self._from_rank(rank, reason)
        return None, None

    def _from_rank(self, rank: int, text: str) -> str:
        """Name the rank a failure came from, when there is more than one."""
        return f"rank {rank}: {text}" if self.ctx.world_size > 1 else text

    @contextmanager
    def _step(self, backend: Backend, phase: str, what: str, cell: Cell, timeout_s: float | None) -> Iterator[None]:
        """One step of a backend on every rank: recorded in flight first (the row it stands for
        is `cell`'s), and watched when it has a time limit."""
        self.step += 1
        template = self._base_row(backend, cell, CRASHED)
        self.recorder.begin(self.step, phase, what, template, timeout_s)
        if timeout_s is None:
            yield
            return
        peers = PeerWatch(self.recorder.run_dir, self.ctx.rank, self.step, waits().peer_wait_s)

        def blame(reason: str, where: str | None, waiting: bool) -> Stop:
            return peers.hang(self.recorder, reason, where, waiting, waits().hang_look_s)

        def on_stop(stop: Stop, timed_out: bool) -> None:
            if timed_out and stop.status == HANG:
                self.recorder.conclude(stop)   # its peers, the driver and a resume read whom it names
            self.recorder.leave(ENDED)
            self.record_stop(stop, template)

        with Watchdog(timeout_s, what, on_stop, peers, who=f"rank {self.ctx.rank}", blame=blame):
            yield

    def record_stop(self, stop: Stop, template: Measurement) -> None:
        """The row a stop stands for (its record's, else `template`), written once (rank 0),
        and the one line a user reads."""
        if stop.status is None or launcher_gone():
            return
        with self._stop_lock:
            row = stop.row(template)
            if row.cell in self.state.done_cells:
                return
            self.state.done_cells.add(row.cell)
            self.stops += 1
            if self.sink.writer is not None:
                self.sink.write(row)
                self.sink.table.row(row)
                self.sink.flush()
            # One rank speaks: rank 0, or rank 1 when rank 0 is the one that failed.
            if self.ctx.rank == (1 if stop.failed_rank == 0 and self.ctx.world_size > 1 else 0):
                hint = f"; continue without it: {self.sink.resume_hint}" if self.sink.resume_hint else ""
                print(f"commbench sweep: {stop_line(stop, row.backend)}{hint}", file=sys.stderr, flush=True)

    # ---- the sweep -----------------------------------------------------------------------

    def run_backend(self, backend: Backend) -> None:
        cells = self._open_cells(backend)
        if not cells:
            return
        if backend.name in self.state.stopped_backends:
            self._skip_all(backend, cells, self.state.stopped_backends[backend.name])
            return
        if backend.reads_rows:
            backend.take_rows(tuple(self.state.rows))
        with self._step(backend, "check", f"check of {backend.name}", cells[0], None):
            try:
                local = backend.check(self.ctx)
            except Exception as exc:  # a check that crashes is a reason like any other
                local = f"check failed: {describe(exc)}"
        rank, reason = self._vote(local)
        if reason:
            self._skip_all(backend, cells, reason, rank)
            return
        ending = False
        try:
            self._measure_backend(backend, cells)
        except (ControlGroupLost, Terminated):
            ending = True   # the process is ending: closing a backend whose peers are gone may block
            raise
        finally:
            if not ending:
                self._close(backend, cells[-1])

    def _measure_backend(self, backend: Backend, cells: list[Cell]) -> None:
        for dtype in self.plan.dtypes:
            dtype_cells = [c for c in cells if c.dtype == dtype_name(dtype)]
            if not dtype_cells or not self._setup(backend, dtype, dtype_cells):
                continue
            for cell in dtype_cells:
                row = self._run_cell(backend, cell)
                if stops_backend(row):
                    # A backend whose bounded wait gave up is not trusted for the rest.
                    self._skip_all(backend, [c for c in cells if c not in self.state.done_cells], stopped_reason(row))
                    return

    def _close(self, backend: Backend, cell: Cell) -> None:
        with self._step(backend, "close", f"close of {backend.name}", cell, None):
            try:
                backend.close()
            except Exception as exc:  # a failing close must not lose the rows already written
                self.sink.table.line(f"# {backend.name}: close failed: {exc}")

    def _setup(self, backend: Backend, dtype: torch.dtype, cells: list[Cell]) -> bool:
        max_bytes = max(cell.shape.message_bytes for cell in cells)
        local: str | None = None
        what = f"setup of {backend.name} ({dtype_name(dtype)})"
        with self._step(backend, "setup", what, cells[0], self.plan.setup_timeout_s):
            try:
                backend.setup(self.ctx, max_bytes, dtype)
            except Exception as exc:
                local = f"setup failed: {describe(exc)}"
                self.recorder.mark(RAISED, local)   # before the vote: peers may never come to it
            rank, reason = self._vote(local)
        if reason:
            self._skip_all(backend, cells, reason, rank)
            return False
        return True

    def _run_cell(self, backend: Backend, cell: Cell) -> Measurement:
        unsupported = backend.supports(cell.shape.message_bytes, TORCH_DTYPES[cell.dtype])
        if unsupported is None and cell.mode == "graph" and not backend.graph_capturable:
            unsupported = "not CUDA-graph capturable"
        if unsupported:
            row = self._base_row(backend, cell, SKIPPED, reason=unsupported)
        else:
            what = f"{backend.name} {format_bytes(cell.shape.message_bytes)} {cell.dtype} {cell.mode}"
            with self._step(backend, "row", what, cell, self.plan.timeout_s):
                local = self._measure_local(backend, cell)
                if not isinstance(local, Measured):   # before the gather: peers may never come to it
                    self.recorder.mark(RAISED, local.reason)
                gathered = self.ctx.all_gather_objects(local)
            row = self._build_row(backend, cell, gathered)
        self.emit(row)
        return row

    def _measure_local(self, backend: Backend, cell: Cell) -> Outcome:
        """This rank's loop totals, jitter samples and checks; errors are caught so every rank
        reaches the gather."""
        try:
            dtype, shape = TORCH_DTYPES[cell.dtype], cell.shape
            item = dtype.itemsize
            two_d = (shape.tokens, shape.hidden) if shape.tokens else None
            size = shape.message_bytes
            eager = cell.mode == "eager"
            calls = self.plan.iterations_for(size) if eager else self.plan.graph_ops_for(size)
            # Eager: one pair per call of a pass, the aligning call included.
            workload = backend.make_workload(self.ctx, size // item, dtype, two_d, calls + 1 if eager else calls)
            bus_factor = workload.bus_factor(self.ctx.world_size)
            workload.prepare(OBSERVE_EPOCH)
            observed = backend.observe(lambda: workload.call(0), size) or {}
            if eager:
                return self._eager(backend, workload, calls, bus_factor, observed, self.plan.jitter_calls_for(size))
            return self._graph(backend, workload, calls, size, bus_factor, observed)
        except BackendUnavailable as exc:  # this shape cannot run (e.g. tokens <= world size)
            return Skipped(str(exc))
        except BackendTimeout as exc:
            return Failed(describe(exc), timed_out=True)
        except Exception as exc:
            return Failed(describe(exc))

    def _warm_up(self, workload: Workload, pairs: int) -> None:
        workload.prepare(WARMUP_EPOCH)
        for i in range(max(1, self.plan.warmup)):
            workload.call(i % pairs)

    def _eager(self, backend: Backend, workload: Workload, calls: int, bus_factor: float | None, observed: dict[str, Any],
               jitter_calls: int) -> Measured:
        """Timed pass (one timer around the loop) over calls + 1 pairs, then the jitter pass (a
        timer per call) of `jitter_calls` calls in rounds of up to `calls` over the same pairs;
        every output of every round is checked before the next round reuses its pair."""
        self._warm_up(workload, calls + 1)

        # The first call after a host barrier carries the ranks' exit skew: it aligns them on the
        # device and stays out of the timer (call 0 of the pass, and of each jitter round).
        def align() -> None:
            workload.call(0)

        def step(i: int) -> None:
            workload.call(i + 1)

        total_us, timed_check = self._pass(backend, workload, TIMED_EPOCH, loop_total_us, align, step, calls, calls + 1)
        samples: list[float] = []
        checks = [timed_check]
        for first in range(0, jitter_calls, calls):
            # A round's epochs follow the last round's, so an answer left from it is wrong here.
            steps = min(calls, jitter_calls - first)
            round_samples, check = self._pass(backend, workload, JITTER_EPOCH + first // calls * EPOCHS_PER_PASS, per_step_us,
                                              align, step, steps, steps + 1)
            samples += round_samples
            checks.append(check)
        return Measured(bus_factor, observed, total_us, timed_calls=calls, samples=samples, calls_per_sample=1,
                        checks=checks, check_scope="timed calls")

    def _graph(self, backend: Backend, workload: Workload, ops: int, size: int, bus_factor: float | None,
               observed: dict[str, Any]) -> Measured:
        """K calls over K pairs captured once; timed replays (one timer), then jitter replays
        (a timer per replay). The outputs left by the last replay of each pass are checked."""
        # Eager calls first: communicators, JIT kernels and IPC buffers exist before capture.
        self._warm_up(workload, ops)
        with backend.graph_capture():
            graph = capture_graph(workload.call, ops)
        replays = self.plan.graph_replays_for(size)
        for _ in range(self.plan.warmup):
            graph.replay()

        def fresh_replay(base_epoch: int) -> None:
            # Each replay re-reduced the previous one's output: check a replay of fresh inputs.
            workload.prepare(base_epoch)
            graph.replay()

        # One replay aligns the ranks, as the first eager call does.
        check_fresh = fresh_replay if workload.destroys_inputs else None
        (total_us, timed_check), (samples, jitter_check) = [
            self._pass(backend, workload, epoch, timer, graph.replay, lambda i: graph.replay(), replays, ops, check_fresh)
            for epoch, timer in ((TIMED_EPOCH, loop_total_us), (JITTER_EPOCH, per_step_us))]
        scope = ("an untimed replay of the timed graph with fresh inputs (the backend reduces in place, "
                 "so timed replays re-reduce their own output)" if workload.destroys_inputs
                 else "timed calls (the last replay of each pass)")
        return Measured(bus_factor, observed, total_us, timed_calls=replays * ops, samples=samples,
                        calls_per_sample=ops, checks=[timed_check, jitter_check], check_scope=scope,
                        work_nodes=count_work_nodes(graph), replays=replays, ops=ops)

    def _pass(self, backend: Backend, workload: Workload, base_epoch: int, timer: Callable[[RunContext, Step, int], Any],
              align: Callable[[], None], step: Step, steps: int, checked: int,
              before_check: Callable[[int], None] | None = None) -> tuple[Any, PassCheck | None]:
        """One pass: a barrier, one untimed aligning step, `timer` over `steps` steps (one timer
        around them: loop_total_us; one per step: per_step_us), then the outputs of the first
        `checked` calls checked (unless the plan checks nothing: -c 0). A wait the backend's kernels
        gave up anywhere in the pass (graph replays included) raises here: a hang row."""
        workload.prepare(base_epoch)
        synchronize(self.ctx)
        self.ctx.barrier()
        align()
        timed = timer(self.ctx, step, steps)
        if self.plan.check and before_check is not None:
            before_check(base_epoch)
        synchronize(self.ctx)
        backend.raise_if_failed()
        # -c 0: no output is read back.
        return timed, workload.verify(0, checked) if self.plan.check else None

    def _build_row(self, backend: Backend, cell: Cell, gathered: list[Outcome]) -> Measurement:
        mode = cell.mode
        row = self._base_row(backend, cell, OK)
        if isinstance(gathered[0], Measured):
            self._apply_fields(row, gathered[0].observed)
        skip = next((g for g in gathered if isinstance(g, Skipped)), None)
        if skip is not None:
            row.status = SKIPPED
            row.reason = skip.reason
            return row
        failures = [(rank, g) for rank, g in enumerate(gathered) if isinstance(g, Failed)]
        if failures:
            # A rank that raised is the cause; peers whose bounded wait then gave up are not.
            rank, failure = next(((r, g) for r, g in failures if not g.timed_out), failures[0])
            row.status = HANG if failure.timed_out else ERROR
            row.failed_rank = rank
            row.reason = self._from_rank(rank, failure.reason)
            return row
        measured = [g for g in gathered if isinstance(g, Measured)]
        first = measured[0]
        row.iterations = first.replays if mode == "graph" else first.timed_calls
        row.ops_per_graph = first.ops
        if self.plan.check:
            row.extra["check"] = first.check_scope
            self._apply_checks(row, [g.checks for g in measured])
        else:   # wrong_elements stays None, so analysis trusts the row no more than #wrong N/A
            row.extra["check"] = CHECK_OFF
        empty_graph = mode == "graph" and any(g.work_nodes == 0 for g in measured)
        if not empty_graph:
            self._apply_fields(row, headline_us([g.total_us for g in measured], first.timed_calls))
            self._apply_fields(row, jitter_stats([g.samples for g in measured], first.calls_per_sample))
            row.algbw_gbps, row.busbw_gbps = bandwidths_gbps(cell.shape.message_bytes, row.latency_us,
                                                             first.bus_factor)
        if row.wrong_elements:
            row.status = WRONG
        elif empty_graph:
            row.status = NO_WORK
            row.reason = "the CUDA graph captured no work (nothing to time)"
        elif self.ctx.world_size == 1:
            row.status = NO_WORK
            row.reason = "world size 1: nothing is communicated; the time is the local call alone"
        return row

    @staticmethod
    def _apply_checks(row: Measurement, per_rank: list[list[PassCheck]]) -> None:
        """Both passes of every rank: #wrong over all of them, the first rank and call that
        failed, the commonest kind of failure, and whether every rank got bit-identical outputs."""
        row.checked_calls = sum(check.calls for check in per_rank[0])
        row.wrong_elements = sum(check.wrong_elements for checks in per_rank for check in checks)
        row.ranks_identical = len({tuple(c.checksum for c in checks) for checks in per_rank}) == 1
        kinds: Counter[str] = Counter()
        for rank, checks in enumerate(per_rank):
            offset = 0
            for check in checks:
                kinds.update(check.kinds)
                if check.first_wrong_call is not None and row.failed_rank is None:
                    row.failed_rank = rank
                    row.first_wrong_call = offset + check.first_wrong_call
                offset += check.calls
        if kinds:
            row.wrong_kind = kinds.most_common(1)[0][0]
            row.extra["wrong_calls_by_kind"] = dict(kinds)
