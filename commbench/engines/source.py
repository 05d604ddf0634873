"""Where an engine's facts come from on this machine: the engine installed beside commbench (found
without importing it), a site-packages folder or unpacked wheel given with --engine-site, or the
facts built in. Reading is `ast` only (facts.py): no engine import, no torch.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from commbench.engines import sglang, vllm
from commbench.engines.facts import Difference, FactSet, read
from commbench.errors import UsageError

BUILT_IN: dict[str, FactSet] = {"vllm": vllm.FACTS, "sglang": sglang.FACTS}
CHECKED: dict[str, tuple[str, ...]] = {"vllm": vllm.CHECKED, "sglang": sglang.CHECKED}
VERSION_LINE = re.compile(r"^Version:\s*([0-9][0-9A-Za-z.+-]{0,31})\s*$", re.MULTILINE)
MAX_METADATA_BYTES = 1 << 20


def package_root(site: Path, engine: str) -> Path | None:
    """The folder holding `engine`'s package: site itself or the folder above a package dir."""
    if (site / engine / "__init__.py").is_file():
        return site
    if site.name == engine and (site / "__init__.py").is_file():
        return site.parent
    return None


def version_at(root: Path, engine: str) -> str | None:
    """The release of `engine` under root, from its dist-info METADATA (what pip wrote)."""
    for info in sorted(root.glob(f"{engine}-*.dist-info")):
        try:
            with open(info / "METADATA", encoding="utf-8", errors="replace") as handle:
                found = VERSION_LINE.search(handle.read(MAX_METADATA_BYTES))
        except OSError:
            continue
        if found:
            return found.group(1)
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


def engines_at(site: Path) -> list[str]:
    return [e for e in BUILT_IN if package_root(site, e) is not None]


def site_refusal(site: Path) -> str | None:
    if not site.exists():
        return f"{site} does not exist"
    if not site.is_dir():
        return f"{site} is not a folder (give a site-packages folder or an unpacked wheel)"
    if not engines_at(site):
        return f"{site} holds no vllm or sglang package (give a site-packages folder or an unpacked vLLM/SGLang wheel)"
    return None


def facts_from(root: Path, engine: str, origin: str) -> FactSet:
    """The facts of the engine under root: read with ast where commbench knows its release, else
    the built-in facts with a warning that names the release."""
    built_in = BUILT_IN[engine]
    version = version_at(root, engine)
    if version is None:
        return _with_warning(built_in, f"{built_in.name} under {root} has no readable version (dist-info METADATA): "
                                       f"{built_in.said} used")
    if version not in CHECKED[engine]:
        return _with_warning(built_in, f"{built_in.name} {version} {origin}: commbench has no reader checked "
                                       f"against it; {built_in.said} used (run `commbench engines --check "
                                       f"{root}` to see what differs)")
    facts, _ = read(root, built_in, version, origin)
    return facts


def _with_warning(facts: FactSet, warning: str) -> FactSet:
    return FactSet(facts.engine, facts.name, facts.version, facts.facts, facts.origin, (*facts.warnings, warning))


_ACTIVE: dict[str, FactSet] = {}
_SITE: list[Path] = []


def use_site(site: str | None) -> None:
    """--engine-site PATH: read the engines' facts from there (one line and exit 2 when it holds none)."""
    _ACTIVE.clear()
    _SITE.clear()
    if site is None:
        return
    path = Path(site)
    refusal = site_refusal(path)
    if refusal:
        raise UsageError(f"--engine-site: {refusal}")
    _SITE.append(path)


def active(engine: str) -> FactSet:
    """The facts every output uses for `engine`: --engine-site, else the installed engine, else built in."""
    if engine not in _ACTIVE:
        root = package_root(_SITE[0], engine) if _SITE else installed_root(engine)
        if root is None:
            built_in = BUILT_IN[engine]
            _ACTIVE[engine] = built_in if not _SITE else _with_warning(
                built_in, f"no {engine} package under {_SITE[0]}: {built_in.said} used")
        else:
            where = f"read from {root}" if _SITE else "installed here"
            _ACTIVE[engine] = facts_from(root, engine, where)
    return _ACTIVE[engine]


def provenance_line(facts: FactSet) -> str:
    """'read from vLLM 0.34.0 installed here' / 'vLLM 0.34.0 facts built in (not installed here)'."""
    if facts.origin == "installed here":
        return f"read from {facts.name} {facts.version} installed here"
    if facts.origin == "built in":
        return f"{facts.said} (not installed here)"
    return f"{facts.name} {facts.version} {facts.origin}"


def check(site: Path) -> tuple[list[tuple[FactSet, list[Difference]]], str | None]:
    """Every built-in fact compared with the engine source under `site`, per engine found there."""
    refusal = site_refusal(site)
    if refusal:
        return [], refusal
    out = []
    for engine in engines_at(site):
        root = package_root(site, engine)
        assert root is not None
        version = version_at(root, engine) or "unknown version"
        out.append(read(root, BUILT_IN[engine], version, f"read from {root}"))
    return out, None
