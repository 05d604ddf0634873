"""`commbench engines`: per engine, its allreduce dispatch chain in order for a box (a run's probe
snapshot, or a snapshot file), each path's gate with the reason and its size limit, the default
path at every decode size of a model under CUDA graphs and without them (in each engine's own
words: vLLM --enforce-eager, SGLang --disable-decode-cuda-graph), how to turn each path on or off
and what a launch line adds for it to take the decode sizes, and where each rule comes from.
`--check PATH` compares every built-in engine fact, gate and the dispatch order with an engine's
released source (an unpacked wheel or a site-packages folder) instead, and the facts of the
libraries the engines call (registry.LIBRARIES) found there.
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
from commbench.engines import check as engine_check
from commbench.engines import paths, source
from commbench.engines.facts import Difference, FactSet
from commbench.engines.paths import Engine
from commbench.engines.registry import BY_KEY
from commbench.errors import UsageError
from commbench.files import read_text
from commbench.runs import load_run
from commbench.topology import box as boxes
from commbench.topology.box import Box
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
                        help="only this mode's defaults (default: both: CUDA graphs and each engine's eager switch, "
                             + ", ".join(f"{e.name} {e.words.eager}" for e in BY_KEY.values()) + ")")
    parser.add_argument("--model", help="a preset (see `commbench floor --list-models`): default path per decode size")
    parser.add_argument("--arch", metavar="NAME",
                        help="the model's architecture (config.json architectures[0]) where no preset names it")
    parser.add_argument("--hidden", type=int, help="the model's hidden size where no preset gives it")
    parser.add_argument("--dtype", default=None, help="activation dtype: bf16 (default), fp16, fp32")
    decide.add_engine_source_arguments(parser)
    parser.add_argument("--check", metavar="PATH",
                        help="compare every built-in engine fact, gate and the dispatch order with the source under "
                             "PATH (an unpacked wheel or site-packages; the gates are the engine's own functions, "
                             "imported in a child process), and the facts of a library the engines call found there "
                             "(FlashInfer: its kernel names among them); exit 1 when any differ")
    parser.add_argument("--json", metavar="FILE", help="also write the chains (or the --check) as JSON ('-' for "
                                                       "stdout: JSON alone)")
    results_out.add_arguments(parser)
    render.add_arguments(parser)


@dataclass(frozen=True)
class GateRecord:
    """One gate (or the dispatch order) of the engine against its own function."""

    key: str
    function: str
    where: str                        # file:line of the engine's function
    compared: int                     # points of the grid
    differ: int
    differences: tuple[str, ...]      # the first few points that differ


@dataclass(frozen=True)
class FactsChecked:
    """One engine's (or library's) facts, gates and order found under --check's PATH against the
    built-in ones; a library has no gates."""

    engine: str                       # the package: an engine's key, or a library's
    name: str
    version: str
    built_in: str                     # the built-in facts' engine and version
    compared: int                     # facts read from the source
    differences: tuple[str, ...]      # one line per fact that differs
    same: tuple[str, ...]             # "key (file:line)" per fact that agrees
    gates: tuple[GateRecord, ...]


@dataclass(frozen=True)
class CheckResult:
    """What `engines --check` answers; its JSON is dataclasses.asdict of this (docs/results.md)."""

    site: str
    engines: tuple[FactsChecked, ...]
    libraries: tuple[FactsChecked, ...]   # the libraries the engines call (FlashInfer): facts only
    differ: int                       # facts and gates that differ


def _facts_checked(key: str, built_in: FactSet, facts: FactSet, differences: list[Difference],
                   gates: tuple[GateRecord, ...] = ()) -> FactsChecked:
    differ = {d.fact.key for d in differences}
    return FactsChecked(key, facts.name, facts.version, f"{built_in.name} {built_in.version}", len(facts.facts),
                        tuple(d.line() for d in differences),
                        tuple(f"{fact.key} ({fact.where()})" for fact in facts.facts if fact.key not in differ), gates)


def check(site: str) -> CheckResult:
    engine_checks, library_checks, refusal = engine_check.check(Path(site))
    if refusal:
        raise UsageError(f"--check: {refusal}")
    checked = tuple(_facts_checked(c.engine.key, c.engine.facts, c.facts, c.differences,
                                   tuple(GateRecord(g.key, g.function, g.where, g.compared, g.differ, g.differences)
                                         for g in c.gates))
                    for c in engine_checks)
    libraries = tuple(_facts_checked(c.library.key, c.library.facts, c.facts, c.differences) for c in library_checks)
    return CheckResult(site, checked, libraries, sum(len(c.differences) + sum(1 for g in c.gates if g.differ)
                                                     for c in checked + libraries))


def check_text(result: CheckResult, wide: bool = False) -> list[str]:
    def item(text: str, depth: int = 1) -> str:
        return render.prose(text, wide, indent="  " * depth + "  ", first="  " * depth)

    out = []
    for c, library in [(c, False) for c in result.engines] + [(c, True) for c in result.libraries]:
        head = (f"{c.name} {c.version} at {result.site}: {c.compared} facts compared with the built-in {c.built_in} "
                f"facts, {len(c.differences)} differ")
        if library:
            out.append(render.prose(f"{head}; a library the engines call: no gate functions or dispatch order of "
                                    "its own to run", wide))
        else:
            out.append(render.prose(f"{head}; {len(c.gates)} gate functions (its dispatch order among them) run as "
                                    f"the engine's own over {sum(g.compared for g in c.gates)} points, "
                                    f"{sum(1 for g in c.gates if g.differ)} differ", wide))
        out += [item(line) for line in c.differences]
        for g in c.gates:
            if g.differ and not g.compared:
                out.append(item(f"gate {g.key}: {g.function} ({g.where}): {g.differences[0]}"))
            elif g.differ:
                out.append(item(f"gate {g.key}: {g.function} ({g.where}) differs at {g.differ} of {g.compared} points:"))
                out += [item(line, 2) for line in g.differences]
        out += [item(f"same: {line}") for line in c.same]
        out += [item(f"same: gate {g.key}: {g.function} ({g.where}), {g.compared} points") for g in c.gates
                if not g.differ]
    return out


@dataclass(frozen=True)
class Shown:
    """What the chains are shown for: the box (None: no box given), its world size and the words
    that name it."""

    box: Box | None
    world_size: int | None
    said: str


def load_box(path: str | None, tp: int | None) -> Shown:
    if path is None:
        return Shown(None, None, "no box given: the gates that read a box are not applied")
    target = Path(path)
    if target.is_dir():
        run = load_run(target)
        world = tp or run_world_size(run)
        return Shown(decide.box_of(run, world or 0), world, f"run {target.name} ({decide.data_tag(run)})")
    try:
        data = json.loads(read_text(target, "snapshot"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("snapshot"), dict):
        data = data["snapshot"]
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list) or not data["gpus"]:
        raise UsageError(f"{path}: not a probe snapshot (no \"gpus\" list)")
    # a probe snapshot's world_size is how the probe ran (often one process): TP defaults to its GPUs
    world = tp or len(data["gpus"])
    return Shown(boxes.read(data, world), world, f"snapshot {target.name}")


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


def _also_needs(engine: Engine, state: paths.PathState, states: list[paths.PathState], sizes: list[int]
                ) -> tuple[tuple[str, ...], str | None]:
    """What a launch line adds for this path to take the decode sizes (paths.move): each path ahead
    of it that would take them, turned off; or why no line moves them there."""
    if state.available is False or (state.rule.on is None and state.rule.off is None):
        return (), None
    launch = paths.Launch().plus(state.rule.on) if state.rule.on is not None else paths.Launch()
    moved = paths.move(states, state.path, launch, sizes)
    if moved.why_not:
        return (), moved.why_not
    return tuple(word for switch in moved.added for word in switch.words()), None


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
    also_needs: tuple[str, ...]      # what a launch line adds for it to take the decode allreduces
    no_line: str | None              # why no launch line moves the decode allreduces to it here
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
    modes: tuple[str, ...]           # the modes of `defaults`, in the engine's own words
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


def _chain(engine: Engine, states: list[paths.PathState], sizes: list[int]) -> tuple[ChainPath, ...]:
    out = []
    for s in states:
        needs, no_line = _also_needs(engine, s, states, sizes)
        out.append(ChainPath(s.rule.title, s.default_on, paths.status(s), s.why,
                             s.max_bytes if s.available is not False else None, s.inclusive, s.rule.turn_on, needs,
                             no_line, s.rule.turn_off, s.source))
    return tuple(out)


def _rules(engine: Engine, facts: FactSet) -> tuple[ChainPath, ...]:
    return tuple(ChainPath(rule.title, rule.default_on, None, None, None, False, rule.turn_on, (), None,
                           rule.turn_off, paths.rule_source(rule, facts)) for rule in engine.rules)


def mode_words(engine: Engine, mode: str) -> str:
    """A timing mode as the engine names it."""
    return "CUDA graphs" if mode == paths.GRAPH else engine.words.eager


def _defaults(engine: Engine, facts: FactSet, box: Box, model: models.Model, modes: list[str], deterministic: bool,
              logged: tuple[str, ...] | None) -> tuple[DefaultAt, ...]:
    per_mode = [paths.states(engine, box, decide.workload(model, m, deterministic), facts, logged) for m in modes]
    rows = []
    for concurrency in models.DEFAULT_CONCURRENCIES:
        size = model.message_bytes(concurrency)
        chosen = [paths.default_path(states, size) for states in per_mode]
        rows.append(DefaultAt(concurrency, size, tuple(c.path.rule.title if c.path else "cannot tell"
                                                       for c in chosen)))
    return tuple(rows)


def engine_chain(engine: Engine, facts: FactSet, shown: Shown, model: models.Model | None, modes: list[str],
                 deterministic: bool, chain: Any, note: str | None) -> EngineChain:
    said = chain.said("") if chain is not None else None
    if shown.box is None:
        return EngineChain(engine.key, facts.name, facts.version, source.provenance_line(facts), tuple(facts.warnings),
                           said, None, _rules(engine, facts), (), (), note)
    logged = chain.paths if chain is not None else None
    states = paths.states(engine, shown.box, decide.workload(model, modes[0], deterministic), facts, logged)
    defaults = _defaults(engine, facts, shown.box, model, modes, deterministic, logged) if model is not None else ()
    return EngineChain(engine.key, facts.name, facts.version, source.provenance_line(facts), tuple(facts.warnings),
                       said, mode_words(engine, modes[0]), _chain(engine, states, decide.decode_sizes(model)),
                       tuple(mode_words(engine, m) for m in modes) if model is not None else (), defaults, note)


def _path_lines(i: int, p: ChainPath, wide: bool) -> list[str]:
    """One path of the chain: what it is and does here, how to turn it on and off, where its rule
    comes from; each part wrapped to the width, a launch setting never split (between backticks)."""
    def part(text: str, first: str = "     ") -> str:
        return render.prose(text, wide, indent="       ", first=first)

    on = "on by default" if p.default_on else "opt-in"
    if p.status is None:
        return [part(f"{p.title} [{on}]: turn on: {p.turn_on}; turn off: {p.turn_off}", f"  {i}. "),
                part(f"source: {p.source}")]
    limit = ("" if p.max_bytes is None else
             f"; takes up to {format_bytes(p.max_bytes)}" + (" inclusive" if p.inclusive else " (exclusive)"))
    also = (f"; with it: {' '.join(f'`{shlex.quote(f)}`' for f in p.also_needs)}" if p.also_needs else
            f"; no launch line moves decode here: {p.no_line}" if p.no_line else "")
    return [part(f"{p.title} [{on}]: {p.status}: {p.why}{limit}", f"  {i}. "),
            part(f"turn on: {p.turn_on}{also}; turn off: {p.turn_off}"), part(f"source: {p.source}")]


def engine_lines(e: EngineChain, result: EnginesResult, wide: bool = False) -> list[str]:
    tp = f", TP {result.tp}" if result.tp else ""
    lines = [render.prose(f"== {e.name} {e.version}{tp}: {result.box} ==", wide),
             render.prose(f"facts: {e.facts}", wide)]
    lines += [render.prose(f"warning: {w}", wide) for w in e.warnings]
    if e.logged is not None:
        lines.append(render.prose(e.logged, wide))
    if e.mode is None:
        lines.append("dispatch chain, in the order the engine tries each call:")
    else:
        lines.append(render.prose(f"dispatch chain at TP {result.tp}, in the order the engine tries each call "
                                  f"({e.mode}):", wide))
    for i, p in enumerate(e.chain, 1):
        lines += _path_lines(i, p, wide)
    if e.defaults and result.model is not None:
        lines.append(render.prose(f"default path per decode size ({result.model.describe()}):", wide))
        lines.append(render.table(["concurrency", "message", *(f"default ({m})" for m in e.modes)],
                                  [[str(d.concurrency), format_bytes(d.message_bytes), *d.paths] for d in e.defaults],
                                  right=(0, 1), wide=wide))
    if e.note:
        lines.append(render.prose(e.note, wide))
    return lines


def text(result: EnginesResult, wide: bool = False) -> str:
    out: list[str] = []
    for e in result.engines:
        if out:
            out.append("")
        out += engine_lines(e, result, wide)
    return "\n".join(out)


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    results_out.check_targets(args)
    if args.check == "":   # an empty PATH names no tree: not the chains shown as if --check were absent
        raise UsageError("--check: an empty path; give the folder of an unpacked wheel or a site-packages")
    if args.check is not None:
        checked = check(args.check)
        print("\n".join(check_text(checked, args.wide)))
        sys.stdout.flush()
        results_out.write(args, checked, f"engines --check {args.check}")
        return DIFFERENT_EXIT if checked.differ else 0
    result = compute(args)
    print(text(result, args.wide))
    sys.stdout.flush()
    results_out.write(args, result, f"engines {result.box}")
    return 0


def compute(args: argparse.Namespace) -> EnginesResult:
    found = decide.engine_sources(args)
    if args.tp is not None and args.tp <= 0:
        raise UsageError(f"--tp must be a positive number of ranks (got {args.tp})")
    model = workload_model(args)
    shown = load_box(args.run, args.tp)
    modes = [args.mode] if args.mode else [paths.GRAPH, paths.EAGER]
    sections = []
    for key, _ in found.asked:
        engine, facts = BY_KEY[key], found.facts[key]
        notes = [f"{facts.name} {facts.version} logs no dispatch chain: this chain is the model's"
                 if args.engine_log and not engine.log_line else "",
                 f"the server runs {facts.name}'s deterministic mode ({engine.words.deterministic}): the paths it "
                 "turns off are off above" if found.deterministic else ""]
        note = "; ".join(n for n in notes if n) or None
        sections.append(engine_chain(engine, facts, shown, model, modes, found.deterministic, found.chains.get(key),
                                     note))
    return EnginesResult(shown.said, shown.world_size, model, tuple(sections))
