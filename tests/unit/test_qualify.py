"""commbench qualify: spec parsing, thresholds -> PASS/WARN/FAIL -> exit status, fabric checks, JUnit."""

from __future__ import annotations

import copy
import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.analysis.qualify import (FAIL, NOT_MEASURED, PASS, WARN, check_acs, check_links, check_p2p,
                                       load_spec)
from commbench.runs import load_run

RUNS = Path(__file__).parents[1] / "data" / "runs"
SYNTHETIC = RUNS / "synthetic-pcie-8gpu"
CPU_A, CPU_B = RUNS / "cpu-gloo-4rank-a", RUNS / "cpu-gloo-4rank-b"
SPECS = Path(__file__).parents[2] / "commbench" / "specs"

# The synthetic run has wrong and hung p2p rows; these specs look at NCCL's thresholds alone.
_HEAD = "[spec]\nname = 't'\nworld_size = 8\n[checks]\nzero_wrong = false\nno_hangs = false\n"


def _measured(tmp_path: Path) -> Path:
    """The synthetic run as if it had been measured (no "provenance": "fixture"): the threshold
    logic is tested on it; the fixture itself never PASSes a hardware check."""
    run = tmp_path / "measured"
    shutil.copytree(SYNTHETIC, run)
    info = json.loads((run / "run.json").read_text())
    del info["provenance"]
    (run / "run.json").write_text(json.dumps(info))
    return run


