"""Signals and process ends (issue 43): SIGTERM to the --nproc driver reaches torchrun and every
rank, the dead rank is the one blamed, the lock file goes with its holder however it ends, and a
child's refusal is the driver's bad input (exit 2)."""

from __future__ import annotations

import contextlib
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
from helpers import child_env, only_run_dir, poll, rows


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


# ---------------------------------------------------------------- the rank that hung, in every watchdog (issue 56)

def _frames(*frames: tuple[str, int, str]) -> str:
    return "\n".join(f'  File "{path}", line {line} in {name}' for path, line, name in frames)


def _stacks(main: list[tuple[str, int, str]]) -> str:
    """What faulthandler writes for a stop signal: every thread's stack, innermost frame first;
    the sweep's thread runs engine.py, the watchdog's waits in threading.py."""
    watchdog = [("/usr/lib/python3.11/threading.py", 331, "wait"), ("/c/commbench/sweep/watchdog.py", 70, "_watch")]
    return (f"Thread 0x00007f01 (most recent call first):\n{_frames(*watchdog)}\n\n"
            f"Current thread 0x00007f00 (most recent call first):\n{_frames(*main)}\n")


ENGINE = [("/c/commbench/runtime/workload.py", 225, "call"), ("/c/commbench/sweep/engine.py", 300, "_warm_up")]
IN_COLLECTIVE = [("/v/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
                 ("/v/torch/distributed/c10d_logger.py", 83, "wrapper"),
                 ("/p/commbench_testbackends.py", 108, "allreduce"), *ENGINE]
IN_BACKEND = [("/p/commbench_testbackends.py", 95, "allreduce"), *ENGINE]


def test_the_stacks_a_kill_left_name_the_rank_that_was_stuck() -> None:
    """The driver's --child-timeout (or its overdue check) kills a run whose watchdogs never
    fired: the stacks each rank's SIGTERM left say which rank's own code was stuck."""
    waiting, stuck = _record(0, RUNNING), _record(1, RUNNING)
    waiting.signals, stuck.signals = _stacks(IN_COLLECTIVE), _stacks(IN_BACKEND)
    waiting.signalled_at = stuck.signalled_at = 2.0   # as read_records sets them beside the stacks
    stop = inflight.postmortem([waiting, stuck], None, "child torchrun exceeded --child-timeout 5 s and was killed")
    assert stop is not None and stop.failed_rank == 1, stop
    assert stop.reason == ("child torchrun exceeded --child-timeout 5 s and was killed, during gloo 4K fp32 eager; "
                           "rank 1 was in commbench_testbackends.py:95 in allreduce <- workload.py:225 in call <- "
                           "engine.py:300 in _warm_up; rank 0 waited for it in distributed_c10d.py:3252 in all_reduce "
                           "<- c10d_logger.py:83 in wrapper <- commbench_testbackends.py:108 in allreduce")
    stuck.signals = _stacks(IN_COLLECTIVE)   # both in the collective: no rank is singled out
    stop = inflight.postmortem([waiting, stuck], None, "killed")
    assert stop is not None and stop.failed_rank is None and stop.reason == "killed, during gloo 4K fp32 eager"


def _hang_record(rank: int, waiting_in: str | None, blamed: int | None = None, detail: str = "") -> Record:
    record = _record(rank, inflight.HANG)
    record.waiting_in, record.blamed, record.detail = waiting_in, blamed, detail or f"rank {rank}'s reason"
    return record


def test_a_rank_that_waited_in_a_collective_is_no_cause() -> None:
    waiter = _hang_record(0, "distributed_c10d.py:3252 in all_reduce")
    assert inflight.peer_stop([waiter, _record(1, RUNNING)], 1, 4, Path("."), set(), set()) is None
    stuck = _hang_record(1, None)
    stop = inflight.peer_stop([waiter, stuck], 2, 4, Path("."), set(), set())
    assert stop is not None and stop.failed_rank == 1 and stop.reason == "rank 1's reason", stop
    named = _hang_record(0, "distributed_c10d.py:3252 in all_reduce", blamed=3, detail="rank 3 never reached ...")
    stop = inflight.postmortem([named, _record(3, RUNNING)], None)
    assert stop is not None and stop.failed_rank == 3 and stop.reason == "rank 3 never reached ...", stop


def test_a_watchdog_that_waited_names_the_peer_that_never_reached_its_own(tmp_path: Path) -> None:
    (tmp_path / inflight.INFLIGHT_DIR).mkdir()
    silent = _record(1, RUNNING)
    (tmp_path / inflight.INFLIGHT_DIR / "rank1.json").write_text(silent.to_json())
    recorder = inflight.Recorder(tmp_path, 0)
    try:
        recorder.begin(4, "row", "gloo 4K fp32 eager", silent.row, 3.0)
        watch = inflight.PeerWatch(tmp_path, 0, 4, peer_wait_s=0.0)
        own = watch.hang(recorder, "no progress within 3 s", "pcie.py:97 in all_reduce", waiting=False, look_s=60)
        assert own.failed_rank == 0 and own.reason == "no progress within 3 s; rank 0 was in pcie.py:97 in all_reduce"
        began = time.monotonic()
        stop = watch.hang(recorder, "no progress within 3 s", "distributed_c10d.py:3252 in all_reduce", waiting=True,
                          look_s=0.3)
        assert time.monotonic() - began < 10
        assert stop.failed_rank == 1 and stop.reason == (
            "no progress within 3 s; rank 1 never reached its own watchdog (a thread may have held the GIL); rank 0 "
            "waited for it in distributed_c10d.py:3252 in all_reduce"), stop
        (mine, _) = inflight.read_records(tmp_path)   # where it waited, for its peers to read
        assert mine.waiting_in == "distributed_c10d.py:3252 in all_reduce" and mine.state == inflight.HANG
    finally:
        recorder.close()


# ---------------------------------------------------------------- a killed launcher leaves no rank running (issue 56)

# A rank as torchrun starts one (RANK, WORLD_SIZE set): its recorder, a step begun, then a wait. It says
# 'ready' inside the try, so a signal sent on that word cannot land before the handler's scope.
_RANK = ("import sys, time\nfrom pathlib import Path\n"
         "from commbench.errors import Terminated\nfrom commbench.inflight import Recorder\n"
         "from commbench.results import Measurement\n"
         "recorder = Recorder(Path(sys.argv[1]), 0)\n"
         "row = Measurement(backend='gloo', mode='eager', dtype='fp32', message_bytes=4096, world_size=2, "
         "status='crashed')\n"
         "recorder.begin(1, 'row', 'gloo 4K fp32 eager', row, None)\n"
         "try:\n    print('ready', flush=True)\n    time.sleep(600)\n"
         "except Terminated as exc:\n    recorder.leave('left', str(exc))\n"
         "    sys.exit(128 + exc.signum)\n")
# Its launcher: starts the rank, says its pid, waits.
_LAUNCHER = ("import subprocess, sys, time\n"
             "rank = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
             "print(rank.pid, flush=True)\ntime.sleep(600)\n")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.procs
@pytest.mark.parametrize("how", ["launcher killed", "SIGHUP"])
def test_a_rank_ends_with_its_launcher_and_a_hangup_is_a_stop(how: str, tmp_path: Path) -> None:
    """kill -9 of the launcher: its rank records that and ends at once (it measured on, an
    orphan). SIGHUP, which torchrun passes on: the rank is stopped (its stacks kept), not a
    death without a trace that a resume would record as the backend's crash."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK, str(tmp_path)], stdout=subprocess.PIPE,
                                text=True, env=child_env({"RANK": "0", "WORLD_SIZE": "2"}))
    try:
        assert launcher.stdout is not None
        rank = int(launcher.stdout.readline())
        assert launcher.stdout.readline() == "ready\n"
        began = time.monotonic()
        if how == "SIGHUP":
            os.kill(rank, signal.SIGHUP)
        else:
            launcher.kill()
        assert poll(lambda: _gone(rank), 30), f"rank {rank} still running"
        assert time.monotonic() - began < 10
    finally:
        launcher.kill()
        launcher.wait()
        if not _gone(rank):
            os.kill(rank, signal.SIGKILL)
    (record,) = inflight.read_records(tmp_path)
    assert record.exit == inflight.LEFT and not inflight._died_without_trace(record), record
    if how == "SIGHUP":
        assert record.exit_detail == "SIGHUP" and record.signals and "sleep" not in record.signals.split("\n")[0]
    else:
        assert record.exit_detail == f"its launcher (pid {launcher.pid}) ended"
    assert inflight.pending(tmp_path) is None   # nothing a resume would record as a crash


def _wait_for_setup(out: Path, backend: str) -> Path:
    """The run dir once every rank's record says it is in `backend`'s setup (records of live
    ranks: a killed run's stay until the resume has read them)."""
    def there() -> bool:
        runs = [p for p in out.iterdir() if p.is_dir()] if out.exists() else []
        records = inflight.read_records(runs[0]) if runs else []
        return bool(records) and all(f"setup of {backend}" in r.what and inflight.is_alive(r) for r in records)
    assert poll(there, 180), f"no rank reached {backend}'s setup"
    return only_run_dir(out)


def _ranks_end(run_dir: Path, within_s: float = 10) -> None:
    pids = [r.pid for r in inflight.read_records(run_dir)]
    assert pids and poll(lambda: all(_gone(pid) for pid in pids), within_s), f"ranks still running: {pids}"


def _sweep(launch: list[str], setup_s: int, *where: str) -> list[str]:
    """The sweep of these tests: a plug-in whose setup sleeps `setup_s`, then one that is exact."""
    return [*launch, "sweep", "--backends", f"testfaults:slow_setup@{setup_s},testfaults:exact", "--sizes", "4K",
            "--iters", "2", "--warmup", "1", "--no-probe", *where]


def _every_cell_measured_once(run_dir: Path, status: str = "ok") -> None:
    """Each backend's one cell measured (world size 1: `no_work`), none skipped."""
    got = sorted((r["backend"], r["status"]) for r in rows(run_dir))
    assert got == [("testfaults:exact", status), ("testfaults:slow_setup", status)], got


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "commbench"]
DRIVER = [sys.executable, "-m", "commbench"]


@pytest.mark.procs
@pytest.mark.slow
def test_a_killed_torchrun_group_leaves_no_rank_and_no_row_a_resume_would_keep(tmp_path: Path) -> None:
    """SIGHUP, then kill -9, of the torchrun launcher's process group while its ranks sit in a
    setup: the ranks end within seconds each time (kill -9 left them measuring: a resume 2 s
    later was refused by their lock, and they wrote the next backend's rows as skipped with a
    Broken pipe, rows a resume then took as done); a resume right after measures every cell."""
    out = tmp_path / "out"
    for sig in (signal.SIGHUP, signal.SIGKILL):
        where = ["--out", str(out)] if sig == signal.SIGHUP else ["--resume", str(only_run_dir(out))]
        torchrun = subprocess.Popen(_sweep(TORCHRUN, 60, *where), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=child_env(), start_new_session=True)
        try:
            run_dir = _wait_for_setup(out, "testfaults:slow_setup")
            os.killpg(torchrun.pid, sig)
            _ranks_end(run_dir)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
        assert inflight.pending(run_dir) is None, inflight.read_records(run_dir)   # no crash to record
        assert rows(run_dir) == [] and not (run_dir / LOCK_FILE).exists()
        RunDir(run_dir).lock().release()   # a resume now is not refused
    done = subprocess.run(_sweep(TORCHRUN, 0, "--resume", str(run_dir)), capture_output=True, text=True,
                          env=child_env(), timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    _every_cell_measured_once(run_dir)


@pytest.mark.procs
@pytest.mark.slow
def test_a_term_hangup_or_kill_of_the_driver_leaves_no_torchrun_and_no_rank(tmp_path: Path) -> None:
    """SIGTERM to `sweep --nproc` while its rank's setup sleeps: every process of the run ends,
    run.json says interrupted, the lock and its file go, exit 143. SIGHUP ends it the same way
    (exit 129; it once ended the driver alone, torchrun and the ranks measured on). kill -9 of the
    driver ends its torchrun (SIGTERM when its parent dies), and torchrun its ranks. Each stop is
    resumed by the next launch; a last resume finishes the plan, every row once."""
    out = tmp_path / "out"
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        where = ["--out", str(out)] if sig == signal.SIGTERM else ["--resume", str(only_run_dir(out))]
        driver = subprocess.Popen(_sweep(DRIVER, 60, "--nproc", "1", *where), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
        try:
            run_dir = _wait_for_setup(out, "testfaults:slow_setup")
            (torchrun,) = Path(f"/proc/{driver.pid}/task/{driver.pid}/children").read_text().split()
            driver.send_signal(sig)
            _, err = driver.communicate(timeout=60)
            assert poll(lambda: _gone(int(torchrun)), 30), "torchrun still running"
            _ranks_end(run_dir)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, signal.SIGKILL)
        if sig != signal.SIGKILL:
            assert driver.returncode == 128 + sig, err[-2000:]
            assert "finished" not in json.loads((run_dir / RUN_FILE).read_text())
            assert "interrupted" in json.loads((run_dir / RUN_FILE).read_text())
            assert not (run_dir / LOCK_FILE).exists()
        assert inflight.pending(run_dir) is None and rows(run_dir) == []
        RunDir(run_dir).lock().release()   # free: kill -9 leaves the holder's file, never its lock
    done = subprocess.run(_sweep(DRIVER, 0, "--nproc", "1", "--resume", str(run_dir)), capture_output=True, text=True,
                          env=child_env(), timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    _every_cell_measured_once(run_dir, "no_work")   # one rank: nothing is communicated
