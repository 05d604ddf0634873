"""What one rank brings to the gather of a cell: Skipped, Failed or Measured.

Every rank measures its cell locally and the engine gathers one outcome per rank over the
gloo control group, then builds the same row everywhere from them. Typed (not a dict whose
keys the callers agree on by convention) so a field renamed on one side fails on the other,
and picklable (plain dataclasses at module level) for all_gather_objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commbench.runtime.workload import PassCheck


@dataclass(frozen=True)
class Skipped:
    """This shape cannot run here (the backend raised BackendUnavailable)."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """The call raised; timed_out: the backend's bounded wait gave up (a hang, likely caused
    by a peer rather than this rank)."""

    reason: str
    timed_out: bool = False


@dataclass(frozen=True)
class Measured:
    """This rank's loop total, jitter samples and checks of both passes (checks are None under
    -c 0: no output was read back)."""

    bus_factor: float | None
    observed: dict[str, Any]          # row fields the backend observed on its first call
    total_us: float                   # the timed pass: one timer around the loop
    timed_calls: int                  # calls inside that timer
    samples: list[float]              # the jitter pass: one time per call (eager) or replay (graph)
    calls_per_sample: int
    checks: list[PassCheck | None]    # timed pass, jitter pass
    check_scope: str                  # which outputs were checked, in words (row.extra["check"])
    work_nodes: int | None = None     # graph mode: kernels and copies the capture holds
    replays: int | None = None        # graph mode: timed replays
    ops: int = 1                      # calls per replay (1 in eager mode)


Outcome = Skipped | Failed | Measured
