"""Bad input, across every subcommand: one line on stderr, exit status 2, no traceback, nothing
printed before it and nothing written.

BAD_INPUT is the one table of (argv, expected line) for the whole CLI: a new flag brings its bad
values here. The cases run in-process (the same code path as `python -m commbench`, without a
Python start per case) with the working directory in a fresh tmp dir, whose contents must be
the same afterwards; a few run as real processes too, under torchrun and through the driver.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from commbench import cli
from helpers import PLUGINS, our_frames, python_in_a_clone_named_commbench, run_cli, run_torchrun

TESTS = Path(__file__).parents[1]
REPO = TESTS.parent
RUNS = TESTS / "data" / "runs"
SNAPSHOT = TESTS / "fixtures" / "snapshots" / "pcie-2x4-numa.json"
SPEC = TESTS.parent / "commbench" / "specs" / "pcie-8x.toml"

# Files the table's cases read, made in {in}/ before each case.
INPUTS: dict[str, bytes] = {
    "not-utf8.toml": b'[spec]\nname = "caf\xe9"\n',
    "world-eight.toml": b'[spec]\nworld_size = "eight"\n',
    "spec-5.toml": b"spec = 5\n",
    "latency-list.toml": b"latency = [1, 2]\n",
    "nan-limit.toml": b"[[latency]]\nsize = '4K'\nmax_us = nan\n",
    "int8.toml": b"[spec]\ndtype = 'int8'\n",
    "checks-5.toml": b"checks = 5\n",
    "latency-table.toml": b"[latency]\nsize = '4K'\n",
    "not-utf8.csv": b"bytes,latency_us\n4K,1\n\xff\xfe,2\n",
    "binary.csv": b"\x7fELF\x02\x01\x01\0\0\0bytes,latency_us\n",
    "nan.csv": b"bytes,latency_us\n4K,nan\n",
    "inf.csv": b"bytes,latency_us\n4K,inf\n",
    "not-utf8.json": b'{"kind": "caf\xe9"}',
    "a-file": b"not a directory\n",
    "empty.log": b"",
    "engine.log": b"INFO 12-02 06:40:11 [api_server.py:1090] vLLM API server version 0.11.2\n",
    # results dirs whose run.json is no run.json
    "run-list/run.json": b"[1, 2]\n",
    "run-not-utf8/run.json": b'{"schema": 3, "host": "caf\xe9"}',
    "run-json-dir/run.json/x": b"",
    # files from someone else (issue 31): nested past any real file, types and ranges run.json never has
    "deep.toml": b"x = " + b"[" * 3000 + b"]" * 3000 + b"\n",
    "run-deep/run.json": b'{"schema": 3, "deep": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    "run-world-text/run.json": b'{"schema": 3, "world_size": "eight"}',
    "run-world-zero/run.json": b'{"schema": 3, "world_size": 0}',
    "run-plan-list/run.json": b'{"schema": 3, "world_size": 1, "plan": ["not", "a", "table"]}',
    "run-plan-no-world/run.json": b'{"schema": 3, "plan": {"message_bytes": [4096]}}',
    "run-rows-dir/run.json": b'{"schema": 3, "run_id": "x"}',
    "run-rows-dir/measurements.jsonl/x": b"",
    "nan-time.txt": (TESTS / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.txt").read_bytes().replace(
        b"    9.11    0.45    0.79       0     9.05", b"     nan    0.45    0.79       0     9.05", 1),
}

ONE_RUN = ["{runs}/cpu-gloo-4rank-a"]
FLOOR = ["floor", "{runs}/synthetic-pcie-8gpu", "--model", "glm-5"]
TABLE = ["floor", "--model", "glm-5", "--latency-table"]
QUALIFY = ["qualify", "{runs}/synthetic-pcie-8gpu", "--spec"]
SWEEP = ["sweep", "--sizes", "4K", "--iters", "2", "--out", "out"]
NCCL_LOG = ["attribute", str(TESTS / "data" / "traces" / "constructed" / "vllm-rank0.trace.json"), "--nccl-log"]

BAD_INPUT = [
    # ---- sweep: sizes, lists, dtypes, modes, backends
    (["sweep", "--backends", "warpdrive", "--out", "out"], "unknown backend 'warpdrive'"),
    (["sweep", "--backends", "nccl:proto=LL129", "--out", "out"], "unknown NCCL protocol 'LL129'"),
    (["sweep", "--backends", ",", "--out", "out"], "--backends ',': the list is empty"),
    (["sweep", "--dtype", "fp8", "--out", "out"], "unknown dtype 'fp8'"),
    (["sweep", "--dtype", "fp32,fp32", "--out", "out"], "--dtype 'fp32,fp32': fp32 is listed twice"),
    (["sweep", "--dtype", "fp32,float", "--out", "out"], "--dtype 'fp32,float': fp32 is listed twice"),
    (["sweep", "--dtype", ",", "--out", "out"], "--dtype ',': the list is empty"),
    (["sweep", "--mode", ",", "--out", "out"], "--mode ',': the list is empty"),
    (["sweep", "--mode", "eager,eager", "--out", "out"], "--mode 'eager,eager': eager is listed twice"),
    (["sweep", "--mode", "graph", "--out", "out"], "graph mode needs CUDA"),
    (["sweep", "-b", "12Q", "--out", "out"], "malformed size '12Q'"),
    (["sweep", "-b", "1M", "-e", "4K", "--out", "out"], "larger than max size"),
    (["sweep", "--sizes", "3", "--out", "out"], "no message size (3B) is a whole number of fp32 elements"),
    (["sweep", "--sizes", "6,10", "--out", "out"], "no message size (6B, 10B) is a whole number of fp32"),
    (["sweep", "--sizes", "4K,4096", "--out", "out"], "--sizes '4K,4096': 4096 is listed twice"),
    (["sweep", "--sizes", ",", "--out", "out"], "--sizes ',': the list is empty"),
    (["sweep", "--tokens", "1,1", "--hidden", "1024", "--out", "out"], "--tokens '1,1': 1 is listed twice"),
    (["sweep", "--tokens", "1,x", "--hidden", "1024", "--out", "out"], "--tokens '1,x': 'x' is not a whole number"),
    # ---- sweep: nccl-tests' short flags
    (["sweep", "-G", "10", "--mode", "eager", "--out", "out"], "-G 10 chooses the mode"),
    (["sweep", "-G", "-1", "--out", "out"], "-G must be 0 (eager) or a number of graph launches"),
    (["sweep", "-G", "10", "-n", "5", "--graph-ops", "5", "--out", "out"], "give -n or --graph-ops, not both"),
    (["sweep", "-G", "10", "--out", "out"], "graph mode needs CUDA"),
    (["sweep", "-c", "-1", "--out", "out"], "-c/--check is a count of checks, 0 or more (got -1)"),
    (["sweep", "-n", "0", "--out", "out"], "--iters must be positive"),
    (["sweep", "-d", "double", "--out", "out"], "unknown dtype 'double'"),
    (["sweep", "--tokens", "0", "--hidden", "1024", "--out", "out"], "--tokens '0': 0 is not positive"),
    (["sweep", "--tokens", "1,2", "--out", "out"], "need both --tokens and --hidden"),
    (["sweep", "--sizes", "9" * 400, "--out", "out"], "is larger than 1048576G, the most a rank can send"),
    (["sweep", "--sizes", "4K,6", "--out", "out"], "message size 6B is not a whole number of fp32 elements"),
    (["sweep", "--tokens", "1", "--hidden", str(10 ** 30), "--out", "out"], "--hidden must be a whole number from 1 to 1048576"),
    (["sweep", "--sizes", "4K", "--backends", "gloo,gloo", "--out", "out"], "--backends 'gloo,gloo': gloo is listed"),
    # ---- sweep: limits that are no limit (NaN fails every comparison; inf overflows the timer)
    ([*SWEEP, "--timeout", "inf"], "--timeout must be a positive, finite number of seconds, at most"),
    ([*SWEEP, "--timeout", "nan"], "--timeout must be a positive, finite number of seconds (got nan)"),
    ([*SWEEP, "--timeout", "1e300"], "--timeout must be a positive, finite number of seconds, at most"),
    ([*SWEEP, "--timeout", "0"], "--timeout must be a positive, finite number of seconds (got 0)"),
    ([*SWEEP, "--setup-timeout", "nan"], "--setup-timeout must be a positive, finite number of seconds"),
    ([*SWEEP, "--nproc", "1", "--child-timeout", "-1"], "--child-timeout must be a positive, finite number"),
    ([*SWEEP, "--nproc", "1", "--child-timeout", "nan"], "--child-timeout must be a positive, finite number"),
    ([*SWEEP, "--p2p-timeout-ms", "-1"], "p2p_timeout_ms must be positive and finite, got -1.0"),
    ([*SWEEP, "--p2p-timeout-ms", "nan"], "p2p_timeout_ms must be positive and finite, got nan"),
    ([*SWEEP, "--p2p-pdl", "maybe"], "argument --p2p-pdl: invalid choice: 'maybe'"),
    ([*SWEEP, "--iters", "0"], "--iters must be positive"),
    # ---- sweep: flags that would be ignored, targets that cannot be written, the driver
    ([*SWEEP, "--junit", "j.xml"], "--junit writes qualify's JUnit XML: give it with --qualify"),
    ([*SWEEP, "--qualify", str(SPEC), "--junit", "/proc/j.xml"], "--junit /proc/j.xml: not writable"),
    ([*SWEEP, "--qualify", "{in}/spec-5.toml"], "spec-5.toml: [spec] must be a table, got 5"),
    (["sweep", "--out", "{in}/a-file/sub"], "--out {in}/a-file/sub: not writable"),
    (["sweep", "--out", "/proc/commbench-results"], "--out /proc/commbench-results: not writable"),
    ([*SWEEP, "--resume", "/nonexistent/run"], "not a commbench results dir"),
    ([*SWEEP, "--resume", "{in}/run-list"], "run.json: a JSON list, not a commbench run.json (an object)"),
    ([*SWEEP, "--resume", "{in}/run-json-dir"], "run.json: is a directory, not a commbench run.json"),
    ([*SWEEP, "--resume", "{in}/run-plan-list"], "run.json: plan is ['not', 'a', 'table'], not a table"),
    ([*SWEEP, "--resume", "{in}/run-plan-no-world"], "records a plan but no world_size"),
    ([*SWEEP, "--resume", "{in}/run-rows-dir"], "measurements.jsonl: a directory, not a rows file"),
    ([*SWEEP, "--env", "lower=1"], "malformed --env"),
    ([*SWEEP, "--env", "NCCL_NVLS_ENABLE=1", "--nproc", "2"], "would enable NVLink multicast"),
    ([*SWEEP, "--mps"], "use it with --nproc N --share-gpus"),
    ([*SWEEP, "--mps", "--nproc", "2", "--share-gpus"], "nvidia-cuda-mps-control not found"),
    ([*SWEEP, "--nproc", "2", "--backends", "testfaults:solo"], "cannot run with 2 rank(s): supports at most 1"),
    # ---- probe
    (["probe", "--from", "/nonexistent/snap.json"], "/nonexistent/snap.json: no such file"),
    (["probe", "--from", "{in}/not-utf8.json"], "not-utf8.json: not UTF-8 text (byte 13)"),
    (["probe", "--from", "{in}"], "is a directory, not a commbench topology snapshot"),
    (["probe", "--from", str(SNAPSHOT), "--json", "{in}"], "--json {in}: is a directory (give a file name)"),
    (["probe", "--from", str(SNAPSHOT), "--json", "-"], "--json -: the probe prints its tables on stdout"),
    (["probe", "--from", str(SNAPSHOT), "--json", "nodir/s.json"], "--json nodir/s.json: no such directory"),
    (["probe", "--from", str(SNAPSHOT), "--plot", "nodir/x.png"], "--plot nodir/x.png: no such directory"),
    (["probe", "--timeout", "0"], "--timeout must be a positive, finite number of seconds (got 0)"),
    (["probe", "--timeout", "nan"], "--timeout must be a positive, finite number of seconds (got nan)"),
    (["probe", "--timeout", "inf"], "--timeout must be a positive, finite number of seconds (got inf)"),
    (["probe", "--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["probe", "--plot", "out.svg"], "--plot writes a PNG"),
    (["probe", "--bandwidth", "--from", "x.json"], "cannot be combined with --from"),
    # ---- report
    (["report", "{runs}/synthetic-pcie-8gpu", "--baseline", "nosuch", "--out", "out"], "baseline 'nosuch' has no"),
    (["report", "/no/such/run"], "no such results directory"),
    (["engines", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["report", "{in}"], "not a commbench results dir (no run.json)"),
    (["report", "{in}/run-list"], "run-list/run.json: a JSON list, not a commbench run.json (an object)"),
    (["report", "{in}/run-json-dir"], "run-json-dir/run.json: is a directory, not a commbench run.json"),
    (["report", "{in}/run-not-utf8"], "run.json: not UTF-8 text (byte 26), not a commbench run.json"),
    (["report", "{in}/run-world-zero"], "run.json: world_size is 0, not a whole number of ranks >= 1"),
    (["report", *ONE_RUN, "--out", "{in}/a-file"], "--out {in}/a-file: exists and is not a directory"),
    (["report", *ONE_RUN, "--out", "/proc/commbench-report"], "--out /proc/commbench-report: not writable"),
    # ---- floor
    ([*FLOOR, "--json", "{in}"], "--json {in}: is a directory (give a file name)"),
    ([*FLOOR, "--step-ms", "nan", "--concurrency", "1"], "--step-ms must be a positive, finite number of milliseconds"),
    ([*FLOOR, "--step-ms", "inf", "--concurrency", "1"], "--step-ms must be a positive, finite number of milliseconds"),
    ([*FLOOR, "--step-ms", "0"], "--step-ms must be a positive, finite number of milliseconds (got 0)"),
    ([*FLOOR, "--step-ms", "17", "--concurrency", "1,2"], "one measured step"),
    ([*FLOOR, "--concurrency", "1,1"], "--concurrency '1,1': 1 is listed twice"),
    ([*FLOOR, "--concurrency", ","], "--concurrency ',': the list is empty"),
    ([*FLOOR, "--dtype", "int8"], "unknown dtype 'int8'"),
    ([*FLOOR, "--dtype", "fp32"], "no fp32 rows"),
    ([*FLOOR, "--tp", "4"], "measured at world size 8, not TP 4"),
    ([*FLOOR, "--tp", "0"], "--tp must be a positive number of ranks (got 0)"),
    (["floor", "{runs}/synthetic-pcie-8gpu", "--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["floor", *ONE_RUN, "--layers", "10", "--hidden", "1024"], "needs all of --layers, --hidden and --ar-per-layer"),
    (["floor", "/no/such/run", "--model", "glm-5"], "no such results directory"),
    (["floor", "{in}/run-not-utf8", "--model", "glm-5"], "run.json: not UTF-8 text (byte 26)"),
    (["floor", "{in}/run-list", "--model", "glm-5"], "run.json: a JSON list, not a commbench run.json"),
    (["floor", "{in}/run-world-text", "--model", "glm-5"], "world_size is 'eight', not a whole number of ranks"),
    ([*TABLE, "{in}/not-utf8.csv"], "not-utf8.csv: not UTF-8 text (byte 22), not a latency table"),
    ([*TABLE, "{in}/binary.csv"], "binary.csv: binary file, not a latency table"),
    ([*TABLE, "{in}"], "is a directory, not a latency table"),
    ([*TABLE, "{in}/nan.csv"], "nan.csv:2: latency_us must be a positive, finite number, got nan"),
    ([*TABLE, "{in}/inf.csv"], "inf.csv:2: latency_us must be a positive, finite number, got inf"),
    ([*TABLE, "{in}/missing.csv"], "missing.csv: no such file"),
    # ---- recommend
    (["recommend", "{runs}/synthetic-pcie-8gpu", "--model", "glm-5", "--concurrency", "8,8"], "8 is listed twice"),
    (["recommend", "{runs}/synthetic-pcie-8gpu", "--model", "glm-5", "--json", "{in}"], "is a directory"),
    (["recommend", "{runs}/synthetic-pcie-8gpu", "--model", "llama-5"], "unknown model 'llama-5'"),
    (["recommend", "{in}/run-json-dir", "--model", "glm-5"], "run.json: is a directory, not a commbench run.json"),
    (["recommend", "{runs}/synthetic-pcie-8gpu", "--model", "glm-5", "--tp", "-1"], "--tp must be a positive number"),
    # ---- qualify
    ([*QUALIFY, "{in}/not-utf8.toml"], "not-utf8.toml: not UTF-8 text (byte 18), not a qualify spec"),
    ([*QUALIFY, "{in}"], "is a directory, not a qualify spec"),
    ([*QUALIFY, "{in}/world-eight.toml"], "[spec] world_size must be a whole number of ranks, got 'eight'"),
    ([*QUALIFY, "{in}/spec-5.toml"], "[spec] must be a table, got 5"),
    ([*QUALIFY, "{in}/checks-5.toml"], "[checks] must be a table, got 5"),
    ([*QUALIFY, "{in}/latency-list.toml"], "[[latency]] #1 must be a table, got 1"),
    ([*QUALIFY, "{in}/latency-table.toml"], "[[latency]] must be an array of tables"),
    ([*QUALIFY, "{in}/nan-limit.toml"], "[[latency]] #1 max_us must be a non-negative finite number, got nan"),
    ([*QUALIFY, "{in}/int8.toml"], "[spec] dtype must be one of bf16, fp16, fp32, got 'int8'"),
    ([*QUALIFY, "{in}/missing.toml"], "missing.toml: no such file"),
    ([*QUALIFY, "{in}/deep.toml"], "deep.toml: nested deeper than 64 levels"),
    ([*QUALIFY, "/dev/zero"], "/dev/zero: is a device, not a qualify spec"),
    (["qualify", "{in}/run-list", "--spec", str(SPEC)], "run.json: a JSON list, not a commbench run.json"),
    ([*QUALIFY, str(SPEC), "--junit", "/proc/q.xml"], "--junit /proc/q.xml: not writable"),
    ([*QUALIFY, str(SPEC), "--junit", "{in}"], "--junit {in}: is a directory"),
    ([*QUALIFY, str(SPEC), "--reference", *ONE_RUN, "--max-slowdown-pct", "nan"], "--max-slowdown-pct must be"),
    ([*QUALIFY, str(SPEC), "--snapshot", "{in}/not-utf8.json"], "not-utf8.json: not UTF-8 text"),
    # ---- compare
    (["compare", *ONE_RUN, "{runs}/cpu-gloo-4rank-b", "--json", "{in}"], "--json {in}: is a directory"),
    (["compare", *ONE_RUN, "{runs}/synthetic-pcie-8gpu", "--out", "out", "--different-machines"], "share no backend"),
    (["compare", *ONE_RUN, "{runs}/synthetic-pcie-8gpu", "--out", "out"], "pass --different-machines"),
    (["compare", *ONE_RUN, "{runs}/cpu-gloo-4rank-b", "--out", "{in}/a-file"], "exists and is not a directory"),
    (["compare", *ONE_RUN, "/no/such/run"], "no such results directory"),
    # ---- table
    (["fleet", "qualify", "{in}"], "{in}: not a fleet (no fleet.json)"),
    (["fleet", "qualify", "{in}", "--min-nodes", "2"], "--min-nodes must be at least 3"),
    (["fleet", "build", *ONE_RUN, "--out", "{in}"], "--out {in}: a folder that is not a fleet and not empty"),
    (["fleet", "query", "{in}", "select 1"], "{in}: not a fleet (no fleet.json)"),
    (["table", "/no/such/run"], "no such results directory"),
    (["engines", "--check", "/no/such/site"], "--check: /no/such/site does not exist"),
    (["engines", "--tp", "0"], "--tp must be a positive number of ranks"),
    (["table", *ONE_RUN, *ONE_RUN], "a run dir is listed twice"),
    (["table", *ONE_RUN, "--out", "{in}"], "--out {in}: is a directory (give a file name)"),
    (["table", "{in}/run-deep"], "run.json: nested deeper than 64 levels"),
    (["compare", *ONE_RUN, "{in}/run-not-utf8"], "run.json: not UTF-8 text (byte 26)"),
    (["compare", "{in}/run-json-dir", *ONE_RUN], "run.json: is a directory, not a commbench run.json"),
    # ---- import-nccl-tests
    (["import-nccl-tests", "{in}/binary.csv", "--out", "out"], "binary.csv: binary file, not nccl-tests output"),
    (["import-nccl-tests", "{in}/not-utf8.csv", "--out", "out"], "not UTF-8 text (byte 22), not nccl-tests output"),
    (["import-nccl-tests", "{in}", "--out", "out"], "is a directory, not nccl-tests output"),
    (["import-nccl-tests", "{in}/binary.csv", "--setting", "nope", "--out", "out"], "malformed --setting 'nope'"),
    (["import-nccl-tests", "{in}/nan-time.txt", "--average", "3", "--out", "out"],
     "nan-time.txt: line 19: the out-of-place time is nan, not a positive time"),
    # ---- engines (more in tests/unit/test_engine_facts.py)
    (["engines", "--check", "{in}/a-file"], "--check: {in}/a-file is not a folder"),
    (["engines", "--check", "{in}"], "holds no vllm, sglang or flashinfer package"),
    (["engines", "--check", "/no/such/site"], "--check: /no/such/site does not exist"),
    (["engines", "--engine-site", "{in}"], "--engine-site: {in} holds no vllm or sglang package"),
    (["engines", "--engine-log", "{in}/engine.log"], "no \"Using [...] all-reduce backends (in dispatch order)"),
    (["engines", "--engine-log", "{in}/no-such.log"], "--engine-log {in}/no-such.log: no such file"),
    (["engines", "{in}/not-utf8.json"], "not-utf8.json"),
    (["engines", "--json", "{in}"], "--json {in}: is a directory"),
    (["engines", "--check", "{in}", "--html", "-"], "--html -: give a file name"),
    (["engines", "{in}/run-list/run.json"], "not a probe snapshot"),
    (["engines", "--engine", "trtllm"], "--engine 'trtllm': choose from vllm, sglang"),
    (["engines", "--model", "glm-5", "--arch", "Glm;rm"], "--arch 'Glm;rm': expected a class name"),
    (["engines", "--tp", "0"], "--tp must be a positive number of ranks"),
    (["recommend", "{runs}/synthetic-pcie-8gpu", "--model", "glm-5", "--engine-log", "{in}/empty.log"],
     "no \"Using [...] all-reduce backends"),
    # ---- attribute (more in tests/system/test_attribute.py)
    (["attribute", "/no/such/trace.json"], "no such file"),
    (["attribute", "{in}"], "is a directory, not a profiler trace"),
    (["attribute", "{in}/binary.csv"], "not a Chrome trace JSON"),
    (["attribute", "{in}/not-utf8.csv"], "not a profiler trace (not UTF-8 text)"),
    (["attribute", "{in}/binary.csv", "--json", "{in}"], "--json {in}: is a directory"),
    ([*NCCL_LOG, "{in}/no-such.log"], "--nccl-log {in}/no-such.log: no such file"),
    ([*NCCL_LOG, "{in}"], "--nccl-log {in}: is a directory, not an NCCL log"),
    ([*NCCL_LOG, "{in}/empty.log"], "--nccl-log {in}/empty.log: empty file, not an NCCL log"),
    ([*NCCL_LOG, "{in}/binary.csv"], "--nccl-log {in}/binary.csv: binary file, not an NCCL log"),
    ([*NCCL_LOG, "{in}/engine.log"], "engine.log: not an NCCL log (no 'NCCL INFO' line; run the engine with"),
]


def _expand(words: list[str], inputs: Path) -> list[str]:
    return [w.replace("{runs}", str(RUNS)).replace("{in}", str(inputs)) for w in words]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory holding {in}/ with the input files; plug-ins importable."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for name, data in INPUTS.items():
        (inputs / name).parent.mkdir(parents=True, exist_ok=True)
        (inputs / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:   # argparse's own errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line(code: int, out: str, err: str, expected: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0], lines[0]
    assert lines[0].startswith("commbench ") and ": error: " in lines[0], lines[0]
    assert out == "", out             # said before anything else is printed


@pytest.mark.parametrize("argv, expected", BAD_INPUT, ids=[" ".join(a)[:70] for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_nothing_written(argv, expected, workdir, capsys):
    before = _tree(workdir)
    code, out, err = run_in_process(_expand(argv, workdir / "in"), capsys)
    assert_one_line(code, out, err, expected.replace("{in}", str(workdir / "in")))
    assert _tree(workdir) == before


def test_the_table_covers_every_subcommand():
    assert {argv[0] for argv, _ in BAD_INPUT} == set(cli.SUBCOMMANDS)


@pytest.mark.parametrize("argv, expected", [
    ([*SWEEP, "--timeout", "inf"], "--timeout must be a positive, finite number of seconds"),
    ([*SWEEP, "--nproc", "2", "--backends", "testfaults:solo"], "cannot run with 2 rank(s)"),
    ([*QUALIFY, str(SPEC), "--junit", "/proc/q.xml"], "--junit /proc/q.xml: not writable"),
])
@pytest.mark.procs
def test_the_real_entry_point_answers_the_same(argv, expected, tmp_path):
    done = run_cli(_expand(argv, tmp_path))
    assert_one_line(done.returncode, done.stdout, done.stderr, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.procs
def test_under_torchrun_the_line_comes_once_before_torchrun_reports(tmp_path):
    """torchrun adds its own report of the failed workers (docs/sweep.md says so); commbench's part is
    one line from rank 0, with no traceback of ours. Run from a checkout named commbench, as a plain
    `git clone` makes it: torchrun's own frames then lie under commbench/.venv/ and must not count."""
    python = python_in_a_clone_named_commbench(tmp_path)
    done = run_torchrun(2, ["sweep", "--timeout", "nan", "--out", str(tmp_path / "out")], python=python)
    ours = [line for line in done.stderr.splitlines() if line.startswith("commbench sweep: error:")]
    assert ours == ["commbench sweep: error: --timeout must be a positive, finite number of seconds (got nan)"]
    assert f"{tmp_path}/commbench/.venv/" in done.stderr   # torchrun's report names its files under the clone
    assert our_frames(done.stderr) == [] and not (tmp_path / "out").exists()


