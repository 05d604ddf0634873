"""The driver outside torchrun: `commbench sweep --nproc N [--env NAME=V1,V2 ...]`.

Process-level NCCL knobs (NCCL_NTHREADS, NCCL_BUFFSIZE, NCCL_MAX_CTAS, NCCL_P2P_LEVEL, ...) are
read once per process, so each setting needs its own torchrun. The driver launches one per
setting (all combinations of the --env flags), each with a time limit; all children append to
one results dir, each row tagged with its env_setting. A backend that must run in a process of
its own (the MSCCL++ NCCL shim, preloaded in place of NCCL) gets one more child with its
environment.

It is the crash-proof way to run a sweep: when a child ends early, because a backend hung,
crashed (a signal, an OOM kill, abort() in native code) or raised on one rank mid-collective,
the ranks' in-flight records (commbench.inflight) name the backend and the step; the driver
records what they could not (the crashed row of a rank that died, the hang of a rank whose
watchdog could not run), and resumes the child without that backend.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from commbench import inflight
from commbench.sweep import mps
from commbench.backends.base import Backend
from commbench.policy import MULTICAST_POLICY_VARS, multicast_forbidden_by
from commbench.errors import FAILED_EXIT, STOP_EXIT, USAGE_LINE_FILE_VAR, ResultsUnwritable, Terminated, UsageError
from commbench.results import HANG, SCHEMA_VERSION, Measurement, RunDir, RunInfo, refuse_other_run, stops_backend
from commbench.sweep.options import SweepOptions
from commbench.sweep.plan import SweepPlan
from commbench.waits import waits

ENV_SETTING_VAR = "COMMBENCH_ENV_SETTING"   # a child's --env setting, as JSON: its rows carry it
REFUSAL_FILE = ".commbench.refused"   # a child's bad-input line, for the driver (USAGE_LINE_FILE_VAR)
_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# Flags the driver consumes; everything else is passed to each child unchanged (--qualify too:
# the spec's sizes and backends are part of the plan; only the driver runs the qualify).
_DRIVER_FLAGS = frozenset({"--nproc", "--env", "--child-timeout", "--resume", "--junit"})
_DRIVER_SWITCHES = frozenset({"--mps"})          # take no value


def parse_env_settings(specs: list[str], allow_multicast: bool) -> list[dict[str, str]]:
    """['NCCL_MAX_CTAS=8,16', 'NCCL_NTHREADS=256'] -> every combination as a dict."""
    axes: list[list[tuple[str, str]]] = []
    for spec in specs:
        name, sep, values_text = spec.partition("=")
        name = name.strip()
        values = [v.strip() for v in values_text.split(",") if v.strip()]
        if not sep or not _NAME_RE.fullmatch(name) or not values:
            raise UsageError(f"malformed --env {spec!r}: use NAME=VALUE1,VALUE2")
        if name in MULTICAST_POLICY_VARS and any(v != MULTICAST_POLICY_VARS[name] for v in values):
            if not allow_multicast or multicast_forbidden_by():
                raise UsageError(f"--env {name}={values_text} would enable NVLink multicast: "
                                 "needs --allow-multicast and no policy variable forbidding it")
        axes.append([(name, v) for v in values])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else []


def child_arguments(argv: list[str], also_drop: frozenset[str] = frozenset()) -> list[str]:
    """The sweep's own arguments minus the driver's flags."""
    return without_flags(argv, _DRIVER_FLAGS | also_drop, _DRIVER_SWITCHES)


def without_flags(argv: list[str], flags: set[str] | frozenset[str], switches: frozenset[str] = frozenset()) -> list[str]:
    """argv without `flags` (both `--flag V` and `--flag=V`) and `switches` (no value)."""
    out: list[str] = []
    skip_next = False
    for token in argv:
        if skip_next:
            skip_next = False
            continue
        flag = token.split("=", 1)[0]
        if flag in switches:
            continue
        if flag in flags:
            skip_next = "=" not in token
            continue
        out.append(token)
    return out


def _open_run_dir(opts: SweepOptions) -> RunDir:
    """The run dir of this driver, locked for the whole run (its children run under that lock)."""
    if opts.resume:
        return RunDir(Path(opts.resume).resolve()).lock()
    run = RunDir.create(Path(opts.out)).lock()
    run.write_info(RunInfo(run_id=run.path.name, started=time.time(), driver={
        "nproc": opts.nproc, "env": list(opts.env), "child_timeout_s": opts.child_timeout}))
    return run


def _kill(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGTERM, then SIGKILL, to the child torchrun and to every rank it left a record for:
    torchrun starts its workers in sessions of their own, so killing torchrun alone would
    orphan a rank that ignores SIGTERM (one stuck in native code)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        ranks = [r.pid for r in inflight.read_records(run_dir) if inflight.is_alive(r)]
        for send in [lambda: os.killpg(proc.pid, sig)] + [lambda pid=pid: os.kill(pid, sig) for pid in ranks]:
            try:
                send()
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + waits().kill_wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not any(inflight.is_alive(r) for r in inflight.read_records(run_dir)):
                return
            time.sleep(0.2)


def child_runs(argv: list[str], env_settings: list[dict[str, str]], variants: list[Backend],
               allow_multicast: bool, shares_gpus: bool = False) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, sweep arguments) of every child torchrun: one per --env setting, plus one
    for each backend that needs a process of its own (e.g. a preloaded NCCL replacement),
    unless it needs one GPU per rank and the ranks share GPUs: the first child's rows already
    say why it cannot run, and a child of its own would only say it again."""
    runs = [(setting, child_arguments(argv)) for setting in env_settings or [{}]]
    for backend in variants:
        if shares_gpus and "own_gpu" in backend.needs:
            continue
        env = backend.process_env(allow_multicast)
        if env:
            runs.append((env, child_arguments(argv, frozenset({"--backends"})) + ["--backends", backend.name]))
    return runs


