"""`commbench sweep`: allreduce latency and bandwidth over sizes, dtypes, modes and backends.

Runs under torchrun (one process per GPU; gloo on the CPU without CUDA), as a single process,
or launches torchrun itself with --nproc N (and one torchrun per --env setting).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from commbench import backends, terminal
from commbench.backends.base import Backend, SweepFacts, describe
from commbench.errors import FAILED_EXIT, STOP_EXIT, TERMINATED_EXIT, ResultsUnwritable, Terminated, UsageError
from commbench.inflight import ENDED, LEFT, PeerWatch, Recorder, recover
from commbench.sweep import launcher
from commbench.launch_env import torchrun_env, under_torchrun
from commbench.ops import ALLREDUCE
from commbench.runtime.context import ControlGroupLost, RunContext, init_context, shutdown
from commbench.sweep.engine import Engine
from commbench.files import check_dir_target, check_file_target
from commbench.sweep.plan import SweepPlan, build_plan
from commbench.sweep.state import RowSink, RunState
from commbench.results import (ERROR, ROWS_FILE, SCHEMA_VERSION, Measurement, RunDir, RunInfo, refuse_other_run,
                               repair_torn_tail, write_whole)
from commbench.sweep.live import LiveTable, header_lines

from commbench.sweep.options import SweepOptions
from commbench.units import positive_finite
from commbench.waits import waits
from commbench.sweep.versions import (LAUNCH_COMMAND_VAR, launch_command, local_device_info, relevant_env,
                                      software_versions)



def backend_options(opts: SweepOptions, plan: SweepPlan, run_dir: Path | None) -> backends.Options:
    """The sweep's facts every family may read, and each family's own options."""
    facts = SweepFacts(hidden=plan.shapes[0].hidden,
                       message_bytes=tuple(sorted({shape.message_bytes for shape in plan.shapes})),
                       allow_multicast=opts.allow_multicast, run_dir=run_dir)
    return backends.Options(facts, opts.families)


def _list_backends() -> int:
    """Each family's summary and example variants, folded to the terminal under its name."""
    width = terminal.width()
    for fac in backends.usable_factories():
        print(textwrap.fill(f"{fac.family:<11} {fac.summary}", width, subsequent_indent=" " * 12,
                            break_long_words=False, break_on_hyphens=False))
        for example in fac.variants_help:
            print(textwrap.fill(example, width, initial_indent=" " * 14, subsequent_indent=" " * 16,
                                break_long_words=False, break_on_hyphens=False))
    return 0


@dataclass(frozen=True)
class Checked:
    """A sweep's arguments, every one checked before any work: what main() runs, and what a command
    the analysis prints must pass (tests/system/test_hints.py)."""

    opts: SweepOptions
    plan: SweepPlan
    env_settings: list[dict[str, str]]
    specs: list[str] | None
    variants: list[Backend]
    ranks: int
    driver: bool


