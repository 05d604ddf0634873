"""The probe's tables print every snapshot string as it is, and stay readable at 80 columns
(the width rich gives piped output): nothing cut, identifiers whole, no line wider than 80."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest

from commbench.probe.render import render

SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "snapshots"


def _load(name: str) -> dict:
    return json.loads((SNAPSHOTS / name).read_text())


def _text(snapshot: dict, width: int = 200) -> str:
    out = io.StringIO()
    render(snapshot, 4, False, file=out, width=width)
    return out.getvalue()


def test_markup_and_emoji_codes_in_snapshot_strings_print_literally():
    s = copy.deepcopy(_load("pcie-switch-4x-acs.json"))
    s["gpus"][0]["pci_bus_id"] = "00000000:AB:00.0"                     # :AB: is an emoji code to rich
    s["gpus"][1]["name"] = "NVIDIA [bold]H200[/bold] :smile:"
    s["notes"] = ["CUDA error [/] at step [bold]x"]                        # "[/]" alone raises in rich
    s["p2p"][0]["write_verify"]["detail"] = "dropped [red]writes[/red]"
    s["pcie_paths"][0]["error"] = "lspci: [Errno 13] Permission denied"
    text = _text(s)
    for literal in ("00000000:AB:00.0", "NVIDIA [bold]H200[/bold] :smile:", "CUDA error [/] at step [bold]x",
                    "WRONG dropped [red]writes[/red]", "lspci: [Errno 13] Permission denied"):
        assert literal in text, literal
    assert "\N{NEGATIVE SQUARED AB}" not in text and "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in text


def test_bridge_states_in_brackets_are_shown():
    # "[ReqRedir+ CmpltRedir+]" after a bridge's address was once swallowed as a style tag.
    text = _text(_load("pcie-switch-4x-acs.json"))
    bridges = [b for p in _load("pcie-switch-4x-acs.json")["pcie_paths"] for b in p.get("bridges", [])]
    states = {b.get("error") or b.get("acs") or " ".join(b.get("flags", [])) for b in bridges}
    assert states and all(f"[{state}]" in text for state in states)


def test_software_without_nccl_says_so():
    s = copy.deepcopy(_load("h200-1gpu.json"))
    s["software"].update(nccl=None, torch_cuda=None, nvidia_driver=None)
    text = _text(s)
    assert "none (this torch has no NCCL)" in text and "none (a CPU build of torch)" in text
    assert "None" not in text.split("Host (read-only)")[0]


@pytest.mark.parametrize("name", sorted(p.name for p in SNAPSHOTS.glob("*.json")))
def test_every_table_is_readable_at_80_columns(name):
    s = _load(name)
    text = _text(s, width=80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text                                    # no cell cut short
    for gpu in s["gpus"]:
        assert gpu["pci_bus_id"] in text                      # identifiers stay on one line
        assert (gpu.get("uuid") or "")[:13] in text
    assert "│ 0   │ NV… │" not in text