def drive(opts: SweepOptions, env_settings: list[dict[str, str]], variants: list[Backend],
          plan: SweepPlan) -> tuple[int, Path]:
    """Run every child, resuming each after a backend ended it; the exit status (FAILED_EXIT
    when a child failed with nothing recorded, STOP_EXIT when a backend hung or crashed, else 0)
    and the results dir."""
    if opts.nproc is None:
        raise UsageError("--env needs --nproc N: the driver launches one torchrun per setting")
    if opts.nproc < 1:
        raise UsageError(f"--nproc must be at least 1 (got {opts.nproc})")
    if opts.mps:
        mps.control_path()   # missing: bad input, said before anything is written
    if opts.resume:
        _check_resume(Path(opts.resume), opts.nproc, plan)
    run = _open_run_dir(opts)
    # SIGTERM (kill, a batch system's stop) and SIGHUP (a closed terminal) unwind the driver as
    # Ctrl-C does: its children are stopped, run.json says interrupted, the lock and its file go;
    # their default action would end the driver alone and leave torchrun and the ranks measuring.
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in _STOP_SIGNALS}
    try:
        return _drive(opts, env_settings, variants, run), run.path
    except (KeyboardInterrupt, Terminated):
        _end_interrupted(run)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        run.release()


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


_PR_SET_PDEATHSIG = 1


