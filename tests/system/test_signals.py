"""Signals and process ends (issue 43): SIGTERM to the --nproc driver reaches torchrun and every
rank, the dead rank is the one blamed, the lock file goes with its holder however it ends, and a
child's refusal is the driver's bad input (exit 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commbench import cli, inflight
from commbench.errors import USAGE_LINE_FILE_VAR, UsageError
from commbench.inflight import RAISED, RUNNING, Record
from commbench.results import CRASHED, STRANDED
from commbench.results import LOCK_FILE, RUN_FILE, Measurement, RunDir
from commbench.sweep import launcher
from helpers import child_env, only_run_dir, rows


def _record(rank: int, state: str, exit: str | None = None, step: int = 4, marked_at: float | None = None) -> Record:
    row = Measurement(backend="gloo", mode="eager", dtype="fp32", message_bytes=4096, world_size=2, status=CRASHED)
    return Record(rank=rank, pid=999999, host="h", step=step, phase="row", what="gloo 4K fp32 eager", row=row,
                  started=1.0, deadline=None, state=state, exit=exit, detail="connection closed by peer"
                  if state == RAISED else None, marked_at=marked_at)


@pytest.mark.parametrize("survivor_exit", [None, inflight.LEFT])
def test_a_rank_killed_without_a_trace_is_blamed_not_the_survivor(survivor_exit: str | None) -> None:
    """kill -9 of rank 0 mid-collective: rank 1's gloo raised "connection closed by peer" and
    left; the row names rank 0's death (it used to be rank 1's error)."""
    stop = inflight.postmortem([_record(0, RUNNING), _record(1, RAISED, survivor_exit)], None)
    assert stop is not None and stop.status == CRASHED and stop.failed_rank == 0, stop


def test_a_rank_that_raised_alone_still_stranded_its_peers() -> None:
    """A death in another step is not the cause: the exception stranded the peers."""
    stop = inflight.postmortem([_record(0, RUNNING, step=3), _record(1, RAISED, step=4)], None)
    assert stop is not None and stop.failed_rank == 1 and stop.extra.get(STRANDED), stop


def test_of_two_ranks_that_raised_the_first_is_the_cause() -> None:
    """Rank 1 raised in the collective and left after its wait; rank 0's gloo then raised
    "connection closed by peer" 3 s later. The row names rank 1, whose exception came first,
    not the lower rank (seen on CI's loaded cores: the survivor's look at the records after the
    control group failed waits for no one)."""
    cause, consequence = _record(1, RAISED, inflight.ENDED, marked_at=100.0), _record(0, RAISED, marked_at=103.0)
    stop = inflight.postmortem([consequence, cause], None)
    assert stop is not None and stop.failed_rank == 1 and stop.extra.get(STRANDED), stop
    stop = inflight.peer_stop([consequence, cause], 0, 4, Path("."), raised={0}, dead_ranks={1})
    assert stop is not None and stop.failed_rank == 1 and stop.extra.get(STRANDED), stop
    # a time that is not a number (a record read from a forwarded dir) counts as unknown: last
    odd = _record(0, RAISED, marked_at="soon")   # type: ignore[arg-type]
    assert inflight.postmortem([odd, cause], None).failed_rank == 1


def test_recorder_marks_when_a_rank_raised(tmp_path: Path) -> None:
    recorder = inflight.Recorder(tmp_path, 0)
    try:
        recorder.begin(1, "row", "gloo 4K fp32 eager", _record(0, RUNNING).row, None)
        before = time.time()
        recorder.mark(RAISED, "boom")
        (record,) = inflight.read_records(tmp_path)
        assert record.state == RAISED and record.marked_at is not None and before <= record.marked_at <= time.time()
    finally:
        recorder.close()


@pytest.mark.procs
def test_the_lock_file_goes_however_the_holder_ends(tmp_path: Path) -> None:
    """An error that ends the process (atexit) or a watchdog's os._exit (release_all): no
    .commbench.lock is left behind."""
    code = ("import sys, os\nfrom pathlib import Path\nfrom commbench.results import RunDir\n"
            "from commbench.results.rundir import release_all\n"
            "RunDir(Path(sys.argv[1])).lock()\n"
            "if sys.argv[2] == 'exit': release_all(); os._exit(3)\n"
            "raise RuntimeError('an error')\n")
    for how in ("error", "exit"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path), how], capture_output=True, text=True,
                              env=child_env(), timeout=60)
        assert done.returncode in (1, 3), done.stderr
        assert not (tmp_path / LOCK_FILE).exists(), how
    RunDir(tmp_path).lock().release()


def test_a_childs_refusal_is_the_drivers_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A child that refuses its --resume (its GPUs differ) exits 2 under torchrun, which exits
    1: the child hands its line to the driver, which says it once and exits 2."""
    refusal = tmp_path / "refused"
    monkeypatch.setenv(USAGE_LINE_FILE_VAR, str(refusal))
    monkeypatch.setenv("RANK", "0")
    cli.usage_error("commbench sweep: error: --resume R: not the run this command would make", "--resume R: not")
    assert capsys.readouterr().err == "" and refusal.read_text() == "--resume R: not"
    with pytest.raises(UsageError, match="--resume R: not"):
        launcher._refused(refusal)
    assert not refusal.exists()
    launcher._refused(refusal)   # none left: a failed child, not a refusal


@pytest.mark.procs
@pytest.mark.slow
def test_sigterm_to_the_driver_stops_torchrun_and_every_rank_and_a_resume_completes(tmp_path: Path) -> None:
    """SIGTERM to `sweep --nproc 1` while its rank's setup sleeps: every process of the run ends,
    run.json says interrupted, the lock and its file go, exit 143; --resume then finishes the
    plan with every row once."""
    sweep = ["sweep", "--nproc", "1", "--backends", "gloo,testfaults:slow_setup@30", "--sizes", "4K",
             "--iters", "2", "--warmup", "1", "--no-probe"]
    driver = subprocess.Popen([sys.executable, "-m", "commbench", *sweep, "--out", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        run_dir = None
        while time.monotonic() < deadline:   # gloo's row, then slow_setup's setup sleeps
            runs = [p for p in tmp_path.iterdir() if p.is_dir()]
            if runs and (runs[0] / "measurements.jsonl").exists() and rows(runs[0]):
                records = inflight.read_records(runs[0])
                if any("slow_setup" in r.what for r in records):
                    run_dir = runs[0]
                    break
            time.sleep(0.2)
        assert run_dir is not None, "the sweep never reached slow_setup's setup"
        ranks = [r.pid for r in inflight.read_records(run_dir)]
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 143, err[-2000:]
    assert all(not Path(f"/proc/{pid}").exists() for pid in ranks), ranks
    info = json.loads((run_dir / RUN_FILE).read_text())
    assert "interrupted" in info and not info.get("finished"), info
    assert not (run_dir / LOCK_FILE).exists()
    resumed = subprocess.run([sys.executable, "-m", "commbench", *sweep[:4], "gloo,testfaults:slow_setup@1",
                              *sweep[5:], "--resume", str(run_dir)], capture_output=True, text=True,
                             env=child_env(), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    cells = [(r["backend"], r["message_bytes"]) for r in rows(only_run_dir(tmp_path))]
    assert sorted(cells) == [("gloo", 4096), ("testfaults:slow_setup", 4096)], cells
