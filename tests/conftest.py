"""Suite-wide guard: tests write only into their tmp dirs, never into the checkout's test data."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from commbench.terminal import DEFAULT_WIDTH

DATA = [Path(__file__).parent / "data", Path(__file__).parent / "fixtures"]


def _listing() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for root in DATA for p in root.rglob("*")}


def pytest_configure(config: pytest.Config) -> None:
    """Outputs fold at one width whatever runs the suite: pytest-xdist's workers set COLUMNS=80,
    and a developer's terminal has its own. A test about widths sets COLUMNS itself."""
    os.environ["COLUMNS"] = str(DEFAULT_WIDTH)
    # A shell without job control starts a background job with Ctrl-C ignored, and its children
    # inherit that: the tests that send SIGINT to a sweep need it delivered.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


SLOW_S = 10.0   # docs/testing.md: a scenario over this on CI's two cores carries @pytest.mark.slow
_unmarked_s: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" not in report.keywords:
        _unmarked_s[report.nodeid] = _unmarked_s.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Names the tests that took over SLOW_S without the slow mark, so the quick loop stays
    quick: a line to read, not a failure (a loaded machine makes any test slower)."""
    over = sorted((s, nodeid) for nodeid, s in _unmarked_s.items() if s > SLOW_S)
    if over:
        terminalreporter.write_line(f"over {SLOW_S:g} s without @pytest.mark.slow (at this machine's load now): "
                                    + ", ".join(f"{nodeid} {s:.1f} s" for s, nodeid in reversed(over)))
