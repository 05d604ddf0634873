"""Running commbench the way users do: real processes, real torchrun, real gloo groups."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).parent / "plugins"
# The harness's fixed waits (commbench/waits.py), shrunk for the processes tests start: a fault
# scenario then waits seconds for a peer or a kill instead of the defaults' tens of seconds. Each
# stays longer than what it waits for here (testfaults backends have no bounded waits of their own).
# poll_after_s keeps its 2 s: tests with a 1 s row limit expect a rank's own watchdog to fire
# before it looks at its peers.
TEST_WAITS = ("poll_s=0.25,peer_wait_s=3,cause_look_s=1.5,driver_poll_s=0.2,"
              "overdue_grace_s=2,kill_wait_s=2,usage_error_grace_s=1")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("COMMBENCH_WAITS", TEST_WAITS)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra or {})
    return env


def run_cli(args: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commbench", *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(env))


def run_torchrun(nproc: int, args: list[str], timeout: float = 180, env: dict[str, str] | None = None,
                 torchrun_args: list[str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", *(torchrun_args or ["--standalone"]),
               "--nproc-per-node", str(nproc), "-m", "commbench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=child_env(env))


def only_run_dir(out: Path) -> Path:
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "measurements.jsonl").read_text().splitlines() if line.strip()]


def sweep_args(*argv: str) -> "argparse.Namespace":
    """The sweep's flags parsed as `commbench sweep` parses them."""
    from commbench.sweep.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))
