"""Per engine: the paths it can take on the run's box, what each costs at a model's decode sizes,
its default, the fastest path it can take, and the saving, only where both were measured.

A path is priced by the rows of the backends that declare it (run.json backend_facts ->
engines.Settings.engine_paths): the engine's own kernels first, a declared stand-in only where
no own kernel was measured, and always named as one. An option is offered with the launch line
that moves the decode sizes to its path in the engine's dispatch order (engines.paths.move): a
size is priced by whichever path takes it under that line. Backends that price no path an
engine can take here are headroom, never a setting. Shared by recommend and floor.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, TypeGuard

from commbench import engines
from commbench.analysis import provenance
from commbench.analysis.curves import INTERPOLATED, Candidate, Curve, CurvePrice, Point, exceeds_spread, ranking
from commbench.engines import log as engine_log
from commbench.engines import paths as engine_paths
from commbench.engines import source
from commbench.engines.facts import FactSet
from commbench.engines.paths import ALLREDUCE, Engine, Launch, Move, PathState
from commbench.engines.registry import BY_KEY, KEYS, NAMES
from commbench.errors import UsageError
from commbench.models import DEFAULT_CONCURRENCIES, Model
from commbench.results import OK, Measurement, Run
from commbench.results.text import capped
from commbench.topology import box as boxes
from commbench.topology.box import Box


def imported(run: Run) -> bool:
    return provenance.of(run).kind == provenance.IMPORTED


def recorded_settings(run: Run, curve: Curve) -> engines.Settings | None:
    """What the backend declared in this run (run.json backend_facts), under the curve's process env.
    An nccl-tests import declares none: its rows are NCCL's own kernels, the path every engine
    falls back to (PyNccl)."""
    entry = (run.info.backend_facts or {}).get(curve.backend)
    declared = entry.get("engine_settings") if isinstance(entry, dict) else None
    if not isinstance(declared, dict) and imported(run):
        return engines.nccl_path(curve.backend).with_process_env(curve.env_setting)
    if not isinstance(declared, dict):
        return None
    try:
        settings = engines.Settings.from_dict(declared)
    except TypeError:
        return None
    return engines.upgraded(settings).with_process_env(curve.env_setting)


def box_of(run: Run, world_size: int) -> Box:
    """The run's box, read once: its probe snapshot (a sweep's, or an import's --snapshot), the NCCL
    the run recorded filling in one the probe did not; an nccl-tests import without a snapshot is
    its log's GPUs and nodes, the fabric unknown."""
    nccl = (run.info.versions or {}).get("nccl")
    nccl = nccl if isinstance(nccl, str) else None
    if run.info.snapshot is None and imported(run):
        return boxes.imported(world_size, run.info.nodes if isinstance(run.info.nodes, int) else None, nccl)
    return boxes.read(run.info.snapshot, world_size, nccl=nccl)


@dataclass(frozen=True)
class Price:
    """A path's price at one size: curves.price() of the curve that priced it (measured or
    interpolated, never out of range), whether that curve is a declared stand-in, its mode."""

    price: CurvePrice
    stand_in: bool
    mode: str

    @classmethod
    def of(cls, candidate: Candidate, stand_in: bool = False) -> Price:
        return cls(candidate.price, stand_in, candidate.curve.key.mode)

    @property
    def point(self) -> Point:
        return self.price.point  # type: ignore[return-value]   # built from a ranking: always covered

    @property
    def latency_us(self) -> float:
        return self.point.latency_us

    @property
    def curve(self) -> str:
        """The curve label that priced it."""
        return self.price.curve

    @property
    def interpolated(self) -> bool:
        return self.price.how == INTERPOLATED


