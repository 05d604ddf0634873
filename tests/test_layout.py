"""The layout keeps its promises: the analysis half runs without torch, the probe and the
backends check needs in one order, and the repository names no file it does not contain."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from commbench.backends.base import NEEDS
from commbench.topology.needs import CHECKS

REPO = Path(__file__).resolve().parents[1]
ANALYSIS = ["commbench.analysis." + p.stem for p in (REPO / "commbench" / "analysis").glob("*.py")
            if p.stem != "__init__"]


@pytest.mark.procs
def test_the_analysis_half_imports_no_torch() -> None:
    modules = ANALYSIS + ["commbench.results", "commbench.engines", "commbench.units", "commbench.policy",
                         "commbench.files"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'commbench.sweep')))\n"
            "print(bad)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    assert len(ANALYSIS) >= 9


def test_needs_are_checked_in_one_order_everywhere() -> None:
    assert list(CHECKS) == list(NEEDS)


# Names of files that live beside a developer's checkout, never in it.
OUTSIDE = ("DESIGN.md", "reference/backends.md", "reference/benchmarks.md", "user-pain.md", "field-2026.md",
           "mscclpp-build.md", "../shared")
PATH_RE = re.compile(r"\b((?:docs|scripts|results/reference|commbench/specs|commbench/data|tests/gpu)/[\w./-]+\w)")


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    return [REPO / f for f in listed if f.endswith((".py", ".md", ".sh", ".toml", ".txt", ".cu")) and (REPO / f).is_file()
            and f != "tests/test_layout.py"]


@pytest.mark.procs
def test_the_repository_points_only_at_files_it_contains() -> None:
    missing = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        missing += [f"{path.relative_to(REPO)}: {name}" for name in OUTSIDE if name in text]
        for ref in PATH_RE.findall(text):
            target = ref.rstrip(".")
            if "<" not in target and "*" not in target and not (REPO / target).exists():
                missing.append(f"{path.relative_to(REPO)}: {target}")
    assert missing == []
