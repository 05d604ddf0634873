"""`commbench engines --check PATH`: every engine found under PATH (an unpacked wheel or a
site-packages folder) against commbench's built-in model of it: each fact read again with ast
(facts.py), and each gate and the dispatch order run as the engine's own functions in a child
process and compared over a grid (gates.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from commbench.engines import gates
from commbench.engines.facts import Difference, FactSet, SourceTree, read
from commbench.engines.paths import Engine
from commbench.engines.source import engines_at, package_root, site_refusal, version_at


@dataclass(frozen=True)
class EngineCheck:
    engine: Engine
    facts: FactSet                    # as the source gives them
    differences: list[Difference]
    gates: list[gates.GateChecked]


def check(site: Path) -> tuple[list[EngineCheck], str | None]:
    """Every engine under `site`, or why `site` holds none."""
    refusal = site_refusal(site)
    if refusal:
        return [], refusal
    out = []
    for engine in engines_at(site):
        root = package_root(site, engine.key)
        assert root is not None
        version = version_at(root, engine.key) or "unknown version"
        facts, differences = read(SourceTree(root), engine.facts, version, f"read from {root}")
        out.append(EngineCheck(engine, facts, differences, gates.check(root, engine, facts)))
    return out, None
