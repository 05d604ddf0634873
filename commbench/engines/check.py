"""`commbench engines --check PATH`: every engine found under PATH (an unpacked wheel or a
site-packages folder) against commbench's built-in model of it: each fact read again with ast
(facts.py), and each gate and the dispatch order run as the engine's own functions in a child
process and compared over a grid (gates.py). A library the engines call whose facts are built in
(registry.LIBRARIES) is checked beside them, by its facts alone: it has no gates of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from commbench.engines import gates
from commbench.engines.facts import Difference, FactSet, Library, SourceTree, read
from commbench.engines.paths import Engine
from commbench.engines.source import engines_at, libraries_at, package_root, site_refusal, version_at


@dataclass(frozen=True)
class EngineCheck:
    engine: Engine
    facts: FactSet                    # as the source gives them
    differences: list[Difference]
    gates: list[gates.GateChecked]


@dataclass(frozen=True)
class LibraryCheck:
    library: Library
    facts: FactSet                    # as the source gives them
    differences: list[Difference]


def _read(site: Path, package: str, distribution: str, built_in: FactSet) -> tuple[Path, FactSet, list[Difference]]:
    root = package_root(site, package)
    assert root is not None
    version = version_at(root, distribution) or "unknown version"
    return (root, *read(SourceTree(root), built_in, version, f"read from {root}"))


def check(site: Path) -> tuple[list[EngineCheck], list[LibraryCheck], str | None]:
    """Every engine and library under `site`, or why `site` holds none."""
    refusal = site_refusal(site, libraries=True)
    if refusal:
        return [], [], refusal
    engines = []
    for engine in engines_at(site):
        root, facts, differences = _read(site, engine.key, engine.key, engine.facts)
        engines.append(EngineCheck(engine, facts, differences, gates.check(root, engine, facts)))
    libraries = [LibraryCheck(lib, *_read(site, lib.key, lib.distribution, lib.facts)[1:])
                 for lib in libraries_at(site)]
    return engines, libraries, None
