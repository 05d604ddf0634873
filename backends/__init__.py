"""Backend registry: built-in families plus the ``commbench.backends`` entry-point group.

A new built-in backend is one module (or folder) in this folder and one line in BUILTIN below; a
family with flags of its own is a folder whose `flags` module declares them without importing
torch (`flags_of`). Outside packages register a ``BackendFactory`` under the entry-point group
``commbench.backends``:

    [project.entry-points."commbench.backends"]
    mykernel = "mypkg.commbench_backend:FACTORY"

Either way the family brings its own flags, needs, software check, engine settings and
observations (commbench.backends.base); nothing else in commbench names a backend.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Mapping

from commbench.backends.factory import BackendFactory, BackendUnavailable, MakeOptions, SweepFacts
from commbench.errors import UsageError

if TYPE_CHECKING:
    from commbench.backends.base import Backend

ENTRY_POINT_GROUP = "commbench.backends"

# family -> module exposing FACTORY. Imported lazily: optional dependencies stay optional.
BUILTIN: dict[str, str] = {
    "nccl": "commbench.backends.nccl.variants",
    "nccl4py": "commbench.backends.nccl4py",
    "gloo": "commbench.backends.gloo",
    "p2p": "commbench.backends.p2p.variants",
    "symm_mem": "commbench.backends.symm_mem",
    "flashinfer": "commbench.backends.flashinfer.variants",
    "mscclpp": "commbench.backends.mscclpp.backend",
    "unfused": "commbench.backends.unfused",
    "sglang": "commbench.backends.sglang_custom_ar",
    "vllm": "commbench.backends.vllm_custom_ar",
}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def families() -> list[str]:
    return list(BUILTIN) + sorted(set(_entry_points()) - set(BUILTIN))


@cache
def factory(family: str) -> BackendFactory:
    """The family's factory; UsageError when it is unknown or its plug-in is broken."""
    if family in BUILTIN:
        return importlib.import_module(BUILTIN[family]).FACTORY
    plugins = _entry_points()
    if family not in plugins:
        raise UsageError(f"unknown backend {family!r}: choose from {', '.join(families())}")
    try:
        loaded = plugins[family].load()
    except Exception as exc:  # an installed plug-in that does not import
        raise UsageError(f"backend plug-in {family!r} ({plugins[family].value}) does not load: "
                         f"{type(exc).__name__}: {exc}") from None
    if not isinstance(loaded, BackendFactory):
        raise UsageError(f"entry point {family!r} in {ENTRY_POINT_GROUP} is not a BackendFactory")
    return loaded


def is_builtin(family: str) -> bool:
    """One of this package's families (BUILTIN), not a plug-in."""
    return family in BUILTIN


def runs_native_code(family: str) -> bool:
    """Optional native code that may crash the process (the factory says; plug-ins are unless
    they say otherwise): the sweep runs such families after the built-in ones."""
    native = factory(family).native
    return family not in BUILTIN if native is None else native


def usable_factories() -> list[BackendFactory]:
    """Every family that loads; a broken plug-in is skipped with one warning, so it can only
    stop a run that asks for it by name."""
    out = []
    for family in families():
        try:
            out.append(factory(family))
        except UsageError as exc:
            _warn_once(str(exc))
    return out


@cache
def _warn_once(line: str) -> None:
    print(f"commbench: warning: {line} (skipped)", file=sys.stderr)


def split_specs(text: str) -> list[str]:
    """Split a --backends list. Commas also separate key=value options inside one spec,
    so 'nccl:proto=LL,algo=Ring,p2p:oneshot' is two specs."""
    specs: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if specs and "=" in token and ":" not in token:
            specs[-1] += "," + token
        else:
            specs.append(token)
    return specs


def _unique(variants: list[Backend]) -> list[Backend]:
    seen: set[str] = set()
    unique = []
    for backend in variants:
        if backend.name not in seen:
            seen.add(backend.name)
            unique.append(backend)
    return unique


@dataclass(frozen=True)
class Options:
    """What the sweep hands the families: its facts and each family's own options, as read_options
    returned them (a family left out gets its flags' defaults). Each family's make sees its own."""

    sweep: SweepFacts = SweepFacts()
    families: Mapping[str, Any] = field(default_factory=dict)

    def make(self, fac: BackendFactory, variant: str | None) -> list[Backend]:
        own = self.families[fac.family] if fac.family in self.families else fac.default_options()
        return fac.make(variant, MakeOptions(own, self.sweep, self.build))

    def build(self, name: str) -> Backend:
        """The variant behind a measured row's name, made the way the sweep made it."""
        family, _, variant = name.partition(":")
        for backend in self.make(factory(family), variant or None):
            if backend.name == name:
                return backend
        raise BackendUnavailable(f"cannot rebuild backend {name!r}")


