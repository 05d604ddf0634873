"""Backend registry: built-in families plus the ``commbench.backends`` entry-point group.

A new built-in backend is one module in this folder and one line in BUILTIN below. Outside
packages register a ``BackendFactory`` under the entry-point group ``commbench.backends``:

    [project.entry-points."commbench.backends"]
    mykernel = "mypkg.commbench_backend:FACTORY"
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

from commbench.backends.base import Backend, BackendFactory
from commbench.errors import UsageError

ENTRY_POINT_GROUP = "commbench.backends"

# family -> module exposing FACTORY. Imported lazily: optional dependencies stay optional.
BUILTIN: dict[str, str] = {
    "nccl": "commbench.backends.nccl",
    "gloo": "commbench.backends.gloo",
    "p2p": "commbench.backends.p2p",
    "symm_mem": "commbench.backends.symm_mem",
    "flashinfer": "commbench.backends.flashinfer",
    "mscclpp": "commbench.backends.mscclpp",
    "unfused": "commbench.backends.unfused",
}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def families() -> list[str]:
    return list(BUILTIN) + sorted(set(_entry_points()) - set(BUILTIN))


def factory(family: str) -> BackendFactory:
    if family in BUILTIN:
        return importlib.import_module(BUILTIN[family]).FACTORY
    plugins = _entry_points()
    if family in plugins:
        loaded = plugins[family].load()
        if not isinstance(loaded, BackendFactory):
            raise UsageError(f"entry point {family!r} in {ENTRY_POINT_GROUP} is not a BackendFactory")
        return loaded
    raise UsageError(f"unknown backend {family!r}: choose from {', '.join(families())}")


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


def expand(specs: list[str] | None, options: dict[str, Any], on_gpu: bool) -> list[Backend]:
    """Backend variants for the specs; None means every family's defaults for this machine."""
    variants: list[Backend] = []
    if specs is None:
        for family in families():
            fac = factory(family)
            if (fac.on_gpu_by_default if on_gpu else fac.on_cpu_by_default):
                variants.extend(fac.make(None, options))
    else:
        for spec in specs:
            family, _, variant = spec.partition(":")
            variants.extend(factory(family.strip()).make(variant.strip() or None, options))
    seen: set[str] = set()
    unique = []
    for backend in variants:
        if backend.name not in seen:
            seen.add(backend.name)
            unique.append(backend)
    return unique
