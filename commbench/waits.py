"""Every fixed wait of the harness in one place: how long it polls, waits for peers and grants
processes before it acts. A run may shrink them through COMMBENCH_WAITS ("peer_wait_s=1,kill_wait_s=0.5"):
the tests do, so that a fault scenario costs seconds, not the defaults' tens of seconds. run.json
records the variable with the other COMMBENCH_ ones, so a run made with shorter waits says so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from commbench.errors import UsageError

WAITS_VAR = "COMMBENCH_WAITS"


@dataclasses.dataclass(frozen=True)
class Waits:
    # The row watchdog looks at the peers' in-flight records only once a region has lasted
    # poll_after_s, then every poll_s: a short row never shares the GIL with it.
    poll_after_s: float = 2.0
    poll_s: float = 1.0
    # How long ranks wait at a vote for a peer that raised, once one did: longer than a backend's
    # own bounded wait (p2p gives up on a missing peer after --p2p-timeout-ms, 5 s by default), so
    # that such peers come to the vote and the row is an error without ending the processes.
    peer_wait_s: float = 10.0
    # How long a rank whose control group failed looks for the peer that caused it: its records
    # are written before its process ends, so a short look suffices.
    cause_look_s: float = 3.0
    # How long a rank whose row watchdog ran out while it waited in a collective looks for the
    # peer that hung to say where it was (its watchdog's limit ends at about the same moment).
    hang_look_s: float = 5.0
    # The driver: how often it looks at its child torchrun, how long a step may overrun its
    # watchdog's deadline before the driver ends the child itself (a thread holding the GIL on
    # every rank that could see it), and how long SIGTERM has before SIGKILL.
    driver_poll_s: float = 1.0
    overdue_grace_s: float = 5.0
    kill_wait_s: float = 5.0
    # Under torchrun, the ranks other than 0 wait this long after bad input, so that rank 0's line
    # is out before torchrun stops every worker (it does so as soon as the first one exits).
    usage_error_grace_s: float = 2.0
    # The driver's private MPS daemon: how long its server may take to exit after `quit` before it
    # is killed (one whose client died mid-kernel ignores quit).
    mps_server_exit_s: float = 5.0
    # `engines --check`: how long one of an engine's gate functions has for its whole grid in the
    # check's child process (each of the real ones takes under a second); past it the child is
    # ended and the function named.
    gate_probe_s: float = 60.0


def parse_waits(text: str) -> Waits:
    """'peer_wait_s=1,kill_wait_s=0.5' -> Waits with those two changed."""
    names = {f.name for f in dataclasses.fields(Waits)}
    changed: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in names:
            raise UsageError(f"{WAITS_VAR}: unknown wait {name!r}: choose from {', '.join(sorted(names))}")
        try:
            seconds = float(value)
        except ValueError:
            raise UsageError(f"{WAITS_VAR}: {name}={value!r} is not a number of seconds") from None
        if not (0 <= seconds < math.inf):
            raise UsageError(f"{WAITS_VAR}: {name}={value} must be a finite number of seconds, 0 or more")
        changed[name] = seconds
    return Waits(**changed)


@functools.cache
def waits() -> Waits:
    """This process's waits: the defaults, or as COMMBENCH_WAITS changes them."""
    return parse_waits(os.environ.get(WAITS_VAR, ""))
