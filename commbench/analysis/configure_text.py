"""A Configuration (configure.py) as terminal text: one paste block per engine, where it loses,
and the trade-off table of every configuration the engine can take over the serving mix."""

from __future__ import annotations

from commbench.analysis import render
from commbench.analysis.configure import DECODE, NCCL_SCOPE, Candidate, Cell, Configuration, loads_text
from commbench.analysis.render import fmt_us
from commbench.units import format_bytes


def _said(cell: Cell) -> str:
    if cell.saving_us is None:   # the block ends with the sweep that measures it
        missing = "the default" if cell.default_us is None else "the configuration"
        return f"{cell.where()}: {missing} not measured"
    if cell.beyond_spread is False:
        return f"{cell.where()}: no measurable difference ({abs(cell.saving_us):.1f} us/call, inside the spread)"
    word = "slower" if cell.saving_us < 0 else "faster"
    spread = "" if cell.beyond_spread else ", spread not measured"
    return f"{cell.where()}: {abs(cell.saving_us):.1f} us/call {word} than the default{spread}"


def block(c: Configuration, tag: str, wide: bool = False, brief: bool = False) -> list[str]:
    """What to run: the configuration, its weighted saving, the paste block, its losses; where
    nothing can be priced, why and the command that would price it."""
    sweep = (["the sweep that would price it, on the serving box with one GPU per rank:", f"    {c.next_command}"]
             if c.next_command else [])
    if c.chosen is None:
        return [render.prose(f"no configuration can be priced from this run ({tag}): {c.why}", wide), *sweep]
    if c.weighted_saving_ms is None:   # the default is not priced here: the fastest measured, no saving claimed
        return [render.prose(f"no saving can be priced from this run ({tag}): {c.why}. The fastest configuration "
                             f"measured here: {c.chosen}", wide), *_paste(c, wide), *sweep]
    source = "" if brief else f" ({c.prefill_source})"
    lines = [render.prose(f"one configuration for {loads_text(c.loads)}, prefill chunk {c.prefill_tokens} "
                          f"tokens{source}:", wide)]
    if c.is_default and c.scope == NCCL_SCOPE:
        lines.append(render.prose(f"its NCCL path only (the box is not known): NCCL as it runs by default is the "
                                  f"cheapest NCCL setting measured here, nothing to set ({tag})", wide))
    elif c.is_default:
        said = c.why or "the engine's default is the cheapest configuration measured here"
        lines.append(render.prose(f"the engine's default: nothing to set ({said}; {tag})", wide))
    elif c.scope == NCCL_SCOPE:
        lines.append(render.prose(f"its NCCL path only (the box is not known): {c.chosen}: "
                                  f"{c.weighted_saving_ms:.2f} ms/step saved over the mix on the sizes it sends NCCL, "
                                  f"against NCCL as it runs by default ({tag})", wide))
        lines += _paste(c, wide)
    else:
        lines.append(render.prose(f"{c.chosen}: {c.weighted_saving_ms:.2f} ms/step of allreduce saved over the mix "
                                  f"({tag})", wide))
        lines += _paste(c, wide)
    losses = [_said(cell) for cell in c.cells if cell.loses or cell.saving_us is None]
    if not c.is_default:
        lines.append(render.prose("where it loses: " + ("; ".join(losses) if losses else "nowhere"),
                                  wide, indent="  "))
    if c.next_command:
        lines += ["  the sweep that would price what is not measured here, on the serving box:",
                  f"    {c.next_command}"]
    return lines


def _paste(c: Configuration, wide: bool) -> list[str]:
    """The paste block, or why there is none, and the notes."""
    lines: list[str] = []
    if c.library:
        lines.append(render.prose(f"not paste-ready: {c.refused}", wide, indent="  "))
        if c.paste:
            lines.append("  the engine settings to run with it:")
            lines.extend(f"    {line}" for line in c.paste)
    elif c.refused:
        lines.append(render.prose(f"warning: settings from this run refused, not printed: {c.refused}", wide,
                                  indent="  "))
    else:
        lines.append("  paste-ready:")
        lines.extend(f"    {line}" for line in c.paste)
    lines.extend(render.prose(f"note: {n}", wide, indent="  ") for n in c.notes)
    return lines


def _column(kind: str, tokens: int, message_bytes: int) -> str:
    return f"c={tokens} {format_bytes(message_bytes)}" if kind == DECODE else f"prefill {format_bytes(message_bytes)}"


def tradeoffs(c: Configuration, wide: bool = False) -> str | None:
    """Every configuration the engine can take: us per call at each size of the mix and the
    prefill chunk, and the allreduce ms per step weighted over the mix (chosen marked '>')."""
    if c.weighted_saving_ms is None or len(c.candidates) < 2:
        return None
    headers = ["configuration", *(_column(cell.phase, cell.tokens, cell.message_bytes) for cell in c.cells),
               "ms/step"]
    rows = [[_mark(c, k) + k.label, *(fmt_us(u) for u in (*k.decode_us, k.prefill_us)),
             render.fmt_num(k.weighted_step_ms)] for k in c.candidates]
    return render.table(headers, rows, right=tuple(range(1, len(headers))), wide=wide)


def _mark(c: Configuration, k: Candidate) -> str:
    return "> " if (k.is_default and c.is_default) or k.label == c.chosen else "  "


def tradeoff_title(names: str, tag: str) -> str:
    return f"{names} trade-offs ({tag}): us per call ('-': not measured), ms/step over the mix; '>' chosen"