@dataclass
class Option:
    """One distinct setting of one path of one engine, with the measured variants that price it and
    the launch line that moves the decode sizes to its path (`move`)."""

    engine: str
    state: PathState
    settings: engines.Settings
    move: Move = field(default_factory=lambda: Move(Launch(), (), ()))
    own: list[Curve] = field(default_factory=list)
    stand_ins: list[Curve] = field(default_factory=list)
    implementations: dict[str, str] = field(default_factory=dict)   # curve label -> what its rows say ran

    @property
    def variants(self) -> list[str]:
        return [c.label for c in self.own + self.stand_ins]

    @property
    def plain(self) -> bool:
        """The path as the engine runs it: no process-wide knobs (NCCL_* left alone) and the
        engine's own NCCL, no other library loaded in its place."""
        return not self.settings.nccl_env and not self.settings.preload

    @property
    def offered(self) -> bool:
        """A launch line moves some decode size to its path (else `move.why_not` says why not)."""
        return not self.move.why_not

    @property
    def label(self) -> str:
        preload = self.settings.preload
        # run.json is untrusted: never echo what is refused
        if engines.env_refusal(self.settings.nccl_env) or (preload and not engines.preload_shown(preload)):
            return f"{self.state.rule.title} [settings refused]"
        engine_env = getattr(self.settings, f"{self.engine}_env")
        chosen = {k: v for k, v in engine_env.items() if k in engines.VARIANT_VARS}
        knobs = " ".join(f"{k}={v}" for k, v in sorted({**self.settings.nccl_env, **chosen}.items()))
        parts = [knobs] if knobs else []
        parts += [f"{engines.PRELOAD_VAR}={preload}"] if preload else []
        return self.state.rule.title + "".join(f" [{p}]" for p in parts)

    def price(self, message_bytes: int) -> Price | None:
        for curves, stand_in in ((self.own, False), (self.stand_ins, True)):
            ranked = ranking(curves, message_bytes)
            if ranked:
                return Price.of(ranked[0], stand_in)
        return None


def _setting_key(engine: str, s: engines.Settings) -> str:
    return json.dumps([s.nccl_env, getattr(s, f"{engine}_env"), getattr(s, f"{engine}_flags"), s.preload],
                      sort_keys=True, default=str)


def options(engine: str, states: list[PathState], run: Run, curves: list[Curve], sizes: list[int]) -> list[Option]:
    """Options in the engine's dispatch order; variants with the same settings merged into one,
    each with the launch line that moves `sizes` to its path."""
    by_path = {s.path: s for s in states}
    found: dict[tuple[str, str], Option] = {}
    for curve in curves:
        settings = recorded_settings(run, curve)
        if settings is None:
            continue
        claim = engines.declared_paths(settings).get(engine)
        state = by_path.get(claim["path"]) if claim else None
        if state is None or state.rule.op != curve.key.op:
            continue
        if claim.get("stand_in") and state.rule.op != ALLREDUCE:
            # A fused path is never chosen, only its default priced, by the engine's own kernel: a
            # stand-in for it is headroom alone (fused_headroom), never part of its option.
            continue
        slot = (state.path, _setting_key(engine, settings))
        if slot not in found:
            found[slot] = Option(engine, state, settings, engine_paths.move(states, state.path,
                                                                            settings.launch(engine), sizes))
        option = found[slot]
        (option.stand_ins if claim.get("stand_in") or not state.own_kernel else option.own).append(curve)
    ran = measured_implementations(run.rows) if found else {}
    for option in found.values():
        option.implementations = {c.label: ran[c.backend] for c in option.own + option.stand_ins if c.backend in ran}
    order = {s.path: i for i, s in enumerate(states)}
    return sorted(found.values(), key=lambda o: (order[o.state.path], not o.plain, o.label))


IMPLEMENTATION_CHARS = 160   # run files are untrusted: a row's text is shown on one line, this long at most


def measured_implementations(rows: Iterable[Measurement]) -> dict[str, str]:
    """Per backend, what its rows say they ran (`extra.implementation`, set by the backends of
    the engines' own kernels: "sglang 0.5.23 custom allreduce v2 (JIT ...)", FlashInfer's port of
    vLLM's kernel and its version), so a price from them says which version was measured."""
    found: dict[str, str] = {}
    for r in rows:
        text = r.extra.get("implementation") if r.status == OK else None
        if isinstance(text, str) and text and r.backend not in found:
            found[r.backend] = capped(text, IMPLEMENTATION_CHARS)
    return found


def _own_price(option: Option, message_bytes: int) -> Price | None:
    """The option's price from the engine's own kernel (a stand-in never decides a configuration)."""
    price = option.price(message_bytes)
    return price if price is not None and not price.stand_in else None