def check(args: argparse.Namespace, argv: Sequence[str], on_gpu: bool, world: int) -> Checked:
    """Every argument of a sweep checked as on a machine with (on_gpu) or without GPUs, under a
    torchrun of `world` processes: bad input raises UsageError before anything runs."""
    spec = _qualify_spec(args)
    plan = build_plan(args, on_gpu, spec.message_sizes() if spec is not None else None)
    env_settings = launcher.parse_env_settings(args.env, args.allow_multicast)
    if args.resume:   # one that cannot be read or written is bad input, before any work
        RunDir(Path(args.resume)).info()
        check_dir_target(Path(args.resume), f"--resume {args.resume}")
    check_dir_target(Path(args.out), f"--out {args.out}")
    # Building the variants validates backend names and options before anything runs.
    specs = backends.split_specs(args.backends) if args.backends is not None else None
    if specs == []:
        raise UsageError(f"--backends {args.backends!r}: the list is empty (leave it out for every backend)")
    twice = next((name for i, name in enumerate(specs or []) if name in specs[:i]), None)
    if twice is not None:
        raise UsageError(f"--backends {args.backends!r}: {twice} is listed twice")
    if specs is not None and spec is not None:
        # The spec's backends are measured too: a check of a backend the run lacks can only FAIL.
        specs += [name for name in sorted(spec.backends()) if name not in specs]
    opts = SweepOptions.from_args(args, argv)   # reads every family's flags
    driver = opts.nproc is not None or bool(env_settings)
    ranks = opts.nproc if driver and opts.nproc else world
    # The driver knows its children's world size: a spec that cannot run with it is one line here,
    # where torchrun would follow each child's line with its own failure report.
    variants = backends.expand(specs, backend_options(opts, plan, None), on_gpu, world_size=ranks)
    if opts.mps and not (opts.nproc and opts.share_gpus):
        raise UsageError("--mps starts an MPS daemon for the children of the driver: use it with --nproc N "
                         "--share-gpus")
    if driver and under_torchrun():
        raise UsageError("--nproc/--env launch torchrun themselves: run them outside torchrun")
    if driver:
        positive_finite(opts.child_timeout, "--child-timeout", "seconds")
    _check_tp(args, ranks)
    return Checked(opts, plan, env_settings, specs, variants, ranks, driver)


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """argv: the sweep's own arguments as typed, for the driver's children and the resume hint."""
    if args.list_backends:
        return _list_backends()
    on_gpu = torch.cuda.is_available() and not args.cpu
    rank, world, _, _ = torchrun_env()
    checked = check(args, argv, on_gpu, world)
    opts, ranks = checked.opts, checked.ranks
    if checked.driver:
        os.environ[LAUNCH_COMMAND_VAR] = json.dumps(sys.argv)   # the children record the driver's command
        try:
            status, run_dir = launcher.drive(opts, checked.env_settings, checked.variants, checked.plan)
        finally:
            del os.environ[LAUNCH_COMMAND_VAR]
        return _finish(opts, status, run_dir, ranks, on_gpu)
    status, run_dir = _run(opts, checked.plan, checked.specs, on_gpu)
    if rank != 0 or opts.run_dir:   # a driver's child: the driver says what comes next
        return status
    return _finish(opts, status, run_dir, ranks, on_gpu)


def next_commands(opts: SweepOptions, run_dir: Path, ranks: int, on_gpu: bool) -> list[str]:
    """What to run after a sweep: every sweep ends with them, each a whole command. A --model run
    of one GPU per rank answers recommend; a CPU run prices no engine path, so its next step is the
    sweep on the GPU box (torchrun's `--nproc-per-node gpu`: one process per GPU there)."""
    run = shlex.quote(str(run_dir))
    out = [f"commbench report {run}"]
    if not on_gpu:
        model = ["--model", opts.model] if opts.model is not None else []
        out.append(shlex.join(["torchrun", "--nproc-per-node", "gpu", "-m", "commbench", "sweep", *model])
                   + "   # on the GPU box: a CPU run prices no engine path")
    elif opts.model is not None:
        out.append(f"commbench recommend {run} --model {shlex.quote(opts.model)} --tp {ranks}")
    else:
        out.append(f"commbench floor --list-models   # then: commbench recommend {run} --tp {ranks} --model "
                   "with one of them")
    return out


def _finish(opts: SweepOptions, status: int, run_dir: Path, ranks: int, on_gpu: bool) -> int:
    """After a sweep that ended well: the commands that come next (the decision for a --model
    run), then the --qualify verdict (whose exit status is the command's)."""
    if status != 0:
        return status
    for command in next_commands(opts, run_dir, ranks, on_gpu):
        print(f"# next: {command}", flush=True)
    return _qualify(opts, run_dir) if opts.qualify is not None else status


def _qualify_spec(args: argparse.Namespace) -> Any:
    """The --qualify spec, loaded before anything is measured (a broken spec is bad input)."""
    if args.junit is not None and args.qualify is None:
        raise UsageError("--junit writes qualify's JUnit XML: give it with --qualify SPEC.toml")
    if args.qualify is None:
        return None
    from commbench.analysis.qualify import load_spec

    check_file_target(args.junit, "--junit")
    return load_spec(args.qualify)


def _check_tp(args: argparse.Namespace, ranks: int) -> None:
    """--tp names the decode question's TP size: latency at another world size does not answer it."""
    if args.tp is None:
        return
    if args.model is None:
        raise UsageError("--tp goes with --model NAME (the model whose decode sizes to measure)")
    if args.tp != ranks:
        raise UsageError(f"--tp {args.tp} but this sweep runs {ranks} rank(s): start it with --nproc {args.tp} "
                         f"(or torchrun --nproc-per-node {args.tp})")


