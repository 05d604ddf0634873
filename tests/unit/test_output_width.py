"""Output that fits: at 80 and 120 columns no line of recommend, floor, compare or table splits
an identifier (a backend spec, a setting, a flag, a path), and no prose line is wider than the
terminal. A line may be wider only where it is one identifier, a paste-ready command, or a
markdown table row (markdown needs a row on one line)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from commbench.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "data" / "runs"
EMULATED_PCIE = ROOT / "results" / "reference" / "h200-mps-emulated" / "world8" / "pcie" / "20261202-005850-vm"
COMMANDS = {
    "recommend": ["recommend", str(RUNS / "synthetic-pcie-8gpu"), "--model", "glm-5", "--concurrency", "1,16,64"],
    "recommend-emulated": ["recommend", str(EMULATED_PCIE), "--model", "glm-5", "--concurrency", "1,16"],
    "floor": ["floor", str(RUNS / "synthetic-pcie-8gpu"), "--model", "glm-5", "--concurrency", "1,16,64"],
    "compare": ["compare", str(RUNS / "cpu-gloo-4rank-a"), str(RUNS / "cpu-gloo-4rank-b")],
    "table": ["table", str(RUNS / "cpu-gloo-4rank-a"), str(RUNS / "cpu-gloo-4rank-b")],
}
# A word that names something a user copies: a spec, a setting, a flag or a path.
IDENTIFIER = re.compile(r"^[\w.,:/=+-]*([:/=]|\[|--|[A-Z]+_[A-Z_]+)[\w.,:/=+\[\]-]*$")


def _output(argv: list[str], columns: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.chdir(tmp_path)   # compare writes its plot under the current directory
    assert cli(argv) == 0
    return capsys.readouterr().out


def _identifiers(text: str) -> set[str]:
    words = {w.strip("()'`;,.:") for w in text.split()}
    return {w for w in words if len(w) >= 6 and IDENTIFIER.match(w)}


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("name", COMMANDS)
def test_no_identifier_is_split_and_no_prose_line_is_wider_than_the_terminal(
        name: str, columns: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    wide = _output([*COMMANDS[name], "--wide"] if name != "table" else COMMANDS[name], 10_000, tmp_path,
                   monkeypatch, capsys)
    text = _output(COMMANDS[name], columns, tmp_path, monkeypatch, capsys)
    whole_words = {w.strip("()'`;,.:") for line in text.splitlines() for w in line.split()}
    split = sorted(w for w in _identifiers(wide) if w not in whole_words and w.replace(str(tmp_path), "") == w)
    assert not split, f"split across lines at {columns} columns: {split[:5]}"
    for line in text.splitlines():
        words = line.split()
        if len(line) <= columns or line.startswith(("    ", "|")) or len(words) == 1:
            continue
        if len(words) == 2 and len(words[1]) > columns // 2 and IDENTIFIER.match(words[1]):
            continue   # "wrote PATH": the path whole on one line

        raise AssertionError(f"a line of {len(line)} characters at {columns} columns: {line!r}")
