"""Run directories, logs, specs, traces and snapshots from someone else (issues 31 and 43): every
case of tests/hostile.py and tests/hostile_inputs.py holds, and the pieces behind them (the lock,
an import cut short, the driver's Ctrl-C, the boundary's text cleaning) do what they say."""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import sys
import time
from pathlib import Path

import pytest

import hostile
from commbench import cli
from commbench.results import LOCK_FILE, RUN_FILE, RowsWriter, RunDir
from commbench.results.rundir import LOCK_HOLDER_VAR, unwritable
from commbench.results.validate import clean_text, file_stem, parse_row
from commbench.sweep import launcher

CASES = hostile.cases()


def _in_process(argv: list[str]) -> hostile.Result:
    out, err = io.StringIO(), io.StringIO()
    began = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:   # argparse's own errors
            code = int(exc.code or 0)
    return hostile.Result(code, out.getvalue(), err.getvalue(), time.monotonic() - began)


def _run(case: hostile.Case, root: Path) -> hostile.Result:
    argv = case.build(root)
    if case.own_process:
        return hostile.run_as_process(sys.executable, argv, root, timeout_s=20 if case.blocks else 120,
                                      interrupt_during=case.interrupt_during, file_limit_bytes=case.file_limit_bytes)
    return _in_process(argv)


