"""One configuration per engine per server: the one set of settings that is cheapest over the
mix of concurrencies the user serves, priced against the engine's default at every decode size
of that mix and at the prefill chunk, with the sizes where it loses.

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
from commbench.engines.paths import ALLREDUCE, NCCL_PATH
from commbench.errors import UsageError
from commbench.results.text import clean_text
from commbench.units import format_bytes

NCCL_ENV_SCOPE = "an NCCL_* variable applies to every message size of every NCCL communicator of the process"

DECODE, PREFILL = "decode", "prefill"
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


@dataclass(frozen=True)
class Configuration:
    engine: str
    name: str                       # "vLLM 0.33.0"
    loads: tuple[Load, ...]
    prefill_tokens: int
    prefill_source: str
    chosen: str | None              # the option's label; None: no configuration can be priced here
    path: str | None                # the chosen option's engine path (engine_paths id); None for the default
    is_default: bool                # the engine's default is the cheapest: nothing to set
    paste: tuple[str, ...]          # the lines to paste; with `library`, the engine's settings to run it with
    refused: str | None             # why the settings are not paste-ready (run files are untrusted)
    library: bool                   # the configuration loads another libnccl (LD_PRELOAD): never a paste line
    notes: tuple[str, ...]
    cells: tuple[Cell, ...]         # decode loads, then the prefill chunk
    weighted_saving_ms: float | None  # per step, over the mix, against the default
    candidates: tuple[Candidate, ...]
    why: str                        # why nothing is chosen, or why the default stays
    next_command: str | None        # the one sweep that would price every size not measured here
    # "engine": the engine's paths on the run's box; "nccl": an nccl-tests import without a probe
    # snapshot, where only NCCL's own settings can be set against each other
    scope: str = "engine"     # ENGINE_SCOPE | NCCL_SCOPE

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


def _weighted(model: Model, loads: tuple[Load, ...], costs: list[float | None]) -> float | None:
    if any(c is None for c in costs):
        return None
    return sum(l.weight * model.allreduces_per_token * c / 1000.0 for l, c in zip(loads, costs))  # type: ignore[operator]


def next_command(model: Model, tp: int | None, loads: tuple[Load, ...], prefill_tokens: int) -> str:
    """The one sweep, on the serving box, that measures every size of the mix and the prefill chunk."""
    return next_steps.sweep_command(model, tp, [l.concurrency for l in loads], [prefill_tokens])


def configure(d: EngineDecision, model: Model, loads: tuple[Load, ...], prefill_tokens: int, prefill_source: str,
              tp: int | None) -> Configuration:
    if d.box.log_only:
        return _nccl_only(d, model, loads, prefill_tokens, prefill_source, tp)
    engine = _Engine(d)
    sizes = [model.message_bytes(l.concurrency) for l in loads]
    prefill_bytes = model.message_bytes(prefill_tokens)
    options: list[Option | None] = [None, *_choosable(d)]
    candidates: list[tuple[Option | None, Candidate]] = []
    for option in options:
        decode = [engine.under(option, s) for s in sizes]
        prefill = engine.under(option, prefill_bytes)
        if option is not None and option.plain and [*decode, prefill] == [engine.under(None, s) for s in
                                                                           [*sizes, prefill_bytes]]:
            continue   # the path the engine takes anyway, with nothing set: the default's row
        candidates.append((option, Candidate(
            "the engine's default" if option is None else option.label, option is None,
            tuple(p.latency_us if p else None for p in decode), prefill.latency_us if prefill else None,
            _weighted(model, loads, [p.latency_us if p else None for p in decode]))))
    base = candidates[0][1]
    if base.weighted_step_ms is None:
        missing = [l.concurrency for l, u in zip(loads, base.decode_us) if u is None]
        defaults = {engine_default_why(d, s) for l, s in zip(loads, sizes) if l.concurrency in missing}
        at = "at any size of the mix" if len(missing) == len(loads) else f"at concurrency {', '.join(map(str, missing))}"
        why = f"the engine's default {at} cannot be priced: " + "; ".join(sorted(defaults))
        # A line that turns off a path the engine takes by default would displace a default this
        # run cannot price: never offered here.
        measured = [(o, c) for o, c in candidates if o is not None and c.weighted_step_ms is not None
                    and not o.move.added]
        if not measured:
            return Configuration(d.key, d.name, loads, prefill_tokens, prefill_source, None, None, False, (), None,
                                 False, (), (), None, tuple(c for _, c in candidates), why,
                                 next_command(model, tp, loads, prefill_tokens))
        # The fastest configuration the engine can take, measured at every size: shown with its
        # settings, no saving claimed against a default this run cannot price.
        option, _ = min(measured, key=lambda oc: (round(oc[1].weighted_step_ms, 9), oc[1].label))  # type: ignore[arg-type]
        cells = _cells(engine, option, loads, sizes, prefill_tokens, prefill_bytes)
        return Configuration(d.key, d.name, loads, prefill_tokens, prefill_source, option.label, option.state.path,
                             False, *_settings(d, option, tp), cells, None, tuple(c for _, c in candidates), why,
                             next_command(model, tp, loads, prefill_tokens))
    priced = [(o, c) for o, c in candidates if c.weighted_step_ms is not None]
    option, best = min(priced, key=lambda oc: (round(oc[1].weighted_step_ms, 9), not oc[1].is_default))  # type: ignore[arg-type]
    cells = _cells(engine, option, loads, sizes, prefill_tokens, prefill_bytes)
    decode_cells = [c for c in cells if c.phase == DECODE]
    if option is not None and not any(c.saving_us and c.saving_us > 0 and c.beyond_spread is not False
                                      for c in decode_cells):
        option, best = None, base    # inside the spread everywhere: no measurable difference, keep the default
        cells = _cells(engine, None, loads, sizes, prefill_tokens, prefill_bytes)
        why = "no other configuration is faster beyond the p10-p90 spread: no measurable difference"
    else:
        why = "" if option is not None else "the engine's default is the cheapest configuration measured here"
    saving = base.weighted_step_ms - best.weighted_step_ms  # type: ignore[operator]
    pasted = _settings(d, option, tp) if option is not None else ((), None, False, ())
    unmeasured = any(cell.saving_us is None for cell in cells)
    return Configuration(d.key, d.name, loads, prefill_tokens, prefill_source,
                         option.label if option else "the engine's default", option.state.path if option else None,
                         option is None, *pasted, cells, saving, tuple(c for _, c in candidates), why,
                         next_command(model, tp, loads, prefill_tokens) if unmeasured else None)


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


def _cells(engine: _Engine, option: Option | None, loads: tuple[Load, ...], sizes: list[int], prefill_tokens: int,
           prefill_bytes: int) -> tuple[Cell, ...]:
    return tuple(_cell(engine, option, DECODE, l.concurrency, l.weight, s) for l, s in zip(loads, sizes)) + \
        (_cell(engine, option, PREFILL, prefill_tokens, 0.0, prefill_bytes),)


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


def _nccl_only(d: EngineDecision, model: Model, loads: tuple[Load, ...], prefill_tokens: int, prefill_source: str,
               tp: int | None) -> Configuration:
    """An nccl-tests import without a probe snapshot: the engine's own paths cannot be told, NCCL's
    can be priced. Its plain rows are the baseline; an NCCL setting the import measured is chosen
    where it is faster beyond the spread, with its NCCL_* exports alone (the engine flags that
    would move sizes to NCCL depend on the box)."""
    nccl = [o for o in d.options if o.state.path == NCCL_PATH and o.own]
    plain = next((o for o in nccl if o.plain), None)
    sizes = [model.message_bytes(l.concurrency) for l in loads]
    prefill_bytes = model.message_bytes(prefill_tokens)

    def cost(option: Option | None, size: int) -> Price | None:
        price = option.price(size) if option is not None else None
        return price if price is not None and not price.stand_in else None

    def candidate(option: Option) -> Candidate:
        decode = [cost(option, s) for s in sizes]
        prefill = cost(option, prefill_bytes)
        return Candidate(option.label if option is not plain else f"{option.label} as NCCL runs by default",
                         option is plain, tuple(p.latency_us if p else None for p in decode),
                         prefill.latency_us if prefill else None,
                         _weighted(model, loads, [p.latency_us if p else None for p in decode]))

    def cells(chosen: Option | None) -> tuple[Cell, ...]:
        out = []
        for phase, tokens, weight, size in [*((DECODE, l.concurrency, l.weight, s) for l, s in zip(loads, sizes)),
                                            (PREFILL, prefill_tokens, 0.0, prefill_bytes)]:
            base, picked = cost(plain, size), cost(chosen, size) if chosen is not None else cost(plain, size)
            gain = beyond = None
            if base is not None and picked is not None:
                gain = base.latency_us - picked.latency_us
                beyond = exceeds_spread(gain, picked.point, base.point)
            out.append(Cell(phase, tokens, weight, size, base.latency_us if base else None,
                            picked.latency_us if picked else None, _how(base), _how(picked),
                            base.curve if base else None, picked.curve if picked else None, gain, beyond))
        return tuple(out)

    rows = tuple(candidate(o) for o in ([plain] if plain else []) + [o for o in nccl if o is not plain])
    base = rows[0] if plain is not None else None
    if base is None or base.weighted_step_ms is None:
        return Configuration(d.key, d.name, loads, prefill_tokens, prefill_source, None, None, False, (), None, False,
                             (), cells(None) if plain else (), None, rows,
                             f"{NCCL_ONLY}; NCCL's rows do not cover every size of the mix", None, NCCL_SCOPE)
    priced = [(o, c) for o, c in zip([plain] + [o for o in nccl if o is not plain], rows)
              if c.weighted_step_ms is not None]
    option, best = min(priced, key=lambda oc: (round(oc[1].weighted_step_ms, 9), not oc[1].is_default))  # type: ignore[arg-type]
    chosen_cells = cells(option if option is not plain else None)
    if option is not plain and not any(c.saving_us and c.saving_us > 0 and c.beyond_spread is not False
                                       for c in chosen_cells if c.phase == DECODE):
        option, best, chosen_cells = plain, base, cells(None)
    if option is plain:
        return Configuration(d.key, d.name, loads, prefill_tokens, prefill_source, base.label, NCCL_PATH, True, (),
                             None, False, (), chosen_cells, 0.0, rows, NCCL_ONLY, None, NCCL_SCOPE)
    exports = tuple(f"export {k}={v}" for k, v in sorted(option.settings.nccl_env.items()))
    refused = engines.env_refusal(option.settings.nccl_env)
    return Configuration(d.key, d.name, loads, prefill_tokens, prefill_source, option.label, NCCL_PATH, False,
                         () if refused else exports, refused, False,
                         (NCCL_ENV_SCOPE, "these exports set NCCL for the sizes the engine sends it; which sizes those "
                                          "are is the box's (its probe snapshot)"),
                         chosen_cells, base.weighted_step_ms - best.weighted_step_ms, rows,  # type: ignore[operator]
                         NCCL_ONLY, None, NCCL_SCOPE)
