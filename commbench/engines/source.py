"""Where an engine's facts come from on this machine: the engine installed beside commbench (found
without importing it), a site-packages folder or unpacked wheel given with --engine-site, or the
facts built in. Resolved once per command into a `Sources` that is passed down (no module state).
Reading is facts.SourceTree's (`ast`): no engine import, no torch.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from commbench.engines.facts import FactSet, Library, SourceTree, read
from commbench.engines.paths import Engine
from commbench.engines.registry import BY_KEY, ENGINES, LIBRARIES
from commbench.errors import UsageError
from commbench.files import NoSuchFile, read_lines

VERSION_LINE = re.compile(r"Version:\s*([0-9][0-9A-Za-z.+-]{0,31})\s*")
MAX_METADATA_BYTES = 1 << 20     # its header, where Version is, is read; the description after it never


def package_root(site: Path, package: str) -> Path | None:
    """The folder holding a package (an engine's or a library's): site itself or the folder above
    a package dir."""
    if (site / package / "__init__.py").is_file():
        return site
    if site.name == package and (site / "__init__.py").is_file():
        return site.parent
    return None


def version_at(root: Path, distribution: str) -> str | None:
    """The release of a distribution under root (an engine's is its key; a library's its
    `distribution`), from its dist-info METADATA (what pip wrote): its header lines, read up to the
    blank line that ends them. A METADATA that is not there is skipped; one that is no regular
    file, binary or past its bound is bad input (UsageError)."""
    for info in sorted(root.glob(f"{distribution}-*.dist-info")):
        try:
            for line in read_lines(info / "METADATA", "a dist-info METADATA", MAX_METADATA_BYTES):
                if not line.strip():
                    break
                found = VERSION_LINE.fullmatch(line)
                if found:
                    return found.group(1)
        except NoSuchFile:
            continue
    return None


def installed_root(engine: str) -> Path | None:
    """Where `engine` is importable from commbench's environment, found without importing it
    (find_spec of a top-level name runs none of its code)."""
    try:
        spec = importlib.util.find_spec(engine)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return package_root(Path(list(spec.submodule_search_locations)[0]), engine)


def engines_at(site: Path) -> list[Engine]:
    return [e for e in ENGINES if package_root(site, e.key) is not None]


def libraries_at(site: Path) -> list[Library]:
    return [lib for lib in LIBRARIES if package_root(site, lib.key) is not None]


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def site_refusal(site: Path, libraries: bool = False) -> str | None:
    """Why `site` is no tree to read: it must hold an engine's package (or, with `libraries`, as
    `engines --check` reads, a library's)."""
    if not site.exists():
        return f"{site} does not exist"
    if not site.is_dir():
        return f"{site} is not a folder (give a site-packages folder or an unpacked wheel)"
    if not engines_at(site) and not (libraries and libraries_at(site)):
        facts = [e.facts for e in ENGINES] + ([lib.facts for lib in LIBRARIES] if libraries else [])
        return (f"{site} holds no {_either([f.engine for f in facts])} package (give a site-packages folder or an "
                f"unpacked {_either([f.name for f in facts])} wheel)")
    return None


def _with_warning(facts: FactSet, warning: str) -> FactSet:
    return FactSet(facts.engine, facts.name, facts.version, facts.facts, facts.origin, (*facts.warnings, warning))


def facts_from(root: Path, engine: Engine, origin: str) -> FactSet:
    """The facts of the engine under root: read with ast where commbench knows its release, else
    the built-in facts with a warning that names the release."""
    built_in = engine.facts
    version = version_at(root, engine.key)
    if version is None:
        return _with_warning(built_in, f"{built_in.name} under {root} has no readable version (dist-info METADATA): "
                                       f"{built_in.said} used")
    if version not in engine.checked:
        return _with_warning(built_in, f"{built_in.name} {version} {origin}: commbench has no reader checked "
                                       f"against it; {built_in.said} used (run `commbench engines --check "
                                       f"{root}` to see what differs)")
    facts, _ = read(SourceTree(root), built_in, version, origin)
    return facts


@dataclass(frozen=True)
class Sources:
    """The facts every output of one command uses, per engine: --engine-site, else the installed
    engine, else built in."""

    facts: dict[str, FactSet]

    def __getitem__(self, engine: str) -> FactSet:
        return self.facts[engine]

    def versions(self) -> dict[str, str]:
        return {key: f.version for key, f in self.facts.items()}


def resolve(site: str | None) -> Sources:
    """--engine-site PATH (one line and exit 2 when it holds no engine), else what is installed here,
    else the facts built in."""
    path = Path(site) if site is not None else None
    if path is not None:
        refusal = site_refusal(path)
        if refusal:
            raise UsageError(f"--engine-site: {refusal}")
    found = {}
    for engine in ENGINES:
        root = package_root(path, engine.key) if path is not None else installed_root(engine.key)
        if root is None:
            found[engine.key] = engine.facts if path is None else _with_warning(
                engine.facts, f"no {engine.key} package under {path}: {engine.facts.said} used")
        else:
            found[engine.key] = facts_from(root, engine, f"read from {root}" if path is not None else "installed here")
    return Sources(found)


BUILT_IN = Sources({e.key: e.facts for e in ENGINES})


def provenance_line(facts: FactSet) -> str:
    """'read from vLLM 0.34.0 installed here' / 'vLLM 0.34.0 facts built in (not installed here)'."""
    if facts.origin == "installed here":
        return f"read from {facts.name} {facts.version} installed here"
    if facts.origin == "built in":
        return f"{facts.said} (not installed here)"
    return f"{facts.name} {facts.version} {facts.origin}"


def engine(key: str) -> Engine:
    return BY_KEY[key]
