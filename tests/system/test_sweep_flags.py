"""nccl-tests' habits in `commbench sweep` (-n -w -d -c -G -T), and the live rows: 120 columns,
a header that says which pass each number comes from, and -c 0 rows labelled and never trusted.
In-process; the one sweep under torchrun is marked procs."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from commbench.analysis.curves import is_trusted
from commbench.results import CHECK_OFF, OK, Measurement
from commbench.errors import UsageError
from commbench.sweep.arguments import add_arguments
from commbench.sweep.nccl_flags import ANSWERS
from commbench.sweep.live import LiveTable, format_row, header_lines
from commbench.sweep.plan import build_plan
import factories
from helpers import only_run_dir, rows, run_torchrun


def sweep_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_short_flags_mean_what_the_long_ones_do() -> None:
    short = build_plan(sweep_args("-n", "7", "-w", "3", "-d", "bfloat16,half,float", "-T", "30"), on_gpu=True)
    long = build_plan(sweep_args("--iters", "7", "--warmup", "3", "--dtype", "bf16,fp16,fp32", "--timeout", "30"),
                      on_gpu=True)
    assert short == long
    assert (short.iterations, short.warmup, short.timeout_s) == (7, 3, 30.0)
    assert short.dtypes == [torch.bfloat16, torch.float16, torch.float32]


def test_graph_launches_are_replays_of_a_graph_of_n_calls_as_in_nccl_tests() -> None:
    plan = build_plan(sweep_args("-G", "100", "-n", "20"), on_gpu=True)
    assert plan.modes == ["graph"]
    assert (plan.graph_ops_for(4 << 10), plan.graph_replays_for(4 << 10)) == (20, 100)
    assert plan.record()["graph_replays"] == 100
    by_size = build_plan(sweep_args("-G", "10"), on_gpu=True)   # calls per graph by size, as without -G
    assert (by_size.graph_ops_for(4 << 10), by_size.graph_ops_for(64 << 20), by_size.graph_replays_for(1)) == (128, 4, 10)
    eager = build_plan(sweep_args("-G", "0", "-n", "20"), on_gpu=True)
    assert eager.modes == ["eager"] and eager.iterations == 20 and eager.graph_replays is None
    # without -G, --iters still counts graph replays
    assert build_plan(sweep_args("-n", "30"), on_gpu=True).graph_replays_for(4 << 10) == 30


def test_check_defaults_on_and_zero_turns_it_off() -> None:
    assert build_plan(sweep_args(), on_gpu=False).check is True
    off = build_plan(sweep_args("-c", "0"), on_gpu=False)
    assert off.check is False and off.record()["check"] is False


def test_check_takes_a_count_as_nccl_tests_does() -> None:
    assert build_plan(sweep_args("-c", "5"), on_gpu=False).check is True
    with pytest.raises(UsageError, match="a count of checks"):
        build_plan(sweep_args("-c", "-1"), on_gpu=False)


@pytest.mark.parametrize("argv", [["-a", "3"], ["-g", "1"], ["-t", "8"], ["-J", "out.json"], ["-z"], ["-R", "2"]])
def test_an_nccl_tests_flag_commbench_lacks_gets_one_line_with_its_equivalent(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        sweep_args(*argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert f"{argv[0]} is not a commbench sweep flag: nccl-tests' " in err and "unrecognized" not in err
    assert err.endswith(ANSWERS[argv[0]])


# A row as wide as a live line gets: the longest numbers and name in every column.
WIDE = dict(backend="flashinfer:trtllm_oneshot_with_a_long_name", message_bytes=268435456, count=134217728,
            world_size=8, latency_us=12345.678, jitter_p99_us=23456.789, algbw_gbps=1234.5, busbw_gbps=2160.4)


@pytest.mark.parametrize("fields", [
    {},
    {"status": "error", "wrong_elements": None, "latency_us": None,
     "reason": "rank 3: RuntimeError: " + "a very long reason from a backend that names a path /x/y/z " * 4},
    {"status": "wrong", "wrong_elements": 123456789, "wrong_kind": "stale"},
    {"wrong_elements": None},
])
@pytest.mark.parametrize("width", [80, 120])
def test_every_live_line_fits_the_terminal_and_nothing_is_cut(fields: dict, width: int) -> None:
    """At 120 columns a row is one nccl-tests-like line (a long status folded under it); at 80 the
    backend's whole name heads it and the numbers and status go under it."""
    row = factories.row(**{**WIDE, **fields})
    lines = format_row(row, width).splitlines()
    assert all(len(line) <= width for line in lines), [len(line) for line in lines]
    if row.reason:   # the whole reason is there, folded onto indented lines
        assert " ".join(" ".join(line.split()) for line in lines).endswith(" ".join(row.reason.split()))
        assert len(lines) > 1 and all(line.startswith("        ") for line in lines[1:])
    assert all(len(line) <= width for line in header_lines(False, width))
    assert row.backend in lines[0] if width < 100 else f"{row.backend}: " in " ".join(lines)   # the whole name
    assert len(header_lines(True, width)[0].split()) == (6 if width < 100 else 12)


