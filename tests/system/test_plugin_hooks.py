"""An outside plug-in (tests/plugins/commbench_hookdemo.py) uses every hook a backend has — its
own flag, needs, a software check, engine settings, a per-row observation — and each reaches
the user through commbench's ordinary commands, with no line of commbench naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import only_run_dir, rows, run_cli, run_torchrun

pytestmark = pytest.mark.procs   # every test here launches processes

SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "snapshots"


def test_the_plugins_flag_is_the_sweeps_flag_and_bad_values_are_bad_input(tmp_path: Path) -> None:
    helped = run_cli(["sweep", "--help"])
    assert "hookdemo backend" in helped.stdout and "--hookdemo-level" in helped.stdout
    listed = run_cli(["sweep", "--list-backends"])
    assert "hookdemo" in listed.stdout and "hookdemo:missing" in listed.stdout
    bad = run_cli(["sweep", "--backends", "hookdemo:plain", "--hookdemo-level", "12", "--out", str(tmp_path / "o")])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "commbench sweep: error: --hookdemo-level must be 1-9, got 12"]
    assert not (tmp_path / "o").exists()


def test_needs_software_settings_and_observations_reach_rows_run_json_and_recommend(tmp_path: Path) -> None:
    result = run_torchrun(2, ["sweep", "--backends", "hookdemo:plain,hookdemo:gpu,hookdemo:missing",
                              "--hookdemo-level", "3", "--tokens", "1", "--hidden", "8192", "--dtype", "bf16",
                              "--iters", "3", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(tmp_path)
    got = {r["backend"]: r for r in rows(run_dir)}
    plain = got["hookdemo:plain"]
    assert plain["status"] == "ok" and plain["wrong_elements"] == 0
    assert plain["requested"] == plain["observed"] == {"HOOKDEMO_LEVEL": "3"}
    assert plain["setting_applied"] == "honoured" and plain["extra"]["hookdemo_observed_bytes"] == 16384
    assert got["hookdemo:gpu"]["status"] == "skipped"
    assert got["hookdemo:gpu"]["reason"].endswith("no CUDA GPU")          # the probe's verdict
    assert got["hookdemo:missing"]["reason"].endswith("hookdemo-lib not installed (pip install hookdemo-lib)")
    info = json.loads((run_dir / "run.json").read_text())
    facts = info["backend_facts"]["hookdemo:plain"]
    assert facts["needs"] == ["node"] and facts["engine_settings"]["vllm_env"] == {"HOOKDEMO_LEVEL": "3"}
    assert facts["engine_settings"]["engine_paths"] == {"vllm": {"path": "nccl", "stand_in": True}}
    assert "pytest" in info["versions"]["packages"]          # the family's own package, recorded
    recommended = run_cli(["recommend", str(run_dir), "--model", "llama-3.1-70b", "--concurrency", "1",
                           "--engine", "vllm", "--wide"])
    assert recommended.returncode == 0, recommended.stderr
    # Its claim reaches recommend: on a CPU run no engine path runs, so it is headroom, never a setting
    # (and HOOKDEMO_LEVEL is no variable vLLM reads: it would be refused in a paste-ready line).
    out = recommended.stdout   # the paths' reason once in the path list; the headroom table refers to it
    assert "]: off here: no CUDA GPU in this run's snapshot" in out
    assert "7. NCCL (PyNccl) [on by default; measured]: off here: as for vLLM 0.34.0's" in out
    assert "* hookdemo:plain" in out
    assert "hookdemo:plain (eager): " in out and "; vLLM 0.34.0: the NCCL (PyNccl) path is off here" in out
    assert "paste-ready" not in recommended.stdout


def test_the_probe_gives_the_plugin_a_verdict_from_its_needs() -> None:
    shown = run_cli(["probe", "--from", str(SNAPSHOTS / "nvswitch-8x-h100.json")], env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    lines = {line.split("│")[1].strip(): line for line in shown.stdout.splitlines() if line.count("│") >= 3}
    assert "can run" in lines["hookdemo:plain"] and "can run" in lines["hookdemo:gpu"]
