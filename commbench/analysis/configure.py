"""One configuration per engine per server: the one set of settings whose allreduce time per
request is the least over the mix of concurrencies the user serves, priced against the engine's
default at every decode size of that mix and at the prefill chunk, with the sizes where it loses.

A request is one prefill chunk of its prompt (`--prefill-tokens` tokens: one forward pass, one
allreduce of chunk x hidden per allreduce point) and the decode steps of its output
(`--output-tokens`, each one allreduce of concurrency x hidden per point), so per request

    ms = allreduces per token x (output tokens x us/call at the decode size + us/call at the chunk) / 1000

weighted over the mix. A setting that saves per decode step but costs more per prefill chunk than
the output tokens win back loses per request and is not chosen.

A server runs one configuration: an NCCL_* variable applies to every message size of every NCCL
communicator of the process, so a setting that wins at concurrency 1 and loses at 64 is one
trade-off, never two paste blocks. Shared by recommend and floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from commbench import engines
from commbench.analysis.curves import exceeds_spread
from commbench.analysis import next_steps
from commbench.analysis.decide import EngineDecision, Option, Price, priced_under
from commbench.models import Model
from commbench.engines import paths as engine_paths
from commbench.engines.paths import ALLREDUCE, FUSED_OP, NCCL_PATH
from commbench.errors import UsageError
from commbench.results.text import clean_text
from commbench.units import format_bytes

NCCL_ENV_SCOPE = "an NCCL_* variable applies to every message size of every NCCL communicator of the process"

DECODE, PREFILL = "decode", "prefill"

# The output tokens a request is priced with unless --output-tokens says otherwise: the output
# length of vLLM's own serving benchmark (`vllm bench serve`, random dataset:
# vllm/benchmarks/datasets/datasets.py RandomDataset.DEFAULT_OUTPUT_LEN, vLLM 0.34.0).
DEFAULT_OUTPUT_TOKENS = 128
ENGINE_SCOPE, NCCL_SCOPE = "engine", "nccl"


@dataclass(frozen=True)
class Load:
    """One concurrency the server runs at, and its share of the serving time."""

    concurrency: int
    weight: float


def parse_loads(text: str | None, default: list[int]) -> tuple[Load, ...]:
    """'1,16,64' (equal shares) or '1:0.2,16:0.5,64:0.3' (weights, scaled to sum to 1)."""
    if not text:
        return tuple(Load(c, 1.0 / len(default)) for c in default)
    pairs: list[tuple[int, float]] = []
    if not text.strip(" ,"):
        raise UsageError(f"--concurrency {text!r}: the list is empty")
    for item in text.split(","):
        conc, sep, weight = item.strip().partition(":")
        try:
            c, w = int(conc), float(weight) if sep else 1.0
        except ValueError:
            raise UsageError(f"--concurrency {text!r}: expected N[,N...] or N:WEIGHT[,N:WEIGHT...], "
                             "e.g. 1,16,64 or 1:0.2,16:0.5,64:0.3") from None
        if c <= 0 or not 0 < w < math.inf:
            raise UsageError(f"--concurrency {text!r}: a concurrency is a positive whole number and a weight a "
                             f"positive, finite number (got {item.strip()!r})")
        if c in {p[0] for p in pairs}:
            raise UsageError(f"--concurrency {text!r}: {c} is listed twice")
        pairs.append((c, w))
    if len({":" in item for item in text.split(",")}) > 1:
        raise UsageError(f"--concurrency {text!r}: give a weight to every concurrency or to none")
    total = sum(w for _, w in pairs)
    return tuple(Load(c, w / total) for c, w in pairs)


def loads_text(loads: tuple[Load, ...]) -> str:
    if len({round(l.weight, 9) for l in loads}) == 1:
        return "concurrency " + ", ".join(str(l.concurrency) for l in loads) + " (equal shares)"
    return "concurrency " + ", ".join(f"{l.concurrency} ({100 * l.weight:.0f}%)" for l in loads)


# --- the configuration ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """The chosen configuration against the engine's default at one message size."""

    phase: str                  # decode | prefill
    tokens: int                 # decode: the concurrency; prefill: the chunk's tokens
    weight: float               # the load's share (decode); 0 for prefill, which is shown, not weighed
    message_bytes: int
    default_us: float | None    # None: not measured at this size (never extrapolated)
    chosen_us: float | None
    default_how: str            # measured | interpolated | not measured
    chosen_how: str
    default_curve: str | None   # the measured variant that priced it
    chosen_curve: str | None
    saving_us: float | None     # default - chosen: negative where the configuration loses
    beyond_spread: bool | None  # the difference exceeds both sides' p10-p90 spread (None: unknown)

    @property
    def loses(self) -> bool:
        return self.saving_us is not None and self.saving_us < 0

    def where(self) -> str:
        what = f"concurrency {self.tokens}" if self.phase == DECODE else f"prefill {self.tokens} tokens"
        return f"{what} ({format_bytes(self.message_bytes)})"


