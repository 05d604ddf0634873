"""`commbench probe` end to end on this (GPU-less) machine, --from re-rendering, --plot, and bad input.

One test runs the real subprocess (`python -m commbench probe`); the rest call the CLI entry
point in-process, which is the same code path without paying a Python start per case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs   # every test here launches processes

SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "snapshots"
ENV = {**os.environ, "COLUMNS": "200"}


def probe_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commbench", "probe", *args], capture_output=True, text=True,
                          env=ENV, timeout=120)


@pytest.fixture
def probe(capsys, monkeypatch):
    """Run `commbench probe ARGS` in-process; returns (exit status, stdout, stderr)."""
    monkeypatch.setenv("COLUMNS", "200")

    def run(*args: str) -> subprocess.CompletedProcess:
        from commbench.cli import main

        try:
            code = main(["probe", *args])
        except SystemExit as exc:   # argparse errors
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


def has_nvidia_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(has_nvidia_driver(), reason="this machine has an NVIDIA driver")
def test_probe_without_gpu_reports_host_facts_and_exits_0(tmp_path):
    out_json, out_png = tmp_path / "snap.json", tmp_path / "topo.png"
    done = probe_subprocess("--json", str(out_json), "--plot", str(out_png))
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU: libcuda.so.1 not found" in done.stdout
    assert "IOMMU" in done.stdout and "Backend verdicts" in done.stdout
    assert "│ gloo" in done.stdout and "skip: no CUDA GPU" in done.stdout
    snap = json.loads(out_json.read_text())
    assert snap["gpus"] == [] and snap["kind"] == "commbench-topology-snapshot"
    assert list(snap["hosts"].values())[0]["kernel"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", sorted(p.name for p in SNAPSHOTS.glob("*.json")))
def test_from_rerenders_every_fixture_with_a_plot(name, tmp_path, probe):
    png = tmp_path / "x.png"
    done = probe("--from", str(SNAPSHOTS / name), "--plot", str(png), "--world-size", "4")
    assert done.returncode == 0, done.stderr
    assert "Backend verdicts at world size 4" in done.stdout and "Explain" in done.stdout
    assert "P2P per directed pair" in done.stdout
    assert png.stat().st_size > 10_000


def test_from_shows_bandwidth_and_copies_json(tmp_path, probe):
    copy = tmp_path / "copy.json"
    done = probe("--from", str(SNAPSHOTS / "pcie-2x4-numa.json"), "--json", str(copy))
    assert done.returncode == 0, done.stderr
    assert "Copy-engine bandwidth" in done.stdout and "52.6 / 2.90" in done.stdout
    assert "rank 5 (GPU 5)" in done.stdout
    assert json.loads(copy.read_text()) == json.loads((SNAPSHOTS / "pcie-2x4-numa.json").read_text())


def test_broken_and_foreign_json_are_usage_errors(tmp_path, probe):
    broken = tmp_path / "broken.json"
    broken.write_text('{"kind": "commbench-topology-snapshot", ')
    done = probe("--from", str(broken))
    assert done.returncode == 2 and "broken.json: not valid JSON (" in done.stderr and "at line 1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    done = probe("--from", str(other))
    assert done.returncode == 2 and "is not a commbench topology snapshot" in done.stderr
    newer = tmp_path / "newer.json"
    newer.write_text('{"kind": "commbench-topology-snapshot", "schema": 99}')
    assert "snapshot schema 99" in probe("--from", str(newer)).stderr
