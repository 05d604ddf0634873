"""The sweep engine's bookkeeping that needs no processes (commbench/sweep/engine.py): row fields,
a cell's row from every rank's typed outcome, a resumed run's state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from commbench.ops import ALLREDUCE
from commbench.results import CHECK_OFF, ERROR, HANG, NO_WORK, OK, SKIPPED, WRONG, Cell, Shape
from commbench.runtime.workload import PassCheck
from commbench.sweep.engine import Engine, UnknownRowField
from commbench.sweep.outcome import Failed, Measured, Skipped
from commbench.sweep.state import RunState
from factories import row


def test_a_built_in_backends_unknown_row_field_is_an_error_and_a_plugins_goes_to_extra() -> None:
    fields = {"requested": {"NCCL_PROTO": "LL"}, "extra": {"kept": 1}}
    strict = row()
    Engine._apply_fields(strict, fields, strict="nccl")
    assert strict.requested == {"NCCL_PROTO": "LL"} and strict.extra == {"kept": 1}
    with pytest.raises(UnknownRowField, match="nccl: row_fields\\(\\) sets 'requsted'"):
        Engine._apply_fields(row(), {"requsted": {"NCCL_PROTO": "LL"}}, strict="nccl")
    plugin = row()
    Engine._apply_fields(plugin, {"requsted": "x"})
    assert plugin.extra == {"requsted": "x"} and plugin.requested == {}


def test_every_built_in_variant_names_only_row_fields() -> None:
    """What each built-in variant records before its setup (the fields that do not depend on a run)
    passes the engine's strict check: no built-in backend leans on a name landing in extra."""
    from commbench.backends import is_builtin, probe_variants

    variants = [b for b in probe_variants() if is_builtin(b.family)]
    assert len(variants) > 40
    for backend in variants:
        Engine._apply_fields(row(), backend.row_fields(), strict=backend.name)


def _engine(world_size: int = 2, check: bool = True) -> Engine:
    """An engine whose row building needs no processes: the context and plan fields it reads."""
    ctx = SimpleNamespace(world_size=world_size, nodes=1, emulation=None)
    return Engine(ctx, SimpleNamespace(check=check), RunState.resumed([], {}), sink=None, recorder=None)


PLUGIN = SimpleNamespace(name="mine", family="mine", row_fields=lambda: {})
CELL = Cell("mine", ALLREDUCE, "bf16", Shape(4096), "graph")


def _measured(total_us: float = 100.0, wrong: int = 0, **changes: object) -> Measured:
    checks = [PassCheck(calls=4, wrong_elements=wrong, first_wrong_call=2 if wrong else None,
                        kinds={"stale": 1} if wrong else {}), PassCheck(calls=4)]
    fields = dict(bus_factor=1.0, observed={"requested": {"NCCL_PROTO": "LL"}}, total_us=total_us,
                  timed_calls=10, samples=[10.0, 12.0], calls_per_sample=2, checks=checks,
                  check_scope="timed calls", work_nodes=3, replays=5, ops=2)
    return Measured(**{**fields, **changes})


def test_a_cells_row_from_every_ranks_measured_outcome() -> None:
    built = _engine()._build_row(PLUGIN, CELL, [_measured(100.0), _measured(200.0)])
    assert (built.status, built.iterations, built.ops_per_graph, built.latency_us) == (OK, 5, 2, 20.0)
    assert built.jitter_samples == 2 and built.jitter_p50_us > 0
    assert built.requested == {"NCCL_PROTO": "LL"} and built.extra["check"] == "timed calls"
    assert (built.checked_calls, built.wrong_elements, built.ranks_identical) == (8, 0, True)


def test_wrong_outputs_on_one_rank_name_that_rank_and_call() -> None:
    built = _engine()._build_row(PLUGIN, CELL, [_measured(), _measured(wrong=3)])
    assert (built.status, built.failed_rank, built.first_wrong_call, built.wrong_kind) == (WRONG, 1, 2, "stale")


def test_an_empty_graph_is_no_work_and_unchecked_rows_say_so() -> None:
    empty = _engine()._build_row(PLUGIN, CELL, [_measured(), _measured(work_nodes=0)])
    assert empty.status == NO_WORK and empty.latency_us is None
    unchecked = _engine(check=False)._build_row(PLUGIN, CELL, [_measured(), _measured()])
    assert unchecked.extra["check"] == CHECK_OFF and unchecked.wrong_elements is None


def test_a_skip_on_any_rank_skips_the_cell() -> None:
    built = _engine()._build_row(PLUGIN, CELL, [_measured(), Skipped("tokens <= world size")])
    assert (built.status, built.reason) == (SKIPPED, "tokens <= world size")


def test_the_rank_that_raised_is_the_cause_not_the_peer_that_timed_out() -> None:
    outcomes = [Failed("peer wait gave up", timed_out=True), Failed("RuntimeError: boom")]
    built = _engine()._build_row(PLUGIN, CELL, outcomes)
    assert (built.status, built.failed_rank, built.reason) == (ERROR, 1, "rank 1: RuntimeError: boom")
    hung = _engine()._build_row(PLUGIN, CELL, [_measured(), Failed("no answer in 5 s", timed_out=True)])
    assert (hung.status, hung.failed_rank) == (HANG, 1)


