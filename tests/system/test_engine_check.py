"""`commbench engines --check` runs an engine's own gate functions (imported from the release, in a
child process) over a grid and compares them with commbench's: a gate edited in a copy of the
engine exits 1 naming the function's file:line. The engine tree is hand-made here, in the test:
one gate of vLLM's shape, written for this test (no engine code is committed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commbench.cli import main as cli

pytestmark = pytest.mark.procs   # the gate check imports the engine's functions in a child process

GATE = "vllm/distributed/device_communicators/custom_all_reduce.py"
# The custom allreduce's size rule as vLLM 0.34.0 states it (custom_all_reduce.py:500-515: no
# message above 8 ranks, f32/f16/bf16, a multiple of 16 bytes, 2 ranks or NVLink on every pair,
# below max_size unless batch invariant), in this test's own words. {limit} is the world-size cap.
SOURCE = '''import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CustomAllreduce:
    _SUPPORTED_WORLD_SIZES = [2, 4, 6, 8, 16]

    def __init__(self, group, device, max_size=8 * 1024 * 1024):
        self.disabled = True

    def should_custom_ar(self, inp):
        size = inp.numel() * inp.element_size()
        if self.disabled or self.mnnvl_only or self.world_size > {limit} or inp.dtype not in DTYPES or size % 16:
            return False
        return (self.world_size == 2 or self.fully_connected) and (self.batch_invariant or size < self.max_size)
'''


def engine_tree(root: Path, limit: int) -> Path:
    (root / "vllm-0.34.0.dist-info").mkdir(parents=True)
    (root / "vllm-0.34.0.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.34.0\n")
    gate = root / GATE
    gate.parent.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("raise SystemExit('the package is never imported whole')\n")
    gate.write_text(SOURCE.format(limit=limit))
    return root


def _gate(out: dict) -> dict:
    (engine,) = out["engines"]
    return next(g for g in engine["gates"] if g["key"] == "custom_ar_takes")


def test_an_edited_gate_in_a_copy_of_the_engine_exits_1_naming_its_file_and_line(tmp_path, capsys):
    line = SOURCE.splitlines().index("    def should_custom_ar(self, inp):") + 1
    faithful = engine_tree(tmp_path / "faithful", 8)
    cli(["engines", "--check", str(faithful), "--json", str(tmp_path / "faithful.json")])
    same = _gate(json.loads((tmp_path / "faithful.json").read_text()))
    assert same["differ"] == 0 and same["compared"] == 1520 and same["where"] == f"{GATE}:{line}"
    capsys.readouterr()

    edited = engine_tree(tmp_path / "edited", 16)     # takes messages at 16 ranks: vLLM refuses them
    assert cli(["engines", "--check", str(edited), "--json", str(tmp_path / "edited.json"), "--wide"]) == 1
    text = capsys.readouterr().out
    differs = _gate(json.loads((tmp_path / "edited.json").read_text()))
    assert differs["differ"] > 0 and differs["where"] == f"{GATE}:{line}"
    assert f"gate custom_ar_takes: CustomAllreduce.should_custom_ar ({GATE}:{line}) differs at" in text
    assert "tp=16, nvlink=True" in text and "built in False; vLLM True" in text