def test_our_frames_are_told_by_the_package_folder_not_by_the_word():
    import commbench

    package = Path(commbench.__file__).parent
    torch_frame = '  File "/home/u/commbench/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 9'
    our_frame = f'  File "{package}/sweep/command.py", line 130, in main'
    assert our_frames("\n".join([torch_frame, our_frame])) == [our_frame]


# ---------------------------------------------------------------- runs that cannot be read or written
# As root (CI) mode bits are ignored, so these cases make the OS answer what it answers a user
# without the permission: EACCES on reading run.json, EROFS on writing into the run dir.

def _copy(name: str, tmp_path: Path) -> Path:
    run = tmp_path / name
    shutil.copytree(RUNS / name, run)
    return run


# {run} is the copied run dir the OS refuses.
UNREADABLE_OR_READ_ONLY = [["report", "{run}"], ["floor", "{run}", "--model", "glm-5", "--dtype", "fp32"],
                           ["compare", str(RUNS / "cpu-gloo-4rank-b"), "{run}"], [*SWEEP, "--resume", "{run}"]]


def _with_run(argv: list[str], run: Path) -> list[str]:
    return [w.replace("{run}", str(run)) for w in argv]


@pytest.mark.parametrize("argv", UNREADABLE_OR_READ_ONLY, ids=lambda argv: argv[0])
def test_an_unreadable_run_dir_is_one_line(argv, tmp_path, monkeypatch, capsys):
    run = _copy("cpu-gloo-4rank-a", tmp_path)
    real = os.open

    def open_(path, flags, *args, **kwargs):   # inputs are opened with os.open (files.open_input)
        if Path(path).parent == run and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_in_process(_with_run(argv, run), capsys)
    assert_one_line(code, out, err, f"{run}/run.json: cannot read (Permission denied)")


