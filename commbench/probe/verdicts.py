"""Can each backend variant run here? A pure function of a snapshot and what the variant declares.

A variant's verdict is, in order: no GPU at all (for a variant that needs one), its software (installed, importable, new enough:
Backend.software_reason, as the probed machine answered it: the snapshot records it, so a
snapshot re-rendered elsewhere keeps its own machine's answer), its static world-size rule,
then every need it declares (Backend.needs, checked by commbench.topology.needs). The variants are those of the backend
registry (commbench.backends.probe_variants), plug-ins included. A variant may also warn about
a snapshot where it runs but should not be trusted (Backend.snapshot_warning: NCCL's LL128 off
NVLink).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commbench.topology.needs import NO_GPU, gpu_side, needs_reason

if TYPE_CHECKING:
    from commbench.backends.base import Backend


def reason_for(backend: "Backend", snapshot: dict[str, Any], world_size: int, allow_multicast: bool) -> str | None:
    """None when the variant can run on this snapshot at this world size, else the reason."""
    if gpu_side(backend.needs) and not snapshot.get("gpus"):
        return NO_GPU
    software = (snapshot.get("backend_software") or {}).get(backend.name)
    if software:
        return software
    static = backend.world_size_reason(world_size)
    if static:
        return static
    return needs_reason(backend.needs, snapshot, world_size, allow_multicast)


def software_record(variants: list["Backend"]) -> dict[str, str | None]:
    """What this machine's software says for each variant, for the snapshot."""
    return {b.name: b.software_reason() for b in variants}


def run_verdicts(variants: list["Backend"], snapshot: dict[str, Any], world_size: int,
                 allow_multicast: bool) -> dict[str, str | None]:
    """The sweep's verdicts for its own variants: as backend_verdicts, but with the software
    answer each variant gives with the run's options (the snapshot's record was taken from
    variants with none, e.g. mscclpp:shim without --mscclpp-nccl-lib)."""
    return backend_verdicts({**snapshot, "backend_software": software_record(variants)}, world_size,
                            allow_multicast, variants)


def backend_verdicts(snapshot: dict[str, Any], world_size: int, allow_multicast: bool,
                     variants: list["Backend"] | None = None) -> dict[str, str | None]:
    """Variant name -> reason it cannot run (None: it can), for every registered variant."""
    if variants is None:
        from commbench.backends import probe_variants

        variants = probe_variants()
    return {b.name: reason_for(b, snapshot, world_size, allow_multicast) for b in variants}

