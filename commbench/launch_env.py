"""What torchrun tells each worker through its environment; free of torch, so the CLI's entry
point can ask before (or without) importing it."""

from __future__ import annotations

import os


def torchrun_env() -> tuple[int, int, int, int]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; a world of one without torchrun."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
