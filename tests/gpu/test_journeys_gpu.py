"""The user's journeys on a GPU: what the README tells a user to run, run as printed, then every
analysis command on what it wrote, and every command the tool then prints.

On one H200 the README's `torchrun --nproc-per-node N -m commbench sweep --model M --tp N` is
`commbench sweep --model M --tp N --nproc N --share-gpus --mps` (N ranks under a private MPS
daemon: emulated rows, the protocol's cost with no fabric, and the rows say so). Each journey
runs every default backend of the machine in graph and eager mode at a preset's decode sizes and
must leave no `error` or `hang` row; then `recommend`, `floor`, `engines`, `report`, `qualify` and
`table` answer on the run with JSON that parses, and the sweep's own `# next:` commands run as
printed. GLM-5 at 8 ranks is the seeds' journey (7 of its 9 `unfused:best` rows were errors at
3f4adff); two other presets run at 4 and 2 ranks. `sweep --qualify` gives its verdict and JUnit.

The sweeps start their own MPS daemon (`--mps`), as a user's would, so `tests/gpu/run.sh` runs
this file with no daemon of its own beside it (named alone, or last in the whole suite).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
JOURNEYS = [("glm-5", 8), ("llama-3.1-70b", 4), ("deepseek-v4-flash", 2)]
MPS_VARS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
# The safety variables stay set in every process (multicast never created: docs/design.md).
POLICY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _commbench(*args: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in MPS_VARS}   # --mps starts the sweep's own
    env.update(POLICY)
    done = subprocess.run([sys.executable, "-m", "commbench", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=cwd, env=env)
    print(f"$ commbench {shlex.join(args)}  -> exit {done.returncode}\n{done.stdout[-4000:]}{done.stderr[-2000:]}")
    return done


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "measurements.jsonl").read_text().splitlines()]


def _sweep_journey(tmp_path: Path, model: str, tp: int, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "results"
    done = _commbench("sweep", "--model", model, "--tp", str(tp), "--nproc", str(tp), "--share-gpus", "--mps",
                      "--mode", "graph,eager", "--out", str(out), *extra, cwd=tmp_path, timeout_s=540)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return done, run_dir


def _answers_with_json(run_dir: Path, tmp_path: Path, argv: list[str], exit_status: int = 0) -> dict:
    target = tmp_path / f"{argv[0]}.json"
    done = _commbench(*argv, "--json", str(target), cwd=tmp_path)
    assert done.returncode == exit_status, done.stderr
    assert "Traceback" not in done.stderr
    return json.loads(target.read_text())


@pytest.mark.parametrize("model,tp", JOURNEYS, ids=[f"{m}-tp{t}" for m, t in JOURNEYS])
def test_the_readme_decode_journey_runs_clean_and_every_answer_follows(tmp_path: Path, model: str, tp: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    done, run_dir = _sweep_journey(tmp_path, model, tp)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(run_dir)
    broken = [(r["backend"], r["message_bytes"], r["mode"], r["status"], r.get("reason")) for r in rows
              if r["status"] in ("error", "hang", "crashed", "wrong")]
    assert not broken, broken
    measured = {r["backend"] for r in rows if r["status"] == "ok"}
    assert "unfused:best" in measured and any(b.startswith("p2p:") for b in measured), sorted(measured)
    assert {r["mode"] for r in rows if r["status"] == "ok"} == {"graph", "eager"}
    unfused = [r for r in rows if r["backend"] == "unfused:best"]
    assert unfused and all(r["status"] == "ok" for r in unfused), unfused
    info = json.loads((run_dir / "run.json").read_text())
    assert info.get("emulation"), "rows of ranks sharing one GPU must say they are emulated"

    # The answers, each with JSON that parses.
    for argv in (["recommend", str(run_dir), "--model", model, "--tp", str(tp)],
                 ["floor", str(run_dir), "--model", model, "--tp", str(tp)], ["engines", str(run_dir), "--model", model]):
        answer = _answers_with_json(run_dir, tmp_path, argv)
        assert len(answer["engines"]) == 2, answer.keys()      # vLLM and SGLang, each answered
    report = _answers_with_json(run_dir, tmp_path, ["report", str(run_dir), "--out", str(tmp_path / "report")])
    assert report["failed_rows"] == 0 and (tmp_path / "report" / "report.html").exists()
    spec = REPO / "commbench" / "specs" / ("nvswitch-8x-h100-h200.toml" if tp == 8 else "pcie-8x.toml")
    verdict = _answers_with_json(run_dir, tmp_path, ["qualify", "--spec", str(spec), str(run_dir)], exit_status=1)
    assert verdict["verdict"] == "FAIL"   # emulated rows are no evidence about a machine: never a PASS
    assert any(c["name"] == "real hardware" and c["status"] == "FAIL" for c in verdict["checks"])
    table = _commbench("table", str(run_dir), cwd=tmp_path)
    assert table.returncode == 0 and run_dir.name in table.stdout, table.stderr

    # The commands the sweep printed next, as printed.
    next_lines = [line.removeprefix("# next: ") for line in done.stdout.splitlines() if line.startswith("# next: ")]
    assert next_lines and any(line.startswith("commbench recommend ") for line in next_lines), done.stdout[-2000:]
    for line in next_lines:
        words = shlex.split(line, comments=True)
        assert words[0] == "commbench", line
        again = _commbench(*words[1:], cwd=tmp_path)
        assert again.returncode == 0, (line, again.stderr)


def test_sweep_qualify_gives_its_verdict_and_junit(tmp_path: Path) -> None:
    """`sweep --qualify SPEC --junit FILE` on the GPU: the sweep measures the spec's sizes too, then
    qualify's verdict on the run it just wrote is the command's exit status (emulated rows: FAIL)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec, junit = tmp_path / "spec.toml", tmp_path / "junit.xml"
    spec.write_text('[spec]\nname = "two ranks of one H200"\nworld_size = 2\ndtype = "bf16"\nmode = "graph"\n'
                    'backend = "p2p:auto"\n\n[checks]\nzero_wrong = true\nno_hangs = true\n\n'
                    '[[latency]]\nsize = "8K"\nmax_us = 1000.0\n')
    out = tmp_path / "results"
    done = _commbench("sweep", "--model", "deepseek-v4-flash", "--tp", "2", "--nproc", "2", "--share-gpus", "--mps",
                      "--tokens", "1,2", "--backends", "p2p:auto", "--qualify", str(spec), "--junit", str(junit),
                      "--out", str(out), cwd=tmp_path, timeout_s=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "-> FAIL" in done.stdout and "real hardware" in done.stdout
    assert "Traceback" not in done.stderr
    assert "<testsuite" in junit.read_text()