@dataclass(frozen=True)
class Candidate:
    """One row of the trade-off table: a configuration the engine can take, priced over the mix."""

    label: str
    is_default: bool
    decode_us: tuple[float | None, ...]     # per load, in --concurrency order
    prefill_us: float | None
    weighted_step_ms: float | None          # sum of share x allreduces per token x us/call; None: unpriced somewhere
    prefill_chunk_ms: float | None          # allreduces per token x us/call at the chunk
    # output tokens x weighted_step_ms + prefill_chunk_ms: what the choice is made on. The chunk
    # counts where the engine's default was priced there (Configuration.prefill_weighed), else
    # decode alone; None where a part that counts is not priced.
    request_ms: float | None


@dataclass(frozen=True)
class Configuration:
    engine: str
    name: str                       # "vLLM 0.33.0"
    loads: tuple[Load, ...]
    prefill_tokens: int
    prefill_source: str
    output_tokens: int              # the decode steps of a request (--output-tokens)
    prefill_weighed: bool           # the default's cost at the prefill chunk is priced: the choice weighs it
    chosen: str | None              # the option's label; None: no configuration can be priced here
    path: str | None                # the chosen option's engine path (engine_paths id); None for the default
    is_default: bool                # the engine's default is the cheapest: nothing to set
    paste: tuple[str, ...]          # the lines to paste; with `library`, the engine's settings to run it with
    refused: str | None             # why the settings are not paste-ready (run files are untrusted)
    library: bool                   # the configuration loads another libnccl (LD_PRELOAD): never a paste line
    notes: tuple[str, ...]
    cells: tuple[Cell, ...]         # decode loads, then the prefill chunk
    weighted_saving_ms: float | None  # per step, over the mix, against the default
    prefill_cost_ms: float | None   # per prefill chunk, the configuration's extra ms (negative: it saves); None: not priced
    net_request_ms: float | None    # per request: output tokens x weighted_saving_ms - prefill_cost_ms (decode alone
    #                                 where the prefill is not weighed)
    candidates: tuple[Candidate, ...]
    why: str                        # why nothing is chosen, or why the default stays
    next_command: str | None        # the one sweep that would price every size not measured here
    # "engine": the engine's paths on the run's box; "nccl": an nccl-tests import without a probe
    # snapshot, where only NCCL's own settings can be set against each other
    scope: str = "engine"     # ENGINE_SCOPE | NCCL_SCOPE
    # Configurations the engine can take that this run cannot price, each with why (a line that
    # turns the engine's fused allreduce+RMSNorm off: the loss of the fusion is not in plain rows)
    unpriced: tuple[str, ...] = ()

    @property
    def losses(self) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.loses)


def _how(price: Price | None) -> str:
    return "not measured" if price is None else "interpolated" if price.interpolated else "measured"


class _Engine:
    """What the engine takes at one size under a configuration (None: the plain default)."""

    def __init__(self, d: EngineDecision):
        self.d = d

    def under(self, option: Option | None, message_bytes: int) -> Price | None:
        """The cost per call with `option`'s launch line: the path the engine then sends this size
        to, priced by its own rows (decide.priced_under)."""
        return priced_under(self.d.states, self.d.options, option, message_bytes)[1]


def _choosable(d: EngineDecision) -> list[Option]:
    return [o for o in d.options if o.state.available is True and o.state.rule.op == ALLREDUCE and o.own
            and o.offered]


@dataclass(frozen=True)
class Mix:
    """What one configuration is priced over: the loads, the prefill chunk of a request (its tokens
    and where that figure comes from) and the output tokens of a request."""

    loads: tuple[Load, ...]
    prefill_tokens: int
    prefill_source: str
    output_tokens: int = DEFAULT_OUTPUT_TOKENS

    def sizes(self, model: Model) -> list[int]:
        return [model.message_bytes(l.concurrency) for l in self.loads]


def _weighted(model: Model, loads: tuple[Load, ...], costs: list[float | None]) -> float | None:
    if any(c is None for c in costs):
        return None
    return sum(l.weight * model.allreduces_per_token * c / 1000.0 for l, c in zip(loads, costs))  # type: ignore[operator]


