"""The front door: README short, every relative link in README and docs resolving, and the
README's output blocks equal to what the committed runs produce today (scripts/readme-outputs.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "results" / "reference").rglob("*.md"))]


def test_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def _dangling(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)   # code blocks hold no links
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue   # a web address or an anchor in the same file
        if not (path.parent / target.split("#")[0]).exists():
            out.append(target)
    return out


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_no_dangling_links(path: Path) -> None:
    assert _dangling(path) == []


def test_the_link_check_sees_a_dangling_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    page.write_text("[ok](there.md#part) [web](https://example.com) [no](missing.md)\n```\n[code](nope.md)\n```\n")
    assert _dangling(page) == ["missing.md"]


@pytest.mark.procs
def test_readme_output_blocks_are_what_the_committed_runs_give_today() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme-outputs.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "block(s) match" in done.stdout