def priced_under(states: list[PathState], opts: list[Option], option: Option | None, message_bytes: int,
                 own_only: bool = True) -> tuple[PathState | None, Price | None]:
    """Who takes this size with `option`'s launch line (None: the engine's default launch) and what
    it costs: the option's own rows where its path takes it, else the rows of the path that does,
    as the engine runs it; unpriced where that path was not measured or is a fused one (its time
    includes the norm: never set against a bare allreduce)."""
    launch = option.move.launch if option is not None else Launch()
    taker = engine_paths.taker(states, launch, message_bytes).path
    if taker is None or taker.rule.op != ALLREDUCE:
        return taker, None
    chosen = option if option is not None and option.state is taker else next(
        (o for o in opts if o.state is taker and o.plain), None)
    if chosen is None:
        return taker, None
    return taker, _own_price(chosen, message_bytes) if own_only else chosen.price(message_bytes)


@dataclass(frozen=True)
class Saving:
    versus: str             # the default's curve label, measured in this run
    per_call_us: float
    per_step_ms: float      # allreduces per token x per call: each sequence's time per output token
    per_token_ms: float     # per step / concurrency: GPU time per generated token
    ratio: float            # default latency / chosen latency
    beyond_spread: bool | None


def saving(model: Model, concurrency: int, chosen: Price, default: Price) -> tuple[Saving | None, str]:
    """The saving of `chosen` over `default`, or why none is claimed."""
    if chosen.stand_in or default.stand_in:
        who = chosen.curve if chosen.stand_in else default.curve
        return None, f"{who} is a stand-in, not the engine's kernel: no saving claimed"
    if chosen.mode != default.mode:
        return None, f"{chosen.curve} and {default.curve} were timed in different modes"
    delta = default.latency_us - chosen.latency_us
    per_step = model.allreduces_per_token * delta / 1000.0
    return Saving(default.curve, delta, per_step, per_step / concurrency, default.latency_us / chosen.latency_us,
                  exceeds_spread(delta, chosen.point, default.point)), ""


def measurable(s: Saving | None) -> TypeGuard[Saving]:
    """A saving worth printing: the kernel is faster, and not within the p10-p90 spread (a spread
    the run did not record is said where the saving is shown)."""
    return s is not None and s.per_call_us > 0 and s.beyond_spread is not False


def verdict(s: Saving) -> str:
    if s.beyond_spread is False:
        return f"no measurable difference from {s.versus} (inside the p10-p90 spread)"
    spread = "" if s.beyond_spread else ", spread not measured"
    return (f"{s.per_call_us:.1f} us/call, {s.per_step_ms:.2f} ms/step faster than {s.versus} "
            f"({s.ratio:.2f}x{spread})")


@dataclass
class SizeDecision:
    concurrency: int
    message_bytes: int
    default: engine_paths.Default
    default_option: Option | None
    default_price: Price | None
    prices: list[Price | None]          # per option, in Engine.options order
    best: Option | None                 # fastest option the engine can take here, priced
    best_price: Price | None
    saving: Saving | None
    why_no_saving: str


@dataclass
class EngineDecision:
    engine: Engine
    facts: FactSet        # the facts its gates read (--engine-site, installed, built in)
    version: str                        # the version the user serves (--engine-version), else the facts'
    box: Box
    states: list[PathState]
    options: list[Option]
    sizes: list[SizeDecision]

    @property
    def key(self) -> str:
        return self.engine.key

    @property
    def name(self) -> str:
        return f"{self.engine.name} {self.version}"


def fastest(opts: list[Option], prices: list[Price | None], message_bytes: int) -> tuple[Option | None, Price | None]:
    """The fastest priced option whose launch line moves this size to its path."""
    takeable = [(p, o) for o, p in zip(opts, prices)
                if p is not None and o.state.available is True and o.state.rule.op == ALLREDUCE
                and o.offered and message_bytes in o.move.sizes]
    if not takeable:
        return None, None
    price, option = min(takeable, key=lambda po: (po[0].latency_us, po[1].label))
    return option, price


