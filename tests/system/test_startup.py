"""Start-up: the CLI imports only the chosen subcommand, and the analysis half runs without torch.

The no-torch run is one Python process with torch made unimportable (a meta-path finder that
refuses it, as an environment without torch would), running every analysis command in turn on
the committed runs: it stands for `pip install --no-deps -e .` plus rich and matplotlib.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from commbench import cli
from helpers import child_env

ROOT = Path(__file__).parents[2]
RUNS = Path(__file__).parents[1] / "data" / "runs"
EMULATED = ROOT / "results" / "reference" / "h200-mps-emulated"
NCCL_TESTS = Path(__file__).parents[1] / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.json"
TRACES = Path(__file__).parents[1] / "data" / "traces" / "h200-mps"

# Runs every argv list in sys.argv[1] (JSON) through the CLI with torch unimportable; prints a
# JSON list of (exit status, whether torch got imported) per command.
NO_TORCH = """
import importlib.abc, json, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
from commbench.cli import main
results = [main(argv) for argv in json.loads(sys.argv[1])]
print(json.dumps([results, "torch" in sys.modules]))
"""


def _one(pattern: str) -> str:
    found = sorted(EMULATED.glob(pattern))
    assert len(found) == 1, found
    return str(found[0])


@pytest.mark.procs
def test_every_analysis_command_runs_with_torch_unimportable(tmp_path: Path) -> None:
    world8 = _one("world8/allreduce/*/")
    commands = [
        ["floor", "--list-models"],
        ["report", world8, "--out", str(tmp_path / "report")],
        ["floor", world8, "--model", "deepseek-v3"],
        ["recommend", world8, "--model", "deepseek-v3"],
        ["qualify", str(RUNS / "synthetic-pcie-8gpu"), "--spec", str(ROOT / "commbench/specs/pcie-8x.toml")],
        ["compare", str(RUNS / "cpu-gloo-4rank-a"), str(RUNS / "cpu-gloo-4rank-b"), "--out", str(tmp_path / "cmp")],
        ["table", _one("world2/allreduce/*/"), world8, "--out", str(tmp_path / "table.md")],
        ["import-nccl-tests", str(NCCL_TESTS), "--out", str(tmp_path / "imported")],
        ["fleet", "build", str(RUNS / "cpu-gloo-4rank-a"), "--out", str(tmp_path / "fleet")],
        ["report", str(tmp_path / "imported"), "--out", str(tmp_path / "imported-report")],
        ["attribute", *(str(p) for p in sorted(TRACES.glob("p2p-oneshot_lamport-rank*.trace.json.gz"))),
         "--run", _one("world2/allreduce/*/"), "--hidden", "4096", "--batch", "8"],
        ["engines", world8, "--model", "glm-5", "--engine-site", str(ROOT / "tests/data/engine-src/vllm-site")],
    ]
    assert {argv[0] for argv in commands} | {"probe", "sweep"} == set(cli.SUBCOMMANDS)
    done = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(commands)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    statuses, torch_imported = json.loads(done.stdout.strip().splitlines()[-1])
    # qualify's exit status is its verdict (1 on FAIL): what matters is that it gave one
    assert [s for argv, s in zip(commands, statuses) if argv[0] != "qualify"] == [0] * (len(commands) - 1)
    assert statuses[4] in (0, 1)
    assert not torch_imported
    assert (tmp_path / "report" / "report.html").is_file() and (tmp_path / "table.md").is_file()


def test_help_lists_every_subcommand_without_importing_one(capsys: pytest.CaptureFixture[str]) -> None:
    modules = {module for module, _ in cli.SUBCOMMANDS.values()}
    loaded = {name: sys.modules.pop(name) for name in modules if name in sys.modules}
    try:
        with pytest.raises(SystemExit) as stop:
            cli.main(["--help"])
        assert stop.value.code == 0
        assert not modules & set(sys.modules)
    finally:
        sys.modules.update(loaded)
    listing = capsys.readouterr().out
    assert all(f"    {name}" in listing for name in cli.SUBCOMMANDS)


def test_every_registered_module_is_a_subcommand() -> None:
    for module_name, help_text in cli.SUBCOMMANDS.values():
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.main) and help_text


# `commbench sweep --help` with torch unimportable: the sweep's flags and every family's own.
SWEEP_HELP = NO_TORCH.split("from commbench.cli import main")[0] + """
from commbench.cli import main
try:
    main(["sweep", "--help"])
except SystemExit as stop:
    print(json.dumps([stop.code, "torch" in sys.modules]))
"""


@pytest.mark.procs
@pytest.mark.parametrize("plugins", [False, True], ids=["built-in", "with plug-ins"])
def test_sweep_help_answers_without_torch(plugins: bool) -> None:
    """A plug-in's module is imported for its flags, and with it backends.base, which imports no
    torch either: the driver of `sweep --nproc` and --help start in a fraction of a second."""
    env = child_env() if plugins else None   # tests/plugins on PYTHONPATH: testfaults and hookdemo
    done = subprocess.run([sys.executable, "-c", SWEEP_HELP], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    *help_text, last = done.stdout.strip().splitlines()
    assert json.loads(last) == [0, False]
    text = "\n".join(help_text)
    assert ("--hookdemo-level" in text) is plugins
    for family, flag in (("nccl", "--nccl-proto"), ("p2p", "--p2p-max-bytes"), ("flashinfer", "--flashinfer-pdl"),
                         ("mscclpp", "--mscclpp-nccl-lib")):
        assert f"{family} backend:" in text and flag in text, family
    assert "--qualify SPEC.toml" in text and "--nproc NPROC" in text