def _ends_with_the_driver() -> None:
    """In the child torchrun, before it runs: SIGTERM when the driver ends, however it ends
    (kill -9 included), so torchrun stops its ranks as on any SIGTERM. It runs in its own
    session, so nothing else would reach it. Linux only (prctl); elsewhere nothing."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl   # looked up here: a forked child only calls it
    except (OSError, AttributeError):
        return None


_prctl = _libc_prctl()


def _end_interrupted(run: RunDir) -> None:
    """Ctrl-C or SIGTERM of the driver: run.json says the run was interrupted (a child may have
    written neither, or `finished` for its own part)."""
    try:
        run.update_info(interrupted=time.time(), finished=None)
    except (UsageError, ResultsUnwritable):   # the rows are on disk; the Ctrl-C line says the rest
        pass


def _drive(opts: SweepOptions, env_settings: list[dict[str, str]], variants: list[Backend],
           run: RunDir) -> int:
    run_dir = run.path
    for line in inflight.recover(run_dir):   # what a run before this command left in flight
        print(f"# driver: {line}", flush=True)
    stops_before = _stop_count(run_dir)
    # Asked only where ranks may share GPUs (--mps needs --share-gpus): no CUDA call in the driver
    # otherwise. As each child's ranks will see it (init_context): more ranks than GPUs share them.
    gpus = torch.cuda.device_count() if opts.share_gpus else 0
    shares_gpus = 0 < gpus < opts.nproc
    daemon = nullcontext(None)
    if opts.mps:
        daemon = mps.private_daemon(run.subdir("mps-logs"), mps.client_env(opts.nproc, gpus))
    with daemon as mps_daemon:
        if mps_daemon is not None:
            print(f"# driver: private MPS daemon for the children ({mps.MPS_PERCENT_VAR}="
                  f"{mps_daemon.share[mps.MPS_PERCENT_VAR]})", flush=True)
        failed = [_run_setting(opts, run, setting, sweep_args, mps_daemon, len(variants))
                  for setting, sweep_args in child_runs(list(opts.argv), env_settings, variants,
                                                        opts.allow_multicast, shares_gpus)]
    run.write_csv()
    print(f"# results: {run_dir}/measurements.jsonl (+ .csv, run.json)")
    if any(failed):
        return FAILED_EXIT
    return STOP_EXIT if _stop_count(run_dir) > stops_before else 0


def _check_resume(run_dir: Path, nproc: int, plan: SweepPlan) -> None:
    """What the driver can compare before it starts a child (the children compare the GPUs)."""
    refuse_other_run(run_dir, RunDir(run_dir).info(), {
        "schema": SCHEMA_VERSION, "host": socket.gethostname(), "world_size": nproc, "nodes": 1,
        "plan": plan.record()})


def _stop_count(run_dir: Path) -> int:
    return sum(1 for row in RunDir(run_dir).rows() if stops_backend(row))


def _run_setting(opts: SweepOptions, run: RunDir, setting: dict[str, str], sweep_args: list[str],
                 daemon: mps.PrivateDaemon | None, max_resumes: int) -> bool:
    """One setting's child torchrun, resumed as long as each child that ends early recorded
    why (each such row takes a backend out of the next child); True if it failed anyway."""
    run_dir = run.path
    # --standalone: a private rendezvous on a free local port for each child.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(opts.nproc),
               "-m", "commbench", "sweep", *sweep_args, "--run-dir", str(run_dir)]
    label = " ".join(f"{k}={v}" for k, v in setting.items()) or "default environment"
    for attempt in range(max_resumes + 1):
        stops_before = _stop_count(run_dir)
        if attempt and daemon is not None:
            print("# driver: a fresh private MPS daemon for the resumed child (the old server may still hold "
                  "the ended child's kernel)", flush=True)
            daemon.restart()
        client = daemon.client_env() if daemon is not None else {}
        refusal = run.path / REFUSAL_FILE
        refusal.unlink(missing_ok=True)
        env = {**os.environ, **client, **setting, **run.holder_env(),
               ENV_SETTING_VAR: json.dumps(setting, sort_keys=True), USAGE_LINE_FILE_VAR: str(refusal)}
        print(f"# driver: torchrun x{opts.nproc} with {label}" + (f" (resume {attempt})" if attempt else ""),
              flush=True)
        proc = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_ends_with_the_driver)
        try:
            rc, killed = _wait(proc, run_dir, opts.child_timeout)
            if any(inflight.is_alive(r) for r in inflight.read_records(run_dir)):
                _kill(proc, run_dir)   # torchrun ended (killed, say) before its ranks: they end too
        except (KeyboardInterrupt, Terminated):   # the ranks record where they were and end
            for sig in _STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)   # once: the kill must not be cut short
            _kill(proc, run_dir)
            run.write_csv()
            raise
        for line in inflight.recover(run_dir, killed):   # the ranks that could not say it themselves
            print(f"# driver: {line}", flush=True)
        if rc == 0:
            return False
        _refused(refusal)
        if _stop_count(run_dir) > stops_before and attempt < max_resumes:
            print("# driver: resuming without that backend", flush=True)
            continue
        if killed and _stop_count(run_dir) == stops_before:
            _record_child_timeout(run, opts, setting, killed)
        print(f"# driver: child with {label} exited with status {rc}", flush=True)
        return True
    return True


def _refused(refusal: Path) -> None:
    """A child that refused its input (a --resume whose GPUs differ, say) left its one line in
    `refusal`: it is the driver's bad input too (exit 2, said once), not a failed child."""
    try:
        line = refusal.read_text(encoding="utf-8", errors="replace").strip()
        refusal.unlink()
    except OSError:
        return
    if line:
        raise UsageError(line)


def _wait(proc: subprocess.Popen, run_dir: Path, child_timeout_s: float) -> tuple[int, str | None]:
    """The child's exit status, and why the driver killed it (None when it ended by itself)."""
    limit = time.monotonic() + child_timeout_s
    while True:
        try:
            return proc.wait(timeout=waits().driver_poll_s), None
        except subprocess.TimeoutExpired:
            pass
        # A step whose watchdog should have fired by now is stuck where no watchdog can run:
        # the driver ends the child itself.
        late = inflight.overdue(run_dir, waits().overdue_grace_s)
        if time.monotonic() > limit:
            reason = f"child torchrun exceeded --child-timeout {child_timeout_s:g} s and was killed"
        elif late is not None:
            reason = (f"no progress within {(late.deadline or late.started) - late.started:g} s, and rank "
                      f"{late.rank}'s watchdog never fired (a thread holding the GIL?): the driver killed the run")
        else:
            continue
        _kill(proc, run_dir)
        return proc.wait(), reason


def _record_child_timeout(run: RunDir, opts: SweepOptions, setting: dict[str, str], reason: str) -> None:
    """A killed child whose ranks were outside every backend's step: the row says only that."""
    run.append(Measurement(backend="(torchrun child)", mode="-", dtype="-", message_bytes=0, world_size=opts.nproc,
                           status=HANG, env_setting=dict(setting), reason=reason, timestamp=time.time()))
