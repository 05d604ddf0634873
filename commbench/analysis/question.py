"""The decision step floor and recommend share: a typed question (read once from the flags), and
its answer computed from one run: the box (read once), the curves, per engine one record (its
paths and their prices from decide.py, the one configuration for the serving mix from
configure.py, the floor of its default and of that configuration), and the headroom. Both
commands print and write that same per-engine record."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from commbench import models
from commbench.analysis import configure, decide, fastest, fused_headroom, next_steps, render
from commbench.analysis.configure import DECODE, Cell, Configuration, Load
from commbench.analysis.curves import Curve, decode_curves, run_world_size
from commbench.analysis.decide import EngineDecision, EngineSources, Headroom, Price, Saving
from commbench.analysis.fastest import FastestAt
from commbench.engines.registry import BY_KEY
from commbench.errors import UsageError
from commbench.models import Model
from commbench.results import Run
from commbench.runs import load_run
from commbench.topology.box import Box


@dataclass(frozen=True)
class Question:
    run_dir: str
    model: Model
    tp: int | None
    mode: str                          # auto | graph | eager
    loads: tuple[Load, ...]            # the serving mix (--concurrency)
    engines: tuple[tuple[str, str], ...]   # (engine, version) in the order asked
    prefill_tokens: int | None         # None: each engine's default chunk on the run's GPUs
    output_tokens: int                 # the decode steps of a request
    sources: EngineSources             # where each engine's facts and chain come from, its mode

    @property
    def concurrencies(self) -> list[int]:
        return [load.concurrency for load in self.loads]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving mix and prefill chunk flags of floor and recommend."""
    parser.add_argument("--concurrency", metavar="N[:W],...",
                        help="the concurrencies the server runs at, e.g. 1,16,64, or a weighted mix "
                             "1:0.2,16:0.5,64:0.3 (shares of serving time); one configuration is priced over "
                             "all of them (default 1,2,4,...,256, equal shares)")
    parser.add_argument("--prefill-tokens", type=int, metavar="N",
                        help="tokens per prefill chunk: each request's prompt is priced as one chunk of N tokens "
                             "(one allreduce of N x hidden per allreduce point; a prompt of k chunks pays k times the "
                             "cost per chunk shown) (default: the engine's chunked-prefill size on the run's GPUs, "
                             "vLLM max_num_batched_tokens / SGLang chunked_prefill_size)")
    parser.add_argument("--output-tokens", type=int, metavar="N", default=configure.DEFAULT_OUTPUT_TOKENS,
                        help="tokens each request generates: its decode steps, weighed against its prefill chunk "
                             "when the configuration is chosen on the allreduce time per request (default "
                             f"{configure.DEFAULT_OUTPUT_TOKENS}, the output length of vLLM's own serving benchmark)")


def requested_model(args: argparse.Namespace) -> Model | None:
    """The model floor or recommend asks about; None after printing the presets (--list-models),
    each folded to the terminal under its name."""
    model = models.requested(args)
    if model is None:
        width = max(len(key) for key, _ in models.described()) + 2
        print("\n".join(render.prose(part, args.wide, indent=" " * width, first=f"{key:<{width}}" if i == 0
                                      else " " * width)
                        for key, parts in models.described() for i, part in enumerate(parts)))
    return model


def from_args(args: argparse.Namespace, model: Model,
              default_concurrencies: Sequence[int] = models.DEFAULT_CONCURRENCIES) -> Question:
    """The question the flags ask (floor's --step-ms defaults to concurrency 1)."""
    if args.prefill_tokens is not None and args.prefill_tokens <= 0:
        raise UsageError(f"--prefill-tokens must be a positive number of tokens (got {args.prefill_tokens})")
    if args.output_tokens <= 0:
        raise UsageError(f"--output-tokens must be a positive number of tokens (got {args.output_tokens})")
    loads = configure.parse_loads(args.concurrency, list(default_concurrencies))
    sources = decide.engine_sources(args)
    return Question(args.run_dir, model, args.tp, args.mode, loads, sources.asked, args.prefill_tokens,
                    args.output_tokens, sources)


