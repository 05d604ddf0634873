"""Which GPUs and pairs a run of a given world size would use, read from a snapshot (pure).

Ranks map onto GPUs the way torchrun + init_context do: in a torchrun snapshot, rank r is
participant r; in a single-process snapshot, rank r uses GPU r modulo the GPU count (several
ranks share a GPU only with --share-gpus).
"""

from __future__ import annotations

from typing import Any


def used_gpus(snapshot: dict[str, Any], world_size: int) -> list[int]:
    """GPU index per rank, for ranks 0..world_size-1 (empty without GPUs)."""
    gpus = snapshot.get("gpus") or []
    if not gpus:
        return []
    if snapshot.get("mode") == "torchrun":
        parts = [p for p in snapshot.get("participants", []) if p.get("gpu") is not None]
        if len(parts) >= world_size:
            return [parts[r]["gpu"] for r in range(world_size)]
    return [r % len(gpus) for r in range(world_size)]


def used_hosts(snapshot: dict[str, Any], world_size: int) -> set[str]:
    gpus = snapshot.get("gpus") or []
    return {gpus[g].get("host") for g in used_gpus(snapshot, world_size)}  # one host when unrecorded


def gpu_pairs(gpu_ids: list[int]) -> list[tuple[int, int]]:
    """Distinct directed pairs of different GPUs among the used ones."""
    distinct = sorted(set(gpu_ids))
    return [(a, b) for a in distinct for b in distinct if a != b]


def p2p_entry(snapshot: dict[str, Any], src: int, dst: int) -> dict[str, Any] | None:
    for e in snapshot.get("p2p") or []:
        if e.get("src") == src and e.get("dst") == dst:
            return e
    return None


def link(snapshot: dict[str, Any], a: int, b: int) -> str:
    matrix = (snapshot.get("links") or {}).get("matrix") or []
    try:
        return matrix[a][b]
    except (IndexError, TypeError):
        return "?"


def is_nvlink(label: str) -> bool:
    return label.startswith("NV")


def non_nvlink_pairs(snapshot: dict[str, Any], world_size: int) -> list[tuple[int, int, str]]:
    """The run's directed pairs of different GPUs that the snapshot does not show joined by
    NVLink, with their link label ("?" where it recorded none)."""
    pairs = [(a, b, link(snapshot, a, b)) for a, b in gpu_pairs(used_gpus(snapshot, world_size))]
    return [(a, b, label) for a, b, label in pairs if not is_nvlink(label)]


def participant_gpu(snapshot: dict[str, Any]) -> dict[int, int | None]:
    return {p["id"]: p.get("gpu") for p in snapshot.get("participants") or []}
