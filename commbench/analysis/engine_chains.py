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
from dataclasses import dataclass
from typing import Any, Sequence

from commbench import engines
from commbench import models
from commbench.analysis import decide, render, results_out
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
    parser.add_argument("--json", metavar="FILE", help="also write the chains (or the --check) as JSON ('-' for "
                                                       "stdout: JSON alone)")
    results_out.add_arguments(parser)


@dataclass(frozen=True)
class FactsChecked:
    """One engine's facts found under --check's PATH against the built-in ones."""

    engine: str
    name: str
    version: str
    built_in: str                     # the built-in facts' engine and version
    compared: int                     # facts read from the source
    differences: tuple[str, ...]      # one line per fact that differs
    same: tuple[str, ...]             # "key (file:line)" per fact that agrees


@dataclass(frozen=True)
class CheckResult:
    """What `engines --check` answers; its JSON is dataclasses.asdict of this (docs/results.md)."""

    site: str
    engines: tuple[FactsChecked, ...]
    differ: int


def check(site: str) -> CheckResult:
    results, refusal = source.check(Path(site))
    if refusal:
        raise UsageError(f"--check: {refusal}")
    checked = []
    for facts, differences in results:
        built_in = source.BUILT_IN[facts.engine]
        differ = {d.fact.key for d in differences}
        checked.append(FactsChecked(facts.engine, facts.name, facts.version, f"{built_in.name} {built_in.version}",
                                    len(facts.facts), tuple(d.line() for d in differences),
                                    tuple(f"{fact.key} ({fact.where()})" for fact in facts.facts
                                          if fact.key not in differ)))
    return CheckResult(site, tuple(checked), sum(len(c.differences) for c in checked))


def check_text(result: CheckResult) -> list[str]:
    out = []
    for c in result.engines:
        out.append(f"{c.name} {c.version} at {result.site}: {c.compared} facts compared with "
                   f"the built-in {c.built_in} facts; {len(c.differences)} differ")
        out += [f"  {line}" for line in c.differences]
        out += [f"  same: {line}" for line in c.same]
    return out


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


def _also_needs(engine: str, state: paths.PathState, states: list[paths.PathState]) -> tuple[str, ...]:
    """What a launch must add for this path to take the decode allreduces (launch_settings): a
    default-on path ahead of it that would intercept them turned off."""
    if state.available is False:
        return ()
    needed = paths.launch_settings(engines.Settings(state.path), engine, state.path, states)
    return tuple(needed.vllm_flags if engine == engines.VLLM else needed.sglang_flags)


@dataclass(frozen=True)
class ChainPath:
    """One path of an engine's dispatch chain; with no box, the rule alone (status, why and the
    size limit None)."""

    title: str
    default_on: bool
    status: str | None               # on | opt-in | off | cannot tell here, on the box
    why: str | None
    max_bytes: int | None            # the largest message it takes here, where it runs
    inclusive: bool
    turn_on: str
    also_needs: tuple[str, ...]      # the flags a launch adds for it to take the decode allreduces
    turn_off: str
    source: str


@dataclass(frozen=True)
class DefaultAt:
    concurrency: int
    message_bytes: int
    paths: tuple[str, ...]           # per mode of EngineChain.modes: the default path's title, or "cannot tell"


@dataclass(frozen=True)
class EngineChain:
    """One engine: where its facts come from, its chain on the box (or its rules), the defaults."""

    engine: str
    name: str
    version: str
    facts: str                       # where the facts come from
    warnings: tuple[str, ...]
    logged: str | None               # what --engine-log says the engine set up
    mode: str | None                 # the chain is the box's under this mode; None: the rules, no box's gates
    chain: tuple[ChainPath, ...]
    modes: tuple[str, ...]           # the modes of `defaults`
    defaults: tuple[DefaultAt, ...]  # with a model: the default path per decode size
    note: str | None


@dataclass(frozen=True)
class EnginesResult:
    """What `engines` answers; its JSON is dataclasses.asdict of this (docs/results.md), and its
    text is drawn from it alone."""

    box: str
    tp: int | None
    model: models.Model | None
    engines: tuple[EngineChain, ...]


def _chain(engine: str, states: list[paths.PathState]) -> tuple[ChainPath, ...]:
    return tuple(ChainPath(s.rule.title, s.default_on, paths.status(s), s.why,
                           s.max_bytes if s.available is not False else None, s.inclusive, s.rule.turn_on,
                           _also_needs(engine, s, states), s.rule.turn_off, s.source) for s in states)


def _rules(engine: str, facts: FactSet) -> tuple[ChainPath, ...]:
    return tuple(ChainPath(rule.title, rule.default_on, None, None, None, False, rule.turn_on, (), rule.turn_off,
                           paths.rule_source(rule, facts)) for rule in paths.RULES if rule.engine == engine)


