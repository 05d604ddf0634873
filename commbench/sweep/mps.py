"""A private MPS daemon for the sweep's driver (`commbench sweep --nproc N --share-gpus --mps`).

Ranks that share a GPU take turns on it without MPS (every call then costs a time slice of a few
milliseconds); under an MPS daemon they run concurrently, each client limited to an equal share
of the SMs, so the protocol's own cost can be measured on one GPU (never a fabric: the rows say
so). commbench starts a daemon only when asked, in fresh pipe and log directories of its own,
stops it when the driver ends, and never touches a daemon it did not start. Before resuming a
child that ended early it starts a fresh daemon, because a server whose client died with a kernel
still spinning on the GPU (a hung backend) accepts no new client.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from commbench.errors import UsageError
from commbench.runtime.context import MPS_PERCENT_VAR
from commbench.waits import waits

CONTROL = "nvidia-cuda-mps-control"
PIPE_VAR, LOG_VAR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
SERVER_COMM = "nvidia-cuda-mps"   # /proc/PID/comm of nvidia-cuda-mps-server (15 characters kept)
CONTROL_TIMEOUT_S = 30.0
KILLED_EXIT_S = 2.0               # and to be gone after SIGKILL (the kernel ends it asynchronously)


def client_env(nproc: int, gpus: int) -> dict[str, str]:
    """Each client's equal share of its GPU's SMs (the ranks of one GPU must all fit at once)."""
    ranks_per_gpu = -(-nproc // max(1, gpus))
    return {MPS_PERCENT_VAR: str(max(1, 100 // ranks_per_gpu))}


def control_path() -> str:
    """The MPS control program, or a usage error saying it is missing (checked before a run)."""
    control = shutil.which(CONTROL)
    if control is None:
        raise UsageError(f"--mps: {CONTROL} not found (it comes with the NVIDIA driver's utilities)")
    return control


def _alive_server(pid: int) -> bool:
    """True while pid is still a running MPS server process (so a reused pid is never signalled;
    a killed one that its parent has not reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    comm, _, rest = stat.partition("(")[2].rpartition(")")
    return comm.startswith(SERVER_COMM) and rest.split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive_server(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


class PrivateDaemon:
    """An MPS control daemon of the driver's own: fresh pipe directory, log in log_dir."""

    def __init__(self, log_dir: Path, share: dict[str, str]):
        self.control = control_path()
        self.log_dir = log_dir
        self.share = share          # each client's SM share (client_env)
        self.env: dict[str, str] = {}

    def client_env(self) -> dict[str, str]:
        """What a child needs to be this daemon's client."""
        return {**self.env, **self.share}

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.control, *args], input=stdin, env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=CONTROL_TIMEOUT_S)

    def start(self) -> None:
        pipe = tempfile.mkdtemp(prefix="commbench-mps-pipe-")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {PIPE_VAR: pipe, LOG_VAR: str(self.log_dir)}
        started = self._run(["-d"])
        if started.returncode != 0:
            self._forget()
            raise UsageError(f"--mps: {CONTROL} -d failed: {(started.stderr or started.stdout).strip()[:200]}")

    def stop(self) -> None:
        """Quit the daemon, then end any of its servers still running: a server whose client was
        killed mid-kernel (a hung backend) keeps that kernel on the GPU and refuses new clients
        ("MPS server is not ready"). Only servers this daemon lists are touched."""
        if not self.env:
            return
        listed = self._run([], "get_server_list\n").stdout.split()
        servers = [int(pid) for pid in listed if pid.isdigit()]
        self._run([], "quit\n")
        _wait_gone(servers, waits().mps_server_exit_s)
        for pid in servers:
            if _alive_server(pid):
                os.kill(pid, signal.SIGKILL)
        # The next daemon must not meet a server that is still dying.
        _wait_gone(servers, KILLED_EXIT_S)
        self._forget()

    def restart(self) -> None:
        self.stop()
        self.start()

    def _forget(self) -> None:
        shutil.rmtree(self.env[PIPE_VAR], ignore_errors=True)   # the pipe directory names this daemon only
        self.env = {}


@contextmanager
def private_daemon(log_dir: Path, share: dict[str, str]) -> Iterator[PrivateDaemon]:
    """A started PrivateDaemon, stopped when the block ends."""
    daemon = PrivateDaemon(log_dir, share)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