@pytest.mark.parametrize("case", [c for c in CASES if not c.procs], ids=lambda c: f"{c.klass}: {c.name}")
def test_a_hostile_case_holds(case: hostile.Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    case.check(_run(case, tmp_path), tmp_path)


@pytest.mark.procs
@pytest.mark.parametrize("case", [c for c in CASES if c.procs], ids=lambda c: f"{c.klass}: {c.name}")
def test_a_hostile_case_with_a_process_holds(case: hostile.Case, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    case.check(_run(case, tmp_path), tmp_path)


def test_a_refused_write_is_not_told_to_make_room(tmp_path: Path) -> None:
    rows = tmp_path / "measurements.jsonl"
    for number, words in ((errno.EACCES, "Permission denied"), (errno.EROFS, "Read-only file system")):
        refused = str(unwritable(rows, OSError(number, words)))
        assert str(rows) in refused and "make room" not in refused and "make it writable" in refused, refused
    full = str(unwritable(rows, OSError(errno.ENOSPC, "No space left on device")))
    assert str(rows) in full and "make room and run the command again" in full


def test_every_class_of_the_issue_has_cases() -> None:
    assert {c.klass for c in CASES} == set(hostile.CLASSES)
    assert len({c.name for c in CASES}) == len(CASES)


# ---------------------------------------------------------------- the lock

def test_a_second_lock_is_refused_with_the_holder(tmp_path: Path) -> None:
    first = RunDir(tmp_path).lock()
    try:
        with pytest.raises(Exception, match=r"another commbench sweep is running in it \(pid \d+ on \S+\)"):
            RunDir(tmp_path).lock()
    finally:
        first.release()
    RunDir(tmp_path).lock().release()   # free again once released


def test_a_child_of_the_driver_that_holds_the_lock_takes_none(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver holds the lock while its torchrun children write the dir: a child must not
    wait for it (the driver waits for the child) nor be refused."""
    driver = RunDir(tmp_path).lock()
    try:
        for name, value in driver.holder_env().items():
            monkeypatch.setenv(name, value)
        child = RunDir(tmp_path).lock()
        child.release()   # releases nothing of the driver's
        monkeypatch.setenv(LOCK_HOLDER_VAR, f"{tmp_path}\n1")   # another pid than the holder's: no pass
        with pytest.raises(Exception, match="another commbench sweep"):
            RunDir(tmp_path).lock()
        assert (tmp_path / LOCK_FILE).exists()   # the driver's, named while it holds
    finally:
        driver.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_driver_marks_its_run_interrupted_on_ctrl_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "_drive", interrupted)
    args = argparse.Namespace(nproc=1, env=[], child_timeout=60.0, resume=None, out=str(tmp_path), mps=False)
    with pytest.raises(KeyboardInterrupt):
        launcher.drive(args, [], [], plan=None)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    info = json.loads((run_dir / RUN_FILE).read_text())
    assert "interrupted" in info and "finished" not in info
    RunDir(run_dir).lock().release()   # the driver let go of it


# ---------------------------------------------------------------- an import cut short

def test_an_import_cut_short_is_completed_by_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = hostile.NCCL_LOG
    out = tmp_path / "imp"
    argv = ["import-nccl-tests", str(log), "--average", "3", "--out", str(out)]
    real = RowsWriter.append
    written = []

    def full_disk(self, row, sync=True):
        if len(written) == 5:
            raise unwritable(self.path, OSError(errno.ENOSPC, "No space left on device"))
        written.append(row)
        real(self, row, sync)

    monkeypatch.setattr(RowsWriter, "append", full_disk)
    cut = _in_process(argv)   # into a new dir: built beside it, so a cut leaves nothing behind
    assert cut.code == 1 and "No space left on device" in cut.err and "--resume" not in cut.err, cut.err
    assert list(tmp_path.iterdir()) == []
    # into a dir an earlier import made: appended in place, and a cut is repaired by the next
    other = ["import-nccl-tests", str(log.with_name("h200-8gpu-mpi-eager-periter.txt")), "--average", "1", "--out",
             str(out)]
    monkeypatch.setattr(RowsWriter, "append", real)
    assert _in_process(other).code == 0
    before = (out / "measurements.jsonl").read_text().count("\n")
    written.clear()
    monkeypatch.setattr(RowsWriter, "append", full_disk)
    cut = _in_process(argv)
    assert cut.code == 1 and "No space left on device" in cut.err, cut.err
    assert len(json.loads((out / RUN_FILE).read_text())["imports"]) == 1   # this import is not recorded as done
    monkeypatch.setattr(RowsWriter, "append", real)
    again = _in_process(argv)
    assert again.code == 0, again.err
    assert "removed 5 row(s) of an import that did not finish" in " ".join(again.out.split())
    full = _in_process(["import-nccl-tests", str(log), "--average", "3", "--out", str(tmp_path / "whole")])
    assert full.code == 0
    assert (out / "measurements.jsonl").read_text().count("\n") == \
        before + (tmp_path / "whole" / "measurements.jsonl").read_text().count("\n")
    assert "already imported" in _in_process(argv).out


def test_rows_of_another_unfinished_import_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "imp"
    assert _in_process(["import-nccl-tests", str(hostile.NCCL_LOG), "--average", "3", "--out", str(out)]).code == 0
    info = json.loads((out / RUN_FILE).read_text())
    info["imports"] = []   # as if its record was never written
    (out / RUN_FILE).write_text(json.dumps(info))
    other = hostile.TESTS / "data" / "nccl-tests" / "h200-8gpu-mpi-eager-periter.txt"
    done = _in_process(["import-nccl-tests", str(other), "--average", "3", "--out", str(out)])
    assert done.code == 2 and "of an import that did not finish" in done.err, done.err


# ---------------------------------------------------------------- the boundary

def test_text_from_run_files_loses_its_control_characters() -> None:
    assert clean_text("nccl\x1b]0;x\x07\x1b[2J\u202e") == "nccl]0;x[2J"
    assert clean_text("a\nb\tc", one_line=False) == "a\nb\tc"
    assert file_stem("bf16") == "bf16" and "/" not in file_stem("../../x") and not file_stem("..").startswith(".")


@pytest.mark.parametrize("line, why", [
    (b"[" * 5000 + b"]" * 5000, "not JSON"),
    (b'{"schema": 3}', "no backend"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_line_that_is_no_row_says_why(line: bytes, why: str) -> None:
    row, problem = parse_row(line)
    assert row is None and problem is not None and why in problem
