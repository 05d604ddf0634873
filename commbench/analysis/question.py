"""The decision step floor and recommend share: a typed question (read once from the flags), and
its answer computed from one run: the curves, per engine the paths and their prices
(decide.py), the one configuration for the serving mix (configure.py) and the headroom."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from commbench import models
from commbench.analysis import configure, decide
from commbench.analysis.configure import Configuration, Load
from commbench.analysis.curves import Curve, decode_curves, run_world_size
from commbench.analysis.decide import EngineDecision, Headroom
from commbench.models import Model
from commbench.engines.log import Chain
from commbench.errors import UsageError
from commbench.results import Run
from commbench.runs import load_run


@dataclass(frozen=True)
class Question:
    run_dir: str
    model: Model
    tp: int | None
    mode: str                          # auto | graph | eager
    loads: tuple[Load, ...]            # the serving mix (--concurrency)
    engines: tuple[tuple[str, str], ...]   # (engine, version) in the order asked
    prefill_tokens: int | None         # None: each engine's default chunk on the run's GPUs
    chains: tuple[tuple[str, Chain], ...] = ()   # engine -> the all-reduce chain its start-up log set up
    engine_log: str | None = None      # the start-up log the chains were read from

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
                        help="tokens per prefill chunk, priced beside the decode sizes (default: the engine's "
                             "chunked-prefill size on the run's GPUs, vLLM max_num_batched_tokens / SGLang "
                             "chunked_prefill_size)")


def from_args(args: argparse.Namespace, model: Model,
              default_concurrencies: Sequence[int] = models.DEFAULT_CONCURRENCIES) -> Question:
    """The question the flags ask (floor's --step-ms defaults to concurrency 1)."""
    if args.prefill_tokens is not None and args.prefill_tokens <= 0:
        raise UsageError(f"--prefill-tokens must be a positive number of tokens (got {args.prefill_tokens})")
    loads = configure.parse_loads(args.concurrency, list(default_concurrencies))
    engines = tuple(decide.requested_engines(args))
    return Question(args.run_dir, model, args.tp, args.mode, loads, engines, args.prefill_tokens,
                    tuple(decide.engine_chains(args).items()), args.engine_log)


@dataclass(frozen=True)
class Answer:
    engines: tuple[tuple[str, str], ...]
    chains: dict[str, Chain]
    run: Run
    curves: list[Curve]
    tp: int | None
    tag: str                            # the data's kind in a few words
    decisions: list[EngineDecision]
    configurations: list[Configuration]  # one per engine, in decisions' order
    headroom: list[Headroom]


def fact_sources(found: Answer, q: Question) -> tuple[str, ...]:
    """Where each engine's facts and chain come from: the first lines of floor and recommend."""
    return tuple(decide.source_lines(list(found.engines), found.chains, q.engine_log))


def answer(q: Question) -> Answer:
    run = load_run(q.run_dir)
    curves = decode_curves(run, q.tp, q.model.dtype, q.mode, q.model)
    tp = q.tp or run_world_size(run)
    tag = decide.data_tag(run)
    chains = dict(q.chains)
    decisions = [decide.decide(engine, run, curves, q.model, q.concurrencies, tp or 0, version, q.mode,
                               chains.get(engine)) for engine, version in q.engines]
    snapshot = decide.box_snapshot(run)
    configurations = []
    for d in decisions:
        tokens, source = ((q.prefill_tokens, "--prefill-tokens") if q.prefill_tokens
                          else configure.default_prefill_tokens(d.engine, snapshot))
        configurations.append(configure.configure(d, q.model, q.loads, tokens, source, tp))
    return Answer(q.engines, chains, run, curves, tp, tag, decisions, configurations,
                  decide.headroom(q.model, run, curves, decisions, q.concurrencies))