def _candidate(label: str, is_default: bool, model: Model, mix: Mix, decode: list[Price | None],
               prefill: Price | None, weigh_prefill: bool) -> Candidate:
    decode_us = [p.latency_us if p else None for p in decode]
    step = _weighted(model, mix.loads, decode_us)
    chunk = model.allreduces_per_token * prefill.latency_us / 1000.0 if prefill else None
    request = None if step is None or (weigh_prefill and chunk is None) else \
        mix.output_tokens * step + (chunk if weigh_prefill else 0.0)  # type: ignore[operator]
    return Candidate(label, is_default, tuple(decode_us), prefill.latency_us if prefill else None, step, chunk,
                     request)


def _pick(priced: list[tuple[Option | None, Candidate]], default: Option | None
          ) -> tuple[Option | None, Candidate]:
    """The least allreduce time per request; the default wins a tie."""
    return min(priced, key=lambda oc: (round(oc[1].request_ms, 9), oc[0] is not default))  # type: ignore[arg-type]


def _measurable(cells: tuple[Cell, ...], weigh_prefill: bool) -> bool:
    """Some size the request pays for is faster beyond both sides' spread (or the spread is unknown)."""
    return any(c.saving_us and c.saving_us > 0 and c.beyond_spread is not False
               for c in cells if c.phase == DECODE or weigh_prefill)


def _per_request(model: Model, mix: Mix, saving_ms: float | None, chosen: Candidate, base: Candidate,
                 weigh_prefill: bool) -> tuple[float | None, float | None]:
    """(the configuration's extra ms per prefill chunk, its net saving per request)."""
    cost = (chosen.prefill_chunk_ms - base.prefill_chunk_ms
            if chosen.prefill_chunk_ms is not None and base.prefill_chunk_ms is not None else None)
    if saving_ms is None:
        return cost, None
    return cost, mix.output_tokens * saving_ms - (cost if weigh_prefill and cost is not None else 0.0)


def fusion_lost(d: EngineDecision, option: Option, sizes: list[int]) -> str | None:
    """Why plain rows cannot price `option`: its launch line turns off a fused allreduce + residual +
    RMSNorm path the engine takes by default at a size of the mix (SGLang's
    --enforce-disable-flashinfer-allreduce-fusion, say). Its decoder layers then run the allreduce,
    the add and the RMSNorm apart: a cost only rows of the whole pattern measure."""
    by_default = engine_paths.enabled(d.states, engine_paths.Launch())
    under = engine_paths.enabled(d.states, option.move.launch)
    for s in d.states:
        if (s.rule.op == FUSED_OP and s.available is True and s.path in by_default and s.path not in under
                and any(s.admits(size, by_default) for size in sizes)):
            return (f"{option.label}: its launch line turns off {s.rule.title}, which the engine runs by default at "
                    "these decode sizes; the allreduce, residual add and RMSNorm then run apart, a cost plain "
                    "allreduce rows do not price (fused and unfused:best rows of a model-shape sweep do)")
    return None


def next_command(model: Model, tp: int | None, loads: tuple[Load, ...], prefill_tokens: int) -> str:
    """The one sweep, on the serving box, that measures every size of the mix and the prefill chunk."""
    return next_steps.sweep_command(model, tp, [l.concurrency for l in loads], [prefill_tokens])