def _qualify(opts: SweepOptions, run_dir: Path) -> int:
    from commbench.analysis import qualify

    # The spec was read before the sweep (bad input then); read again here, as the run's own.
    result = qualify.answer(qualify.load_spec(opts.qualify), run_dir, opts.junit)
    return qualify.exit_status(result)


def _run(opts: SweepOptions, plan: SweepPlan, specs: list[str] | None, on_gpu: bool) -> tuple[int, Path]:
    run_dir_arg = opts.run_dir or opts.resume
    ctx, note = init_context(allow_multicast=opts.allow_multicast, force_cpu=opts.cpu,
                             share_gpus=opts.share_gpus)
    try:
        run_dir = _prepare_run_dir(ctx, opts, run_dir_arg)
        variants = backends.expand(specs, backend_options(opts, plan, run_dir), ctx.is_cuda)
        # Backends that read earlier rows (Backend.reads_rows) after all the others; plain
        # allreduce before fused ops; optional native code (MSCCL++, FlashInfer, plug-ins) last
        # within each, where a crash costs least.
        variants.sort(key=lambda b: (b.reads_rows, b.op != ALLREDUCE, backends.runs_native_code(b.family)))
        return _sweep(ctx, opts, plan, variants, run_dir, note), run_dir
    finally:
        shutdown()


def _prepare_run_dir(ctx: RunContext, opts: SweepOptions, existing: str | None) -> Path:
    path = None
    if ctx.rank == 0:
        path = str(Path(existing).resolve() if existing else RunDir.create(Path(opts.out)).path)
    return Path(ctx.broadcast_object(path))


def _probe(ctx: RunContext, opts: SweepOptions, variants: list) -> tuple[RunContext, list[str]]:
    """Take the topology snapshot and the per-backend verdicts; never fatal. The context with
    them, and the lines that say what went wrong."""
    if opts.no_probe:
        return ctx, ["probe skipped (--no-probe)"]
    try:
        from commbench.probe.snapshot import take_snapshot
        from commbench.probe.verdicts import run_verdicts
    except ImportError as exc:
        return ctx, [f"probe unavailable: {exc}"]
    notes: list[str] = []
    try:
        snapshot = take_snapshot(ctx, bandwidth=False, allow_multicast=opts.allow_multicast)
    except Exception as exc:  # a broken probe must not stop the sweep; the reason is recorded
        snapshot = {"error": f"{type(exc).__name__}: {exc}"}
        notes.append(f"probe failed on rank {ctx.rank}: {exc}")
    # Rank 0 holds the merged snapshot; every rank decides skips from the same verdicts.
    if ctx.rank == 0 and "error" not in snapshot:
        verdicts = run_verdicts(variants, snapshot, ctx.world_size, opts.allow_multicast)
    else:
        verdicts = {}
    return ctx.with_probe(*ctx.broadcast_object((snapshot, verdicts) if ctx.rank == 0 else None)), notes


