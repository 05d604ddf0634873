"""Analysis reads its input runs and never writes into them: every analysis command over a
committed reference run and the test data leaves the input folders exactly as they were (their
output goes to --out, by default a new folder in the current directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from commbench.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = next((ROOT / "results" / "reference" / "h200-mps-emulated" / "world2" / "allreduce").glob("*/run.json")).parent
CPU_A = ROOT / "tests" / "data" / "runs" / "cpu-gloo-4rank-a"
CPU_B = ROOT / "tests" / "data" / "runs" / "cpu-gloo-4rank-b"
SYNTHETIC = ROOT / "tests" / "data" / "runs" / "synthetic-pcie-8gpu"
TRACES = sorted((ROOT / "tests" / "data" / "traces" / "h200-mps").glob("p2p-oneshot_lamport-rank*.trace.json.gz"))
SPEC = ROOT / "commbench" / "specs" / "pcie-8x.toml"


def _state(folders: list[Path]) -> dict[str, tuple[int, float]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime) for f in folders for p in [f, *f.rglob("*")]}


@pytest.mark.parametrize("argv", [
    ["report", str(REFERENCE)],
    ["report", str(SYNTHETIC)],
    ["compare", str(CPU_A), str(CPU_B)],
    ["floor", str(REFERENCE), "--model", "llama-3.1-70b"],
    ["recommend", str(SYNTHETIC), "--model", "glm-5", "--brief"],
    ["table", str(CPU_A), str(CPU_B)],
    ["qualify", "--spec", str(SPEC), str(SYNTHETIC)],
    ["attribute", *map(str, TRACES), "--run", str(REFERENCE), "--hidden", "4096", "--batch", "8"],
], ids=["report-reference", "report-fixture", "compare", "floor", "recommend", "table", "qualify", "attribute"])
def test_an_analysis_command_leaves_its_inputs_as_they_were(argv: list[str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = [REFERENCE, CPU_A, CPU_B, SYNTHETIC]
    before = _state(inputs)
    monkeypatch.chdir(tmp_path)
    assert cli(argv) in (0, 1)   # qualify exits 1 on a FAIL
    assert _state(inputs) == before
