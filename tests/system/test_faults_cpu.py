"""Faults that end processes, on the CPU with real torchrun and gloo: a rank that raises while
its peer waits in a collective, a rank that dies of SIGSEGV (in setup, in a row, the rank that
writes the rows), a rank that hangs holding the GIL, a results file that stops taking writes.
Every one becomes a row that names it, the other backends are measured (by the --nproc driver
in one command, by one --resume under torchrun), and no row is lost or written twice."""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from commbench.sweep import mps
from helpers import (child_env, install_fake_mps, mps_starts, only_run_dir, our_frames,
                     python_in_a_clone_named_commbench, rows, run_cli, run_torchrun)

pytestmark = pytest.mark.procs   # every test here launches processes

REPO = Path(__file__).resolve().parents[2]
SIZES = ["--sizes", "4K,16K,64K", "--iters", "2"]


def statuses(all_rows: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for row in all_rows:
        out.setdefault(row["backend"], []).append(row["status"])
    return out


def by_backend(all_rows: list[dict], backend: str) -> list[dict]:
    return [r for r in all_rows if r["backend"] == backend]


def assert_each_cell_once(all_rows: list[dict]) -> None:
    keys = [(r["backend"], r["mode"], r["dtype"], r["message_bytes"], json.dumps(r["env_setting"])) for r in all_rows]
    assert len(keys) == len(set(keys)), keys


def commbench_lines(stderr: str) -> list[str]:
    """commbench's own lines (torchrun's error box says "commbench FAILED": not one of them)."""
    return [line for line in stderr.splitlines() if line.startswith(("commbench sweep", "commbench:"))]


def resume_command(stderr: str) -> list[str]:
    """The command the one line says continues the run, as argv for this Python."""
    (line,) = [line for line in commbench_lines(stderr) if "continue without it: " in line]
    words = shlex.split(line.split("continue without it: ", 1)[1])
    assert words[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *words[1:]]


@pytest.mark.slow
def test_a_rank_that_raises_in_allreduce_is_an_error_row_and_the_printed_resume_goes_on(tmp_path: Path) -> None:
    # The default 120 s row watchdog would outlast the test's own limit: the error must come sooner.
    first = run_torchrun(2, ["sweep", "--backends", "testfaults:raise_rank1@16384,testfaults:exact", *SIZES,
                             "--out", str(tmp_path)], timeout=110)
    assert first.returncode != 0
    run_dir = only_run_dir(tmp_path)
    (error,) = [r for r in rows(run_dir) if r["status"] == "error"]
    assert error["backend"] == "testfaults:raise_rank1" and error["message_bytes"] == 16384
    assert error["failed_rank"] == 1 and error["extra"]["stranded_peers"] is True
    assert error["reason"].startswith("rank 1: RuntimeError: deliberate failure in allreduce on rank 1 [")
    (line,) = commbench_lines(first.stderr)
    assert "testfaults:raise_rank1 failed on one rank (rank 1: RuntimeError" in line
    assert line.endswith(f"--resume {run_dir}")

    second = subprocess.run(resume_command(first.stderr), capture_output=True, text=True, timeout=180,
                            env=child_env())
    assert second.returncode == 0, second.stderr
    got = rows(run_dir)
    assert statuses(got) == {"testfaults:raise_rank1": ["ok", "error", "skipped"], "testfaults:exact": ["ok"] * 3}
    assert by_backend(got, "testfaults:raise_rank1")[2]["reason"].startswith("failed on one rank earlier in this run")
    assert_each_cell_once(got)
    assert not (run_dir / "inflight").exists()
    info = json.loads((run_dir / "run.json").read_text())
    assert len(info["resumed"]) == 1 and "--resume" not in info["command"]   # the original stays


@pytest.mark.slow
def test_the_driver_survives_crashes_a_stranding_setup_and_a_gil_hang_with_a_fresh_mps_daemon_each_time(
        tmp_path: Path) -> None:
    """One driver run (each scenario here costs a child torchrun and its ranks): a rank that dies
    in setup and in a row, a setup that strands its peer, a rank that hangs holding the GIL; every
    other backend is measured, and each resumed child gets a fresh private MPS daemon (the
    stand-in of tests/helpers.py: a server that ignores quit, as one whose client died does)."""
    faulty = ["testfaults:segv_setup_rank1", "testfaults:segv_rank1@16384", "testfaults:raise_setup_rank1",
              "testfaults:hang_gil_rank0@16384"]
    bin_dir, mps_log = install_fake_mps(tmp_path / "mps", mps.CONTROL)
    result = run_cli(["sweep", "--nproc", "2", "--share-gpus", "--mps", "--backends",
                      ",".join(faulty + ["testfaults:exact", "gloo"]), *SIZES, "--timeout", "3",
                      "--out", str(tmp_path / "out")], timeout=600,
                     env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_MPS_LOG": str(mps_log)})
    assert result.returncode == 3, result.stdout + result.stderr   # finished, and something crashed or hung
    assert result.stdout.count("# driver: resuming without that backend") == 4
    assert result.stdout.count("# driver: a fresh private MPS daemon for the resumed child") == 4
    assert len(mps_starts(mps_log)) == 5
    assert not any(mps._alive_server(pid) for _, pid in mps_starts(mps_log))
    run_dir = only_run_dir(tmp_path / "out")
    got = rows(run_dir)
    assert statuses(got) == {
        "gloo": ["ok"] * 3,   # a built-in: before every plug-in, though named last
        "testfaults:segv_setup_rank1": ["crashed", "skipped", "skipped"],
        "testfaults:segv_rank1": ["ok", "crashed", "skipped"],
        "testfaults:raise_setup_rank1": ["error", "skipped", "skipped"],
        "testfaults:hang_gil_rank0": ["ok", "hang", "skipped"],
        "testfaults:exact": ["ok"] * 3}
    assert got[0]["backend"] == "gloo"
    assert_each_cell_once(got)
    setup_crash, row_crash = (by_backend(got, name)[i] for name, i in ((faulty[0], 0), ("testfaults:segv_rank1", 1)))
    assert setup_crash["reason"] == "rank 1 died (SIGSEGV) during setup of testfaults:segv_setup_rank1 (fp32)"
    assert row_crash["reason"] == "rank 1 died (SIGSEGV) during testfaults:segv_rank1 16K fp32 eager"
    for row, phase in ((setup_crash, "setup"), (row_crash, "row")):
        assert row["failed_rank"] == 1 and row["extra"]["signal"] == "SIGSEGV" and row["extra"]["phase"] == phase
        assert "Segmentation fault" in (run_dir / row["extra"]["fault_log"]).read_text()
    stranded = by_backend(got, "testfaults:raise_setup_rank1")[0]
    assert stranded["failed_rank"] == 1 and stranded["reason"].startswith(
        "rank 1: setup failed: RuntimeError: deliberate failure in setup on rank 1")
    hang = by_backend(got, "testfaults:hang_gil_rank0")[1]
    # Rank 1's watchdog fired while it waited in the collective (in the plug-in's allreduce); rank
    # 0's never ran: rank 0 is the one named.
    assert re.fullmatch(r"no progress within 3 s during testfaults:hang_gil_rank0 16K fp32 eager; rank 0 never "
                        r"reached its own watchdog \(a thread may have held the GIL\); rank 1 waited for it in "
                        r"distributed_c10d\.py:\d+ in all_reduce <- .* <- commbench_testbackends\.py:\d+ in allreduce",
                        hang["reason"]), hang["reason"]
    assert hang["failed_rank"] == 0
    assert not (run_dir / "inflight").exists()
    # report, recommend and qualify show a crash like a hang: red, never a winner, a FAIL of a spec
    # about that backend (a spec about NCCL and the machine says it beside its "no data").
    report = run_cli(["report", str(run_dir), "--out", str(tmp_path / "report")])
    assert report.returncode == 0, report.stderr
    assert "failed their check (wrong data, hang or crash)" in report.stdout
    assert "testfaults:segv_rank1 16K crashed" in report.stdout
    qualified = run_cli(["qualify", "--spec", str(REPO / "commbench" / "specs" / "pcie-8x.toml"), str(run_dir), "--wide"])
    assert qualified.returncode == 1
    # the CPU run has no NCCL rows: the spec's hang check read nothing ("not measured": the spec
    # names it, so no PASS), and says what it saw outside its backends
    assert re.search(r"not measured +correctness +no hangs +CPU data: not measured: .*outside the spec's backends, "
                     r"3 hang\(s\) or crash\(es\): testfaults:hang_gil_rank0 16K hang, testfaults:segv_rank1 16K crashed",
                     qualified.stdout)
    spec = tmp_path / "faults.toml"
    spec.write_text("[spec]\nname = 'faults'\nbackend = 'testfaults'\n")
    qualified = run_cli(["qualify", "--spec", str(spec), str(run_dir), "--wide"])
    assert re.search(r"FAIL +correctness +no hangs +CPU data: 1 hang\(s\), 2 crash\(es\): testfaults:hang_gil_rank0 16K hang, "
                     r"testfaults:segv_rank1 16K crashed",
                     qualified.stdout)


@pytest.mark.slow
def test_a_crash_of_the_rank_that_writes_rows_under_torchrun_is_named_and_one_resume_finishes(tmp_path: Path) -> None:
    args = ["sweep", "--backends", "testfaults:segv_rank0@16384,testfaults:exact", *SIZES, "--out", str(tmp_path)]
    first = run_torchrun(2, args)
    assert first.returncode != 0
    run_dir = only_run_dir(tmp_path)
    # Rank 1 speaks for the rank that died; the row waits for the next look at the dir.
    (line,) = commbench_lines(first.stderr) or [first.stderr[-3000:]]
    assert line.startswith("commbench sweep: testfaults:segv_rank0 crashed (rank 0 died (SIGSEGV) during "
                           "testfaults:segv_rank0 16K fp32 eager); continue without it: torchrun ")
    assert statuses(rows(run_dir)) == {"testfaults:segv_rank0": ["ok"]}
    looked = run_cli(["report", str(run_dir), "--out", str(tmp_path / "report")])
    assert ("commbench: warning: rank 0 died (SIGSEGV) during testfaults:segv_rank0 16K fp32 eager: not in "
            f"measurements.jsonl yet (commbench sweep --resume {run_dir} records it)") in looked.stderr
    second = run_torchrun(2, args + ["--resume", str(run_dir)])
    assert second.returncode == 0, second.stderr
    assert "# rank 0 died (SIGSEGV) during testfaults:segv_rank0 16K fp32 eager: recorded as a crashed row" in \
        second.stdout
    got = rows(run_dir)
    assert statuses(got) == {"testfaults:segv_rank0": ["ok", "crashed", "skipped"], "testfaults:exact": ["ok"] * 3}
    assert by_backend(got, "testfaults:segv_rank0")[1]["failed_rank"] == 0
    assert_each_cell_once(got)


def _file_size_limit(limit_bytes: int):
    def apply() -> None:
        # Past the limit a write is cut short, then fails with EFBIG (Python ignores SIGXFSZ):
        # a full disk for this process and its children, without root.
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


@pytest.mark.slow
def test_a_write_error_ends_the_run_with_one_line_and_resume_repairs_the_torn_row(tmp_path: Path) -> None:
    args = ["sweep", "--backends", "testfaults:exact", "--sizes", "1K,2K,4K,8K,16K,32K", "--iters", "2",
            "--no-probe", "--out", str(tmp_path / "out")]
    python = python_in_a_clone_named_commbench(tmp_path / "clone")   # torchrun's frames then hold "/commbench/"
    full = run_torchrun(2, args, python=python, preexec_fn=_file_size_limit(4000))
    assert full.returncode != 0
    run_dir = only_run_dir(tmp_path / "out")
    (line,) = commbench_lines(full.stderr)   # rank 0's; rank 1 leaves quietly
    assert line.startswith(f"commbench sweep: error: cannot write {run_dir}/measurements.jsonl: File too large "
                           "(errno 27); every row written before it is intact")
    assert "/commbench/.venv/" in full.stderr and our_frames(full.stderr) == []   # torchrun's box is the rest
    text = (run_dir / "measurements.jsonl").read_text()
    assert not text.endswith("\n")   # cut mid-row
    kept = len(text.splitlines()) - 1
    assert kept >= 1

    resumed = run_torchrun(2, args + ["--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr
    assert "# measurements.jsonl ended in a torn line (" in resumed.stdout
    got = rows(run_dir)
    assert [r["message_bytes"] for r in got] == [1 << 10, 2 << 10, 4 << 10, 8 << 10, 16 << 10, 32 << 10]
    assert all(r["status"] == "ok" for r in got)
    # The fragment, byte for byte, and the newline the repair adds (the cut may end in a space).
    assert (run_dir / "measurements.jsonl.torn").read_text() == text.splitlines()[-1] + "\n"


@pytest.mark.slow
def test_exit_status_three_means_something_hung_or_crashed_during_this_command(tmp_path: Path) -> None:
    args = ["sweep", "--backends", "testfaults:slow_setup@5", "--sizes", "4K", "--iters", "2", "--setup-timeout", "1"]
    alone = run_cli(args + ["--out", str(tmp_path / "a")])
    assert alone.returncode == 3, alone.stderr                       # one process: commbench's own status
    (line,) = commbench_lines(alone.stderr)
    run_dir = only_run_dir(tmp_path / "a")
    head = "commbench sweep: testfaults:slow_setup hung (no progress within 1 s during setup of testfaults:slow_setup (fp32); "
    tail = f"); continue without it: python -m commbench {' '.join(args)} --out {tmp_path / 'a'} --resume {run_dir}"
    assert line.startswith(head + "rank 0 was in commbench_testbackends.py:") and line.endswith(tail), line
    again = run_cli(args + ["--out", str(tmp_path / "a"), "--resume", str(run_dir)])
    assert again.returncode == 0, again.stderr                       # nothing hung during the resume
    # Under torchrun the same hang ends the worker with 3: test_sweep_cpu's setup watchdog test.


@pytest.mark.slow
def test_a_resume_of_another_experiment_is_refused_with_the_differences_and_changes_nothing(tmp_path: Path) -> None:
    made = run_cli(["sweep", "--backends", "testfaults:exact", "--sizes", "4K", "--iters", "2", "--no-probe",
                    "--out", str(tmp_path)])
    assert made.returncode == 0, made.stderr
    run_dir = only_run_dir(tmp_path)
    before = {name: (run_dir / name).read_bytes() for name in ("run.json", "measurements.jsonl")}
    common = ["--backends", "testfaults:exact", "--iters", "2", "--no-probe", "--out", str(tmp_path),
              "--resume", str(run_dir)]

    wider = run_torchrun(2, ["sweep", "--sizes", "4K", *common])
    (line,) = commbench_lines(wider.stderr)
    assert line == (f"commbench sweep: error: --resume {run_dir}: not the run this command would make (world size 2 "
                    "here, 1 in the run; GPUs: 2 rank(s) here, 1 in the run); leave out --resume to start a new one")
    replanned = run_cli(["sweep", "--sizes", "8K", "--dtype", "fp32", *common])
    assert replanned.returncode == 2
    assert "(plan message_bytes [8192] here, [4096] in the run)" in replanned.stderr
    driven = run_cli(["sweep", "--nproc", "2", "--sizes", "4K", *common])
    assert driven.returncode == 2 and len(driven.stderr.strip().splitlines()) == 1
    assert "world size 2 here, 1 in the run" in driven.stderr
    assert {name: (run_dir / name).read_bytes() for name in before} == before

    same = run_cli(["sweep", "--sizes", "4K", "--timeout", "60", *common])   # a longer timeout is the same run
    assert same.returncode == 0, same.stderr
    info = json.loads((run_dir / "run.json").read_text())
    assert info["command"] == json.loads(before["run.json"])["command"] and info["world_size"] == 1
    (entry,) = info["resumed"]
    assert "60" in entry["command"] and entry["backends"] == ["testfaults:exact"]
