"""Every command the tool tells a user to run is one it accepts as printed.

The analysis commands run on the committed runs and fixtures (and on nccl-tests imports made here,
with and without a probe snapshot); every command their output names, between backticks or on a
line of its own (a paste block, a `# next:` line), is collected and put through the tool's own
argument checks: a sweep through `commbench.sweep.command.check` as on a GPU box under that
torchrun, an analysis command run for real (files only), the probe parsed. A mention of a
commbench command or torchrun in prose, outside such a command, fails too: a hint is a whole
command or nothing.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from commbench import cli

pytestmark = pytest.mark.slow   # ~40 analysis runs in process

REPO = Path(__file__).parents[2]
RUNS = REPO / "tests" / "data" / "runs"
REFERENCE = REPO / "results" / "reference"
NCCL_TESTS = REPO / "tests" / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.txt"
SNAPSHOT = REPO / "tests" / "fixtures" / "snapshots" / "h200-nvlink-8x.json"
TRACES = REPO / "tests" / "data" / "traces" / "h200-mps"
SPECS = sorted((REPO / "commbench" / "specs").glob("*.toml"))

SUBCOMMANDS = "|".join(map(re.escape, cli.SUBCOMMANDS))
# A command the tool prints: what it starts with (a line of the tool's own, "commbench floor: error:
# ...", is not one).
COMMAND = re.compile(rf"^(?:(?:python3? -m )?commbench (?:{SUBCOMMANDS})(?: |$)|torchrun --nproc-per-node "
                     r"|bash scripts/|pip install )")
OWN_LINE = re.compile(rf"^commbench (?:{SUBCOMMANDS}): ")
MENTION = re.compile(rf"\b(?:commbench (?:{SUBCOMMANDS})\b|torchrun\b)")
BACKTICKED = re.compile(r"`([^`\n]+)`")


def _only_run(folder: Path) -> Path:
    (run,) = [p.parent for p in folder.glob("*/run.json")]
    return run


def commands_in(text: str) -> tuple[list[str], list[str]]:
    """(the commands the text names, the lines that mention a command outside one)."""
    found: list[str] = []
    stray: list[str] = []
    for line in text.splitlines():
        whole = line.strip().removeprefix("# next: ").removeprefix("$ ")
        if COMMAND.match(whole):
            found.append(whole)
            continue
        found += [c for c in BACKTICKED.findall(line) if COMMAND.match(c)]
        if MENTION.search(OWN_LINE.sub("", BACKTICKED.sub("", whole))):
            stray.append(line)
    return found, stray


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def accepts(command: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str | None:
    """Why the tool refuses `command` as printed, or None: the tool's own checks, run in
    `workdir` (where probe.json is the committed 8x H200 snapshot, as the probe would leave it)."""
    words = _words(command)
    monkeypatch.chdir(workdir)
    if words[:2] == ["pip", "install"]:
        extras = re.findall(r"commbench\[(\w+)\]", command)
        text = (REPO / "pyproject.toml").read_text()
        missing = [e for e in extras if not re.search(rf"^{e} = \[", text, re.M)]
        return f"no extra {missing}" if missing or not extras else None
    if words[0] == "bash":
        return None if (REPO / words[1]).is_file() else f"{words[1]} is not in the repo"
    ranks = None
    if words[0] == "torchrun":
        assert words[1] == "--nproc-per-node" and words[3:5] == ["-m", "commbench"], command
        ranks = None if words[2] == "gpu" else int(words[2])
        words = words[5:]
    elif words[0] in ("python", "python3"):
        words = words[3:]
    else:
        words = words[1:]
    name = words[0]
    if name in ("sweep", "probe"):
        try:
            args = cli.build_parser(name).parse_args(words)
        except SystemExit:
            return capsys.readouterr().err.strip()
        if name == "probe":
            return None
        from commbench.errors import UsageError
        from commbench.sweep.command import check

        try:
            check(args, words[1:], on_gpu=True, world=ranks or 8)
        except UsageError as exc:
            return str(exc)
        return None
    try:
        status = cli.main(words)
    except SystemExit as exc:   # argparse's refusal
        status = int(exc.code or 0)
    out = capsys.readouterr()
    return None if status in (0, 1) and "error:" not in out.err else out.err.strip() or f"exit {status}"


@pytest.fixture(scope="module")
def imports(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    where = tmp_path_factory.mktemp("imports")
    with_box, bare = where / "with-box", where / "bare"
    assert cli.main(["import-nccl-tests", str(NCCL_TESTS), "--average", "3", "--out", str(bare)]) == 0
    assert cli.main(["import-nccl-tests", str(NCCL_TESTS), "--average", "3", "--snapshot", str(SNAPSHOT),
                     "--out", str(with_box)]) == 0
    return SimpleNamespace(with_box=with_box, bare=bare)


def _analyses(imports: SimpleNamespace, out: Path) -> list[list[str]]:
    """Every analysis command, on every kind of run the repo holds (fixture, CPU, MPS-emulated,
    imported with and without a box), with the options that change what it suggests."""
    pcie = RUNS / "synthetic-pcie-8gpu"
    cpu = RUNS / "cpu-gloo-4rank-a"
    world8 = _only_run(REFERENCE / "h200-mps-emulated" / "world8" / "allreduce")
    world2 = _only_run(REFERENCE / "h200-mps-emulated" / "world2" / "allreduce")
    fused = _only_run(REFERENCE / "h200-mps-emulated" / "world8" / "fused-h6144")
    runs = [pcie, cpu, world8, fused, imports.with_box, imports.bare]
    mixes = [[], ["--concurrency", "1,16,512", "--prefill-tokens", "8192"]]
    argvs: list[list[str]] = []
    for run in runs:
        for mix in mixes:
            argvs += [["recommend", str(run), "--model", "glm-5", *mix], ["floor", str(run), "--model", "glm-5", *mix]]
        argvs.append(["engines", str(run), "--model", "glm-5"])
        argvs += [["qualify", "--spec", str(spec), str(run)] for spec in SPECS]
    argvs += [["recommend", str(pcie), "--model", "llama-3.1-70b", "--tp", "4"],   # TP not the run's
              ["floor", str(world8), "--hidden", "5120", "--layers", "40", "--ar-per-layer", "2"],
              ["report", str(pcie), "--out", str(out / "report")],
              ["compare", str(RUNS / "cpu-gloo-4rank-a"), str(RUNS / "cpu-gloo-4rank-b"), "--out", str(out / "cmp")],
              ["table", str(world2), str(world8)],
              ["attribute", str(TRACES / "p2p-oneshot_lamport-rank0.trace.json.gz"),
               str(TRACES / "p2p-oneshot_lamport-rank1.trace.json.gz"), "--run", str(world2)]]
    return argvs


def test_every_command_the_analysis_prints_is_accepted_as_printed(imports, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "box"
    workdir.mkdir()
    shutil.copy(SNAPSHOT, workdir / "probe.json")
    monkeypatch.setenv("COLUMNS", "100")
    said: dict[str, list[str]] = {}
    strays: list[str] = []
    for argv in _analyses(imports, tmp_path):
        cli.main(argv)
        out = capsys.readouterr()
        found, stray = commands_in(out.out + out.err)
        strays += [f"{' '.join(argv[:2])}: {line.strip()}" for line in stray]
        for command in found:
            said.setdefault(command, []).append(" ".join(argv[:2]))
    assert not strays, "\n".join(strays)
    # The commands these outputs must suggest somewhere (a test that finds none proves nothing).
    assert any("--prefill-tokens 8192" in c and "--tokens 1,2,4,8,16,32,64,128,256,512" in c for c in said), said
    assert any(c.startswith("commbench probe") for c in said), said
    refused = {c: why for c in said if (why := accepts(c, workdir, monkeypatch, capsys)) is not None}
    assert not refused, "\n".join(f"{c}\n  <- {why} (from {', '.join(sorted(set(said[c])))})"
                                  for c, why in refused.items())


def test_the_sweeps_next_steps_are_accepted_as_printed(tmp_path, monkeypatch, capsys):
    from commbench.sweep.command import next_commands

    run = _only_run(REFERENCE / "h200-mps-emulated" / "world8" / "allreduce")
    printed = [command for model in ("glm-5", None) for on_gpu in (True, False)
               for command in next_commands(SimpleNamespace(model=model), run, 8, on_gpu)]
    assert len(printed) == 8
    refused = {c: why for c in printed if (why := accepts(c, tmp_path, monkeypatch, capsys)) is not None}
    assert not refused, refused


def test_a_hint_is_told_from_prose_and_a_refused_one_is_caught(tmp_path, monkeypatch, capsys):
    """The collector's own checks: what counts as a command, a stray mention, and a refusal."""
    found, stray = commands_in("the sweep that prices it:\n    torchrun --nproc-per-node 8 -m commbench sweep -e 64M"
                               "\nrun `commbench floor --list-models` first\nor commbench report it")
    assert found == ["torchrun --nproc-per-node 8 -m commbench sweep -e 64M", "commbench floor --list-models"]
    assert stray == ["or commbench report it"]
    assert "leave out -e" in accepts(
        "torchrun --nproc-per-node 8 -m commbench sweep --model glm-5 --tp 8 -e 64M", tmp_path, monkeypatch, capsys)
    assert "--tp 4 but this sweep runs 8" in accepts(
        "torchrun --nproc-per-node 8 -m commbench sweep --model glm-5 --tp 4", tmp_path, monkeypatch, capsys)
    assert accepts("commbench recommend --model glm-5", tmp_path, monkeypatch, capsys)
    assert accepts("pip install 'commbench[nosuch]'", tmp_path, monkeypatch, capsys)


def test_the_specs_comments_show_commands_that_work(tmp_path, monkeypatch, capsys):
    """Each spec's comments say how to produce a run for it and qualify that run; each command is
    accepted as written, with DIR/<run> standing for the folder the sweep writes under --out DIR
    (a committed run here) and probe.json for the snapshot the probe writes."""
    workdir = tmp_path / "box"
    workdir.mkdir()
    shutil.copy(SNAPSHOT, workdir / "probe.json")
    run = RUNS / "synthetic-pcie-8gpu"
    for spec in SPECS:
        comments = [line.lstrip("#").strip() for line in spec.read_text().splitlines() if line.startswith("#")]
        found = [c for line in comments for c in commands_in(line)[0]]
        assert any("sweep --qualify" in c for c in found) and any(c.startswith("commbench qualify") for c in found), \
            spec.name
        for command in found:
            command = command.replace("DIR/<run>", str(run)).replace(f"commbench/specs/{spec.name}", str(spec))
            assert accepts(command, workdir, monkeypatch, capsys) is None, (spec.name, command)