def configure(d: EngineDecision, model: Model, mix: Mix, tp: int | None) -> Configuration:
    if d.box.log_only:
        return _nccl_only(d, model, mix, tp)
    engine = _Engine(d)
    sizes = mix.sizes(model)
    prefill_bytes = model.message_bytes(mix.prefill_tokens)
    weigh = engine.under(None, prefill_bytes) is not None
    candidates: list[tuple[Option | None, Candidate]] = []
    unpriced: list[str] = []
    for option in [None, *_choosable(d)]:
        lost = fusion_lost(d, option, sizes) if option is not None else None
        if lost is not None:
            unpriced.append(lost)
            continue
        decode = [engine.under(option, s) for s in sizes]
        prefill = engine.under(option, prefill_bytes)
        if option is not None and option.plain and [*decode, prefill] == [engine.under(None, s) for s in
                                                                           [*sizes, prefill_bytes]]:
            continue   # the path the engine takes anyway, with nothing set: the default's row
        candidates.append((option, _candidate("the engine's default" if option is None else option.label,
                                              option is None, model, mix, decode, prefill, weigh)))
    table = tuple(c for _, c in candidates)
    base = candidates[0][1]

    def configuration(option: Option | None, chosen: str | None, saving: float | None,
                      cells: tuple[Cell, ...], why: str, best: Candidate | None = None) -> Configuration:
        cost, net = _per_request(model, mix, saving, best, base, weigh) if best else (None, None)
        settings = _settings(d, option, tp) if option is not None else ((), None, False, ())
        unmeasured = chosen is None or saving is None or any(cell.saving_us is None for cell in cells)
        return Configuration(d.key, d.name, mix.loads, mix.prefill_tokens, mix.prefill_source, mix.output_tokens,
                             weigh, chosen, option.state.path if option else None,
                             chosen is not None and option is None, *settings, cells, saving, cost, net, table, why,
                             next_command(model, tp, mix.loads, mix.prefill_tokens) if unmeasured else None,
                             unpriced=tuple(unpriced))

    if base.weighted_step_ms is None:
        missing = [l.concurrency for l, u in zip(mix.loads, base.decode_us) if u is None]
        defaults = {engine_default_why(d, s) for l, s in zip(mix.loads, sizes) if l.concurrency in missing}
        at = ("at any size of the mix" if len(missing) == len(mix.loads)
              else f"at concurrency {', '.join(map(str, missing))}")
        why = f"the engine's default {at} cannot be priced: " + "; ".join(sorted(defaults))
        # A line that turns off a path the engine takes by default would displace a default this
        # run cannot price: never offered here.
        measured = [(o, c) for o, c in candidates if o is not None and c.request_ms is not None and not o.move.added]
        if not measured:
            return configuration(None, None, None, (), why)
        # The fastest configuration the engine can take, measured at every size: shown with its
        # settings, no saving claimed against a default this run cannot price.
        option, _ = min(measured, key=lambda oc: (round(oc[1].request_ms, 9), oc[1].label))  # type: ignore[arg-type]
        return configuration(option, option.label, None, _cells(engine, option, mix, model), why)  # type: ignore[union-attr]
    option, best = _pick([(o, c) for o, c in candidates if c.request_ms is not None], None)
    cells = _cells(engine, option, mix, model)
    why = "" if option is not None else "the engine's default is the cheapest configuration measured here"
    if option is not None and not _measurable(cells, weigh):
        option, best = None, base    # inside the spread everywhere: no measurable difference, keep the default
        cells = _cells(engine, None, mix, model)
        why = "no other configuration is faster beyond the p10-p90 spread: no measurable difference"
    return configuration(option, option.label if option else "the engine's default",
                         base.weighted_step_ms - best.weighted_step_ms, cells, why, best)  # type: ignore[operator]


def _settings(d: EngineDecision, option: Option, tp: int | None
              ) -> tuple[tuple[str, ...], str | None, bool, tuple[str, ...]]:
    """The option's paste lines (with what turns off each path ahead of it for these sizes), why
    they are refused, whether it loads another libnccl, its notes."""
    off_here = {st.path for st in d.states if st.available is False}
    settings, _ = engines.launch_settings(engines.without_offs(option.settings, d.key, off_here), d.key,
                                          option.state.path, d.states, [s.message_bytes for s in d.sizes])
    paste, refused = engines.paste_lines(settings, d.key, tp)
    library = bool(refused and option.settings.preload)
    if library:   # the library is loaded by the deployment; the engine's own settings still paste
        under, under_refused = engines.paste_lines(replace(settings, preload=""), d.key, tp)
        paste = [] if under_refused else under
    notes = tuple(clean_text(str(n)) for n in settings.notes if str(n) != engines.NCCL_ENV_IS_PROCESS_WIDE)
    if option.settings.nccl_env:
        notes = (NCCL_ENV_SCOPE, *notes)
    return tuple(paste), refused, library, notes


def _cells(engine: _Engine, option: Option | None, mix: Mix, model: Model) -> tuple[Cell, ...]:
    return tuple(_cell(engine, option, DECODE, l.concurrency, l.weight, s) for l, s in zip(mix.loads, mix.sizes(model))) + \
        (_cell(engine, option, PREFILL, mix.prefill_tokens, 0.0, model.message_bytes(mix.prefill_tokens)),)


def engine_default_why(d: EngineDecision, message_bytes: int) -> str:
    default = engine_paths.default_path(d.states, message_bytes)
    if default.path is None:
        return default.why
    if default.path.rule.op != ALLREDUCE:
        return (f"by default the engine runs {default.path.rule.title} at this size, whose time includes the norm: "
                "never priced against a bare allreduce")
    return f"its default ({default.path.rule.title}) was not measured by the engine's own kernel in this run"


