"""`--json -`: standard output carries the JSON alone, so `commbench X ... --json - | jq` works;
the human text, if any, goes to standard error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commbench.cli import main as cli

DATA = Path(__file__).parents[1] / "data"
SYNTHETIC = DATA / "runs" / "synthetic-pcie-8gpu"
CPU_A = DATA / "runs" / "cpu-gloo-4rank-a"
CPU_B = DATA / "runs" / "cpu-gloo-4rank-b"
VLLM_TRACES = sorted((DATA / "traces" / "constructed").glob("vllm-rank*.trace.json"))


@pytest.mark.parametrize("argv", [
    ["floor", str(SYNTHETIC), "--model", "llama-3.1-70b"],
    ["recommend", str(SYNTHETIC), "--model", "llama-3.1-70b"],
    ["recommend", str(SYNTHETIC), "--model", "llama-3.1-70b", "--brief"],
    ["compare", str(CPU_A), str(CPU_B)],
    ["attribute", *map(str, VLLM_TRACES), "--steps", "annotation"],
], ids=["floor", "recommend", "recommend-brief", "compare", "attribute"])
def test_json_dash_is_json_alone_on_stdout(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)   # compare writes its plot under the current directory
    assert cli([*argv, "--json", "-"]) == 0
    out = capsys.readouterr()
    assert isinstance(json.loads(out.out), dict)
    assert out.err.strip(), "the human text goes to stderr"
