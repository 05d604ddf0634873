"""The sweep end to end on the CPU: real torchrun, real gloo process groups, real files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commbench import inflight
from helpers import child_env, free_port, only_run_dir, poll, rows, run_cli, run_torchrun

pytestmark = pytest.mark.procs   # every test here launches processes

CHILD_TIMEOUT_S = 5


def by_backend(all_rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in all_rows:
        out.setdefault(row["backend"], []).append(row)
    return out


@pytest.mark.slow
def test_default_torchrun_sweep_writes_rows_table_csv_and_run_json(tmp_path: Path) -> None:
    # Held to at most two cores (CI has two), the four ranks take turns: what they time is the
    # scheduler, and the sweep says so once, on any machine.
    cores = sorted(os.sched_getaffinity(0))[:2]
    result = run_torchrun(4, ["sweep", "--out", str(tmp_path)], env={"COMMBENCH_TEST_KNOB": "recorded"},
                          preexec_fn=lambda: os.sched_setaffinity(0, cores))
    assert result.returncode == 0, result.stderr
    assert "no CUDA device: running on the CPU with gloo" in result.stdout
    warning = f"warning: 4 ranks share {len(cores)} CPU core(s) on this host: the latencies are mostly scheduler time"
    assert result.stdout.count(f"# {warning}") == 1
    assert "#wrong" in result.stdout and "busbw" in result.stdout
    run_dir = only_run_dir(tmp_path)
    got = rows(run_dir)
    # CPU default: 1K..256K by factor 4 = 5 sizes, fp32, eager, gloo.
    assert [r["message_bytes"] for r in got] == [1024, 4096, 16384, 65536, 262144]
    for row in got:
        assert row["status"] == "ok" and row["wrong_elements"] == 0 and row["world_size"] == 4
        assert row["schema"] == 3 and row["ranks_identical"] is True and row["first_wrong_call"] is None
        # Both passes, each with its aligning call, every output checked.
        # the jitter pass: 100 calls one by one, in rounds of the timed pass's calls, each round aligned and checked
        rounds = -(-100 // row["iterations"])
        assert row["checked_calls"] == row["iterations"] + 1 + 100 + rounds and row["jitter_samples"] == 100
        assert row["jitter_min_us"] <= row["jitter_p50_us"] <= row["jitter_p99_us"] <= row["jitter_max_us"]
        assert 0 < row["latency_rank_mean_us"] <= row["latency_us"]
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * 3 / 4)
        assert row["algbw_gbps"] == pytest.approx(row["message_bytes"] / row["latency_us"] / 1e3)
    csv_lines = (run_dir / "measurements.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(got) and csv_lines[0].startswith("backend,")
    info = json.loads((run_dir / "run.json").read_text())
    assert info["schema"] == 3 and info["world_size"] == 4 and len(info["gpus"]) == 4
    assert info["versions"]["torch"] and "finished" in info and "interrupted" not in info
    assert info["args"]["out"] == str(tmp_path)
    # torchrun's command line, as typed, not the worker's "commbench sweep".
    assert info["command"][1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    assert info["env"]["COMMBENCH_TEST_KNOB"] == "recorded" and "OMP_NUM_THREADS" not in info["env"]
    assert any(note.startswith(warning.split(":")[0] + ":") for note in info["notes"])


CPU_SPEC = """[spec]
name = "CPU smoke"
world_size = 1
dtype = "fp32"
mode = "eager"
backend = "gloo"