def _make(fac: BackendFactory, variant: str | None, options: Options, skip_if_broken: bool) -> list[Backend]:
    """fac.make(). A plug-in that fails there (other than refusing bad input, UsageError) is
    a one-line UsageError when asked for by name, and left out with one warning otherwise."""
    try:
        return options.make(fac, variant)
    except UsageError:
        raise
    except Exception as exc:
        if fac.family in BUILTIN:
            raise   # commbench's own bug: the traceback says where
        spec = fac.family + (f":{variant}" if variant else "")
        line = f"backend plug-in {spec!r} could not make its backends: {type(exc).__name__}: {exc}"
        if not skip_if_broken:
            raise UsageError(line) from None
        _warn_once(line)
        return []


def expand(specs: list[str] | None, options: Options, on_gpu: bool, world_size: int | None = None) -> list[Backend]:
    """Backend variants for the specs; None means every family's defaults for this machine.
    With world_size, a spec none of whose variants can ever use that many ranks is bad input (a
    variant named alone, or a family that cannot run there). A family's variant that cannot,
    beside some that can (`mscclpp` at 2 ranks: rsag_zero_copy runs 4 or 8), stays: its check()
    makes it a skipped row with the reason, as it does for spanning nodes, a fact of the machine."""
    variants: list[Backend] = []
    if specs is None:
        for fac in usable_factories():
            if fac.on_gpu_by_default if on_gpu else fac.on_cpu_by_default:
                variants.extend(_make(fac, None, options, skip_if_broken=True))
    else:
        for spec in specs:
            family, _, variant = spec.partition(":")
            made = _make(factory(family.strip()), variant.strip() or None, options, skip_if_broken=False)
            if world_size is not None:
                _refuse_world_size(made, world_size)
            variants.extend(made)
    return _unique(variants)


def _refuse_world_size(variants: list[Backend], world_size: int) -> None:
    reasons = [(backend.name, backend.world_size_reason(world_size)) for backend in variants]
    if reasons and all(reason for _, reason in reasons):
        name, reason = reasons[0]
        raise UsageError(f"backend {name} cannot run with {world_size} rank(s): {reason}")


def probe_variants(options: Options = Options()) -> list[Backend]:
    """The variants the probe gives a verdict for: each family's probe_specs."""
    return _unique([b for fac in usable_factories() for spec in fac.probe_specs
                    for b in _make(fac, spec, options, skip_if_broken=True)])


def flags_of(family: str) -> Callable[[argparse._ArgumentGroup], None] | None:
    """A family's flags. A built-in family with flags is a folder, and declares them in the
    `flags` module beside its factory module, which imports no torch: the sweep's parser (and
    `sweep --help`) loads no family's code. A plug-in's come from its factory."""
    if family not in BUILTIN:
        return factory(family).add_arguments
    package = BUILTIN[family].rpartition(".")[0]
    if package in ("", __name__):   # a family of one module: no flags of its own
        return None
    name = f"{package}.flags"
    return importlib.import_module(name).add_arguments if importlib.util.find_spec(name) else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every family's own flags, in an argument group named after it; a plug-in whose flags
    cannot be added (a name another family took, a bug, a plug-in that does not load) is left out
    with one warning."""
    for family in families():
        try:
            flags = flags_of(family)
        except UsageError as exc:
            _warn_once(str(exc))
            continue
        if flags is None:
            continue
        group = parser.add_argument_group(f"{family} backend")
        try:
            flags(group)
        except Exception as exc:
            if family in BUILTIN:
                raise
            _warn_once(f"backend plug-in {family!r} could not add its flags: {type(exc).__name__}: {exc}")


def read_options(args: argparse.Namespace) -> dict[str, Any]:
    """Each family's own options, read from the parsed flags (validated there: bad input raises)."""
    options: dict[str, Any] = {}
    for fac in usable_factories():
        if fac.read_options is None:
            continue
        try:
            options[fac.family] = fac.read_options(args)
        except UsageError:
            raise
        except Exception as exc:  # a bug in an installed plug-in, or flags it never added
            if fac.family in BUILTIN:
                raise
            _warn_once(f"backend plug-in {fac.family!r} could not read its flags: {type(exc).__name__}: {exc}")
    return options


def packages() -> tuple[str, ...]:
    """Distributions whose versions the families want recorded."""
    return tuple(dict.fromkeys(name for fac in usable_factories() for name in fac.packages))
