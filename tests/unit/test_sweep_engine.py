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
