"""A private MPS daemon for the sweep's driver (`commbench sweep --nproc N --share-gpus --mps`).

Ranks that share a GPU take turns on it without MPS (every call then costs a time slice of a few
milliseconds); under an MPS daemon they run concurrently, each client limited to an equal share
of the SMs, so the protocol's own cost can be measured on one GPU (never a fabric: the rows say
so). commbench starts a daemon only when asked, in fresh pipe and log directories of its own,
stops it when the driver ends, and never touches a daemon it did not start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from commbench.sweep.context import MPS_PERCENT_VAR
from commbench.errors import UsageError

CONTROL = "nvidia-cuda-mps-control"
PIPE_VAR, LOG_VAR = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
CONTROL_TIMEOUT_S = 30.0


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


@contextmanager
def private_daemon(log_dir: Path) -> Iterator[dict[str, str]]:
    """Start an MPS control daemon with a new pipe directory and its log in log_dir; yields the
    variables its clients need."""
    control = control_path()
    pipe = tempfile.mkdtemp(prefix="commbench-mps-pipe-")
    log_dir.mkdir(parents=True, exist_ok=True)
    daemon_env = {PIPE_VAR: pipe, LOG_VAR: str(log_dir)}
    env = {**os.environ, **daemon_env}
    try:
        started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=CONTROL_TIMEOUT_S)
        if started.returncode != 0:
            raise UsageError(f"--mps: {CONTROL} -d failed: {(started.stderr or started.stdout).strip()[:200]}")
        try:
            yield daemon_env
        finally:
            # The pipe directory names this daemon and no other.
            subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True,
                           timeout=CONTROL_TIMEOUT_S)
    finally:
        shutil.rmtree(pipe, ignore_errors=True)