def workload(model: Model | None, mode: str, deterministic: bool = False) -> engine_paths.Workload:
    """What the engines' model rules read; engines run CUDA graphs unless told otherwise."""
    graph = engine_paths.EAGER if mode == "eager" else engine_paths.GRAPH
    if model is None:
        return engine_paths.Workload(mode=graph, deterministic=deterministic)
    return engine_paths.Workload(model.arch, model.hidden, graph, model.dtype, deterministic)


def best_path_at(engine: Engine, facts: FactSet, run: Run, curves: list[Curve], box: Box,
                 dtype: str, message_bytes: int, chain: engine_log.Chain | None = None,
                 deterministic: bool = False) -> tuple[Option | None, Price | None]:
    """The fastest path `engine` can take on the run's box for one message size (for a caller
    that has sizes rather than a model, e.g. a profiler trace's allreduces)."""
    found = engine_paths.states(engine, box, engine_paths.Workload(dtype=dtype, deterministic=deterministic), facts,
                                chain.paths if chain else None)
    opts = options(engine.key, found, run, curves, [message_bytes])
    return fastest(opts, [o.price(message_bytes) for o in opts], message_bytes)


def decide_size(model: Model, e_states: list[PathState], opts: list[Option], concurrency: int) -> SizeDecision:
    size = model.message_bytes(concurrency)
    default = engine_paths.default_path(e_states, size)
    d_opt = next((o for o in opts if default.path is not None and o.state is default.path and o.plain), None)
    d_price = d_opt.price(size) if d_opt else None
    prices = [o.price(size) for o in opts]
    best, best_price = fastest(opts, prices, size)
    gain, why = None, ""
    if best is None:
        why = "no path this engine can take here was measured at this size"
    elif default.path is not None and default.path.rule.op != ALLREDUCE:
        why = (f"by default the engine runs {default.path.rule.title} at this size, whose timing includes the norm: "
               "no saving is claimed against a bare allreduce (the paths below run only with the fusion off)")
    elif default.path is None:
        why = f"the default path cannot be told here: {default.why}"
    elif d_price is None:
        why = f"the default ({default.path.rule.title}) was not measured in this run"
    elif best is d_opt:
        why = "the default is the fastest path measured here"
    else:
        gain, why = saving(model, concurrency, best_price, d_price)  # type: ignore[arg-type]
    return SizeDecision(concurrency, size, default, d_opt, d_price, prices, best, best_price, gain, why)


def decide(engine: Engine, facts: FactSet, run: Run, box: Box, curves: list[Curve], model: Model,
           concurrencies: list[int], w: engine_paths.Workload, version: str | None = None,
           chain: engine_log.Chain | None = None) -> EngineDecision:
    e_states = engine_paths.states(engine, box, w, facts, chain.paths if chain else None)
    opts = options(engine.key, e_states, run, curves, [model.message_bytes(c) for c in concurrencies])
    return EngineDecision(engine, facts, version or facts.version, box, e_states, opts,
                          [decide_size(model, e_states, opts, c) for c in concurrencies])


@dataclass(frozen=True)
class Headroom:
    """A measured kernel no requested engine can run here, against the best path one can."""

    kernel: str                    # the curve's label
    why: str
    concurrency: int
    message_bytes: int
    cost: Price
    versus: Price | None
    saving: Saving | None
    engine_kernel: bool = False    # a requested engine's own kernel, forced where the engine would not take it
    said: str = ""                 # `why` without the paths' reasons, for an output that gives them once above


