"""What each rank is about to run, and what survivors make of it (commbench/inflight.py)."""

from __future__ import annotations

import pytest

from commbench import inflight
from commbench.inflight import ENDED, HANG, PeerWatch, Record, read_records, recover
from commbench.ops import ALLREDUCE
from commbench.results import CRASHED, Cell, Measurement, RunDir, Shape


def test_an_in_flight_record_keeps_its_cells_row_and_recovery_writes_it_once(tmp_path) -> None:
    run = RunDir.create(tmp_path)
    cell = Cell("demo", ALLREDUCE, "fp32", Shape(4096), "eager", Cell.setting({"NCCL_PROTO": "LL"}))
    template = Measurement.of(cell, 2, CRASHED, count=1024, requested={"NCCL_PROTO": "LL"})
    (run.path / "inflight").mkdir()
    record = Record(rank=1, pid=999999999, host="synthetic-host", step=3, phase="row", what="demo 4K fp32 eager",
                    row=template, started=1.0, deadline=None)
    (run.path / "inflight" / "rank1.json").write_text(record.to_json())
    assert read_records(run.path)[0].row == template
    assert len(recover(run.path)) == 1 and recover(run.path) == []   # the records are gone after the first
    written = run.rows()
    assert len(written) == 1 and written[0].cell == cell and written[0].status == CRASHED
    assert written[0].requested == {"NCCL_PROTO": "LL"} and written[0].failed_rank == 1


def test_a_peer_whose_watchdog_wrote_hang_just_before_it_exited_is_a_hang_not_a_silent_death(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen at 8 ranks on the H200: rank 4's watchdog wrote "hang, ended" and left by os._exit
    # between a peer's read of the records and its look at /proc; the peer read the older
    # record with a dead process and called it "died without a trace (SIGKILL?)".
    run = RunDir.create(tmp_path)
    (run.path / "inflight").mkdir()
    cell = Cell("demo", ALLREDUCE, "bf16", Shape(16384), "graph", Cell.setting({}))
    running = Record(rank=4, pid=999999999, host="synthetic-host", step=7, phase="row", what="demo 16K bf16 graph",
                     row=Measurement.of(cell, 8, CRASHED), started=1.0, deadline=21.0)
    path = run.path / "inflight" / "rank4.json"
    path.write_text(running.to_json())

    def exits_after_its_last_write(record: Record) -> bool:
        final = Record(**{**vars(running), "state": HANG, "detail": "no progress within 20 s during demo",
                          "exit": ENDED, "exit_at": 22.0})
        path.write_text(final.to_json())
        return False

    monkeypatch.setattr(inflight, "is_alive", exits_after_its_last_write)
    stop = PeerWatch(run.path, rank=0, step=7, peer_wait_s=0.0)()
    assert stop is not None and stop.status == HANG and "no progress within 20 s" in stop.reason, stop