def test_the_p99_beside_the_time_says_what_it_is() -> None:
    graph = format_row(factories.row(**WIDE, jitter_samples=10))
    assert "[p99 of 10 replay means]" in " ".join(graph.split())
    eager = format_row(factories.row(**WIDE, mode="eager", jitter_samples=200))
    assert "p99" not in eager.split("  ok")[-1]                      # a per-call p99 of 200 calls: no flag
    assert "p99 of 20 calls" in " ".join(format_row(factories.row(**WIDE, mode="eager", jitter_samples=20)).split())
    below = format_row(factories.row(**{**WIDE, "mode": "eager", "jitter_samples": 200, "jitter_p99_us": 10000.0}))
    assert "p99 below time: separate passes" in " ".join(below.split())


def test_header_says_time_and_p99_come_from_different_passes() -> None:
    lines = header_lines(True, 120)
    assert lines[0].startswith("#") and "time(us)" in lines[0] and "p99(us)" in lines[0]
    assert "timed pass" in lines[1] and "separate jitter pass" in " ".join(lines[1:3])
    assert not any("-c 0" in line for line in lines)
    assert any("-c 0" in line for line in header_lines(False))


def test_an_unchecked_row_is_labelled_and_never_trusted() -> None:
    checked = factories.row(**WIDE)
    unchecked = factories.row(**WIDE, wrong_elements=None, checked_calls=0, extra={"check": CHECK_OFF})
    assert is_trusted(checked) and not is_trusted(unchecked)
    assert "ok, unchecked" in " ".join(format_row(unchecked).split()) and "unchecked" not in format_row(checked)


@pytest.mark.procs
def test_a_sweep_with_checks_off_labels_every_row(tmp_path) -> None:
    done = run_torchrun(2, ["sweep", "-c", "0", "--sizes", "4K,16K", "-n", "3", "-w", "1", "--no-probe",
                            "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    got = rows(only_run_dir(tmp_path))
    assert len(got) == 2
    for row in got:
        assert row["status"] == OK and row["latency_us"] > 0 and row["iterations"] == 3
        assert row["wrong_elements"] is None and row["checked_calls"] == 0 and row["extra"]["check"] == CHECK_OFF
        assert not is_trusted(Measurement.from_dict(row))
    printed = [line for line in done.stdout.splitlines() if not line.startswith("#")]
    assert sum("ok, unchecked" in line for line in printed) == 2 and "# -c 0: no output is checked" in done.stdout
    assert all(len(line) <= 100 for line in printed)   # the width a pipe gets
    info = json.loads((only_run_dir(tmp_path) / "run.json").read_text())
    assert info["plan"]["check"] is False


@pytest.mark.parametrize("width", [80, 120])
def test_the_live_tables_comments_fold_and_a_next_step_stays_whole(width: int, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    table = LiveTable(enabled=True, total_rows=0)
    note = "# p2p:oneshot: skipped: " + "a reason a backend gives that runs on and on past the width " * 3
    command = "# next: torchrun --nproc-per-node 8 -m commbench sweep --model glm-5 --tp 8 --prefill-tokens 8192 x"
    table.line(note)
    table.line(command)
    table.row(factories.row(**WIDE))
    lines = capsys.readouterr().out.splitlines()
    assert command in lines and all(len(line) <= width for line in lines if line != command)
    assert all(line.startswith("#") for line in lines[:lines.index(command)])
    assert " ".join(" ".join(line.lstrip("#").split()) for line in lines[:lines.index(command)]) == " ".join(
        note[2:].split())