[checks]
zero_wrong = true
no_hangs = true
"""


def test_single_process_world_of_one_says_nothing_is_communicated_and_qualify_gives_its_verdict(
        tmp_path: Path) -> None:
    """One launch: the world of one, then `--qualify` answers on the run it just wrote (its verdict,
    JUnit, and qualify's exit status as the command's), as `commbench qualify` would."""
    spec, junit = tmp_path / "spec.toml", tmp_path / "junit.xml"
    spec.write_text(CPU_SPEC)
    result = run_cli(["sweep", "--sizes", "4K", "--iters", "3", "--out", str(tmp_path / "runs"),
                      "--qualify", str(spec), "--junit", str(junit)])
    run_dir = only_run_dir(tmp_path / "runs")
    (row,) = rows(run_dir)
    assert row["status"] == "no_work" and "world size 1" in row["reason"]
    assert row["wrong_elements"] == 0
    # gloo on the CPU is no real hardware: a FAIL, so the sweep's status is qualify's, 1.
    assert result.returncode == 1, result.stderr
    assert f"qualify {run_dir.name} against CPU smoke" in result.stdout
    assert re.search(r"\n\d+ PASS, \d+ WARN, [1-9]\d* FAIL -> FAIL\n", result.stdout), result.stdout
    assert f"wrote {junit}" in result.stdout and "Traceback" not in result.stderr
    alone = run_cli(["qualify", "--spec", str(spec), str(run_dir)])
    assert alone.returncode == 1 and alone.stdout.splitlines()[-1] == result.stdout.splitlines()[-2]
    assert "<testsuite" in junit.read_text() and 'name="zero #wrong"' in junit.read_text()


FAULTY = ("exact", "noop", "one_wrong", "stale", "setup_fails_rank1", "wrong_every@64", "back_to_back", "returns",
          "returns_reused", "returns_short")


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict[str, list[dict]]]:
    """One torchrun over every faulty backend, read by the two tests below: 64 timed calls per
    pass, so each row has 2 x 65 checked calls."""
    out = tmp_path_factory.mktemp("faulty")
    result = run_torchrun(2, ["sweep", "--backends", ",".join(f"testfaults:{v}" for v in FAULTY),
                              "--sizes", "4K,16K,64K", "--iters", "64", "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stderr
    return result, by_backend(rows(only_run_dir(out)))


@pytest.mark.slow
def test_faulty_backends_are_caught_not_averaged_away(faulty_run) -> None:
    result, got = faulty_run
    assert all(r["status"] == "ok" and r["wrong_elements"] == 0 for r in got["testfaults:exact"])
    for row in got["testfaults:noop"]:
        assert row["status"] == "wrong" and row["wrong_kind"] == "noop" and row["wrong_elements"] > 0
        assert row["failed_rank"] == 0 and row["first_wrong_call"] == 0
    for row in got["testfaults:one_wrong"]:
        # Rank 0 gets one wrong element on every call: 65 checked calls per pass, two passes.
        assert row["status"] == "wrong" and row["wrong_elements"] == 130 and row["wrong_kind"] == "values"
        assert row["failed_rank"] == 0 and row["ranks_identical"] is False
    for row in got["testfaults:stale"]:
        assert row["status"] == "wrong" and row["wrong_kind"] == "stale"
    for row in got["testfaults:setup_fails_rank1"]:
        assert row["status"] == "skipped" and row["failed_rank"] == 1
        assert row["reason"] == "rank 1: setup failed: this rank's workspace allocation failed (deliberate)"
    assert "testfaults:one_wrong" in result.stdout and "wrong: values" in result.stdout


def test_every_timed_call_is_checked_so_intermittent_faults_fail_every_row(faulty_run) -> None:
    """Faults a single check after the loop cannot see: a result the next call overwrites, the
    previous call's answer, and one wrong call in 64. Each row has 2 x 65 checked calls."""
    _, got = faulty_run
    for row in got["testfaults:exact"]:
        assert row["status"] == "ok" and row["checked_calls"] == 130 and row["ranks_identical"] is True
    for fault, kind in (("testfaults:wrong_every", "values"), ("testfaults:back_to_back", "values"),
                        ("testfaults:stale", "stale")):
        assert len(got[fault]) == 3
        for row in got[fault]:
            assert row["status"] == "wrong" and row["wrong_kind"] == kind, row
            assert row["failed_rank"] == 0 and row["first_wrong_call"] is not None
    # One call in 64 is wrong, on both ranks alike: two or three of every row's 130 per rank.
    assert all(r["wrong_elements"] in (4, 6) for r in got["testfaults:wrong_every"])


