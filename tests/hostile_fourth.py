"""The hostile cases of issue 56 that one command shows: exit codes and words, attribute's clocks,
sqlite names, dropped kernels and absurd times, engine trees and logs read by `engines --check`,
`--engine-site` and `--engine-log`, built fresh in a tmp dir as tests/hostile.py builds its run
dirs (nothing hostile is committed). Each case is a hostile.Case of one class. Fleets
(tests/unit/test_fleet.py), deploy (tests/system/test_deploy.py), the kills of a sweep's processes
(tests/system/test_signals.py) and the gate check's child (tests/system/test_engine_check.py) are
tested beside their code."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from hostile import TESTS, Case, Result, copy_run, no_traceback, one_line
from hostile_inputs import _nsys, attribute, dropped, quick, trace_with

CONSTRUCTED = TESTS / "data" / "traces" / "constructed"
SWEEP = ["sweep", "--cpu", "--iters", "2", "--warmup", "1", "--no-probe", "--sizes", "4K"]
VICTIM = "precious\n"


def _stub_with_torn_rows(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"schema": 3, "run_id": "run", "started": 1.0}))
    (run / "measurements.jsonl").write_text('{"backend": "gloo", "mo')   # cut short by a full disk
    return run


def _exit_cases() -> list[Case]:
    out = []

    def torn_symlink(root: Path) -> list[str]:
        run = _stub_with_torn_rows(root)
        (root / "victim.txt").write_text(VICTIM)
        (run / "measurements.jsonl.torn").symlink_to(root / "victim.txt")
        return [*SWEEP, "--resume", str(run)]

    def refused_and_victim_kept(result: Result, root: Path) -> None:
        one_line(2, "measurements.jsonl.torn", "a symlink")(result, root)
        assert (root / "victim.txt").read_text() == VICTIM
        assert "make room" not in result.err
    out.append(Case("security", "sweep --resume: measurements.jsonl.torn a symlink out", torn_symlink,
                    refused_and_victim_kept))

    def torn_to_proc(root: Path) -> list[str]:
        run = _stub_with_torn_rows(root)
        (run / "measurements.jsonl.torn").symlink_to("/proc/version")
        return [*SWEEP, "--resume", str(run)]
    out.append(Case("traceback", "sweep --resume: measurements.jsonl.torn a symlink to /proc (exit 1, make room)",
                    torn_to_proc, one_line(2, "measurements.jsonl.torn", "a symlink")))

    def rows_fifo(root: Path) -> list[str]:
        run = copy_run(root)
        (run / "measurements.jsonl").unlink()
        os.mkfifo(run / "measurements.jsonl")
        return ["table", str(run)]
    out.append(Case("resource", "table: measurements.jsonl a FIFO", rows_fifo,
                    one_line(2, "measurements.jsonl", "FIFO"), procs=True, blocks=True))

    out.append(Case("traceback", "table --out on a full disk names the file",
                    lambda root: ["table", str(copy_run(root)), "--out", "/dev/full"],
                    one_line(1, "/dev/full", "No space left on device", "make room")))
    out.append(Case("traceback", "attribute --json on a full disk names the file",
                    lambda root: attribute(trace_with(root, lambda d: None), "--json", "/dev/full"),
                    _last_line(1, "/dev/full", "No space left on device", "make room")))
    out.append(Case("silent", "engines --check '' (an empty path)", lambda root: ["engines", "--check", ""],
                    one_line(2, "--check", "empty path")))
    return out


def _last_line(code: int, *expected: str) -> Callable[[Result, Path], None]:
    """The command's last line on stderr says it (its text went to stdout before)."""
    def check(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == code, (result.code, result.err[-1000:])
        last = result.err.strip().splitlines()[-1]
        for text in expected:
            assert text in last, last
    return check


# ---------------------------------------------------------------- attribute

def _ranks_apart(root: Path, offset_us: float) -> list[Path]:
    """The constructed SGLang TP2 pair, rank 1's clock `offset_us` ahead of rank 0's."""
    paths = []
    for rank, source in enumerate(sorted(CONSTRUCTED.glob("1764650000-TP-*.gz"))):
        data: dict[str, Any] = json.loads(gzip.decompress(source.read_bytes()))
        for event in data["traceEvents"]:
            if rank and isinstance(event.get("ts"), (int, float)):
                event["ts"] += offset_us
        paths.append(root / source.name.removesuffix(".gz"))
        paths[-1].write_text(json.dumps(data))
    return paths


def _attribute_cases() -> list[Case]:
    out = []

    def no_huge_wait(result: Result, root: Path) -> None:
        one_line(2, "--clock shared", "do not share a clock")(result, root)
    out.append(Case("silent", "attribute --clock shared: ranks 10^9 us apart",
                    lambda root: ["attribute", *map(str, _ranks_apart(root, 1e9)), "--steps", "gap",
                                  "--clock", "shared"], no_huge_wait))

    def aligned(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 0 and "clock: aligned" in result.out, result.out[-1500:]
    out.append(Case("silent", "attribute: ranks 10^9 us apart, clock auto",
                    lambda root: ["attribute", *map(str, _ranks_apart(root, 1e9)), "--steps", "gap"], aligned))

    def named(name: str) -> Callable[[Path], list[str]]:
        def build(root: Path) -> list[str]:
            path = _nsys(root, [])
            target = root / name
            path.rename(target)
            return attribute(target)
        return build

    def read_as_a_path(result: Result, root: Path) -> None:
        no_traceback(result)
        assert result.code == 0 and "ncclDevKernel_AllReduce" in result.out, result.err[-1000:]
        assert sorted(p.name for p in root.iterdir()) == sorted([p.name for p in root.iterdir()
                                                                 if p.name.endswith(".sqlite")]), list(root.iterdir())
    for name in ("t#.sqlite", "t?mode=rwc&x=.sqlite"):
        out.append(Case("security", f"attribute: an nsys export named {name!r}", named(name), read_as_a_path))

    def all_dropped(root: Path) -> list[str]:
        path = root / "bad.sqlite"
        _nsys(root, [("soon", 5, 0, 7, 9, 2, 1 << 24, None)]).rename(path)
        import sqlite3
        db = sqlite3.connect(path)
        db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'soon'")
        db.commit()
        db.close()
        return attribute(path)
    out.append(Case("traceback", "attribute: an nsys export whose every kernel row is dropped", all_dropped,
                    _last_line(2, "bad.sqlite", "no kernel row", "passed its check")))

    out.append(Case("silent", "attribute: an nsys kernel at 2^62 ns",
                    lambda root: attribute(_nsys(root, [(1 << 62, (1 << 62) + 5_000, 0, 7, 9, 1, 1 << 24, None)])),
                    dropped("starts at 4.61169e+15 us", "more than 7 days")))

    def far_event(data: dict[str, Any]) -> None:
        kernel = next(e for e in data["traceEvents"] if e.get("cat") == "kernel")
        data["traceEvents"].append({**kernel, "ts": float(1 << 62) / 1e3})
    out.append(Case("silent", "attribute: a kineto kernel 146,000 years on", lambda root: attribute(
        trace_with(root, far_event), "--steps", "gap"), dropped("more than 7 days")))
    return out


# ---------------------------------------------------------------- engine trees and logs

ENGINE_SITE = TESTS / "data" / "engine-src" / "vllm-site"    # a hand-made vLLM 0.34.0 tree (no engine code)
CUSTOM_AR = "vllm/distributed/device_communicators/custom_all_reduce.py"   # line 5 its world sizes, 7 max_size
H200_BOX = TESTS / "fixtures" / "snapshots" / "h200-nvlink-8x.json"     # the box whose gates read the facts


def _engine_tree(root: Path, edit: Callable[[str], str] = lambda text: text) -> Path:
    """The hand-made vLLM tree, copied, its custom_all_reduce.py edited."""
    site = root / "site"
    shutil.copytree(ENGINE_SITE, site)
    (site / CUSTOM_AR).write_text(edit((site / CUSTOM_AR).read_text()))
    return site


def _max_size(expression: str) -> Callable[[str], str]:
    return lambda text: text.replace("max_size=8 * 1024 * 1024", f"max_size={expression}")


def _world_sizes(expression: str) -> Callable[[str], str]:
    return lambda text: text.replace("_SUPPORTED_WORLD_SIZES = [2, 4, 8]", f"_SUPPORTED_WORLD_SIZES = {expression}")


def _engine_argv(command: str, site: Path) -> list[str]:
    return ["engines", "--check", str(site)] if command == "--check" else \
        ["engines", str(H200_BOX), "--engine", "vllm", "--engine-site", str(site)]


def _read_as_before(command: str) -> Callable[[Result, Path], None]:
    """A constant no fact reads changes nothing: the tree's facts are read (and differ) as before."""
    def check(result: Result, root: Path) -> None:
        no_traceback(result)
        if command == "--check":
            assert result.code == 1 and "custom_ar_world_sizes: built in [2, 4, 6, 8, 16]; source [2, 4, 8]" \
                in result.out, (result.code, result.err[-1000:])
        else:
            assert result.code == 0 and "facts: vLLM 0.34.0 read from" in result.out, (result.code, result.err[-1000:])
    return check


def _engine_cases() -> list[Case]:
    out = []
    # (class, name, edit of custom_all_reduce.py, what its one line says after its file:line)
    constants = [
        ("traceback", "max_size = 1 / 0", _max_size("1 / 0"), ":7: CustomAllreduce.__init__.max_size divides by zero"),
        ("traceback", "max_size = 1e300 ** 2", _max_size("1e300 ** 2"), ":7: CustomAllreduce.__init__.max_size is "
                                                                      "larger than 2^64"),
        ("traceback", "max_size an int of 8,192 hex digits", _max_size("0x" + "f" * 8192), ":7: CustomAllreduce"
                                                                                          ".__init__.max_size is larger"),
        ("traceback", "max_size NaN (1e999 * 0)", _max_size("1e999 * 0"), ":7: CustomAllreduce.__init__.max_size is "
                                                                          "inf, not a finite number"),
        ("traceback", "max_size inf", _max_size("1e999"), ":7: CustomAllreduce.__init__.max_size is inf"),
        ("traceback", "max_size a string", _max_size("'8M'"), ":7: CustomAllreduce.__init__.max_size is '8M', not a "
                                                              "whole number >= 0"),
        ("traceback", "max_size a list", _max_size("[8388608]"), ":7: CustomAllreduce.__init__.max_size is [8388608], "
                                                                 "not a whole number >= 0"),
        ("traceback", "_SUPPORTED_WORLD_SIZES = None", _world_sizes("None"),
         ":5: CustomAllreduce._SUPPORTED_WORLD_SIZES is None, not a list"),
        ("traceback", "_SUPPORTED_WORLD_SIZES a dict keyed by a list", _world_sizes("{[2]: 4}"),
         ":5: CustomAllreduce._SUPPORTED_WORLD_SIZES has a list, set or table as a dict key"),
        ("traceback", "max_size = BAD, BAD = 1 / 0", lambda text: _max_size("BAD")(text) + "BAD = 1 / 0\n",
         ":7: CustomAllreduce.__init__.max_size uses BAD (line 9), which divides by zero"),
        ("silent", "max_size True (takes up to TrueB)", _max_size("True"), ":7: CustomAllreduce.__init__.max_size is "
                                                                           "True, not a whole number >= 0"),
        ("resource", "max_size chained powers", lambda text: _max_size("D")(text) + "".join(
            f"{name} = {base} ** 64\n" for name, base in (("A", 10), ("B", "A"), ("C", "B"), ("D", "C"))),
         ":7: CustomAllreduce.__init__.max_size uses D, from A (line 9), which is larger than 2^64 (10 ** 64)"),
    ]
    for command in ("--check", "--engine-site"):
        for klass, name, edit, said in constants:
            check = one_line(2, f"{CUSTOM_AR}{said}")
            out.append(Case(klass, f"engines {command}: {name}",
                            lambda root, c=command, e=edit: _engine_argv(c, _engine_tree(root, e)),
                            quick(10, check) if klass == "resource" else check))
        # a constant that no fact reads was evaluated all the same: a traceback
        out.append(Case("traceback", f"engines {command}: BAD = 1 / 0 beside the facts",
                        lambda root, c=command: _engine_argv(c, _engine_tree(root, lambda t: t + "BAD = 1 / 0\n")),
                        _read_as_before(command), procs=command == "--check"))   # --check runs the gate child

    def fifo(at: str) -> Callable[[Path], list[str]]:
        def build(root: Path) -> list[str]:
            site = _engine_tree(root)
            if at == "--engine-log":
                os.mkfifo(root / "fifo")
                return ["engines", "--engine", "vllm", "--engine-log", str(root / "fifo")]
            (site / at).unlink()
            os.mkfifo(site / at)
            return _engine_argv("--check" if at.endswith("METADATA") else "--engine-site", site)
        return build
    for at, named in (("vllm/envs.py", "envs.py"), ("vllm-0.34.0.dist-info/METADATA", "METADATA"),
                      ("--engine-log", "fifo")):
        out.append(Case("resource", f"engines: a FIFO as {at.split('/')[-1]}", fifo(at), one_line(2, named, "FIFO"),
                        procs=True, blocks=True))

    def zero(at: str) -> Callable[[Path], list[str]]:
        def build(root: Path) -> list[str]:
            site = _engine_tree(root)
            if at == "--engine-log":
                (root / "vllm.log").symlink_to("/dev/zero")
                return ["engines", "--engine", "vllm", "--engine-log", str(root / "vllm.log")]
            (site / at).unlink(missing_ok=True)
            (site / at).symlink_to("/dev/zero")
            return _engine_argv("--check", site)
        return build
    for at, named in (("vllm/envs.py", "envs.py"), ("vllm/_C_stable_libtorch.abi3.so", "_C_stable_libtorch.abi3.so"),
                      ("--engine-log", "vllm.log")):
        out.append(Case("resource", f"engines: /dev/zero behind a symlink as {at.split('/')[-1]}", zero(at),
                        quick(10, one_line(2, named, "a device")), procs=True, blocks=True))
    return out


def cases() -> list[Case]:
    return _exit_cases() + _attribute_cases() + _engine_cases()
