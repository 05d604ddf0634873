"""What the analysis says about lines that are not rows, and how the sweep treats installed
plug-ins that are broken: every skipped line and every skipped plug-in is named, once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from commbench.results import RunDir
from helpers import child_env, only_run_dir, rows, run_cli

RUNS = Path(__file__).parents[1] / "data" / "runs"
MODEL = ["--model", "llama-3-70b"]


def _garbled_copy(tmp_path: Path) -> tuple[Path, int]:
    """cpu-gloo-4rank-a with lines that are not rows in the middle and a torn last line."""
    run_dir = tmp_path / "run"
    shutil.copytree(RUNS / "cpu-gloo-4rank-a", run_dir)
    lines = (run_dir / "measurements.jsonl").read_text().splitlines()
    string_latency = {**json.loads(lines[3]), "latency_p50_us": "fast"}
    unknown_status = {**json.loads(lines[4]), "status": "great"}
    garbage = ["not json at all", "[1, 2]", '{"schema": 1}', json.dumps(string_latency), json.dumps(unknown_status)]
    text = "\n".join(lines[:2] + garbage[:2] + lines[2:5] + garbage[2:] + lines[5:]) + "\n" + lines[6][:40]
    (run_dir / "measurements.jsonl").write_text(text)
    return run_dir, len(lines)


@pytest.mark.procs
def test_every_analysis_names_the_lines_it_skips_and_keeps_every_row(tmp_path: Path) -> None:
    run_dir, row_count = _garbled_copy(tmp_path)
    expected = (f"commbench: warning: {run_dir}/measurements.jsonl: skipped 6 line(s) that are not rows: "
                "line 3 (not JSON); line 4 (a JSON list, not an object); "
                "line 8 (no backend, mode, dtype, message_bytes, world_size, status); "
                "line 9 (latency_us is 'fast'); line 10 (unknown status 'great'); "   # p50 is schema 1's headline
                "an incomplete last line (a row being written, or cut short)")
    for args in (["report", str(run_dir), "--out", str(tmp_path / "report")],
                 ["recommend", str(run_dir), *MODEL], ["compare", str(run_dir), str(run_dir), "--out", str(tmp_path / "cmp")]):
        result = run_cli(args)
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if line.startswith("commbench: warning:")]
        assert warnings and set(warnings) == {expected}, (args, result.stderr)
    read = RunDir(run_dir).read_rows()
    assert len(read.rows) == row_count and read.torn_tail   # every good row is still counted


def _install_plugins(tmp_path: Path, entry_points: dict[str, str], modules: dict[str, str]) -> dict[str, str]:
    """A dist-info with `entry_points` in the commbench.backends group and `modules` beside it."""
    info = tmp_path / "brokenplugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[commbench.backends]\n" + "".join(f"{name} = {target}\n" for name, target in entry_points.items()))
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(source)
    return {"PYTHONPATH": f"{tmp_path}:{child_env()['PYTHONPATH']}"}


BROKEN = {"gone": "no_such_module_anywhere:FACTORY", "notfactory": "brokenplugin_values:NOT_A_FACTORY",
          "makefails": "brokenplugin_values:MAKE_FAILS"}
BROKEN_SOURCE = '''
from commbench.backends.base import BackendFactory

NOT_A_FACTORY = 42


def _make(variant, options):
    raise RuntimeError("cannot find libmykernel.so")


MAKE_FAILS = BackendFactory(family="makefails", make=_make, on_cpu_by_default=True)
'''


@pytest.mark.procs
@pytest.mark.slow
def test_broken_plugins_are_skipped_with_one_warning_unless_named(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    env = _install_plugins(tmp_path / "site", BROKEN, {"brokenplugin_values": BROKEN_SOURCE})
    listed = run_cli(["sweep", "--list-backends"], env=env)
    assert listed.returncode == 0, listed.stderr
    assert "gloo" in listed.stdout and "testfaults" in listed.stdout
    warnings = listed.stderr.strip().splitlines()
    assert len(warnings) == 2, listed.stderr   # the two that do not load; makefails is only made when swept
    assert any("'gone' (no_such_module_anywhere:FACTORY) does not load: ModuleNotFoundError" in w for w in warnings)
    assert any("'notfactory' in commbench.backends is not a BackendFactory" in w for w in warnings)
    assert all(w.startswith("commbench: warning: ") and w.endswith("(skipped)") for w in warnings)

    swept = run_cli(["sweep", "--sizes", "4K", "--iters", "2", "--no-probe", "--out", str(tmp_path / "o")], env=env)
    assert swept.returncode == 0, swept.stderr
    assert "'makefails' could not make its backends: RuntimeError: cannot find libmykernel.so (skipped)" in swept.stderr
    assert "Traceback" not in swept.stderr
    assert {r["backend"] for r in rows(only_run_dir(tmp_path / "o"))} == {"gloo"}

    for name, words in (("gone", "does not load"), ("notfactory", "is not a BackendFactory"),
                        ("makefails", "could not make its backends")):
        named = run_cli(["sweep", "--backends", name, "--sizes", "4K", "--out", str(tmp_path / name)], env=env)
        assert named.returncode == 2
        errors = [line for line in named.stderr.splitlines() if not line.startswith("commbench: warning:")]
        assert len(errors) == 1 and errors[0].startswith("commbench sweep: error: ") and words in errors[0], \
            named.stderr
        assert not (tmp_path / name).exists() or not any((tmp_path / name).iterdir())


def test_a_resume_on_another_machine_names_the_host_and_the_gpu_that_differ() -> None:
    from commbench.results import RunInfo, resume_differences

    gpu = {"host": "boxa", "device": "cuda:0", "name": "NVIDIA H200", "uuid": "GPU-aaa", "pci_bus_id": "0000:19:00.0"}
    recorded = {"world_size": 1, "host": "boxa", "nodes": 1, "gpus": [gpu], "plan": {"message_bytes": [4096]}}
    moved = {"world_size": 1, "host": "boxb", "nodes": 1, "gpus": [{**gpu, "host": "boxb", "uuid": "GPU-bbb"}],
             "plan": {"message_bytes": [4096]}}
    assert resume_differences(RunInfo.from_dict(recorded), moved) == [
        "host boxb here, boxa in the run",
        "GPU of rank 0: boxb cuda:0 NVIDIA H200 GPU-bbb 0000:19:00.0 here, "
        "boxa cuda:0 NVIDIA H200 GPU-aaa 0000:19:00.0 in the run"]
    assert resume_differences(RunInfo.from_dict(recorded), recorded) == []
    assert resume_differences(RunInfo(), moved) == []   # a dir no sweep has written yet