# --- the floor of one price at one concurrency --------------------------------------------------

@dataclass
class FloorRow:
    concurrency: int
    message_bytes: int
    allreduces_per_token: int
    backend: str
    latency_us: float | None          # None: the size is outside the measured range
    floor_ms_per_token: float | None
    max_tokens_per_s: float | None    # all sequences together, if compute were free
    latency_source: str               # measured | interpolated | out of range <lo>-<hi>


def row(model: Model, concurrency: int, latency_us: float | None, backend: str, source: str) -> FloorRow:
    """The floor of one price at one concurrency (latency None: not priced there)."""
    size = model.message_bytes(concurrency)
    n = model.allreduces_per_token
    if latency_us is None:
        return FloorRow(concurrency, size, n, backend, None, None, None, source)
    floor_ms = n * latency_us / 1000.0
    return FloorRow(concurrency, size, n, backend, latency_us, floor_ms, concurrency * 1000.0 / floor_ms, source)


def priced_row(model: Model, concurrency: int, p: Price) -> FloorRow:
    """The floor of an engine path from its price."""
    source = ("interpolated" if p.interpolated else "measured") + (", stand-in" if p.stand_in else "")
    return row(model, concurrency, p.latency_us, p.curve, source)


@dataclass(frozen=True)
class RowPair:
    default: FloorRow
    configured: FloorRow


# --- the per-engine record both commands give ----------------------------------------------------

@dataclass(frozen=True)
class PathRecord:
    """One engine path on the run's box (decide's PathState, as the JSON gives it)."""

    path: str
    title: str
    default_on: bool            # for this model on this box (the engine may turn an opt-in path on)
    available: bool | None
    why: str
    turn_on: str
    source: str
    max_bytes: int | None


@dataclass(frozen=True)
class OptionRecord:
    label: str
    path: str
    available: bool | None
    own: tuple[str, ...]
    stand_ins: tuple[str, ...]
    measured_implementations: dict[str, str]
    launch_adds: tuple[str, ...]      # what its launch line adds to move the decode sizes to its path
    not_offered: str | None           # why no launch line moves a decode size to its path


@dataclass(frozen=True)
class SizeRecord:
    """One decode size: the default's price and every option's, the choice and its saving."""

    concurrency: int
    message_bytes: int
    default_path: str | None
    default_why: str
    default_cost: Price | None
    costs: dict[str, Price | None]
    choice: str | None
    choice_cost: Price | None
    saving: Saving | None
    why_no_saving: str | None


@dataclass(frozen=True)
class EngineRecord:
    """One engine on the run's box: its paths, what each costs at the mix's decode sizes, the one
    configuration for the mix, and the floor of its default and of that configuration per load."""

    engine: str
    version: str
    version_note: str | None
    eager: str                        # the engine's own switch for decode without CUDA graphs
    paths: tuple[PathRecord, ...]
    options: tuple[OptionRecord, ...]
    sizes: tuple[SizeRecord, ...]
    configuration: Configuration
    losses: tuple[Cell, ...]          # the configuration's cells where it is slower than the default
    floors: tuple[RowPair, ...]       # per load: the default's floor and the configuration's

    @property
    def name(self) -> str:
        return f"{BY_KEY[self.engine].name} {self.version}"


def floors(model: Model, c: Configuration) -> tuple[RowPair, ...]:
    """Per load of the mix: the floor of the engine's default and of the one configuration."""
    if c.weighted_saving_ms is None:
        return ()
    return tuple(RowPair(row(model, cell.tokens, cell.default_us, cell.default_curve or "-", cell.default_how),
                         row(model, cell.tokens, cell.chosen_us, cell.chosen_curve or "-", cell.chosen_how))
                 for cell in c.cells if cell.phase == DECODE)


