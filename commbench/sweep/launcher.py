"""The driver outside torchrun: `commbench sweep --nproc N [--env NAME=V1,V2 ...]`.

Process-level NCCL knobs (NCCL_NTHREADS, NCCL_BUFFSIZE, NCCL_MAX_CTAS, NCCL_P2P_LEVEL, ...) are
read once per process, so each setting needs its own torchrun. The driver launches one per
setting (all combinations of the --env flags), each with a time limit; a child that hangs is
killed; a child whose watchdog recorded a hang is resumed without the backend that hung; all
children append to one results dir, each row tagged with its env_setting. A backend that must
run in a process of its own (the MSCCL++ NCCL shim, preloaded in place of NCCL) gets one more
child with its environment.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from commbench.sweep import mps
from commbench.backends.base import Backend
from commbench.policy import MULTICAST_POLICY_VARS, multicast_forbidden_by
from commbench.errors import HANG_EXIT, UsageError
from commbench.results import HANG, Measurement, ResultsWriter, new_run_dir, read_rows, write_csv, write_run_info

_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# Flags the driver consumes; everything else is passed to each child unchanged.
_DRIVER_FLAGS = {"--nproc", "--env", "--child-timeout", "--resume", "--qualify", "--junit"}
_DRIVER_SWITCHES = {"--mps"}          # take no value
MAX_RESUMES_PER_SETTING = 3


def parse_env_settings(specs: list[str], allow_multicast: bool) -> list[dict[str, str]]:
    """['NCCL_MAX_CTAS=8,16', 'NCCL_NTHREADS=256'] -> every combination as a dict."""
    axes: list[list[tuple[str, str]]] = []
    for spec in specs:
        name, sep, values_text = spec.partition("=")
        name = name.strip()
        values = [v.strip() for v in values_text.split(",") if v.strip()]
        if not sep or not _NAME_RE.match(name) or not values:
            raise UsageError(f"malformed --env {spec!r}: use NAME=VALUE1,VALUE2")
        if name in MULTICAST_POLICY_VARS and any(v != MULTICAST_POLICY_VARS[name] for v in values):
            if not allow_multicast or multicast_forbidden_by():
                raise UsageError(f"--env {name}={values_text} would enable NVLink multicast: "
                                 "needs --allow-multicast and no policy variable forbidding it")
        axes.append([(name, v) for v in values])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else []


def child_arguments(argv: list[str], also_drop: frozenset[str] = frozenset()) -> list[str]:
    """The sweep's own arguments minus the driver's flags (both `--flag V` and `--flag=V`)."""
    out: list[str] = []
    skip_next = False
    for token in argv:
        if skip_next:
            skip_next = False
            continue
        flag = token.split("=", 1)[0]
        if flag in _DRIVER_SWITCHES:
            continue
        if flag in _DRIVER_FLAGS or flag in also_drop:
            skip_next = "=" not in token
            continue
        out.append(token)
    return out


def _new_run_dir(args: argparse.Namespace) -> Path:
    if args.resume:
        return Path(args.resume).resolve()
    path = new_run_dir(Path(args.out))
    write_run_info(path, {"run_id": path.name, "started": time.time(), "driver": {
        "nproc": args.nproc, "env": args.env, "child_timeout_s": args.child_timeout}})
    return path


def _hang_count(run_dir: Path) -> int:
    return sum(1 for row in read_rows(run_dir) if row.status == HANG)


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def child_runs(argv: list[str], env_settings: list[dict[str, str]], variants: list[Backend],
               allow_multicast: bool) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, sweep arguments) of every child torchrun: one per --env setting, plus one
    for each backend that needs a process of its own (e.g. a preloaded NCCL replacement)."""
    runs = [(setting, child_arguments(argv)) for setting in env_settings or [{}]]
    for backend in variants:
        env = backend.process_env(allow_multicast)
        if env:
            runs.append((env, child_arguments(argv, frozenset({"--backends"})) + ["--backends", backend.name]))
    return runs


def drive(args: argparse.Namespace, env_settings: list[dict[str, str]], variants: list[Backend]) -> tuple[int, Path]:
    """Run every child; returns the exit status and the results dir. The status follows the
    plain sweep's: 3 when something hung (its row recorded, the rest resumed and measured), 1
    when a child failed otherwise, 0 when every child finished."""
    if args.nproc is None:
        raise UsageError("--env needs --nproc N: the driver launches one torchrun per setting")
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1 (got {args.nproc})")
    if args.mps:
        mps.control_path()   # missing: bad input, said before anything is written
    run_dir = _new_run_dir(args)
    hangs_before = _hang_count(run_dir)   # a resumed dir's earlier hangs are not this run's
    with mps.private_daemon(run_dir / "mps-logs") if args.mps else nullcontext({}) as daemon_env:
        if daemon_env:
            import torch

            daemon_env = {**daemon_env, **mps.client_env(args.nproc, torch.cuda.device_count())}
            print(f"# driver: private MPS daemon for the children ({mps.MPS_PERCENT_VAR}="
                  f"{daemon_env[mps.MPS_PERCENT_VAR]})", flush=True)
        failures = sum(_run_setting(args, run_dir, setting, sweep_args, daemon_env)
                       for setting, sweep_args in child_runs(getattr(args, "_argv", []), env_settings, variants,
                                                             args.allow_multicast))
    write_csv(run_dir)
    print(f"# results: {run_dir}/measurements.jsonl (+ .csv, run.json)")
    if _hang_count(run_dir) > hangs_before:
        return HANG_EXIT, run_dir
    return (1 if failures else 0), run_dir


def _run_setting(args: argparse.Namespace, run_dir: Path, setting: dict[str, str], sweep_args: list[str],
                 daemon_env: dict[str, str]) -> int:
    """One setting's child torchrun, resumed after a recorded hang; 1 if it failed, else 0."""
    # --standalone: a private rendezvous on a free local port for each child.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               "-m", "commbench", "sweep", *sweep_args, "--run-dir", str(run_dir)]
    label = " ".join(f"{k}={v}" for k, v in setting.items()) or "default environment"
    for attempt in range(MAX_RESUMES_PER_SETTING + 1):
        hangs_before = _hang_count(run_dir)
        env = {**os.environ, **daemon_env, **setting, "COMMBENCH_ENV_SETTING": json.dumps(setting, sort_keys=True)}
        print(f"# driver: torchrun x{args.nproc} with {label}" + (f" (resume {attempt})" if attempt else ""),
              flush=True)
        proc = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            _record_child_timeout(run_dir, args, setting)
            return 1
        except KeyboardInterrupt:
            _kill(proc)
            write_csv(run_dir)
            raise
        if rc == 0:
            return 0
        if _hang_count(run_dir) > hangs_before and attempt < MAX_RESUMES_PER_SETTING:
            continue  # the watchdog wrote a hang row: resume without that backend
        print(f"# driver: child with {label} exited with status {rc}", flush=True)
        return 1
    return 1


def _record_child_timeout(run_dir: Path, args: argparse.Namespace, setting: dict[str, str]) -> None:
    writer = ResultsWriter(run_dir)
    try:
        writer.append(Measurement(backend="(torchrun child)", mode="-", dtype="-", message_bytes=0,
                                  world_size=args.nproc, status=HANG, env_setting=dict(setting),
                                  reason=f"child torchrun exceeded --child-timeout {args.child_timeout:g} s "
                                         "and was killed", timestamp=time.time()))
    finally:
        writer.close()
