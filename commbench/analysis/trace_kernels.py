"""Which profiler-trace kernel is an allreduce, and whose: the patterns every backend module owns.

Each backend module (built-in or plug-in) may define a module-level literal

    TRACE_KERNELS = ((kernel_regex, library, floor_variant_regex, note), ...)

where an entry may add a fifth item, the op its kernel computes (commbench.ops: "allreduce" when
left out; FlashInfer's fused allreduce + residual + RMSNorm kernels say "allreduce_residual_rmsnorm",
so that they are set against rows of that op and shape, never against a bare allreduce).

and commbench.engines holds the engines' own kernels the same way. The backend modules import
torch at the top and the analysis never does, so the literal is read from the module's source
with ast: the built-in package's folder comes from its import spec (which does not run
backends/__init__.py), a plug-in's module from its entry point's origin.

A kernel matched by entries of more than one library is reported as ambiguous, naming them all;
an unmatched kernel whose name says allreduce (or an NCCL kernel no entry names) is
"unclassified communication", never compute. Every other kernel is compute.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

from commbench import engines
from commbench.ops import ALLREDUCE, SHAPED_OPS

BACKENDS_PACKAGE = "commbench.backends"
ENTRY_POINT_GROUP = "commbench.backends"
LITERAL_NAME = "TRACE_KERNELS"
UNCLASSIFIED = "unclassified communication"
# Names that say communication though no module claims them (HTA's own rule is only ^nccl).
COMMUNICATION_HINT = re.compile(r"all_?reduce|allreduce|AllReduce|reduce_scatter|all_?gather|\bnccl\w*Kernel",
                                re.IGNORECASE)


@dataclass(frozen=True)
class KernelPattern:
    regex: re.Pattern[str]
    library: str
    floor_variants: str      # regex over a run's backend names; "" = no commbench backend measures it
    note: str
    source: str              # the module that owns it
    op: str = ALLREDUCE      # what its kernel computes (commbench.ops)


@dataclass(frozen=True)
class Classification:
    kind: str                # "allreduce" | "communication" | "compute"
    library: str             # who runs it ("" for compute)
    floor_variants: str      # "" when unknown or ambiguous
    note: str
    op: str = ALLREDUCE      # what the kernel computes; "" where its library's entries disagree


def literal_patterns(source_text: str, origin: str) -> list[KernelPattern]:
    """TRACE_KERNELS of one module's source, or none; a malformed literal is skipped whole."""
    try:
        tree = ast.parse(source_text, filename=origin)
    except SyntaxError:
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == LITERAL_NAME
                                                for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
                return [_pattern(entry, origin) for entry in value]
            except (ValueError, TypeError, re.error):
                return []
    return []


def _pattern(entry: object, origin: str) -> KernelPattern:
    if not (isinstance(entry, tuple) and len(entry) in (4, 5) and all(isinstance(x, str) for x in entry)):
        raise ValueError(f"{origin}: {LITERAL_NAME} entries are (regex, library, floor regex, note[, op])")
    regex, library, floor, note, *op = entry
    if op and op[0] not in (ALLREDUCE, *SHAPED_OPS):
        raise ValueError(f"{origin}: {LITERAL_NAME}: an entry's op is one of {ALLREDUCE}, {', '.join(SHAPED_OPS)}")
    if floor:
        re.compile(floor)
    return KernelPattern(re.compile(regex), library, floor, note, origin, *op)


def _module_files() -> dict[Path, str]:
    """Each module file to read -> its name on a pattern: a built-in's path in the package (a
    family may be a folder: p2p/backend.py), a plug-in's file name."""
    spec = importlib.util.find_spec(BACKENDS_PACKAGE)
    files: dict[Path, str] = {}
    for folder in (spec.submodule_search_locations or []) if spec else []:
        files.update((path, path.relative_to(folder).as_posix()) for path in sorted(Path(folder).rglob("*.py")))
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        module_name = ep.value.partition(":")[0].strip()
        try:
            origin = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):   # a plug-in whose parent package is missing
            continue
        if origin is not None and origin.origin and origin.origin.endswith(".py"):
            files.setdefault(Path(origin.origin), Path(origin.origin).name)
    return files


@cache
def all_patterns() -> tuple[KernelPattern, ...]:
    """Every module's patterns; the engines' own first."""
    out = [_pattern(entry, "commbench/engines/settings.py") for entry in engines.TRACE_KERNELS]
    for path, name in _module_files().items():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.extend(literal_patterns(text, name))
    return tuple(out)


def classify(name: str, patterns: tuple[KernelPattern, ...] | None = None) -> Classification:
    patterns = all_patterns() if patterns is None else patterns
    hits = [p for p in patterns if p.regex.search(name)]
    libraries = list(dict.fromkeys(p.library for p in hits))
    if len(libraries) == 1:
        floors = {p.floor_variants for p in hits}
        ops = {p.op for p in hits}
        notes = [p.note for p in hits if p.note]
        return Classification("allreduce", libraries[0], floors.pop() if len(floors) == 1 else "",
                              notes[0] if notes else "", ops.pop() if len(ops) == 1 else "")
    if libraries:
        return Classification("allreduce", "ambiguous: " + " or ".join(libraries), "",
                              "more than one library's kernels carry this name")
    if COMMUNICATION_HINT.search(name):
        return Classification("communication", UNCLASSIFIED, "", "no backend module names this kernel")
    return Classification("compute", "", "", "")
