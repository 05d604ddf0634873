"""`sweep --model NAME --tp N` measures a model's decode sizes and names the next command;
`sweep --qualify SPEC` plans the sizes its spec checks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from helpers import only_run_dir, rows, run_torchrun

from commbench.models import DEFAULT_CONCURRENCIES, lookup
from commbench.analysis.qualify import load_spec
from commbench.cli import main as cli
from commbench.sweep.arguments import add_arguments
from commbench.sweep.plan import build_plan

SPECS = Path(__file__).parents[2] / "commbench" / "specs"


def sweep_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_model_plans_its_decode_sizes_in_graph_mode():
    glm = lookup("glm-5")
    plan = build_plan(sweep_args("--model", "glm-5"), on_gpu=True)
    assert [s.message_bytes for s in plan.shapes] == [t * glm.hidden * 2 for t in DEFAULT_CONCURRENCIES]
    assert [s.tokens for s in plan.shapes] == DEFAULT_CONCURRENCIES and {s.hidden for s in plan.shapes} == {6144}
    assert plan.modes == ["graph"] and [str(d) for d in plan.dtypes] == ["torch.bfloat16"] and not plan.notes
    on_cpu = build_plan(sweep_args("--model", "glm-5"), on_gpu=False)
    assert on_cpu.modes == ["eager"]
    assert on_cpu.notes == ["GLM-5: graph mode needs CUDA GPUs, so on the CPU its decode sizes run in eager mode"]
    fewer = build_plan(sweep_args("--model", "glm-5", "--tokens", "1,8"), on_gpu=True)
    assert [s.message_bytes for s in fewer.shapes] == [12288, 8 * 12288]


def test_qualify_adds_the_sizes_its_spec_checks():
    spec = load_spec(SPECS / "pcie-8x.toml")
    assert 1 << 30 in spec.message_sizes()
    plan = build_plan(sweep_args(), on_gpu=True, checked_bytes=spec.message_sizes())
    assert plan.max_bytes == 1 << 30                        # the GPU default stops at 256M
    assert all(s in {shape.message_bytes for shape in plan.shapes} for s in spec.message_sizes())
    assert plan.notes == ["--qualify: added 1G, the size(s) its spec checks"]
    assert build_plan(sweep_args("-e", "1G"), on_gpu=True, checked_bytes=spec.message_sizes()).notes == []


@pytest.mark.parametrize("argv, message", [
    (["--model", "glm-5", "--tp", "8"], "--tp 8 but this sweep runs 1 rank(s): start it with --nproc 8"),
    (["--model", "glm-5", "-b", "4K"], "--model sets the sizes (decode tokens x its hidden size x dtype): leave out -b"),
    (["--model", "glm-5", "--hidden", "7168"], "leave out --hidden"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--tp", "8"], "--tp goes with --model NAME"),
])
def test_model_flags_that_cannot_answer_the_question_exit_2(tmp_path, capsys, argv, message):
    assert cli(["sweep", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "out").exists()                   # nothing written


@pytest.mark.procs
@pytest.mark.slow
def test_model_sweep_on_cpu_runs_the_preset_sizes_and_prints_the_next_command(tmp_path, capsys, monkeypatch):
    # Two ranks: the preset's sizes do not depend on the TP size, and 8 CPU ranks cost CI 30 s more.
    done = run_torchrun(2, ["sweep", "--model", "glm-5", "--tp", "2", "--iters", "2", "--warmup", "0",
                            "--out", str(tmp_path)], timeout=600)
    assert done.returncode == 0, done.stderr
    run_dir = only_run_dir(tmp_path)
    got = rows(run_dir)
    assert [r["message_bytes"] for r in got] == [t * 6144 * 2 for t in DEFAULT_CONCURRENCIES]
    assert all(r["status"] == "ok" and r["mode"] == "eager" and r["dtype"] == "bf16" and r["world_size"] == 2
               for r in got)
    assert "# GLM-5: graph mode needs CUDA GPUs, so on the CPU its decode sizes run in eager mode" in done.stdout
    report, gpu_sweep = done.stdout.strip().splitlines()[-2:]
    assert report == f"# next: commbench report {run_dir}"
    # a CPU run prices no engine path: the decision needs the sweep on the GPU box
    assert gpu_sweep.startswith("# next: torchrun --nproc-per-node gpu -m commbench sweep --model glm-5 ")
    # The printed command runs as printed (report writes into a new folder here, never the run dir).
    monkeypatch.chdir(tmp_path)
    assert cli(report.removeprefix("# next: commbench ").split()) == 0
    assert (tmp_path / f"{run_dir.name}-report" / "report.html").exists()
    # The rest of the journey on the same run: every answer exits as it should, its JSON parses.
    for argv, status in ((["recommend", str(run_dir), "--model", "glm-5", "--tp", "2"], 0),
                         (["floor", str(run_dir), "--model", "glm-5", "--tp", "2"], 0),
                         (["engines", str(run_dir), "--model", "glm-5"], 0),
                         (["qualify", "--spec", str(SPECS / "pcie-8x.toml"), str(run_dir)], 1)):   # CPU: no GPU
        target = tmp_path / f"{argv[0]}.json"
        assert cli([*argv, "--json", str(target)]) == status, argv
        answer = json.loads(target.read_text())
        assert answer.get("engines") or answer.get("verdict") == "FAIL", (argv, list(answer))
    assert cli(["table", str(run_dir)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_gpu_sweep_ends_with_the_decision_and_a_cpu_sweep_with_the_sweep_that_prices_one(tmp_path):
    from types import SimpleNamespace

    from commbench.sweep.command import next_commands
    run = tmp_path / "run"
    assert next_commands(SimpleNamespace(model="glm-5"), run, 8, on_gpu=True) == [
        f"commbench report {run}", f"commbench recommend {run} --model glm-5 --tp 8"]
    # Without --model, a whole command that names the presets (no placeholder to fill in).
    assert next_commands(SimpleNamespace(model=None), run, 2, on_gpu=True)[1].startswith(
        "commbench floor --list-models   # then:")
    assert next_commands(SimpleNamespace(model=None), run, 2, on_gpu=False)[1] == (
        "torchrun --nproc-per-node gpu -m commbench sweep   # on the GPU box: a CPU run prices no engine path")


def test_the_driver_hands_qualify_to_its_children_for_the_plan_and_runs_it_once():
    from commbench.sweep.launcher import child_arguments

    assert child_arguments(["--qualify", "s.toml", "--junit", "j.xml", "--nproc", "2", "--model", "glm-5"]) == [
        "--qualify", "s.toml", "--model", "glm-5"]