@pytest.mark.parametrize("argv", [a for a in UNREADABLE_OR_READ_ONLY if a[0] != "floor"], ids=lambda argv: argv[0])
def test_a_read_only_output_folder_is_one_line_before_any_work(argv, tmp_path, monkeypatch, capsys):
    """A resume writes into its run dir; report and compare write to a new folder in the current
    directory (never into the run they read): whichever is read-only is one line, nothing written."""
    run = _copy("cpu-gloo-4rank-a", tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    read_only = run if argv[0] == "sweep" else here
    real = tempfile.TemporaryFile

    def temporary_file(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", temporary_file)
    monkeypatch.chdir(here)
    before = _tree(run)
    code, out, err = run_in_process(_with_run(argv, run), capsys)
    assert_one_line(code, out, err, f"{read_only}")
    assert "not writable (Read-only file system)" in err
    assert ("--out DIR" in err) == (argv[0] != "sweep")   # analysis can write elsewhere; a resume cannot
    assert _tree(run) == before


def test_an_uninstalled_checkout_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`python -m commbench` in a checkout that was never installed finds no commbench.topology or
    commbench.backends (they are backends/ and topology/ until installed): one line, exit 1."""
    import importlib
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name in cli.LAYOUT_PACKAGES else real_find_spec(name, *rest))

    def import_module(name: str):
        raise ModuleNotFoundError("No module named 'commbench.topology'", name="commbench.topology")

    monkeypatch.setattr(importlib, "import_module", import_module)
    assert cli.main(["report", "--help"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this checkout is not installed" in err and "pip install -e ." in err