def _cell(engine: _Engine, option: Option | None, phase: str, tokens: int, weight: float,
          message_bytes: int) -> Cell:
    default = engine.under(None, message_bytes)
    chosen = engine.under(option, message_bytes)
    saving = beyond = None
    if default is not None and chosen is not None:
        saving = default.latency_us - chosen.latency_us
        beyond = exceeds_spread(saving, chosen.point, default.point)
    return Cell(phase, tokens, weight, message_bytes, default.latency_us if default else None,
                chosen.latency_us if chosen else None, _how(default), _how(chosen),
                default.curve if default else None, chosen.curve if chosen else None, saving, beyond)


NCCL_ONLY = ("which path the engine takes at each size needs the box's probe snapshot, which this nccl-tests import "
             "lacks: these are the prices of its NCCL path, where it sends every size no other path takes")


def _nccl_only(d: EngineDecision, model: Model, mix: Mix, tp: int | None) -> Configuration:
    """An nccl-tests import without a probe snapshot: the engine's own paths cannot be told, NCCL's
    can be priced. Its plain rows are the baseline; an NCCL setting the import measured is chosen
    where it costs less per request beyond the spread, with its NCCL_* exports alone (the engine
    flags that would move sizes to NCCL depend on the box)."""
    nccl = [o for o in d.options if o.state.path == NCCL_PATH and o.own]
    plain = next((o for o in nccl if o.plain), None)
    sizes = mix.sizes(model)
    prefill_bytes = model.message_bytes(mix.prefill_tokens)

    def cost(option: Option | None, size: int) -> Price | None:
        price = option.price(size) if option is not None else None
        return price if price is not None and not price.stand_in else None

    weigh = cost(plain, prefill_bytes) is not None

    def cells(chosen: Option | None) -> tuple[Cell, ...]:
        out = []
        for phase, tokens, weight, size in [*((DECODE, l.concurrency, l.weight, s) for l, s in zip(mix.loads, sizes)),
                                            (PREFILL, mix.prefill_tokens, 0.0, prefill_bytes)]:
            base, picked = cost(plain, size), cost(chosen, size) if chosen is not None else cost(plain, size)
            gain = beyond = None
            if base is not None and picked is not None:
                gain = base.latency_us - picked.latency_us
                beyond = exceeds_spread(gain, picked.point, base.point)
            out.append(Cell(phase, tokens, weight, size, base.latency_us if base else None,
                            picked.latency_us if picked else None, _how(base), _how(picked),
                            base.curve if base else None, picked.curve if picked else None, gain, beyond))
        return tuple(out)

    ordered = ([plain] if plain else []) + [o for o in nccl if o is not plain]
    pairs = [(o, _candidate(o.label if o is not plain else f"{o.label} as NCCL runs by default", o is plain, model,
                            mix, [cost(o, s) for s in sizes], cost(o, prefill_bytes), weigh)) for o in ordered]
    rows = tuple(c for _, c in pairs)
    base = rows[0] if plain is not None else None

    def configuration(chosen: str | None, is_default: bool, paste: tuple[str, ...], refused: str | None,
                      notes: tuple[str, ...], chosen_cells: tuple[Cell, ...], saving: float | None, why: str,
                      best: Candidate | None = None) -> Configuration:
        extra, net = _per_request(model, mix, saving, best, base, weigh) if best and base else (None, None)
        return Configuration(d.key, d.name, mix.loads, mix.prefill_tokens, mix.prefill_source, mix.output_tokens,
                             weigh, chosen, NCCL_PATH if chosen else None, is_default, paste, refused, False, notes,
                             chosen_cells, saving, extra, net, rows, why, None, NCCL_SCOPE)

    if base is None or base.weighted_step_ms is None:
        return configuration(None, False, (), None, (), cells(None) if plain else (), None,
                             f"{NCCL_ONLY}; NCCL's rows do not cover every size of the mix")
    option, best = _pick([(o, c) for o, c in pairs if c.request_ms is not None], plain)
    chosen_cells = cells(option if option is not plain else None)
    if option is not plain and not _measurable(chosen_cells, weigh):
        option, best, chosen_cells = plain, base, cells(None)
    if option is plain:
        return configuration(base.label, True, (), None, (), chosen_cells, 0.0, NCCL_ONLY, base)
    exports = tuple(f"export {k}={v}" for k, v in sorted(option.settings.nccl_env.items()))  # type: ignore[union-attr]
    refused = engines.env_refusal(option.settings.nccl_env)  # type: ignore[union-attr]
    return configuration(option.label, False, () if refused else exports, refused,  # type: ignore[union-attr]
                         (NCCL_ENV_SCOPE, "these exports set NCCL for the sizes the engine sends it; which sizes "
                                          "those are is the box's (its probe snapshot)"),
                         chosen_cells, base.weighted_step_ms - best.weighted_step_ms, NCCL_ONLY, best)  # type: ignore[operator]