def _sweep(ctx: RunContext, opts: SweepOptions, plan: SweepPlan, variants: list, run_dir: Path,
           note: str | None) -> int:
    rank0 = ctx.rank == 0
    env_setting = json.loads(os.environ.get(launcher.ENV_SETTING_VAR, "{}"))
    gpus = ctx.all_gather_objects(local_device_info(ctx.device))
    run = RunDir(run_dir)   # rank 0 holds its lock for the whole sweep
    failure, opened, previous = ctx.broadcast_object(_open_run_dir(ctx, plan, gpus, run) if rank0 else None)
    if failure is not None:
        run.release()
        raise failure
    state = RunState.resumed(previous, env_setting)
    ctx, probe_notes = _probe(ctx, opts, variants)
    notes = ([note] if note else []) + plan.notes + opened + _oversubscribed(ctx) + probe_notes
    # After rank 0 has read a dead run's records: this rank's own start afresh. Ranks on nodes
    # that do not see the results dir keep none.
    recorder = Recorder(run_dir if run_dir.is_dir() else None, ctx.rank)
    engine: Engine | None = None
    writer = None
    unwritable = False
    completed = False   # a Ctrl-C or an error ends the run interrupted, never "finished"
    try:
        if rank0:
            _write_run_json(ctx, opts, plan, variants, run, gpus, notes, env_setting)
            writer = run.writer()
        total = len(variants) * sum(len(plan.sizes_for(d)) for d in plan.dtypes) * len(plan.modes)
        table = LiveTable(enabled=rank0, total_rows=total)
        with table:
            for line in notes:
                table.line(f"# {line}")
            table.line(f"# commbench sweep: {ctx.world_size} rank(s) on {ctx.nodes} node(s), "
                       f"{'CUDA' if ctx.is_cuda else 'CPU/gloo'}; results in {run_dir}")
            for line in header_lines(plan.check, table.width):
                table.line(line)
            sink = RowSink(writer, table, flush=run.write_csv,
                           resume_hint=None if opts.run_dir else resume_command(opts.argv, ctx, run_dir))
            engine = Engine(ctx, plan, state, sink, recorder)
            for backend in variants:
                engine.run_backend(backend)
            _fusion_summary(ctx, state.rows, run_dir, table)
        # Leave together: a rank that tears its gloo pairs down while a peer still uses them
        # makes that peer abort (seen on CPU with two torchrun agents).
        ctx.barrier()
        recorder.close()
        completed = True
    except (ControlGroupLost, Terminated) as exc:
        return _after_peer_loss(ctx, engine, recorder, exc)
    except (KeyboardInterrupt, UsageError):
        recorder.close()
        raise
    except BaseException as exc:
        unwritable = isinstance(exc, ResultsUnwritable)
        recorder.leave(ERROR, describe(exc))   # not a crash: its own line says what happened
        raise
    finally:
        if writer is not None:
            writer.close()
            if not unwritable:
                run.write_csv()
                _end_run_json(run, completed)
        run.release()
    if rank0 and not opts.run_dir:  # a driver's child: the driver names the results once, at the end
        print(f"# results: {run_dir}/measurements.jsonl (+ .csv, run.json)")
    return STOP_EXIT if engine.stops else 0


def _open_run_dir(ctx: RunContext, plan: SweepPlan, gpus: list, run: RunDir
                  ) -> tuple[Exception | None, list[str], list[Measurement]]:
    """Rank 0, before anything is written: take the run dir's lock (another sweep in it is
    refused), refuse to resume another experiment; else repair a torn last row, turn a dead
    run's in-flight records into rows, and read the rows (the failure, every rank raises it;
    the lines that say what was done; the rows)."""
    try:
        run.lock()
        refuse_other_run(run.path, run.info_or_new(), run_identity(ctx, plan, gpus))
        lines = [line for line in [repair_torn_tail(run.path / ROWS_FILE)] if line] + recover(run.path)
        read = run.read_rows()
    except (UsageError, ResultsUnwritable) as exc:
        return exc, [], []
    problems = [line for line in (read.problems_line(run.path / ROWS_FILE), read.duplicates_line(run.path / ROWS_FILE))
                if line]
    return None, lines + problems, list(read.rows)   # the engine appends to them


def run_identity(ctx: RunContext, plan: SweepPlan, gpus: list) -> dict[str, Any]:
    """What a resume must share with the run it continues (results.resume_differences)."""
    return {"schema": SCHEMA_VERSION, "host": ctx.hostname, "world_size": ctx.world_size, "nodes": ctx.nodes,
            "device_type": ctx.device.type, "gpus": gpus,
            "emulation": ctx.emulation.to_dict() if ctx.emulation else None, "plan": plan.record()}


def resume_command(argv: Sequence[str], ctx: RunContext, run_dir: Path) -> str:
    """The command that continues this run after a stop, as the user started it."""
    sweep = shlex.join(["-m", "commbench", "sweep", *launcher.without_flags(list(argv),
                                                                            {"--resume", "--run-dir"}),
                        "--resume", str(run_dir)])
    if not under_torchrun():
        return f"python {sweep}"
    if ctx.nodes == 1:
        return f"torchrun --standalone --nproc-per-node {ctx.local_world_size} {sweep}"
    return f"torchrun --nnodes {ctx.nodes} --nproc-per-node {ctx.local_world_size} <your rendezvous flags> {sweep}"


