"""scripts/engine-kernel-ratios.py on recorded rows: FlashInfer's TRT-LLM rows fill its columns
(ENGINE_KERNEL_BACKENDS may name them for scripts/mps-reference.sh) and count as peers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from factories import row, write_run

SCRIPT = Path(__file__).parents[2] / "scripts" / "engine-kernel-ratios.py"
spec = importlib.util.spec_from_file_location("engine_kernel_ratios_under_test", SCRIPT)
ratios = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ratios)


def test_flashinfer_rows_fill_its_columns_and_the_goal_table(tmp_path):
    times = {"p2p:auto": 3.0, "flashinfer:trtllm_oneshot": 2.5, "flashinfer:trtllm_twoshot": 4.0,
             "sglang:1shot_push": 2.8, "vllm:auto": 5.0}
    run = write_run(tmp_path / "run", [row(backend=b, world_size=8, latency_us=us) for b, us in times.items()])
    line = next(line for line in ratios.table(run) if line.startswith("| 4K |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "2.50 (trtllm_oneshot)"                 # flashinfer best
    assert cells[-1] == "2.00x"                                # vllm:auto / flashinfer
    goal = next(line for line in ratios.goal_table(run) if line.startswith("| 4K |"))
    assert goal == "| 4K | 3.00 | 2.50 (flashinfer:trtllm_oneshot) | 1.20x | no |"
