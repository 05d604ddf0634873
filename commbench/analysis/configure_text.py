"""A Configuration (configure.py) as terminal text: one paste block per engine with what the
configuration saves per decode step, costs per prefill chunk and nets per request, where it loses,
and the trade-off table of every configuration the engine can take over the serving mix."""

from __future__ import annotations

from commbench.analysis import render
from commbench.analysis.configure import DECODE, NCCL_SCOPE, Candidate, Cell, Configuration, loads_text
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


def _request(c: Configuration, brief: bool) -> str:
    source = "" if brief else f" ({c.prefill_source})"
    return (f"a request: one prefill chunk of {c.prefill_tokens} tokens{source} and {c.output_tokens} output "
            "tokens")


def block(c: Configuration, tag: str, wide: bool = False, brief: bool = False) -> list[str]:
    """What to run: the configuration, its saving per step, per prefill chunk and per request, the
    paste block, its losses; where nothing can be priced, why and the command that would price it."""
    sweep = (["the sweep that would price it, on the serving box with one GPU per rank:", f"    {c.next_command}"]
             if c.next_command else [])
    unpriced = [render.prose(f"not priced: {why}", wide, indent="  ") for why in c.unpriced]
    if c.chosen is None:
        return [render.prose(f"no configuration can be priced from this run ({tag}): {c.why}", wide), *unpriced,
                *sweep]
    if c.weighted_saving_ms is None:   # the default is not priced here: the fastest measured, no saving claimed
        return [render.prose(f"no saving can be priced from this run ({tag}): {c.why}. The fastest configuration "
                             f"measured here: {c.chosen}", wide), *_paste(c, wide), *unpriced, *sweep]
    lines = [render.prose(f"one configuration for {loads_text(c.loads)}; {_request(c, brief)}:", wide)]
    if c.is_default and c.scope == NCCL_SCOPE:
        lines.append(render.prose(f"its NCCL path only (the box is not known): NCCL as it runs by default is the "
                                  f"cheapest NCCL setting measured here per request, nothing to set ({tag})", wide))
    elif c.is_default:
        said = c.why or "the engine's default is the cheapest configuration measured here"
        lines.append(render.prose(f"the engine's default: nothing to set ({said}; {tag})", wide))
    else:
        scope = ("its NCCL path only (the box is not known), against NCCL as it runs by default, on the sizes it "
                 "sends NCCL: " if c.scope == NCCL_SCOPE else "")
        lines.append(render.prose(f"{scope}{c.chosen} ({tag}):", wide))
        lines += per_request(c, wide)
        lines += _paste(c, wide)
    lines += _not_chosen(c, wide) + unpriced
    losses = [_said(cell) for cell in c.cells
              if cell.phase == DECODE and (cell.loses or cell.saving_us is None)]
    if not c.is_default:
        lines.append(render.prose("where it loses: " + ("; ".join(losses) if losses else "at no decode size"),
                                  wide, indent="  "))
    if c.next_command:
        lines += ["  the sweep that would price what is not measured here, on the serving box:",
                  f"    {c.next_command}"]
    return lines


def per_request(c: Configuration, wide: bool) -> list[str]:
    """The decode saving per step, the prefill cost per chunk and the net per request, in ms."""
    saving, n = c.weighted_saving_ms or 0.0, c.output_tokens
    prefill = next(cell for cell in c.cells if cell.phase != DECODE)
    chunk = f"{c.prefill_tokens}-token chunk ({format_bytes(prefill.message_bytes)})"
    if not c.prefill_weighed:
        said = f"prefill: not weighed, the default is not measured at the {chunk}"
    elif c.prefill_cost_ms is None:
        said = f"prefill: the configuration is not measured at the {chunk}"
    elif abs(c.prefill_cost_ms) < 0.005:
        said = f"prefill: the same per {chunk}"
    else:
        word = "more" if c.prefill_cost_ms > 0 else "less"
        said = (f"prefill: {abs(c.prefill_cost_ms):.1f} ms {word} per {chunk}, "
                f"{abs(prefill.saving_us or 0.0):.1f} us/call {'slower' if c.prefill_cost_ms > 0 else 'faster'}"
                + (", inside the spread" if prefill.beyond_spread is False else ""))
    net = c.net_request_ms or 0.0
    return [render.prose(f"decode: {saving:.2f} ms/step of allreduce saved over the mix x {n} output tokens = "
                         f"{n * saving:,.1f} ms", wide, indent="  "),
            render.prose(said, wide, indent="  "),
            render.prose(f"net: {abs(net):,.1f} ms of allreduce {'saved' if net >= 0 else 'lost'} per request", wide,
                         indent="  ")]


def _not_chosen(c: Configuration, wide: bool) -> list[str]:
    """The configuration that saves the most per decode step, where the prefill chunk makes it
    lose per request, so it is not chosen."""
    base = next((k for k in c.candidates if k.is_default), None)
    steps = [k for k in c.candidates if k.weighted_step_ms is not None and not k.is_default]
    if base is None or base.weighted_step_ms is None or not steps or not c.prefill_weighed:
        return []
    fastest = min(steps, key=lambda k: k.weighted_step_ms)  # type: ignore[arg-type, return-value]
    if fastest.label == c.chosen or fastest.weighted_step_ms >= base.weighted_step_ms \
            or fastest.request_ms is None or base.request_ms is None:  # type: ignore[operator]
        return []
    saved = base.weighted_step_ms - fastest.weighted_step_ms  # type: ignore[operator]
    cost = (fastest.prefill_chunk_ms or 0.0) - (base.prefill_chunk_ms or 0.0)
    net = base.request_ms - fastest.request_ms
    return [render.prose(f"not chosen: {fastest.label}: {saved:.2f} ms/step saved x {c.output_tokens} = "
                         f"{c.output_tokens * saved:,.1f} ms, {cost:,.1f} ms more per prefill chunk: {abs(net):,.1f} ms "
                         f"{'lost' if net < 0 else 'saved'} per request", wide, indent="  ")]


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


def tradeoffs(c: Configuration, wide: bool = False) -> str | None:
    """Every configuration the engine can take, on what the choice is made: the allreduce ms per
    decode step over the mix, per prefill chunk and per request (chosen marked '>')."""
    if c.weighted_saving_ms is None or len(c.candidates) < 2:
        return None
    headers = ["configuration", "ms/step", "ms/prefill chunk", "ms/request"]
    rows = [[_mark(c, k) + k.label, render.fmt_num(k.weighted_step_ms), render.fmt_num(k.prefill_chunk_ms),
             "-" if k.request_ms is None else f"{k.request_ms:,.1f}"] for k in c.candidates]
    return render.table(headers, rows, right=(1, 2, 3), wide=wide)


def _mark(c: Configuration, k: Candidate) -> str:
    return "> " if (k.is_default and c.is_default) or k.label == c.chosen else "  "


def tradeoff_title(names: str, tag: str, c: Configuration) -> str:
    chunk = " + one prefill chunk" if c.prefill_weighed else " (the chunk not weighed)"
    return f"{names} trade-offs ({tag}): allreduce ms; ms/request = {c.output_tokens} x ms/step{chunk}; '>' chosen"