def _after_peer_loss(ctx: RunContext, engine: Engine | None, recorder: Recorder, exc: BaseException) -> int:
    """A peer is gone (the control group failed) or torchrun or the driver is stopping this
    rank: record what the peers' in-flight records say (rank 0), say it once, and end."""
    peers = PeerWatch(recorder.run_dir, ctx.rank, engine.step if engine else 0, peer_wait_s=0.0)
    stop = peers()
    deadline = time.monotonic() + waits().cause_look_s
    while stop is None and time.monotonic() < deadline:
        time.sleep(0.2)
        stop = peers()
    if stop is not None and stop.status is not None:
        if engine is not None and recorder.record is not None:
            engine.record_stop(stop, recorder.record.row)
        recorder.leave(ENDED)
        return STOP_EXIT
    recorder.leave(LEFT, describe(exc))
    if isinstance(exc, Terminated):
        return TERMINATED_EXIT
    if stop is None:   # nothing on disk says why (a peer on a node that does not see the results dir)
        print(f"commbench sweep: rank {ctx.rank} lost its peers ({exc}); their own output says why",
              file=sys.stderr, flush=True)
    return FAILED_EXIT


def _oversubscribed(ctx: RunContext) -> list[str]:
    """A warning when CPU ranks outnumber this host's cores: they then take turns, and what the
    rows time is mostly the scheduler (8 ranks on 2 cores: p50 17-22 ms), not the transport."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if ctx.is_cuda or ctx.local_world_size <= cores:
        return []
    return [f"warning: {ctx.local_world_size} ranks share {cores} CPU core(s) on this host: the latencies are "
            "mostly scheduler time, not the transport's"]


def _fusion_summary(ctx: RunContext, rows: list[Measurement], run_dir: Path, table: LiveTable) -> None:
    fused = [r for r in rows if r.op != ALLREDUCE]
    if not fused:
        return
    from commbench.analysis.fusion import summarize

    summary = summarize(rows)
    if ctx.rank == 0 and summary:  # only fused rows have a saving to report
        write_whole(run_dir / "fusion.json", json.dumps(summary, indent=2, sort_keys=True))
        for item in summary:
            table.line("# fusion: " + ", ".join(f"{k}={v}" for k, v in item.items()))


def _write_run_json(ctx: RunContext, opts: SweepOptions, plan: SweepPlan, variants: list, run: RunDir,
                    gpus: list, notes: list[str], env_setting: dict[str, str]) -> None:
    """A new run's metadata; on a resume (the same run, checked before), the original stays and
    the resume adds an entry to `resumed` and the facts of backends new to the run."""
    info = run.info() if run.has_info() else RunInfo(run_id=run.path.name, started=time.time())
    command = {"command": launch_command(), "args": dict(opts.recorded),
               "versions": software_versions(), "env": relevant_env(), "notes": notes}
    # What each variant declares, for the offline analysis (it never imports a backend).
    facts = {b.name: backend_facts(b, ctx.world_size) for b in variants}
    names = [b.name for b in variants]
    if info.world_size is not None:
        info.resumed = [*(info.resumed or []), {"at": time.time(), **command, "backends": names}]
        info.backend_facts = {**facts, **(info.backend_facts or {})}
        info.verdicts = {**ctx.verdicts, **(info.verdicts or {})}
    else:
        info = replace(info, **command, **run_identity(ctx, plan, gpus), resumed=[],
                       local_world_size=ctx.local_world_size, shares_gpus=ctx.shares_gpus, snapshot=ctx.snapshot,
                       verdicts=ctx.verdicts, backends=names, backend_facts=facts)
    if env_setting and env_setting not in (info.env_settings or []):
        info.env_settings = [*(info.env_settings or []), env_setting]
    info.finished = info.interrupted = None
    run.write_info(info)


def backend_facts(backend, world_size: int) -> dict[str, Any]:
    settings = backend.engine_settings(world_size)
    return {"family": backend.family, "needs": list(backend.needs),
            "engine_settings": settings.to_dict() if settings is not None else None}


def _end_run_json(run: RunDir, completed: bool) -> None:
    """Record how the run ended: `finished` when every backend ran, `interrupted` when Ctrl-C
    or an error stopped it (a hang ends the process and leaves neither: still unfinished)."""
    try:
        run.update_info(**{"finished" if completed else "interrupted": time.time()})
    except UsageError:
        return
