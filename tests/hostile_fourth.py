"""The hostile cases of issue 56 that one command shows: exit codes and words, attribute's clocks,
sqlite names, dropped kernels and absurd times, built fresh in a tmp dir as tests/hostile.py
builds its run dirs (nothing hostile is committed). Each case is a hostile.Case of one class.
Fleets (tests/unit/test_fleet.py), deploy (tests/system/test_deploy.py) and the kills of a
sweep's processes (tests/system/test_signals.py) are tested beside their code."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any, Callable

from hostile import TESTS, Case, Result, copy_run, no_traceback, one_line
from hostile_inputs import _nsys, attribute, dropped, trace_with

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


def cases() -> list[Case]:
    return _exit_cases() + _attribute_cases()