def record(d: EngineDecision, c: Configuration, model: Model) -> EngineRecord:
    return EngineRecord(
        d.key, d.version, decide.version_note(d), d.engine.words.eager,
        tuple(PathRecord(s.path, s.rule.title, s.default_on, s.available, s.why, s.rule.turn_on, s.source,
                         s.max_bytes) for s in d.states),
        tuple(OptionRecord(o.label, o.state.path, o.state.available, tuple(c.label for c in o.own),
                           tuple(c.label for c in o.stand_ins), o.implementations,
                           tuple(s.text() for s in o.move.added), o.move.why_not or None) for o in d.options),
        tuple(SizeRecord(s.concurrency, s.message_bytes, s.default.path.path if s.default.path else None,
                         s.default.why, s.default_price, {o.label: p for o, p in zip(d.options, s.prices)},
                         s.best.label if s.best else None, s.best_price, s.saving, s.why_no_saving or None)
              for s in d.sizes),
        c, c.losses, floors(model, c))


# --- the answer ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    engines: tuple[tuple[str, str], ...]
    sources: EngineSources
    run: Run
    curves: list[Curve]
    tp: int | None
    tag: str                            # the data's kind in a few words
    box: Box
    box_hint: str | None                # an import without a probe snapshot: the one command that prices the rest
    decisions: list[EngineDecision]
    records: tuple[EngineRecord, ...]   # one per engine, in decisions' order
    headroom: list[Headroom]
    facts: tuple[str, ...]              # where each engine's facts and chain come from: the first lines
    fastest: tuple[FastestAt, ...]      # per size, the fastest kernel measured: what headroom is set against
    # per size where an engine's default is a fused kernel: the fastest stand-in for it (fused_headroom.py)
    fused_headroom: tuple[Headroom, ...] = ()

    @property
    def configurations(self) -> list[Configuration]:
        return [r.configuration for r in self.records]


def box_hint(run: Run, box: Box) -> str | None:
    """For an nccl-tests import without a probe snapshot: what only NCCL can price, and the one
    command (after the probe on that box) that prices the rest."""
    if box.fabric_known or not decide.imported(run):
        return None
    first = next((t for t in run.info.imports or [] if isinstance(t, dict) and isinstance(t.get("file"), str)), {})
    flags = []   # the first log again, as it was imported (one log records the box for the whole run)
    if first.get("average_from") == "--average" and isinstance(first.get("average"), int):
        flags += ["--average", str(first["average"])]
    setting = first.get("env_setting")
    if isinstance(setting, dict):
        flags += [w for k, v in sorted(setting.items()) if isinstance(v, str) for w in ("--setting", f"{k}={v}")]
    command = next_steps.import_command([first.get("file", "LOG"), *flags], "probe.json", str(run.path))
    return (f"this nccl-tests import has no probe snapshot: only NCCL's own path is priced. On that box "
            f"{next_steps.inline(next_steps.probe_command(json_file='probe.json'))}, then "
            f"{next_steps.inline(command)} prices each engine's paths")


def answer(q: Question) -> Answer:
    run = load_run(q.run_dir)
    curves = decode_curves(run, q.tp, q.model.dtype, q.mode, q.model)
    tp = q.tp or run_world_size(run)
    box = decide.box_of(run, tp or 0)
    w = decide.workload(q.model, q.mode, q.sources.deterministic)
    decisions = [decide.decide(BY_KEY[key], q.sources.facts[key], run, box, curves, q.model, q.concurrencies, w,
                               version, q.sources.chains.get(key)) for key, version in q.engines]
    records = []
    for d in decisions:
        tokens, said = ((q.prefill_tokens, "--prefill-tokens") if q.prefill_tokens
                        else d.engine.prefill(box, d.facts))
        c = configure.configure(d, q.model, configure.Mix(q.loads, tokens, said, q.output_tokens), tp)
        records.append(record(d, c, q.model))
    return Answer(q.engines, q.sources, run, curves, tp, decide.data_tag(run), box, box_hint(run, box), decisions,
                  tuple(records), decide.headroom(q.model, run, curves, decisions, q.concurrencies),
                  tuple(decide.source_lines(list(q.engines), q.sources)),
                  fastest.fastest_by_size(run, curves, q.model, q.concurrencies, decisions),
                  tuple(fused_headroom.headroom(q.model, run, curves, decisions, q.concurrencies)))