def headroom_curves(run: Run, curves: list[Curve], decisions: list[EngineDecision]
                    ) -> list[tuple[Curve, str, str, bool]]:
    """Plain-allreduce curves that price no path a requested engine can take here, with why (in
    full, and without the paths' own reasons) and whether the curve is a requested engine's own
    kernel (on a path that is off or unknown here)."""
    used = {id(c) for d in decisions for o in d.options if o.state.available is True for c in o.own + o.stand_ins}
    out = []
    for curve in curves:
        if curve.key.op != ALLREDUCE or id(curve) in used:
            continue
        settings = recorded_settings(run, curve)
        if settings is None:
            why = (f"no engine settings recorded for {curve.backend} in this run's run.json (runs record what each "
                   "backend declares since results schema 3)")
            out.append((curve, why, why, False))
            continue
        claims = engines.declared_paths(settings)
        reasons = []
        short: dict[str, list[str]] = {}     # a phrase, and the engines it is said of
        own = False
        for d in decisions:
            claim = claims.get(d.key)
            state = next((s for s in d.states if claim and s.path == claim["path"]), None)
            if state is None:
                reasons.append(f"{d.name} has no path that runs it")
                phrase = "no path runs it"
            elif state.available is None:
                own = own or (state.own_kernel and not claim.get("stand_in"))
                reasons.append(f"{d.name}: whether its {state.rule.title} path runs here cannot be told ({state.why})")
                phrase = f"whether the {state.rule.title} path runs here cannot be told"
            else:
                own = own or (state.own_kernel and not claim.get("stand_in"))
                reasons.append(f"{d.name}: its {state.rule.title} path is off here ({state.why})")
                phrase = f"the {state.rule.title} path is off here"
            short.setdefault(phrase, []).append(d.name)
        said = "; ".join(f"{' and '.join(names)}: {phrase}" for phrase, names in short.items())
        out.append((curve, "; ".join(reasons), said, own))
    return out


def headroom(model: Model, run: Run, curves: list[Curve], decisions: list[EngineDecision],
             concurrencies: list[int]) -> list[Headroom]:
    out = []
    for curve, why, said, own in headroom_curves(run, curves, decisions):
        for i, concurrency in enumerate(concurrencies):
            size = model.message_bytes(concurrency)
            ranked = ranking([curve], size)
            if not ranked:
                continue
            price = Price.of(ranked[0])
            rivals = [d.sizes[i].best_price for d in decisions]
            measured = [p for p in rivals if p is not None and not p.stand_in]
            versus = min(measured, key=lambda p: p.latency_us) if measured else None
            gain = saving(model, concurrency, price, versus)[0] if versus else None
            out.append(Headroom(curve.label, why, concurrency, size, price, versus, gain, own, said))
    return out


def most_saving(rooms: list[Headroom]) -> list[Headroom]:
    """Per kernel, its row with the largest measurable saving per step (--brief says one size each)."""
    best: dict[str, Headroom] = {}
    for r in rooms:
        if measurable(r.saving) and (r.kernel not in best
                                     or r.saving.per_step_ms > best[r.kernel].saving.per_step_ms):  # type: ignore
            best[r.kernel] = r
    return list(best.values())


def fastest_headroom(rooms: list[Headroom]) -> list[Headroom]:
    """Per size, the fastest kernel no requested engine can run here."""
    fastest_: dict[int, Headroom] = {}
    for r in rooms:
        if r.concurrency not in fastest_ or r.cost.latency_us < fastest_[r.concurrency].cost.latency_us:
            fastest_[r.concurrency] = r
    return sorted(fastest_.values(), key=lambda r: r.concurrency)


# --- what the commands share: engine arguments, the data's kind ------------------------------

DATA_WORDS = {"measured": "measured", "emulated": "MPS-emulated, no fabric", "imported": "imported from nccl-tests",
              "fixture": "fixture, not a measurement", "cpu": "CPU (gloo), no GPU"}


def data_tag(run: Run) -> str:
    """The few words every line about the run's numbers carries."""
    return kind_tag(provenance.of(run).kind)


def kind_tag(kind: str) -> str:
    """data_tag of a provenance kind (a result's `provenance["kind"]`)."""
    return DATA_WORDS.get(kind, "unknown origin")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", action="append", default=None, metavar="vllm|sglang",
                        help="the serving engine(s) to answer for (repeatable or a comma list; default: both)")
    parser.add_argument("--engine-version", action="append", default=None, metavar="ENGINE=VERSION",
                        help="the engine version you serve with, e.g. vllm=0.33.0 (the rules are read at "
                             f"vLLM {engines.VLLM_VERSION} and SGLang {engines.SGLANG_VERSION}, or from the engine "
                             "installed here; another version is named in the output as unchecked)")
    add_engine_source_arguments(parser)


