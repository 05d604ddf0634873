"""The row and its cell (commbench/results/schema.py)."""

from __future__ import annotations

from commbench.ops import ALLREDUCE, FUSED_OP
from commbench.results import CRASHED, OK, Cell, Measurement, Shape


def test_a_row_is_its_cell_plus_an_outcome_in_the_row_format_it_always_had() -> None:
    cell = Cell("nccl:lib=next", ALLREDUCE, "bf16", Shape(14336, 1, 7168), "graph",
                Cell.setting({"LD_PRELOAD": "/opt/nccl/libnccl.so.2"}))
    row = Measurement.of(cell, 8, OK, count=7168, latency_us=12.5)
    flat = Measurement(backend="nccl:lib=next", mode="graph", dtype="bf16", message_bytes=14336, world_size=8,
                       status=OK, count=7168, tokens=1, hidden=7168, latency_us=12.5,
                       env_setting={"LD_PRELOAD": "/opt/nccl/libnccl.so.2"})
    assert row.to_dict() == flat.to_dict() and row.cell == flat.key() == cell
    assert cell.library == "/opt/nccl/libnccl.so.2"
    # Every part of the cell tells rows apart; the outcome does not.
    for other in (Shape(14336), Shape(28672, 2, 7168)):
        assert Measurement.of(Cell("nccl:lib=next", ALLREDUCE, "bf16", other, "graph", cell.env_setting), 8,
                              OK).key() != row.key()
    assert Measurement.from_dict({**row.to_dict(), "op": FUSED_OP}).key() != row.key()
    assert Measurement.from_dict({**row.to_dict(), "env_setting": {}}).key() != row.key()
    assert Measurement.of(cell, 8, CRASHED, reason="died").key() == row.key()