def _spec(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(_HEAD + body, encoding="utf-8")
    return path


@pytest.mark.parametrize("limits, code, status", [
    ("max_us = 50.0", 0, "PASS"),                 # nccl graph latency at 4K is 42 us
    ("max_us = 50.0\nwarn_us = 40.0", 0, "WARN"),
    ("max_us = 40.0", 1, "FAIL"),
])
def test_latency_threshold_sets_the_exit_status(tmp_path, capsys, limits, code, status):
    spec = _spec(tmp_path, f"[[latency]]\nsize = '4K'\n{limits}\nsource = 'test'\n")
    assert cli(["qualify", "--spec", str(spec), str(_measured(tmp_path))]) == code
    line = next(l for l in capsys.readouterr().out.splitlines() if "nccl latency at 4K" in l)
    assert line.startswith(status) and "latency 42 us" in line


def test_busbw_floor_and_interpolated_size(tmp_path, capsys):
    # busbw at 4M: 4 MiB / 2500 us * 2*7/8 = 2.94 GB/s; 3M is interpolated between 2M and 4M
    spec = _spec(tmp_path, "[[busbw]]\nsize = '4M'\nmin_gbps = 3.0\n[[busbw]]\nsize = '3M'\nmin_gbps = 1.0\n"
                           "[[latency]]\nsize = '8M'\nmax_us = 1e6\n")
    assert cli(["qualify", "--spec", str(spec), str(_measured(tmp_path)), "--wide"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL +busbw +nccl busbw at 4M +busbw 2.94 GB/s", out)
    assert re.search(r"PASS +busbw +nccl busbw at 3M +interpolated busbw", out)
    # 8M: the run never measured it: neither PASS nor FAIL, and no PASS verdict while it is so
    assert re.search(r"not measured +latency +nccl latency at 8M +not measured: nccl \(graph\) covers 4K-4M", out)
    assert "-> FAIL: 1 check(s) not measured, neither PASS nor FAIL" in " ".join(out.split())


def test_a_size_the_run_never_measured_is_not_measured_and_the_verdict_is_incomplete(tmp_path, capsys):
    """No FAIL, one size the run never reached: the verdict is INCOMPLETE, exit 1 (a CI gate passes
    on a measured PASS only), the check skipped in JUnit; a size whose rows all failed is a FAIL."""
    spec = _spec(tmp_path, "[[latency]]\nsize = '4K'\nmax_us = 1e6\n[[latency]]\nsize = '8M'\nmax_us = 1e6\n")
    junit = tmp_path / "q.xml"
    run = _measured(tmp_path)
    assert cli(["qualify", "--spec", str(spec), str(run), "--wide", "--junit", str(junit), "--json",
                str(tmp_path / "q.json")]) == 1
    out = capsys.readouterr().out
    assert "-> INCOMPLETE: 1 check(s) not measured, neither PASS nor FAIL; the verdict is PASS only when every " \
           "check is measured and none fails (exit 1 until then)" in out
    data = json.loads((tmp_path / "q.json").read_text())
    assert (data["verdict"], data["failed"], data["not_measured"]) == ("INCOMPLETE", 0, 1)
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("skipped") == "1" and suite.get("failures") == "0"
    (skipped,) = [c for c in suite.findall("testcase") if c.find("skipped") is not None]
    assert skipped.get("name") == "nccl latency at 8M"
    # rows of nccl at 8M that all hung: measured, and failed
    rows = [json.loads(line) for line in (run / "measurements.jsonl").read_text().splitlines()]
    hung = {**next(r for r in rows if r["backend"] == "nccl" and r["message_bytes"] == 4 << 20),
            "message_bytes": 8 << 20, "status": "hang", "latency_us": None, "reason": "timed out"}
    with (run / "measurements.jsonl").open("a") as f:
        f.write(json.dumps(hung) + "\n")
    assert cli(["qualify", "--spec", str(spec), str(run), "--wide"]) == 1
    assert re.search(r"FAIL +latency +nccl latency at 8M +measured, no trusted row: nccl 8M hang",
                     capsys.readouterr().out)


def test_wrong_and_hung_rows_fail_the_checks_of_their_backend_only(tmp_path, capsys):
    run = _measured(tmp_path)
    spec = tmp_path / "s.toml"
    spec.write_text("[spec]\nname = 'defaults'\n")                 # about nccl (the default backend)
    assert cli(["qualify", "--spec", str(spec), str(run), "--wide"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"WARN +correctness +zero #wrong +\d+ checked rows of nccl, none wrong; outside the spec's "
                     r"backends, 1 row\(s\) with wrong results: p2p:oneshot graph 1M #wrong 4096", out)
    assert re.search(r"WARN +correctness +no hangs +.*outside the spec's backends, 2 hang", out)
    assert re.search(r"PASS +fabric +functional P2P on every pair", out)    # the snapshot is healthy
    spec.write_text("[spec]\nname = 'p2p'\nbackend = 'p2p:oneshot'\n")   # about the failing kernel
    assert cli(["qualify", "--spec", str(spec), str(run), "--wide"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"FAIL +correctness +zero #wrong +1 row\(s\) with wrong results: p2p:oneshot graph 1M", out)
    assert re.search(r"FAIL +correctness +no hangs +2 hang\(s\): p2p:oneshot 2M hang", out)


def test_a_fixture_or_an_emulated_run_never_passes_hardware(tmp_path, capsys):
    spec = _spec(tmp_path, "[[latency]]\nsize = '4K'\nmax_us = 50.0\nsource = 'test'\n")
    assert cli(["qualify", "--spec", str(spec), str(SYNTHETIC), "--wide"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("data: fixture: hand-made test data, not a measurement")
    assert not [line for line in lines if re.match(r"PASS +(fabric|latency|busbw|correctness) ", line)]
    assert re.search(r"FAIL +run +real hardware +fixture data: a hand-made fixture, never measured: no check of "
                     r"this run is evidence about a machine", "\n".join(lines))
    assert re.search(r"WARN +fabric +functional P2P on every pair +fixture data: "
                     r"write-and-verify ok on all 56 directed pairs", "\n".join(lines))
    assert re.search(r"WARN +latency +nccl latency at 4K +fixture data: latency 42 us", "\n".join(lines))
    # every check carries the same prefix, whatever its status
    table = lines[lines.index("") + 3:lines.index("where the thresholds come from:") - 1]
    assert table and all(re.match(r"\S+ +\S+ +.+? {2,}fixture data: ", line) for line in table), table
    emulated = next((Path(__file__).parents[2] / "results" / "reference" / "h200-mps-emulated" / "world8"
                     / "allreduce").glob("*/run.json")).parent
    spec.write_text(   # about a kernel the emulated run measured
        "[spec]\nname = 'e'\nworld_size = 8\nbackend = 'p2p:oneshot'\n[[latency]]\nsize = '4K'\n"
        "max_us = 1000.0\nsource = 'test'\n")
    assert cli(["qualify", "--spec", str(spec), str(emulated), "--wide"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("data: emulated: 8 ranks on 1x NVIDIA H200 under MPS")
    assert re.search(r"FAIL +run +real hardware +emulated data: 8 ranks on 1 GPU", "\n".join(lines))
    assert not [line for line in lines if re.match(r"PASS +(fabric|latency|busbw) ", line)]
    assert re.search(r"WARN +latency +p2p:oneshot latency at 4K +emulated data: ", "\n".join(lines))


@pytest.mark.parametrize("body, message", [
    ("[[latency]]\nsize = '4K'\nmax_uss = 5\n", "unknown key 'max_uss' in [[latency]] #1 (did you mean 'max_us'?)"),
    ("[check]\nzero_wrong = true\n", "unknown key 'check' in the spec (did you mean 'checks'?)"),
    ("[[latency]]\nsize = '4Q'\nmax_us = 5\n", "malformed size '4Q'"),
    ("[[busbw]]\nsize = '1G'\n", "needs 'min_gbps'"),
    ("[spec\n", "not valid TOML"),
])
def test_spec_typos_exit_2(tmp_path, capsys, body, message):
    spec = tmp_path / "bad.toml"
    spec.write_text(body)
    assert cli(["qualify", "--spec", str(spec), str(SYNTHETIC)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_shipped_specs_load_and_source_every_threshold():
    for path in sorted(SPECS.glob("*.toml")):
        spec = load_spec(path)
        assert spec.world_size == 8 and spec.latency and spec.busbw
        for limit in spec.latency + spec.busbw:
            assert limit.source, f"{path.name}: threshold at {limit.message_bytes} B has no source"
            assert limit.warn_at is not None
    assert {p.name for p in SPECS.glob("*.toml")} == {"nvswitch-8x-h100-h200.toml", "pcie-8x.toml"}


def test_fabric_checks_read_the_probe_snapshot():
    healthy = load_run(SYNTHETIC).info.snapshot
    assert check_p2p(healthy).status == PASS
    assert check_links(healthy).status == PASS
    assert check_acs(healthy).status == PASS

    broken = copy.deepcopy(healthy)
    broken["p2p"][3]["write_verify"] = {"status": "wrong"}
    broken["gpus"][5]["pcie"]["width_current"] = 8
    broken["pcie_paths"][0]["bridges"][1].update(req_redir=True, acs_ctl="0x001d")
    assert check_p2p(broken).status == FAIL and "0->4 wrong" in check_p2p(broken).detail
    assert check_links(broken).status == FAIL and "GPU 5 x8 of x16" in check_links(broken).detail
    assert check_acs(broken).status == FAIL and "0x001d" in check_acs(broken).detail

    idle = copy.deepcopy(healthy)
    idle["gpus"][0]["pcie"]["gen_current"] = 1                # idle GPUs drop to Gen1
    assert check_links(idle).status == WARN

    unprobed = {"gpus": [{"index": 0}], "pcie_paths": [{"a": 0, "b": 1, "bridges": [{"bdf": "x", "error": "needs root"}]}]}
    assert [check_p2p(unprobed).status, check_links(unprobed).status, check_acs(unprobed).status] == [WARN] * 3
    assert "not probed" in check_p2p(unprobed).detail


def test_reference_run_and_junit(tmp_path):
    spec = tmp_path / "ref.toml"
    spec.write_text(f"[spec]\nname = 'cpu'\nmode = 'any'\ndtype = 'fp32'\n[checks]\np2p_all_pairs = false\n"
                    f"pcie_link_at_max = false\nno_acs_redirect = false\n"
                    f"[reference]\nrun = '{CPU_A}'\nmax_slowdown_pct = 1000\nsource = 'first CPU sweep'\n")
    junit = tmp_path / "q.xml"
    # A CPU run is no hardware: it FAILs "real hardware", and its reference checks never PASS.
    assert cli(["qualify", "--spec", str(spec), str(CPU_B), "--junit", str(junit)]) == 1
    suite = ET.parse(junit).getroot().find("testsuite")
    properties = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert properties["provenance"].startswith("data: cpu: 4 ranks of gloo on the CPU")
    failed = [c for c in suite.findall("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["real hardware"]
    references = [c for c in suite.findall("testcase") if c.get("classname") == "commbench.qualify.reference"]
    assert references and all(c.find("system-out").text.startswith("WARN: CPU data: ") for c in references)
    # the two CPU sweeps differ by tens of percent at some sizes (a shared 2-core VM): 5% fails
    assert cli(["qualify", "--spec", str(spec), str(CPU_B), "--reference", str(CPU_A),
                "--max-slowdown-pct", "5", "--junit", str(junit)]) == 1
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert int(suite.get("failures")) == sum(c.find("failure") is not None for c in cases) == 2
    failed = [c for c in cases if c.find("failure") is not None and c.get("name") != "real hardware"]
    assert failed[0].get("classname") == "commbench.qualify.reference" and "gloo (eager)" in failed[0].get("name")


@pytest.mark.parametrize("checks, status", [("", WARN), ("zero_wrong = true\nno_hangs = true\n", NOT_MEASURED)])
def test_a_check_that_found_no_rows_is_not_measured_never_pass(tmp_path, capsys, checks, status):
    """A CPU run has gloo rows only: an NCCL spec's correctness checks read nothing. That is
    "not measured": a WARN where the check runs by default, not measured (no PASS verdict) where
    the spec asks for it; every check says it is CPU data, and the fabric ones the real cause."""
    spec = tmp_path / "spec.toml"
    spec.write_text(f"[spec]\nname = 't'\nbackend = 'nccl'\n[checks]\n{checks}", encoding="utf-8")
    assert cli(["qualify", "--spec", str(spec), str(CPU_A), "--wide"]) == 1   # CPU data FAILs real hardware
    lines = capsys.readouterr().out.splitlines()
    for check in ("zero #wrong", "no hangs"):
        line = next(l for l in lines if f" {check} " in l)
        assert line.startswith(status) and "CPU data: not measured: the run has no rows of nccl" in line
    checks_shown = [l for l in lines if l.startswith((PASS, WARN, FAIL, NOT_MEASURED))]
    assert checks_shown and all(" CPU data: " in l for l in checks_shown)
    assert all("not probed: the snapshot lists no GPUs" in l for l in checks_shown if " fabric " in l)


def test_no_hangs_is_never_passed_on_rows_that_did_not_run(tmp_path, capsys):
    """A backend whose every row was skipped (NCCL refuses two ranks on one GPU; FlashInfer's fused
    kernels without multicast here) never called anything: "no hangs" has nothing to show, so it is
    not measured where the spec asks for it, never a PASS counting the skipped rows."""
    spec = tmp_path / "spec.toml"
    spec.write_text("[spec]\nname = 't'\nworld_size = 8\nbackend = 'flashinfer:fused_oneshot'\n"
                    "[checks]\nno_hangs = true\nzero_wrong = false\n", encoding="utf-8")
    assert cli(["qualify", "--spec", str(spec), str(_measured(tmp_path)), "--wide"]) == 1
    line = next(l for l in capsys.readouterr().out.splitlines() if " no hangs " in l)
    assert line.startswith(NOT_MEASURED), line
    assert "1 of its rows were skipped" in line
