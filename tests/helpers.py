"""Running commbench the way users do: real processes, real torchrun, real gloo groups."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

PLUGINS = Path(__file__).parent / "plugins"
# The harness's fixed waits (commbench/waits.py), shrunk for the processes tests start: a fault
# scenario then waits seconds for a peer or a kill instead of the defaults' tens of seconds. Each
# stays longer than what it waits for here (testfaults backends have no bounded waits of their own).
# poll_after_s keeps its 2 s: tests with a 1 s row limit expect a rank's own watchdog to fire
# before it looks at its peers.
TEST_WAITS = ("poll_s=0.25,peer_wait_s=3,cause_look_s=1.5,hang_look_s=1.5,driver_poll_s=0.2,"
              "overdue_grace_s=2,kill_wait_s=2,usage_error_grace_s=1,mps_server_exit_s=0.5")


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
                 torchrun_args: list[str] | None = None, python: str = sys.executable,
                 preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """preexec_fn: run in the child before torchrun starts (a CPU affinity, a file-size limit),
    which torchrun and its ranks inherit."""
    command = [python, "-m", "torch.distributed.run", *(torchrun_args or ["--standalone"]),
               "--nproc-per-node", str(nproc), "-m", "commbench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=child_env(env),
                          preexec_fn=preexec_fn)


def python_in_a_clone_named_commbench(tmp_path: Path) -> str:
    """This environment's Python as `git clone ... commbench` and the quickstart make it: under
    TMP/commbench/.venv/ (a link to this environment), so every file torchrun's own report names
    holds "/commbench/" wherever this checkout lies; a stderr check must tell our frames apart
    (our_frames), not look for the word."""
    clone = tmp_path / "commbench"
    clone.mkdir(parents=True, exist_ok=True)
    venv = clone / ".venv"
    if not venv.exists():
        venv.symlink_to(sys.prefix, target_is_directory=True)
    return str(venv / Path(sys.executable).relative_to(sys.prefix))


def our_frames(stderr: str) -> list[str]:
    """The lines of a traceback in `stderr` that name a file of commbench's own package (its
    folders, wherever they are installed): a checkout is often itself named "commbench", so
    "commbench/" in a path says nothing (torch's frames under its .venv hold it too)."""
    import importlib.util

    folders = [folder for name in ("commbench", "commbench.backends", "commbench.topology")
               for folder in importlib.util.find_spec(name).submodule_search_locations]
    return [line for line in stderr.splitlines()
            if any(f'File "{os.path.join(folder, "")}' in line for folder in folders)]


def only_run_dir(out: Path) -> Path:
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "measurements.jsonl").read_text().splitlines() if line.strip()]


def sweep_args(*argv: str) -> "argparse.Namespace":
    """The sweep's flags parsed as `commbench sweep` parses them."""
    from commbench.sweep.arguments import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def poll(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> bool:
    """True as soon as condition() is, False once timeout_s has passed: a test waits for a
    state, never for a guessed number of seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def installed_module(monkeypatch: Any, name: str) -> None:
    """For this test, `name` imports (an empty module) as if it were installed: a backend's
    declared requirement (backends.base.Requires) on it then passes on a machine without it."""
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    module = ModuleType(name)
    module.__spec__ = ModuleSpec(name, None)
    monkeypatch.setitem(sys.modules, name, module)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(worker: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
                dead_peer_grace_s: float = 10.0) -> dict[int, Any]:
    """worker(rank, world, *args) in `world` spawned processes, each with one rank's
    torch.distributed environment on this host (RANK, WORLD_SIZE, LOCAL_*, a free MASTER_PORT);
    their return values by rank. A worker that raises returns {"crash": its traceback}, and a rank
    that dies without an answer (a signal, os._exit) {"crash": its exit code}, and the ranks still
    without an answer dead_peer_grace_s later a crash naming it (they may wait for it in a
    collective forever), so a test fails at once instead of waiting out timeout_s. `worker` and args must pickle: a module-level function
    of a test module."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(worker, rank, world, port, args, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    seen_dead: set[int] = set()
    died: list[int] = []
    answered: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, value = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                got[rank] = value
                answered.add(rank)
                continue
            except queue.Empty:
                pass
            # A rank's answer is in the pipe before it exits; still, a rank counts as dead only when
            # it was already gone at the previous look, a second of empty queue ago.
            for rank, proc in enumerate(procs):
                if rank in got or proc.exitcode is None:
                    continue
                if rank in seen_dead:
                    got[rank] = {"crash": f"rank {rank} exited with code {proc.exitcode} and no answer"}
                    died.append(rank)
                    deadline = min(deadline, time.monotonic() + dead_peer_grace_s)
                seen_dead.add(rank)
            if time.monotonic() >= deadline:
                missing = sorted(set(range(world)) - set(got))
                if not died:
                    raise TimeoutError(f"no answer from ranks {missing} in {timeout_s:g} s")
                got.update({rank: {"crash": f"rank {rank}: no answer after rank {died[0]} died"} for rank in missing})
        return got
    finally:
        for rank, proc in enumerate(procs):
            proc.join(timeout=30 if rank in answered else 0)   # one left without an answer may never exit
            if proc.is_alive():
                proc.kill()


def _rank_main(worker: Callable[..., Any], rank: int, world: int, port: int, args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        results.put((rank, worker(rank, world, *args)))
    except Exception:
        results.put((rank, {"crash": traceback.format_exc()}))


# A stand-in nvidia-cuda-mps-control (a real program, and a real server process): it logs each
# request; -d starts a "server" (sleep, under the server's name) that quit leaves running, as one
# whose client died mid-kernel does.
FAKE_MPS_CONTROL = """#!/usr/bin/env bash
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


def install_fake_mps(folder: Path, control_name: str) -> tuple[Path, Path]:
    """The stand-in control and server in folder/bin: (the bin folder for PATH, the request log
    for FAKE_MPS_LOG)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    control = bin_dir / control_name
    control.write_text(FAKE_MPS_CONTROL)
    control.chmod(control.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "nvidia-cuda-mps-server").symlink_to("/bin/sleep")
    return bin_dir, folder / "mps.log"


def mps_starts(log: Path) -> list[tuple[str, int]]:
    """(pipe directory, server pid) of every daemon start the stand-in logged, in order."""
    return [(words[1], int(words[2])) for words in map(str.split, log.read_text().splitlines()) if words[0] == "start"]
