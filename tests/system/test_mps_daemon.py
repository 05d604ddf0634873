"""The driver's private MPS daemon, with a stand-in nvidia-cuda-mps-control on PATH (a real
program and a real server process): the driver starts it, ends a server that ignores quit (as one
whose client died mid-kernel does), starts a fresh daemon for every resumed child, and leaves no
process or pipe directory behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from commbench.sweep import mps
from commbench.waits import parse_waits
from helpers import only_run_dir, rows, run_cli

# Logs each request; -d starts a "server" (sleep, under the server's name) that quit leaves running.
FAKE_CONTROL = """#!/usr/bin/env bash
log=$FAKE_MPS_LOG
if [ "${1:-}" = "-d" ]; then
  "$(dirname "$0")/nvidia-cuda-mps-server" 300 >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/server.pid"
  echo "start $CUDA_MPS_PIPE_DIRECTORY $!" >> "$log"
  exit 0
fi
read -r request
echo "$request $CUDA_MPS_PIPE_DIRECTORY" >> "$log"
[ "$request" != get_server_list ] || cat "$CUDA_MPS_PIPE_DIRECTORY/server.pid"
"""


@pytest.fixture
def fake_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(FAKE_CONTROL)
    control.chmod(control.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "nvidia-cuda-mps-server").symlink_to("/bin/sleep")
    log = tmp_path / "mps.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.setattr(mps, "waits", lambda: parse_waits("mps_server_exit_s=0.5"))
    return log


def started(log: Path) -> list[tuple[str, int]]:
    """(pipe directory, server pid) of every daemon start, in order."""
    return [(words[1], int(words[2])) for words in map(str.split, log.read_text().splitlines()) if words[0] == "start"]


@pytest.mark.procs
def test_restart_ends_the_stuck_server_and_starts_a_new_daemon(fake_mps: Path, tmp_path: Path) -> None:
    with mps.private_daemon(tmp_path / "mps-logs", {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}) as daemon:
        first = daemon.client_env()
        assert first["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert first["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mps-logs")
        daemon.restart()
        second = daemon.client_env()
    (pipe1, server1), (pipe2, server2) = started(fake_mps)
    assert first["CUDA_MPS_PIPE_DIRECTORY"] == pipe1 != pipe2 == second["CUDA_MPS_PIPE_DIRECTORY"]
    assert [line.split()[0] for line in fake_mps.read_text().splitlines()] == [
        "start", "get_server_list", "quit", "start", "get_server_list", "quit"]
    for pid in (server1, server2):     # killed and reaped by its parent shell: gone
        assert not mps._alive_server(pid)
    assert not Path(pipe1).exists() and not Path(pipe2).exists()


def test_a_pid_that_is_no_mps_server_is_never_signalled() -> None:
    assert not mps._alive_server(os.getpid())


@pytest.mark.procs
@pytest.mark.slow
def test_the_driver_gives_every_resumed_child_a_fresh_daemon(fake_mps: Path, tmp_path: Path) -> None:
    result = run_cli(["sweep", "--nproc", "2", "--share-gpus", "--mps", "--backends",
                      "testfaults:segv_rank1@16384,testfaults:exact", "--sizes", "4K,16K,64K", "--iters", "2",
                      "--out", str(tmp_path / "out")], timeout=300, env={"FAKE_MPS_LOG": str(fake_mps)})
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.count("# driver: a fresh private MPS daemon for the resumed child") == 1
    assert len(started(fake_mps)) == 2
    got = {(r["backend"], r["message_bytes"]): r["status"] for r in rows(only_run_dir(tmp_path / "out"))}
    assert got[("testfaults:segv_rank1", 16384)] == "crashed"
    assert [got[("testfaults:exact", size)] for size in (4096, 16384, 65536)] == ["ok"] * 3
    for _, pid in started(fake_mps):
        assert not mps._alive_server(pid)
