"""Suite-wide guard: tests write only into their tmp dirs, never into the checkout's test data."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

DATA = [Path(__file__).parent / "data", Path(__file__).parent / "fixtures"]


def _listing() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for root in DATA for p in root.rglob("*")}


@pytest.fixture(autouse=True, scope="session")
def test_data_stays_untouched():
    before = _listing()
    yield
    after = _listing()
    changed = sorted(set(after) ^ set(before) | {p for p in before if p in after and after[p] != before[p]})
    assert not changed, f"the suite wrote into the checkout: {changed[:5]}"


@pytest.fixture(autouse=True)
def only_procs_tests_launch_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The `procs` mark is what `-m "not procs"` leaves out: a test without it that starts a
    process fails here, so the in-process tier stays in-process (and fast)."""
    if request.node.get_closest_marker("procs") is None:
        def refuse(*args, **kwargs):
            raise AssertionError("this test launches a process: mark it @pytest.mark.procs")
        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