def test_a_resumed_run_keeps_a_backend_stopped_only_under_the_same_setting() -> None:
    hung = row(backend="p2p:auto", status=HANG, reason="no answer", env_setting={"NCCL_PROTO": "LL"})
    state = RunState.resumed([hung, row()], {"NCCL_PROTO": "LL"})
    assert state.stopped_backends["p2p:auto"] == "hung earlier in this run (4K graph): no answer"
    assert state.done_cells == {hung.cell, row().cell}
    assert RunState.resumed([hung], {}).stopped_backends == {}


class _LocalSum:
    """A world of one on the CPU, in this process: the sum is the input (a stale answer from
    call `stale_at` of the jitter pass on, to show every round is checked)."""

    in_place = False

    def __init__(self, stale_at: int | None = None, gave_up: Exception | None = None):
        self.calls = 0
        self.stale_at = stale_at
        self.gave_up = gave_up     # what its kernels recorded on the device, raised after a pass

    def raise_if_failed(self) -> None:
        if self.gave_up is not None:
            raise self.gave_up

    def make_workload(self, ctx, count, dtype, shape, pairs):  # noqa: ANN001, ANN201
        from commbench.runtime.workload import AllreduceWorkload
        return AllreduceWorkload(self, ctx, count, dtype, pairs)

    def observe(self, call, message_bytes):  # noqa: ANN001, ANN201
        return {}

    def allreduce(self, x, out):  # noqa: ANN001, ANN201
        self.calls += 1
        if self.stale_at is None or self.calls < self.stale_at:
            out.copy_(x)


def _eager_row(backend: _LocalSum, *flags: str) -> tuple[Measured, object]:
    import torch

    from commbench.sweep.plan import build_plan
    from helpers import sweep_args

    plan = build_plan(sweep_args("--sizes", "4K", *flags), on_gpu=False)
    ctx = SimpleNamespace(world_size=1, rank=0, nodes=1, emulation=None, device=torch.device("cpu"), is_cuda=False,
                          barrier=lambda: None)
    engine = Engine(ctx, plan, RunState.resumed([], {}), sink=None, recorder=None)
    cell = Cell("mine", ALLREDUCE, "fp32", Shape(4096), "eager")
    local = engine._measure_local(backend, cell)
    assert isinstance(local, Measured), local
    return local, engine._build_row(PLUGIN, cell, [local])


def test_a_default_eager_row_times_at_least_100_calls_one_by_one_and_checks_each() -> None:
    """p99 is a per-call tail: the jitter pass times >= 100 calls (in rounds over the row's 21
    pairs on the CPU), the row's percentiles are those samples', and every call is checked."""
    from commbench.results import percentile

    local, built = _eager_row(_LocalSum())
    assert local.timed_calls == 20 and len(local.samples) == 100 and local.calls_per_sample == 1
    assert built.jitter_samples == 100 and built.iterations == 20
    ordered = sorted(local.samples)
    assert built.jitter_p99_us == percentile(ordered, 99) and built.jitter_max_us == ordered[-1]
    # the timed pass's 20 calls and the aligning one, then 5 rounds of 20 with theirs
    assert built.checked_calls == 21 + 5 * 21 and built.wrong_elements == 0 and built.status == NO_WORK
    fewer, row = _eager_row(_LocalSum(), "--jitter-calls", "7")   # CPU tests may ask for fewer
    assert len(fewer.samples) == 7 and row.checked_calls == 21 + 8


def test_a_wrong_answer_in_a_later_jitter_round_is_caught() -> None:
    warm = 2           # warm-up calls (CPU default; this backend observes nothing)
    stale_from = warm + 21 + 3 * 21 + 5   # the 5th call of the jitter pass's 4th round
    _, built = _eager_row(_LocalSum(stale_at=stale_from))
    assert built.status == WRONG and built.wrong_kind == "unwritten"
    assert built.first_wrong_call == 21 + 3 * 21 + 4


def test_a_wait_the_kernels_gave_up_is_a_hang_row_not_wrong_values() -> None:
    """The harness asks the backend after each pass (graph replays never pass through allreduce):
    a recorded timeout becomes the row's hang, named, however right the outputs look."""
    from commbench.backends.base import BackendTimeout
    from commbench.sweep.plan import build_plan
    from helpers import sweep_args
    import torch

    plan = build_plan(sweep_args("--sizes", "4K"), on_gpu=False)
    ctx = SimpleNamespace(world_size=1, rank=0, nodes=1, emulation=None, device=torch.device("cpu"), is_cuda=False,
                          barrier=lambda: None)
    engine = Engine(ctx, plan, RunState.resumed([], {}), sink=None, recorder=None)
    cell = Cell("mine", ALLREDUCE, "fp32", Shape(4096), "eager")
    local = engine._measure_local(_LocalSum(gave_up=BackendTimeout("peer 1 never arrived")), cell)
    assert isinstance(local, Failed) and local.timed_out and "peer 1 never arrived" in local.reason
    built = engine._build_row(PLUGIN, cell, [local])
    assert built.status == HANG and built.failed_rank == 0
