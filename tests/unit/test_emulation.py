"""Runs whose ranks shared GPUs measure the protocol, not the fabric: every analysis command
says so in its first line, and qualify never passes such a run as hardware."""

from __future__ import annotations

from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.runtime.context import Emulation
from commbench.results import describe_emulation
from commbench.runs import load_run
from factories import write_run

SYNTHETIC = Path(__file__).parents[1] / "data" / "runs" / "synthetic-pcie-8gpu"
SPEC = Path(__file__).parents[2] / "commbench" / "specs" / "pcie-8x.toml"
UNDER_MPS = {"gpus": 1, "ranks": 8, "mps": True, "sm_percent": 12.0}


@pytest.fixture
def emulated(tmp_path: Path) -> Path:
    # No longer the hand-made fixture: an emulated run.
    return write_run(tmp_path / "emulated", like=SYNTHETIC, provenance=None, emulation=UNDER_MPS)


def test_the_label_says_what_ran_and_what_it_does_not_measure():
    assert describe_emulation(UNDER_MPS) == (
        "emulated: 8 ranks on 1 GPU(s), concurrently under MPS, 12% of the SMs each; these rows measure the "
        "protocol with no fabric between the ranks, not NVLink or PCIe")
    assert "taking turns on it (time slicing, no MPS)" in describe_emulation({**UNDER_MPS, "mps": False})
    assert Emulation(gpus=1, ranks=8, mps=True, sm_percent=12.0).label() == describe_emulation(UNDER_MPS)
    assert Emulation(gpus=1, ranks=8, mps=True, sm_percent=None).ranks_per_gpu == 8


@pytest.mark.parametrize("argv", [
    ["report", "{run}", "--out", "{tmp}/r"],
    ["floor", "{run}", "--model", "llama-3.1-70b", "--concurrency", "1"],
    ["recommend", "{run}", "--model", "llama-3.1-70b", "--concurrency", "1"],
])
def test_analysis_commands_name_the_emulation_first(emulated, tmp_path, capsys, argv):
    assert cli([a.format(run=emulated, tmp=tmp_path) for a in argv]) == 0
    # The provenance line ("data: emulated: 8 ranks on 1x GPU ...") or the emulation label.
    assert "emulated: 8 ranks on 1" in capsys.readouterr().out.splitlines()[0]


def test_plain_runs_carry_no_label(capsys, tmp_path):
    assert load_run(SYNTHETIC).emulation is None
    assert cli(["report", str(SYNTHETIC), "--out", str(tmp_path)]) == 0
    assert not capsys.readouterr().out.startswith("emulated")


def test_qualify_never_passes_an_emulated_run(emulated, tmp_path, capsys):
    assert cli(["qualify", "--spec", str(SPEC), str(emulated), "--wide"]) == 1
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "real hardware" in l)
    assert line.startswith("FAIL") and "emulated data: 8 ranks on 1 GPU(s)" in line
    assert not [l for l in out.splitlines() if l.startswith("PASS") and " fabric " in l]


def test_rows_alone_are_enough_to_know(tmp_path):
    rows = list(load_run(SYNTHETIC).rows)
    rows[0].emulation = UNDER_MPS
    assert load_run(write_run(tmp_path / "run", rows, like=SYNTHETIC, provenance=None)).emulation == UNDER_MPS
