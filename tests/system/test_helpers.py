"""The shared test helpers that launch processes: spawn_ranks' answer when a rank dies."""

from __future__ import annotations

import os
import time

import pytest

from helpers import spawn_ranks


def _dies_or_waits(rank: int, world: int) -> str:
    if rank == 1:
        os._exit(3)          # as a rank killed by a hung kernel's watchdog, or a signal: no answer
    time.sleep(120)          # as a rank waiting on its dead peer in a collective
    return "never"


@pytest.mark.procs
def test_a_rank_that_dies_without_an_answer_ends_the_wait_with_its_exit_code() -> None:
    start = time.monotonic()
    got = spawn_ranks(_dies_or_waits, 2, timeout_s=100, dead_peer_grace_s=1)
    assert got[1] == {"crash": "rank 1 exited with code 3 and no answer"}
    assert got[0] == {"crash": "rank 0: no answer after rank 1 died"}
    assert time.monotonic() - start < 60    # not the 100 s timeout, nor the sleeping rank's 120 s
