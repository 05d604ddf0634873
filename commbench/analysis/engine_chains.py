"""`commbench engines`: per engine, its allreduce dispatch chain in order for a box (a run's probe
snapshot, or a snapshot file), each path's gate with the reason and its size limit, the default
path at every decode size of a model under CUDA graphs and under --enforce-eager, how to turn each
path on or off, and where each rule comes from. `--check PATH` compares every built-in engine fact
with an engine's released source (an unpacked wheel or a site-packages folder) instead.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from commbench import engines
from commbench import models
from commbench.analysis import decide, render
from commbench.analysis.curves import run_world_size
from commbench.engines import paths, source
from commbench.engines.facts import FactSet
from commbench.errors import UsageError
from commbench.files import read_text
from commbench.runs import load_run
from commbench.units import format_bytes

DIFFERENT_EXIT = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", nargs="?", metavar="RUN",
                        help="a results dir (its probe snapshot) or a probe snapshot .json; without it, the chains "
                             "are printed with no box's gates applied")
    parser.add_argument("--engine", action="append", default=None, metavar="vllm|sglang",
                        help="the engine(s) to show (default: both)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: the run's world size)")
    parser.add_argument("--mode", choices=(paths.GRAPH, paths.EAGER), default=None,
                        help="only this mode's defaults (default: both: CUDA graphs and --enforce-eager)")
    parser.add_argument("--model", help="a preset (see `commbench floor --list-models`): default path per decode size")
    parser.add_argument("--arch", metavar="NAME",
                        help="the model's architecture (config.json architectures[0]) where no preset names it")
    parser.add_argument("--hidden", type=int, help="the model's hidden size where no preset gives it")
    parser.add_argument("--dtype", default=None, help="activation dtype: bf16 (default), fp16, fp32")
    decide.add_engine_source_arguments(parser)
    parser.add_argument("--check", metavar="PATH",
                        help="compare every built-in engine fact with the source under PATH (an unpacked wheel or "
                             "site-packages); exit 1 when any differ")


def check_main(site: str) -> int:
    results, refusal = source.check(Path(site))
    if refusal:
        raise UsageError(f"--check: {refusal}")
    differ = 0
    for facts, differences in results:
        built_in = source.BUILT_IN[facts.engine]
        print(f"{facts.name} {facts.version} at {site}: {len(facts.facts)} facts compared with the built-in "
              f"{built_in.name} {built_in.version} facts; {len(differences)} differ")
        for d in differences:
            print(f"  {d.line()}")
        for fact in facts.facts:
            if not any(d.fact.key == fact.key for d in differences):
                print(f"  same: {fact.key} ({fact.where()})")
        differ += len(differences)
    return DIFFERENT_EXIT if differ else 0


class Box:
    """What the chains are shown for: a snapshot, its world size and the words that name it."""

    def __init__(self, snapshot: dict[str, Any] | None, world_size: int | None, said: str):
        self.snapshot, self.world_size, self.said = snapshot, world_size, said


def load_box(path: str | None) -> Box:
    if path is None:
        return Box(None, None, "no box given: the gates that read a box are not applied")
    target = Path(path)
    if target.is_dir():
        run = load_run(target)
        return Box(decide.box_snapshot(run), run_world_size(run), f"run {target.name} ({decide.data_tag(run)})")
    try:
        data = json.loads(read_text(target, "snapshot"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("snapshot"), dict):
        data = data["snapshot"]
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list) or not data["gpus"]:
        raise UsageError(f"{path}: not a probe snapshot (no \"gpus\" list)")
    # a probe snapshot's world_size is how the probe ran (often one process): TP defaults to its GPUs
    return Box(data, len(data["gpus"]), f"snapshot {target.name}")


def workload_model(args: argparse.Namespace) -> models.Model | None:
    if args.model:
        model = models.lookup(args.model)
        if args.hidden is not None:
            raise UsageError("give either --model or --hidden, not both")
    elif args.hidden is not None:
        if args.hidden <= 0:
            raise UsageError("--hidden must be positive")
        model = models.custom(1, args.hidden, 1, args.dtype or "bf16")
    else:
        return None
    return models.with_arch(model, args.arch, args.dtype)


def _also_needs(engine: str, state: paths.PathState, states: list[paths.PathState]) -> str:
    """What a launch must add for this path to take the decode allreduces (launch_settings): a
    default-on path ahead of it that would intercept them turned off."""
    needed = paths.launch_settings(engines.Settings(state.path), engine, state.path, states)
    flags = needed.vllm_flags if engine == engines.VLLM else needed.sglang_flags
    return f"; with it: {' '.join(shlex.quote(f) for f in flags)}" if flags and state.available is not False else ""


def _chain_lines(engine: str, states: list[paths.PathState]) -> list[str]:
    lines = []
    for i, s in enumerate(states, 1):
        limit = ""
        if s.max_bytes is not None and s.available is not False:
            limit = f"; takes up to {format_bytes(s.max_bytes)}" + (" inclusive" if s.inclusive else " (exclusive)")
        lines.append(f"  {i}. {s.rule.title} [{'on by default' if s.default_on else 'opt-in'}]: "
                     f"{paths.status(s)}: {s.why}{limit}")
        lines.append(f"     turn on: {s.rule.turn_on}{_also_needs(engine, s, states)}; turn off: {s.rule.turn_off}")
        lines.append(f"     source: {s.source}")
    return lines


def _default_table(engine: str, box: Box, tp: int, model: models.Model, modes: list[str],
                   logged: list[str] | None) -> str:
    per_mode = {m: paths.states(engine, box.snapshot, tp, model.dtype, workload=decide.workload(model, m),
                                logged=logged) for m in modes}
    rows = []
    for concurrency in models.DEFAULT_CONCURRENCIES:
        size = model.message_bytes(concurrency)
        cells = []
        for m in modes:
            chosen = paths.default_path(per_mode[m], size)
            cells.append(chosen.path.rule.title if chosen.path else "cannot tell")
        rows.append([str(concurrency), format_bytes(size), *cells])
    headers = ["concurrency", "message", *(f"default ({'CUDA graphs' if m == paths.GRAPH else '--enforce-eager'})"
                                           for m in modes)]
    return render.table(headers, rows, right=(0, 1))


def engine_section(engine: str, facts: FactSet, box: Box, tp: int | None, model: models.Model | None,
                   modes: list[str], chain: Any) -> list[str]:
    lines = [f"== {facts.name} {facts.version}" + (f", TP {tp}" if tp else "") + f": {box.said} ==",
             f"facts: {source.provenance_line(facts)}"]
    lines += [f"warning: {w}" for w in facts.warnings]
    if chain is not None:
        lines.append(chain.said(""))
    if tp is None or box.snapshot is None:
        lines.append("dispatch chain, in the order the engine tries each call:")
        for i, rule in enumerate(r for r in paths.RULES if r.engine == engine):
            lines.append(f"  {i + 1}. {rule.title} [{'on by default' if rule.default_on else 'opt-in'}]: "
                         f"turn on: {rule.turn_on}; turn off: {rule.turn_off}")
            lines.append(f"     source: {paths.rule_source(rule, facts)}")
        return lines
    workload = decide.workload(model, modes[0]) if model else paths.Workload(mode=modes[0])
    logged = list(chain.paths) if chain is not None else None
    states = paths.states(engine, box.snapshot, tp, model.dtype if model else "bf16", workload=workload,
                          logged=logged)
    lines.append(f"dispatch chain at TP {tp}, in the order the engine tries each call "
                 f"({'CUDA graphs' if modes[0] == paths.GRAPH else '--enforce-eager'}):")
    lines += _chain_lines(engine, states)
    if model is not None:
        lines.append(f"default path per decode size ({model.describe()}):")
        lines.append(_default_table(engine, box, tp, model, modes, logged))
    return lines


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if args.check:
        return check_main(args.check)
    asked = decide.requested_engines(argparse.Namespace(engine=args.engine, engine_version=None))
    chains = decide.engine_chains(args)
    if args.tp is not None and args.tp <= 0:
        raise UsageError(f"--tp must be a positive number of ranks (got {args.tp})")
    model = workload_model(args)
    box = load_box(args.run)
    tp = args.tp or box.world_size
    modes = [args.mode] if args.mode else [paths.GRAPH, paths.EAGER]
    out: list[str] = []
    for engine, _ in asked:
        if out:
            out.append("")
        out += engine_section(engine, source.active(engine), box, tp, model, modes, chains.get(engine))
        if args.engine_log and engine == engines.SGLANG:
            out.append(f"SGLang {source.active(engine).version} logs no dispatch chain on CUDA: this chain is the "
                       "model's")
    print("\n".join(out))
    sys.stdout.flush()
    return 0