def add_engine_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the engines' facts and chain come from, and the mode the server runs in."""
    parser.add_argument("--engine-site", metavar="PATH",
                        help="read the engines' facts from this site-packages folder or unpacked wheel (default: "
                             "the vLLM / SGLang installed beside commbench, else the facts built in)")
    parser.add_argument("--engine-log", metavar="FILE",
                        help="vLLM's start-up log: use the all-reduce chain it says it set up ('Using [...] "
                             "all-reduce backends (in dispatch order)'); SGLang logs none")
    parser.add_argument("--deterministic", action="store_true",
                        help="the server runs its deterministic mode (vLLM VLLM_BATCH_INVARIANT=1, SGLang "
                             "--enable-deterministic-inference), which turns several paths off")


@dataclass(frozen=True)
class EngineSources:
    """What a command knows of the engines it answers for, read once and passed down: where each
    one's facts come from (--engine-site), the chain its start-up log names (--engine-log), and
    whether the server runs its deterministic mode (--deterministic)."""

    facts: source.Sources
    chains: dict[str, engine_log.Chain]
    log_file: str | None = None
    deterministic: bool = False
    asked: tuple[tuple[str, str], ...] = ()   # (engine, version) in the order asked (--engine, --engine-version)


def engine_sources(args: argparse.Namespace) -> EngineSources:
    """The engine flags read once: --engine-site resolved, --engine-log read (the chain per engine
    that logs one), --deterministic, and the engines asked for with their versions."""
    names, pinned = requested_engines(args)
    facts = source.resolve(getattr(args, "engine_site", None))
    path = getattr(args, "engine_log", None)
    chains = {e.key: engine_log.read_chain(path, e) for e in BY_KEY.values() if e.log_line} if path else {}
    return EngineSources(facts, chains, path, bool(getattr(args, "deterministic", False)),
                         tuple((name, pinned.get(name, facts[name].version)) for name in names))


def source_lines(asked: list[tuple[str, str]], found: EngineSources) -> list[str]:
    """Where each engine's facts and chain come from, for the top of an output."""
    lines = []
    for engine, _ in asked:
        facts = found.facts[engine]
        lines.append(f"{facts.name} facts: {source.provenance_line(facts)}")
        lines += [f"  warning: {w}" for w in facts.warnings]
        if engine in found.chains:
            lines.append(f"  {found.chains[engine].said(found.log_file or '')}")
        elif found.log_file:
            lines.append(f"  {facts.name} {facts.version} logs no dispatch chain on CUDA: its chain here is the "
                         "model's")
        if found.deterministic:
            lines.append(f"  the server runs {facts.name}'s deterministic mode ({BY_KEY[engine].words.deterministic}): "
                         "the paths it turns off are off below")
    return lines


VERSION = re.compile(r"^[0-9][0-9A-Za-z.+-]{0,31}$")


def requested_engines(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The engines in the order asked, and the versions --engine-version names; one line and exit 2
    for anything else."""
    names: list[str] = []
    given = getattr(args, "engine", None)
    for item in ([given] if isinstance(given, str) else given) or [",".join(KEYS)]:
        for name in item.split(","):
            name = name.strip().lower()
            if name not in KEYS:
                raise UsageError(f"--engine {name!r}: choose from {', '.join(KEYS)}")
            if name in names:
                raise UsageError(f"--engine {name} is given twice")
            names.append(name)
    pinned: dict[str, str] = {}
    for item in getattr(args, "engine_version", None) or []:
        engine, sep, version = item.partition("=")
        engine = engine.strip().lower()
        if not sep or engine not in KEYS or not VERSION.fullmatch(version.strip()):
            raise UsageError(f"--engine-version {item!r}: expected ENGINE=VERSION, e.g. vllm=0.33.0")
        pinned[engine] = version.strip()
    return names, pinned


def version_note(d: EngineDecision) -> str | None:
    known = d.facts.version
    if d.version == known:
        return None
    return (f"you asked for {NAMES[d.key]} {d.version}; these rules were read at {known} "
            "and were not checked against your version")


def decode_sizes(model: Model | None) -> list[int]:
    """The message sizes a launch line is built for: the model's decode sizes, or without a model
    every power of two from 4 KiB to 64 MiB."""
    if model is None:
        return [1 << k for k in range(12, 27)]
    return [model.message_bytes(c) for c in DEFAULT_CONCURRENCIES]
