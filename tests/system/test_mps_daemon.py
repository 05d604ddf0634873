"""The driver's private MPS daemon, with a stand-in nvidia-cuda-mps-control on PATH (a real
program and a real server process, tests/helpers.py): a restart ends a server that ignores quit
(as one whose client died mid-kernel does), starts a fresh daemon and leaves no process or pipe
directory behind. A whole driver run with a fresh daemon for every resumed child shares the crash
scenario's launch (test_faults_cpu)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from commbench.sweep import mps
from commbench.waits import parse_waits
from helpers import install_fake_mps, mps_starts


@pytest.fixture
def fake_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, log = install_fake_mps(tmp_path, mps.CONTROL)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.setattr(mps, "waits", lambda: parse_waits("mps_server_exit_s=0.5"))
    return log


@pytest.mark.procs
def test_restart_ends_the_stuck_server_and_starts_a_new_daemon(fake_mps: Path, tmp_path: Path) -> None:
    with mps.private_daemon(tmp_path / "mps-logs", {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}) as daemon:
        first = daemon.client_env()
        assert first["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert first["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mps-logs")
        daemon.restart()
        second = daemon.client_env()
    (pipe1, server1), (pipe2, server2) = mps_starts(fake_mps)
    assert first["CUDA_MPS_PIPE_DIRECTORY"] == pipe1 != pipe2 == second["CUDA_MPS_PIPE_DIRECTORY"]
    assert [line.split()[0] for line in fake_mps.read_text().splitlines()] == [
        "start", "get_server_list", "quit", "start", "get_server_list", "quit"]
    for pid in (server1, server2):     # killed and reaped by its parent shell: gone
        assert not mps._alive_server(pid)
    assert not Path(pipe1).exists() and not Path(pipe2).exists()


def test_a_pid_that_is_no_mps_server_is_never_signalled() -> None:
    assert not mps._alive_server(os.getpid())
