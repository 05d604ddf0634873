"""Running commbench the way users do: real processes, real torchrun, real gloo groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PLUGINS = Path(__file__).parent / "plugins"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGINS), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
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
