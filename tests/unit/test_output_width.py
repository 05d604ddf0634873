"""Every text command fits the terminal (issue 54): at 80 and 120 columns no line of any command's
output on the committed runs and fixtures is wider than COLUMNS (the sweep's live rows: in
tests/system/test_sweep_flags.py), but a command (a paste block, a
next step on its own line, a command between backticks), which stays whole so it pastes, one word
longer than the width (a path) and a 'wrote PATH' line; and no identifier (a backend spec, a
setting, a flag, a path) is split across lines where --wide prints it whole."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from commbench.cli import main as cli
from factories import fused_run

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "data" / "runs"
REFERENCE = ROOT / "results" / "reference"
SNAPSHOTS = ROOT / "tests" / "fixtures" / "snapshots"
EMULATED_PCIE = REFERENCE / "h200-mps-emulated" / "world8" / "pcie" / "20261202-005850-vm"
SPEC = ROOT / "commbench" / "specs" / "pcie-8x.toml"
NCCL_TESTS = ROOT / "tests" / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.txt"


def _only_run(folder: Path) -> str:
    (run,) = [p.parent for p in folder.glob("*/run.json")]
    return str(run)


WORLD2 = _only_run(REFERENCE / "h200-mps-emulated" / "world2" / "allreduce")
WORLD8 = _only_run(REFERENCE / "h200-mps-emulated" / "world8" / "allreduce")
PCIE = str(RUNS / "synthetic-pcie-8gpu")
CPU_A, CPU_B = str(RUNS / "cpu-gloo-4rank-a"), str(RUNS / "cpu-gloo-4rank-b")
TRACES = [str(ROOT / "tests" / "data" / "traces" / "h200-mps" / f"p2p-oneshot_lamport-rank{r}.trace.json.gz")
          for r in (0, 1)]
# Each command, and whether it takes --wide (one line per table row).
COMMANDS: dict[str, tuple[list[str], bool]] = {
    "probe-h200": (["probe", "--from", str(SNAPSHOTS / "h200-nvlink-8x.json")], False),
    "probe-pcie-aer": (["probe", "--from", str(SNAPSHOTS / "pcie-4x-aer-link.json")], False),
    "report": (["report", PCIE, "--out", "{tmp}/report"], True),
    "floor": (["floor", PCIE, "--model", "glm-5", "--concurrency", "1,16,64"], True),
    "floor-list-models": (["floor", "--list-models"], True),
    "floor-what-if": (["floor", PCIE, "--model", "glm-5", "--engine", "sglang", "--concurrency", "1", "--step-ms",
                       "17.28"], True),
    "floor-latency-table": (["floor", "--latency-table", "{tmp}/latency.csv", "--model",
                             "glm-5", "--concurrency", "1", "--step-ms", "17.28"], True),
    "recommend": (["recommend", PCIE, "--model", "glm-5"], True),
    "recommend-brief": (["recommend", PCIE, "--model", "glm-5", "--brief", "--prefill-tokens", "256"], True),
    "recommend-emulated": (["recommend", str(EMULATED_PCIE), "--model", "glm-5", "--concurrency", "1,16"], True),
    "recommend-fused": (["recommend", "{tmp}/fused/run", "--model", "glm-5", "--concurrency", "1,8,64"], True),
    "recommend-fused-brief": (["recommend", "{tmp}/fused/run", "--model", "glm-5", "--concurrency", "1,8,64",
                               "--brief"], True),
    "floor-fused": (["floor", "{tmp}/fused/run", "--model", "glm-5", "--concurrency", "1,8,64"], True),
    "engines": (["engines", PCIE, "--model", "glm-5"], True),
    "engines-emulated": (["engines", WORLD8, "--model", "glm-5"], True),
    "engines-no-box": (["engines"], True),
    "qualify": (["qualify", "--spec", str(SPEC), PCIE], True),
    "qualify-cpu": (["qualify", "--spec", str(SPEC), CPU_A], True),
    "compare": (["compare", CPU_A, CPU_B, "--out", "{tmp}/compare"], True),
    "table": (["table", WORLD2, WORLD8], True),
    "attribute": (["attribute", *TRACES, "--run", WORLD2, "--hidden", "4096", "--batch", "8", "--engine", "sglang"],
                  True),
    "attribute-one-rank": (["attribute", TRACES[0], "--run", WORLD2, "--hidden", "4096", "--batch", "8"], True),
    "fleet-qualify": (["fleet", "qualify", str(REFERENCE / "cpu-fleet" / "fleet"), "--spec", str(SPEC)], True),
    "sweep-list-backends": (["sweep", "--list-backends"], False),
    "import-nccl-tests": (["import-nccl-tests", str(NCCL_TESTS), "--average", "3", "--out", "{tmp}/import"], False),
}
# A word that names something a user copies: a spec, a setting, a flag or a path.
IDENTIFIER = re.compile(r"^[\w.,:/=+-]*([:/=]|\[|--|[A-Z]+_[A-Z_]+)[\w.,:/=+\[\]-]*$")
# A command the tool prints on a line of its own: a paste line (its engine variables first), a next step.
COMMAND = re.compile(r"^(?:# next: |\$ )?(?:[A-Z_][A-Z0-9_]*=\S+ )*(?:(?:python3? -m )?commbench |torchrun |export |"
                     r"vllm serve |python -m sglang|bash scripts/|pip install )")
BACKTICKED = re.compile(r"`[^`\n]+`")


def _output(argv: list[str], columns: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latency.csv").write_text("bytes,latency_us\n4K,20\n16K,40\n64K,90\n")   # floor --latency-table
    if any("{tmp}/fused/" in a for a in argv) and not (tmp_path / "fused").exists():
        fused_run(tmp_path / "fused" / "run")   # the fused headroom's tables (a fixture made here)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli(argv) in (0, 1), argv     # 1: qualify's verdict
    out = capsys.readouterr()
    return out.out + out.err


def wider_than(line: str, columns: int) -> bool:
    """A line wider than the terminal that is not allowed to be."""
    if len(line) <= columns:
        return False
    body = line.strip()
    words = body.split()
    if COMMAND.match(body) or len(words) == 1 or (words[0] == "wrote" and len(words) == 2):
        return False
    return bool(BACKTICKED.sub("", body).strip(" ():;,.")) or not BACKTICKED.search(body)


def _identifiers(text: str) -> set[str]:
    words = {w.strip("()'`;,.:") for w in text.split()}
    return {w for w in words if len(w) >= 6 and IDENTIFIER.match(w)}


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("name", COMMANDS)
def test_every_line_fits_the_terminal_and_no_identifier_is_split(
        name: str, columns: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    argv, has_wide = COMMANDS[name]
    text = _output(argv, columns, tmp_path, monkeypatch, capsys)
    assert text.strip()
    wide = [line for line in text.splitlines() if wider_than(line, columns)]
    assert not wide, f"{len(wide)} line(s) wider than {columns} columns, the first: {wide[0]!r}"
    if has_wide:
        whole = _output([*argv, "--wide"], 10_000, tmp_path, monkeypatch, capsys).replace(str(tmp_path), "")
        shown = {w.strip("()'`;,.:") for line in text.replace(str(tmp_path), "").splitlines() for w in line.split()}
        split = sorted(w for w in _identifiers(whole) if w not in shown)
        assert not split, f"split across lines at {columns} columns: {split[:5]}"


@pytest.mark.slow
@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("snapshot", sorted(SNAPSHOTS.glob("*.json")), ids=lambda p: p.stem)
def test_the_probe_renders_every_recorded_snapshot_within_the_terminal(
        snapshot: Path, columns: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    text = _output(["probe", "--from", str(snapshot)], columns, tmp_path, monkeypatch, capsys)
    wide = [line for line in text.splitlines() if wider_than(line, columns)]
    assert not wide, wide[0]


def test_the_check_tells_a_command_from_prose() -> None:
    assert not wider_than("    torchrun --nproc-per-node 8 -m commbench sweep --model glm-5 --tp 8 --prefill-tokens 8", 40)
    assert not wider_than("`commbench engines tests/data/runs/synthetic-pcie-8gpu --engine vllm --tp 8`):", 40)
    assert not wider_than("wrote /a/very/long/path/that/does/not/fit/in/forty/columns.png", 40)
    assert not wider_than("    SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=1 python -m sglang.launch_server --model-path MODEL", 40)
    assert wider_than("a sentence that goes on for longer than forty columns of text", 40)
    assert wider_than("see `commbench floor --list-models` for a sentence longer than forty columns", 40)
