"""Hostile run directories, built fresh in a tmp dir: the cases of issue 31, each with the
behaviour commbench promises for it.

Nothing hostile is committed: every case copies a recorded run (tests/data/runs) into its own
root and breaks it there. A case is (class, name, build, check): `build(root)` makes the files and
returns the argv; `check(result, root)` raises AssertionError when the promise is broken.

The classes are those of the issue: traceback (one line and exit 2 promised), silent (bad input
accepted without a word), data (a row lost, doubled or taken without a word), security (a write
outside the run dir, shell or terminal text passed on), and those of issue 43 (traces, snapshots,
imports, signals: tests/hostile_inputs.py) add resource (unbounded time or memory, a read that
blocks forever).

Run as a script to count, per class, the cases an interpreter's commbench gets right, e.g. that
of an older checkout's venv: `python tests/hostile.py OLD/.venv/bin/python [NAME-FILTER]`.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TESTS = Path(__file__).parent
RUNS = TESTS / "data" / "runs"
SPEC = TESTS.parent / "commbench" / "specs" / "pcie-8x.toml"
NCCL_LOG = TESTS / "data" / "nccl-tests" / "h200-8gpu-mpi-graph.txt"

CLASSES = ("traceback", "silent", "data", "security", "resource")


@dataclass
class Result:
    code: int
    out: str
    err: str
    seconds: float = 0.0                    # how long the command took


@dataclass
class Case:
    klass: str
    name: str
    build: Callable[[Path], list[str]]
    check: Callable[[Result, Path], None]
    procs: bool = False                    # launches a process (a lock holder, or the command itself)
    interrupt_during: str | None = None     # run as a process, SIGINT once it imports this module
    file_limit_bytes: int | None = None     # run as a process whose files cannot grow past this (a full disk)
    blocks: bool = False                    # blocked forever before (a FIFO): run as a process, with a limit

    @property
    def own_process(self) -> bool:
        return self.interrupt_during is not None or self.file_limit_bytes is not None or self.blocks


# ---------------------------------------------------------------- building blocks

def copy_run(root: Path, name: str = "synthetic-pcie-8gpu", as_name: str = "run") -> Path:
    target = root / as_name
    shutil.copytree(RUNS / name, target)
    return target


def rows_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "measurements.jsonl").read_text().splitlines() if line.strip()]


def write_rows(run: Path, rows: list[dict]) -> None:
    (run / "measurements.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def with_row(root: Path, index: int, **changes) -> Path:
    """The synthetic 8-GPU run with row `index` (line index + 1) changed."""
    run = copy_run(root)
    rows = rows_of(run)
    rows[index].update(changes)
    write_rows(run, rows)
    return run


def wrong_row(root: Path, backend: str) -> Path:
    """The synthetic run with its one `wrong` row (which qualify and report name) renamed."""
    run = copy_run(root)
    rows = rows_of(run)
    next(r for r in rows if r["status"] == "wrong")["backend"] = backend
    write_rows(run, rows)
    return run


def with_info(root: Path, **changes) -> Path:
    run = copy_run(root)
    info = json.loads((run / "run.json").read_text())
    info.update(changes)
    (run / "run.json").write_text(json.dumps(info))
    return run


def stub_run(root: Path, **info) -> Path:
    """A run dir as the --nproc driver leaves it before its first child: run.json and nothing
    a resume compares."""
    run = root / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"schema": 3, "run_id": "run", "started": 1.0, **info}))
    return run


def analysis(command: str, run: Path, root: Path) -> list[str]:
    """argv of one analysis command over `run` (a second run beside it for compare)."""
    if command == "table":
        return ["table", str(run)]
    if command == "floor":
        return ["floor", str(run), "--model", "glm-5"]
    if command == "recommend":
        return ["recommend", str(run), "--model", "glm-5"]
    if command == "qualify":
        return ["qualify", str(run), "--spec", str(SPEC)]
    if command == "compare":
        return ["compare", str(copy_run(root, as_name="other")), str(run), "--out", str(root / "cmp")]
    assert command == "report"
    return ["report", str(run), "--out", str(root / "rep")]


ANALYSIS = ("table", "floor", "recommend", "qualify", "compare", "report")


# ---------------------------------------------------------------- checks

def no_traceback(result: Result) -> None:
    assert "Traceback" not in result.err and "Traceback" not in result.out, result.err[-2000:]


def one_line(code: int = 2, *expected: str) -> Callable[[Result, Path], None]:
    def check(result: Result, root: Path) -> None:
        no_traceback(result)
        lines = result.err.strip().splitlines()
        assert result.code == code, (result.code, result.err[-1000:])
        assert len(lines) == 1, result.err[-2000:]
        for text in expected:
            assert text in lines[0], lines[0]
    return check


def row_skipped(line: int, field: str, bad: str | None = None) -> Callable[[Result, Path], None]:
    """The command works on the other rows and names the bad one (its line and field); the bad
    value shows nowhere in the answer."""
    def check(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code in (0, 1), (result.code, result.err[-1000:])   # qualify fails a real check
        assert f"line {line}" in result.err and field in result.err, result.err[-2000:]
        if bad is not None:   # not in the paths under root: pytest's tmp folder may be pytest-42
            assert bad not in result.out.replace(str(root), "<root>"), result.out[-2000:]
    return check


def info_refused(*expected: str) -> Callable[[Result, Path], None]:
    return one_line(2, "run.json", *expected)


# ---------------------------------------------------------------- the cases

def _row_cases() -> list[Case]:
    """Rows no sweep writes: each analysis command skips them by name, or the row is no row."""
    out = []
    bad_rows = [   # (name, changes to line 1, the field named, a value that must not show)
        ("zero latency", {"latency_p50_us": 0}, "latency", None),
        ("negative latency", {"latency_p50_us": -42.0}, "latency", "-42"),
        ("zero size", {"message_bytes": 0}, "message_bytes", None),
        ("huge size", {"message_bytes": 10 ** 300}, "message_bytes", None),
        ("world size 0", {"world_size": 0}, "world_size", None),
        ("negative busbw", {"busbw_gbps": -1.0}, "busbw_gbps", None),
    ]
    for name, changes, field, bad in bad_rows:
        for command in ANALYSIS:
            klass = "silent" if "latency" in name or "busbw" in name or "world" in name else "traceback"
            out.append(Case(klass, f"{command}: row with {name}",
                            lambda root, c=command, ch=changes: analysis(c, with_row(root, 0, **ch), root),
                            row_skipped(1, field, bad)))
    return out


def _info_cases() -> list[Case]:
    out = []
    for command in ("floor", "report", "table", "qualify"):
        out.append(Case("traceback", f"{command}: run.json world_size is text",
                        lambda root, c=command: analysis(c, with_info(root, world_size="eight"), root),
                        info_refused("world_size")))
        out.append(Case("silent", f"{command}: run.json world_size 0",
                        lambda root, c=command: analysis(c, with_info(root, world_size=0), root),
                        info_refused("world_size")))
    nested = "[" * 3000 + "]" * 3000

    def deep_run(root: Path) -> list[str]:
        run = copy_run(root)
        info = (run / "run.json").read_text().rstrip()
        (run / "run.json").write_text(info[:-1] + ', "deep": ' + nested + "}")
        return ["table", str(run)]

    out.append(Case("traceback", "table: run.json nested 3000 deep", deep_run, info_refused("nest")))

    def deep_spec(root: Path) -> list[str]:
        (root / "deep.toml").write_text("x = " + nested + "\n")
        return ["qualify", str(copy_run(root)), "--spec", str(root / "deep.toml")]

    out.append(Case("traceback", "qualify: spec nested 3000 deep", deep_spec, one_line(2, "deep.toml", "nest")))
    out.append(Case("traceback", "qualify: /dev/zero as a spec",
                    lambda root: ["qualify", str(copy_run(root)), "--spec", "/dev/zero"],
                    one_line(2, "/dev/zero")))
    return out


def _security_cases() -> list[Case]:
    out = []

    def dtype_escape(root: Path) -> list[str]:
        run = copy_run(root)
        rows = rows_of(run)
        for row in rows:
            row["dtype"] = "../../../escaped"
        write_rows(run, rows)
        return ["report", str(run), "--out", str(root / "rep" / "a")]

    def nothing_escaped(result: Result, root: Path) -> None:
        no_traceback(result)
        assert not list(root.rglob("*escaped*.png")) or all(
            (root / "rep" / "a") in p.parents for p in root.rglob("*escaped*.png")), list(root.rglob("*escaped*"))
    out.append(Case("security", "report: a dtype that climbs out of --out", dtype_escape, nothing_escaped))

    def html_symlink(root: Path) -> list[str]:
        run = copy_run(root)
        (root / "victim.txt").write_text("keep me\n")
        (run / "report.html").symlink_to(root / "victim.txt")
        return ["report", str(run), "--out", str(run)]   # analysis writes into a run dir only when told to

    def victim_kept(result: Result, root: Path) -> None:
        no_traceback(result)
        assert (root / "victim.txt").read_text() == "keep me\n"
    out.append(Case("security", "report: report.html a symlink out", html_symlink, victim_kept))

    def crash_log_symlink(root: Path) -> list[str]:
        run = copy_run(root)
        (root / "elsewhere").mkdir()
        (run / "crash-logs").symlink_to(root / "elsewhere")
        records = run / "inflight"
        records.mkdir()
        row = rows_of(run)[0]
        record = {"rank": 0, "pid": 999999, "host": "synthetic-host", "step": 1, "phase": "row",
                  "what": "nccl 4K bf16 graph", "row": row, "started": 1.0, "deadline": None, "state": "running",
                  "detail": None, "exit": None, "exit_detail": None, "exit_at": None}
        (records / "rank0.json").write_text(json.dumps(record))
        (records / "rank0.fatal").write_text("Fatal Python error: Segmentation fault\n")
        return ["table", str(run)]

    def nothing_written(result: Result, root: Path) -> None:
        no_traceback(result)
        assert not list((root / "elsewhere").iterdir()), list((root / "elsewhere").iterdir())
        assert not (root / "run" / "crash-logs").is_dir() or not list((root / "run" / "crash-logs").iterdir())
    out.append(Case("security", "table: a dead run's record, crash-logs a symlink out", crash_log_symlink,
                    nothing_written))

    escape = "\x1b]0;pwned\x07\x1b[2J"

    def terminal(command: str) -> Callable[[Path], list[str]]:
        return lambda root: analysis(command, wrong_row(root, "p2p:oneshot" + escape), root)

    def no_escape(result: Result, root: Path) -> None:
        no_traceback(result)
        assert "\x1b" not in result.out and "\x1b" not in result.err, repr(result.out[-500:])
    for command in ("table", "qualify", "report"):
        out.append(Case("security", f"{command}: terminal escapes in a backend name", terminal(command), no_escape))

    def markdown(root: Path) -> list[str]:   # the markdown (a terminal's text shows the name as text)
        return ["table", str(with_row(root, 0, backend="nccl|<script>alert(1)</script>")), "--markdown"]

    def markdown_clean(result: Result, root: Path) -> None:
        no_traceback(result)
        assert "<script>" not in result.out, result.out[-500:]
    out.append(Case("security", "table: markdown and HTML in a backend name", markdown, markdown_clean))

    def junit(root: Path) -> list[str]:
        run = wrong_row(root, "p2p:oneshot\x01\x02")
        return ["qualify", str(run), "--spec", str(SPEC), "--junit", str(root / "q.xml")]

    def junit_parses(result: Result, root: Path) -> None:
        no_traceback(result)
        import xml.etree.ElementTree as ElementTree

        try:
            ElementTree.parse(root / "q.xml")
        except ElementTree.ParseError as exc:
            raise AssertionError(f"q.xml: {exc}") from None
    out.append(Case("security", "qualify: control characters into JUnit XML", junit, junit_parses))

    def analysis_writes_nothing(root: Path) -> list[str]:
        run = copy_run(root)
        records = run / "inflight"
        records.mkdir()
        record = {"rank": 0, "pid": 999999, "host": "synthetic-host", "step": 1, "phase": "row",
                  "what": "nccl 4K bf16 graph", "row": rows_of(run)[0], "started": 1.0, "deadline": None,
                  "state": "running", "detail": None, "exit": None, "exit_detail": None, "exit_at": None}
        (records / "rank0.json").write_text(json.dumps(record))
        (records / "rank0.fatal").write_text("Fatal Python error: Segmentation fault\n")
        return ["floor", str(run), "--model", "glm-5"]

    def run_dir_unchanged(result: Result, root: Path) -> None:
        no_traceback(result)
        assert not (root / "run" / "crash-logs").exists(), list((root / "run" / "crash-logs").iterdir())
    out.append(Case("security", "floor: a reader writes no crash log into the run dir", analysis_writes_nothing,
                    run_dir_unchanged))
    return out


def _data_cases() -> list[Case]:
    out = []

    def duplicate(command: str) -> Callable[[Path], list[str]]:
        def build(root: Path) -> list[str]:
            run = copy_run(root)
            rows = rows_of(run)
            write_rows(run, rows + [dict(rows[0], latency_p50_us=1.0)])
            return analysis(command, run, root)
        return build

    def duplicate_named(result: Result, root: Path) -> None:
        no_traceback(result)
        assert "duplicate" in result.err and "line 1" in result.err and "line 69" in result.err, result.err[-1000:]
    for command in ("table", "floor", "compare"):
        out.append(Case("data", f"{command}: two rows of one key", duplicate(command), duplicate_named))

    def nan_import(value: str) -> Callable[[Path], list[str]]:
        def build(root: Path) -> list[str]:
            lines = NCCL_LOG.read_text().splitlines(keepends=True)
            for i, line in enumerate(lines):
                fields = line.split()
                if fields and fields[0].isdigit() and len(fields) > 8:   # the first result row
                    fields[5] = value
                    lines[i] = "  ".join(fields) + "\n"
                    break
            (root / "log.txt").write_text("".join(lines))
            return ["import-nccl-tests", str(root / "log.txt"), "--average", "3", "--out", str(root / "imp")]
        return build
    for value in ("nan", "-5.00"):
        out.append(Case("silent", f"import-nccl-tests: a time of {value}", nan_import(value),
                        one_line(2, "log.txt", "time")))
    return out


def _sweep_cases() -> list[Case]:
    sweep = ["sweep", "--cpu", "--iters", "2", "--warmup", "1", "--no-probe"]
    out = [
        Case("silent", "sweep: a size that is no whole number of fp32 elements",
             lambda root: [*sweep, "--sizes", "4K,6", "--out", str(root / "o")], one_line(2, "6")),
        Case("silent", "sweep: a backend listed twice",
             lambda root: [*sweep, "--sizes", "4K", "--backends", "gloo,gloo", "--out", str(root / "o")],
             one_line(2, "gloo", "twice")),
        Case("silent", "sweep: a model shape whose bytes overflow",
             lambda root: [*sweep, "--tokens", "1", "--hidden", str(10 ** 30), "--out", str(root / "o")],
             one_line(2, "--hidden")),
        Case("traceback", "sweep: an oversized size literal",
             lambda root: [*sweep, "--sizes", "9" * 400, "--out", str(root / "o")], one_line(2, "size")),
    ]

    def symlink_loop(root: Path) -> list[str]:
        (root / "loop").symlink_to(root / "loop")
        return [*sweep, "--sizes", "4K", "--out", str(root / "loop")]
    out.append(Case("traceback", "sweep: --out a symlink loop", symlink_loop, one_line(2, "loop")))

    def rows_dir(root: Path) -> list[str]:
        run = stub_run(root)
        (run / "measurements.jsonl").mkdir()
        return [*sweep, "--sizes", "4K", "--resume", str(run)]
    out.append(Case("traceback", "sweep --resume: measurements.jsonl a directory", rows_dir,
                    one_line(2, "measurements.jsonl")))

    def wrong_types(root: Path) -> list[str]:
        run = stub_run(root, world_size=1, plan=["not", "a", "table"])
        return [*sweep, "--sizes", "4K", "--resume", str(run)]
    out.append(Case("traceback", "sweep --resume: run.json of the wrong types", wrong_types,
                    one_line(2, "run.json", "plan")))

    recorded_plan = {"message_bytes": [4096], "dtypes": ["fp32"], "modes": ["eager"]}

    def no_world(root: Path) -> list[str]:
        run = stub_run(root, plan=recorded_plan, host="another-host")
        return [*sweep, "--sizes", "8K", "--resume", str(run)]

    def plan_kept(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 2, (result.code, result.err[-500:])
        assert json.loads((root / "run" / "run.json").read_text())["plan"] == recorded_plan
    out.append(Case("data", "sweep --resume: run.json without world_size, another plan", no_world, plan_kept))

    def locked(root: Path) -> list[str]:
        run = stub_run(root)
        holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(run / ".commbench.lock")], stdout=subprocess.PIPE)
        assert holder.stdout is not None and holder.stdout.readline()   # it holds the lock now
        (root / "holder.pid").write_text(str(holder.pid))
        return [*sweep, "--sizes", "4K", "--resume", str(run)]

    def refused_with_holder(result: Result, root: Path) -> None:
        pid = (root / "holder.pid").read_text()
        os.kill(int(pid), 9)
        one_line(2, "pid " + pid)(result, root)
    out.append(Case("data", "sweep --resume: a second sweep of a locked dir", locked, refused_with_holder,
                    procs=True))
    out.append(Case("traceback", "table: Ctrl-C while it starts (imports)",
                    lambda root: ["table", str(copy_run(root))], one_line(130, "interrupted"), procs=True,
                    interrupt_during="commbench.cli"))
    for command in ("report", "compare", "table"):
        out.append(Case("traceback", f"{command}: --out on a full disk",
                        lambda root, c=command: _with_out(analysis(c, copy_run(root), root), root),
                        one_line(1, "File too large"), procs=True, file_limit_bytes=500))
    return out


def _with_out(argv: list[str], root: Path) -> list[str]:
    """argv writing its output under root/full (table: a markdown file there)."""
    (root / "full").mkdir()
    if argv[0] == "table":
        return [*argv, "--out", str(root / "full" / "t.md")]
    return [*argv[:-2], "--out", str(root / "full")]


# A process that holds the run dir's lock, as a running sweep does (flock on the dir, its pid
# and host in the holder file), and says so on stdout once it holds it.
_HOLD_LOCK = ("import fcntl, os, socket, sys, time\n"
              "fd = os.open(os.path.dirname(sys.argv[1]), os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
              "open(sys.argv[1], 'w').write(f'{os.getpid()} {socket.gethostname()}\\n')\n"
              "print('held', flush=True); time.sleep(600)\n")


def cases() -> list[Case]:
    import hostile_fourth
    import hostile_inputs

    return (_row_cases() + _info_cases() + _security_cases() + _data_cases() + _sweep_cases()
            + hostile_inputs.cases() + hostile_fourth.cases())


# ---------------------------------------------------------------- counting (script use)

_IMPORT_TIME = "import time:"   # python -X importtime's lines on stderr, one per module imported


def run_as_process(python: str, argv: list[str], cwd: Path, timeout_s: float = 120,
                   interrupt_during: str | None = None, file_limit_bytes: int | None = None) -> Result:
    """`python -m commbench argv` in cwd. interrupt_during: SIGINT as soon as it has imported
    that module (-X importtime says when), so the signal lands among the start-up imports.
    file_limit_bytes: a write past it fails with EFBIG, as on a full disk (RLIMIT_FSIZE)."""
    def limit() -> None:
        if file_limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit_bytes, file_limit_bytes))

    began = time.monotonic()
    flags = ["-X", "importtime"] if interrupt_during else []
    proc = subprocess.Popen([python, *flags, "-m", "commbench", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=limit)
    early = []
    if interrupt_during and proc.stderr is not None:
        for line in proc.stderr:
            early.append(line)
            if line.startswith(_IMPORT_TIME) and line.rstrip().endswith(f" {interrupt_during}"):
                proc.send_signal(signal.SIGINT)
                break
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return Result(-9, "", f"still running after {timeout_s:g} s", timeout_s)
    err = "".join(line for line in [*early, *err.splitlines(keepends=True)] if not line.startswith(_IMPORT_TIME))
    return Result(proc.returncode, out, err, time.monotonic() - began)


def count(python: str, only: str | None = None) -> dict[str, list[int]]:
    import tempfile

    tally = {klass: [0, 0] for klass in CLASSES}
    for case in cases():
        if only and only not in case.name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            argv = case.build(root)
            result = run_as_process(python, argv, root, timeout_s=20 if case.blocks else 60,
                                    interrupt_during=case.interrupt_during,
                                    file_limit_bytes=case.file_limit_bytes)
            try:
                case.check(result, root)
                verdict = "held"
            except AssertionError as exc:
                verdict = f"BROKEN ({str(exc).strip().splitlines()[-1][:150] if str(exc).strip() else ''})"
            tally[case.klass][0 if verdict == "held" else 1] += 1
            print(f"{case.klass:<9} {case.name:<60} {verdict}", flush=True)
    return tally


if __name__ == "__main__":
    totals = count(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    for klass, (held, broken) in totals.items():
        print(f"{klass:<9} held {held}, broken {broken}")
