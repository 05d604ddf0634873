"""The sweep on a CUDA machine: NCCL in eager and graph mode, what NCCL reports it used,
the world-size-1 cases that must not be reported as latencies, and the P2P-capable backends
with unfused:best through the real CLI with ranks sharing one GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from commbench.sweep.mps import client_env
from commbench.runtime.timing import capture_graph, count_work_nodes

REPO = Path(__file__).resolve().parents[2]


def _sweep(tmp_path: Path, *args: str, nproc: int | None = None, timeout_s: float = 300) -> list[dict]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc else [sys.executable])
    env = dict(os.environ)
    if nproc and env.get("CUDA_MPS_PIPE_DIRECTORY"):   # tests/gpu/run.sh's daemon: an equal SM share
        env.update(client_env(nproc, torch.cuda.device_count()))
    result = subprocess.run([*launcher, "-m", "commbench", "sweep", "--out", str(tmp_path), *args],
                            capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return [json.loads(line) for line in (run_dir / "measurements.jsonl").read_text().splitlines()]


def test_graph_node_count_tells_work_from_no_work() -> None:
    x = torch.ones(1024, device="cuda")
    assert count_work_nodes(capture_graph(lambda i: x.mul_(1.0), 3)) == 3
    assert count_work_nodes(capture_graph(lambda i: None, 3)) == 0


def test_world_size_one_nccl_is_flagged_not_timed(tmp_path: Path) -> None:
    rows = _sweep(tmp_path, "--backends", "nccl", "-b", "4K", "-e", "1M", "-f", "16", "--iters", "20")
    assert {r["mode"] for r in rows} == {"eager", "graph"}
    for row in rows:
        assert row["status"] == "no_work" and row["wrong_elements"] == 0, row
    graph = [r for r in rows if r["mode"] == "graph"]
    assert all("captured no work" in r["reason"] and r["latency_us"] is None for r in graph)
    eager = [r for r in rows if r["mode"] == "eager"]
    assert all("world size 1" in r["reason"] and r["latency_us"] > 0 for r in eager)


def test_multi_gpu_nccl_protocol_matrix_is_exact_and_reported(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        import pytest

        pytest.skip("needs 2 GPUs: NCCL refuses two ranks on one GPU")
    rows = _sweep(tmp_path, "--backends", "nccl", "--nccl-proto", "LL,Simple", "--nccl-algo", "Ring",
                  "-b", "4K", "-e", "4M", "-f", "32", "--iters", "20", nproc=torch.cuda.device_count())
    assert all(r["status"] == "ok" and r["wrong_elements"] == 0 for r in rows), rows
    forced = [r for r in rows if r["requested"].get("NCCL_PROTO")]
    assert forced and all(r["observed"]["NCCL_PROTO"] == r["requested"]["NCCL_PROTO"] for r in forced), forced
    assert all(r["setting_applied"] == "honoured" for r in forced)


def test_shared_gpu_sweep_runs_p2p_symm_mem_and_unfused(tmp_path: Path) -> None:
    """Two torchrun workers on one GPU through the CLI: the engine's vote, setup, checks and
    clean exit with real CUDA-IPC backends, and unfused:best picking among them. FlashInfer's
    fused kernel against it is test_libraries_sweep_gpu's, which says why when it is skipped."""
    plain = ["p2p:auto", "p2p:oneshot", "symm_mem:one_shot"]
    rows = _sweep(tmp_path, "--share-gpus", "--backends", ",".join([*plain, "unfused:best"]),
                  "--tokens", "1,8", "--hidden", "4096", "--iters", "5", nproc=2, timeout_s=480)
    by_backend: dict[str, list[dict]] = {}
    for row in rows:
        by_backend.setdefault(row["backend"], []).append(row)
    assert sorted(by_backend) == sorted([*plain, "unfused:best"]), sorted(by_backend)
    for backend, got in by_backend.items():
        assert len(got) == 4, (backend, got)     # 2 token counts x eager/graph
        for row in got:
            assert row["status"] == "ok" and row["wrong_elements"] == 0, row
            assert row["world_size"] == 2 and row["latency_us"] > 0, row
    assert {r["extra"]["allreduce_backend"] for r in by_backend["unfused:best"]} <= set(plain)