def test_a_backend_that_returns_its_own_tensor_is_checked_and_timed_the_same(faulty_run) -> None:
    """An engine's kernel hands back a tensor of its own: the harness checks that one, every call,
    and catches one reused by the next call or of the wrong size."""
    _, got = faulty_run
    for row in got["testfaults:returns"]:
        assert row["status"] == "ok" and row["wrong_elements"] == 0 and row["checked_calls"] == 130
        assert row["latency_us"] > 0 and row["ranks_identical"] is True
    for row in got["testfaults:returns_reused"]:
        # Every call of each pass reads back the last call's answer: wrong wherever its epoch differs.
        assert row["status"] == "wrong" and row["first_wrong_call"] == 0 and row["wrong_elements"] > 0
    short = got["testfaults:returns_short"][0]
    assert short["status"] == "error" and short["latency_us"] is None
    assert "returned a tensor of 1023 float32 on cpu for an input of 1024 float32 on cpu" in short["reason"]


@pytest.mark.slow
def test_plugin_env_setting_reaches_child_and_nccl_explains_itself_on_cpu(tmp_path: Path) -> None:
    result = run_cli(["sweep", "--nproc", "2", "--env", "COMMBENCH_TEST_KNOB=a,b", "--backends",
                      "testfaults:exact,nccl", "--sizes", "4K", "--iters", "2", "--out", str(tmp_path)], timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(tmp_path)
    got = rows(run_dir)
    exact = [r for r in got if r["backend"] == "testfaults:exact"]
    assert sorted((r["env_setting"]["COMMBENCH_TEST_KNOB"], r["extra"]["test_knob"]) for r in exact) == \
        [("a", "a"), ("b", "b")]
    nccl = [r for r in got if r["backend"] == "nccl"]
    assert len(nccl) == 2 and all(r["status"] == "skipped" and "CUDA" in r["reason"] for r in nccl)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["env_settings"] == [{"COMMBENCH_TEST_KNOB": "a"}, {"COMMBENCH_TEST_KNOB": "b"}]
    assert info["driver"]["nproc"] == 2
    assert info["command"][1:5] == ["sweep", "--nproc", "2", "--env"]     # the driver's, not its children's
    assert "COMMBENCH_LAUNCH_COMMAND" not in info["env"]


@pytest.mark.slow
def test_setup_has_its_own_watchdog_limit(tmp_path: Path) -> None:
    # A setup that builds kernels on first use outlasts the per-row limit and must still run.
    args = ["sweep", "--backends", "testfaults:slow_setup@3", "--sizes", "4K", "--iters", "2", "--timeout", "1"]
    slow = run_torchrun(2, args + ["--setup-timeout", "60", "--out", str(tmp_path / "a")])
    assert slow.returncode == 0, slow.stderr
    assert [r["status"] for r in rows(only_run_dir(tmp_path / "a"))] == ["ok"]
    stuck = run_torchrun(2, args + ["--setup-timeout", "1", "--out", str(tmp_path / "b")])
    # A hang ends a rank with 3 (test_faults_cpu); torchrun's own status for a worker's 3 is 1.
    assert stuck.returncode == 1 and "exitcode  : 3" in stuck.stderr, stuck.stderr
    (row,) = rows(only_run_dir(tmp_path / "b"))
    assert row["status"] == "hang"
    # Where the rank's thread was when its time ran out: the plug-in's sleep, then our setup step.
    # Both ranks sleep alike; on a loaded machine rank 1 may start first, and rank 0's watchdog
    # then reports rank 1's earlier hang (seen with the default waits too).
    assert re.fullmatch(r"no progress within 1 s during setup of testfaults:slow_setup \(fp32\); rank [01] was in "
                        r"commbench_testbackends\.py:\d+ in setup <- engine\.py:\d+ in \w+ <- \S+:\d+ in \w+",
                        row["reason"]), row["reason"]


@pytest.mark.slow
def test_a_hang_becomes_a_row_and_the_driver_resumes_without_that_backend(tmp_path: Path) -> None:
    """The driver's child torchrun is the one a user runs: its watchdog writes the hang row and the
    child ends; the driver's resume then measures every other backend and skips the one that hung."""
    resumed = run_cli(["sweep", "--nproc", "2", "--backends", "testfaults:hang_rank1@16384,testfaults:exact",
                       "--sizes", "4K,16K,64K", "--iters", "2", "--timeout", "3", "--out", str(tmp_path)], timeout=240)
    assert resumed.returncode == 3, resumed.stdout + resumed.stderr   # finished, and something hung
    assert resumed.stdout.count("# results:") == 1, resumed.stdout    # the driver's, not each child's
    run_dir = only_run_dir(tmp_path)
    assert (run_dir / "measurements.csv").exists()
    got = by_backend(rows(run_dir))
    hang = got["testfaults:hang_rank1"]
    assert [r["status"] for r in hang] == ["ok", "hang", "skipped"]
    assert "no progress within 3 s" in hang[1]["reason"] and hang[1]["message_bytes"] == 16384
    # The rank that hung is named, not rank 0, which waited for it in the collective (issue 56).
    # Whichever watchdog fires first writes the row: rank 1's names its own place at once; rank
    # 0's, having waited, adds where it waited.
    assert hang[1]["failed_rank"] == 1, hang[1]
    assert re.search(r"; rank 1 was in commbench_testbackends\.py:\d+ in allreduce <- [^;]*"
                     r"(; rank 0 waited for it in distributed_c10d\.py:\d+ in all_reduce.*)?$",
                     hang[1]["reason"]), hang[1]["reason"]
    assert "hung earlier in this run" in hang[2]["reason"]
    assert [r["status"] for r in got["testfaults:exact"]] == ["ok"] * 3


def children(driver: subprocess.Popen) -> list[str]:
    return Path(f"/proc/{driver.pid}/task/{driver.pid}/children").read_text().split()


def child_exited(driver: subprocess.Popen) -> bool:
    """The stopped driver's child torchrun has ended: a zombie, left for the driver to reap."""
    (child,) = children(driver)
    return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
def test_driver_kills_a_child_past_its_limit(tmp_path: Path) -> None:
    """The driver is held stopped (SIGSTOP) from each child's start until what the test needs has
    happened: the ranks are inside the hung row (the first child), the child has exited (the
    resumed one, which has nothing left to run). Its --child-timeout then runs out while the hang
    is in place, and never during the resumed child's start, however slowly ranks start on a
    loaded machine: the test waits for states, not a race. The one race left is the test's own
    look at the driver within CHILD_TIMEOUT_S of its child's start."""
    out, log = tmp_path / "out", tmp_path / "driver.log"
    hung = "testfaults:hang_rank1 4K fp32 eager"

    def ranks_hung() -> bool:
        return out.exists() and any(out.iterdir()) and [
            (r.rank, r.what) for r in inflight.read_records(only_run_dir(out))] == [(0, hung), (1, hung)]

    with log.open("w") as sink:
        driver = subprocess.Popen([sys.executable, "-m", "commbench", "sweep", "--nproc", "2", "--backends",
                                   "testfaults:hang_rank1@4096", "--sizes", "4K", "--timeout", "600",
                                   "--child-timeout", str(CHILD_TIMEOUT_S), "--out", str(out)],
                                  stdout=sink, stderr=subprocess.STDOUT, text=True, env=child_env())
    try:
        for started, done in (("# driver: torchrun x2 with default environment\n", ranks_hung),
                              ("# driver: torchrun x2 with default environment (resume 1)\n",
                               lambda: child_exited(driver))):
            # Stopped once the child exists (it was reaped before the next one): a driver stopped
            # between its line and its fork would never start the child.
            assert poll(lambda: started in log.read_text() and children(driver), 120), log.read_text()
            driver.send_signal(signal.SIGSTOP)
            assert poll(done, 120), log.read_text()
            driver.send_signal(signal.SIGCONT)
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:   # a failed look: the driver ends its child (own session) on SIGTERM
            driver.send_signal(signal.SIGCONT)
            driver.terminate()
            driver.wait(timeout=60)
    assert driver.returncode == 3, log.read_text()
    (row,) = rows(only_run_dir(out))   # named from the ranks' in-flight records
    assert row["backend"] == "testfaults:hang_rank1" and row["status"] == "hang"
    # Which rank hung, from the stacks each rank's SIGTERM left: rank 1 in the plug-in's own
    # code, rank 0 inside the collective waiting for it.
    assert row["reason"].startswith(f"child torchrun exceeded --child-timeout {CHILD_TIMEOUT_S} s and was killed, "
                                    f"during {hung}; rank 1 was in commbench_testbackends.py:"), row["reason"]
    assert "; rank 0 waited for it in distributed_c10d.py:" in row["reason"] and row["failed_rank"] == 1, row


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes(tmp_path: Path) -> None:
    port = str(free_port())
    # c10d rendezvous, as users start agents on several hosts; the store lives on one agent.
    common = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", f"commbench-test-{port}"]
    args = ["sweep", "--backends", "gloo,testfaults:nodelocal", "--sizes", "4K", "--iters", "2", "--out", str(tmp_path)]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common,
                                "--nproc-per-node", "1", "-m", "commbench", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
              for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=120) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
        print([agent.communicate() for agent in agents])
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    got = by_backend(rows(only_run_dir(tmp_path)))
    (gloo,) = got["gloo"]
    assert gloo["status"] == "ok" and gloo["world_size"] == 2 and gloo["nodes"] == 2
    (local,) = got["testfaults:nodelocal"]
    assert local["status"] == "skipped" and "spans 2 nodes" in local["reason"]