def _defaults(engine: str, box: Box, tp: int, model: models.Model, modes: list[str],
              logged: list[str] | None) -> tuple[DefaultAt, ...]:
    per_mode = [paths.states(engine, box.snapshot, tp, model.dtype, workload=decide.workload(model, m),
                             logged=logged) for m in modes]
    rows = []
    for concurrency in models.DEFAULT_CONCURRENCIES:
        size = model.message_bytes(concurrency)
        chosen = [paths.default_path(states, size) for states in per_mode]
        rows.append(DefaultAt(concurrency, size, tuple(c.path.rule.title if c.path else "cannot tell"
                                                       for c in chosen)))
    return tuple(rows)


def engine_chain(engine: str, facts: FactSet, box: Box, tp: int | None, model: models.Model | None,
                 modes: list[str], chain: Any, note: str | None) -> EngineChain:
    said = chain.said("") if chain is not None else None
    if tp is None or box.snapshot is None:
        return EngineChain(engine, facts.name, facts.version, source.provenance_line(facts), tuple(facts.warnings),
                           said, None, _rules(engine, facts), (), (), note)
    workload = decide.workload(model, modes[0]) if model else paths.Workload(mode=modes[0])
    logged = list(chain.paths) if chain is not None else None
    states = paths.states(engine, box.snapshot, tp, model.dtype if model else "bf16", workload=workload,
                          logged=logged)
    defaults = _defaults(engine, box, tp, model, modes, logged) if model is not None else ()
    return EngineChain(engine, facts.name, facts.version, source.provenance_line(facts), tuple(facts.warnings), said,
                       modes[0], _chain(engine, states), tuple(modes) if model is not None else (), defaults, note)


def _mode_text(mode: str) -> str:
    return "CUDA graphs" if mode == paths.GRAPH else "--enforce-eager"


def _path_lines(i: int, p: ChainPath) -> list[str]:
    on = "on by default" if p.default_on else "opt-in"
    if p.status is None:
        return [f"  {i}. {p.title} [{on}]: turn on: {p.turn_on}; turn off: {p.turn_off}", f"     source: {p.source}"]
    limit = ("" if p.max_bytes is None else
             f"; takes up to {format_bytes(p.max_bytes)}" + (" inclusive" if p.inclusive else " (exclusive)"))
    also = f"; with it: {' '.join(shlex.quote(f) for f in p.also_needs)}" if p.also_needs else ""
    return [f"  {i}. {p.title} [{on}]: {p.status}: {p.why}{limit}",
            f"     turn on: {p.turn_on}{also}; turn off: {p.turn_off}", f"     source: {p.source}"]


def engine_lines(e: EngineChain, result: EnginesResult) -> list[str]:
    tp = f", TP {result.tp}" if result.tp else ""
    lines = [f"== {e.name} {e.version}{tp}: {result.box} ==", f"facts: {e.facts}"]
    lines += [f"warning: {w}" for w in e.warnings]
    if e.logged is not None:
        lines.append(e.logged)
    if e.mode is None:
        lines.append("dispatch chain, in the order the engine tries each call:")
    else:
        lines.append(f"dispatch chain at TP {result.tp}, in the order the engine tries each call "
                     f"({_mode_text(e.mode)}):")
    for i, p in enumerate(e.chain, 1):
        lines += _path_lines(i, p)
    if e.defaults and result.model is not None:
        lines.append(f"default path per decode size ({result.model.describe()}):")
        lines.append(render.table(["concurrency", "message", *(f"default ({_mode_text(m)})" for m in e.modes)],
                                  [[str(d.concurrency), format_bytes(d.message_bytes), *d.paths] for d in e.defaults],
                                  right=(0, 1)))
    if e.note:
        lines.append(e.note)
    return lines


def text(result: EnginesResult) -> str:
    out: list[str] = []
    for e in result.engines:
        if out:
            out.append("")
        out += engine_lines(e, result)
    return "\n".join(out)


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    results_out.check_targets(args)
    if args.check:
        checked = check(args.check)
        print("\n".join(check_text(checked)))
        sys.stdout.flush()
        results_out.write(args, checked, f"engines --check {args.check}")
        return DIFFERENT_EXIT if checked.differ else 0
    result = compute(args)
    print(text(result))
    sys.stdout.flush()
    results_out.write(args, result, f"engines {result.box}")
    return 0


def compute(args: argparse.Namespace) -> EnginesResult:
    asked = decide.requested_engines(argparse.Namespace(engine=args.engine, engine_version=None))
    chains = decide.engine_chains(args)
    if args.tp is not None and args.tp <= 0:
        raise UsageError(f"--tp must be a positive number of ranks (got {args.tp})")
    model = workload_model(args)
    box = load_box(args.run)
    tp = args.tp or box.world_size
    modes = [args.mode] if args.mode else [paths.GRAPH, paths.EAGER]
    sections = []
    for engine, _ in asked:
        facts = source.active(engine)
        note = (f"SGLang {facts.version} logs no dispatch chain on CUDA: this chain is the model's"
                if args.engine_log and engine == engines.SGLANG else None)
        sections.append(engine_chain(engine, facts, box, tp, model, modes, chains.get(engine), note))
    return EnginesResult(box.said, tp, model, tuple(sections))