@pytest.mark.slow
def test_unwritable_out_and_unusable_world_size_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    result = run_cli(["sweep", "--out", str(blocker / "sub")])
    assert result.returncode == 2 and "not writable" in result.stderr and len(result.stderr.splitlines()) == 1
    result = run_torchrun(2, ["sweep", "--backends", "testfaults:solo", "--out", str(tmp_path / "o")])
    assert "supports at most 1 ranks" in result.stderr
    assert "commbench/cli.py" not in result.stderr and not (tmp_path / "o").exists()  # no traceback of ours


def test_ctrl_c_keeps_every_finished_row(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "commbench", "sweep", "--backends", "testfaults:exact",
                             "-b", "1K", "-e", "256M", "-f", "2", "--iters", "100", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    deadline = time.time() + 60
    while time.time() < deadline:
        runs = [p for p in tmp_path.iterdir() if p.is_dir()]
        if runs and (runs[0] / "measurements.jsonl").exists() and len(rows(runs[0])) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    run_dir = only_run_dir(tmp_path)
    kept = rows(run_dir)
    assert len(kept) >= 2 and all(r["status"] == "no_work" for r in kept)
    assert len((run_dir / "measurements.csv").read_text().splitlines()) == 1 + len(kept)
    info = json.loads((run_dir / "run.json").read_text())
    assert "interrupted" in info and "finished" not in info
    report = run_cli(["report", str(run_dir), "--out", str(tmp_path / "report")])
    assert "interrupted at" in report.stdout and "interrupted at" in (tmp_path / "report" / "report.html").read_text()
