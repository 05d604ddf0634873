"""FlashInfer and MSCCL++ through the real sweep, ranks sharing one GPU (tests/gpu/run.sh's MPS
daemon when it runs one): every variant measured and checked, or skipped with the library's
reason; a test is skipped, with the reason, where its library is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commbench.sweep.mps import client_env

REPO = Path(__file__).resolve().parents[2]
MODEL_TOKENS = "1,4,16"
MODEL_HIDDEN = "7168"


def _sweep(out: Path, *args: str, driver: bool = False, timeout_s: float = 900) -> tuple[Path, list[dict]]:
    """Two ranks on GPU 0: torchrun, or the --nproc driver (crash-proof for native backends)."""
    env = dict(os.environ)
    if env.get("CUDA_MPS_PIPE_DIRECTORY"):      # tests/gpu/run.sh's daemon: an equal SM share
        env.update(client_env(2, torch.cuda.device_count()))
    launcher = ([sys.executable, "-m", "commbench", "sweep", "--nproc", "2"] if driver else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "-m", "commbench", "sweep"])
    result = subprocess.run([*launcher, "--share-gpus", "--out", str(out), *args], capture_output=True,
                            text=True, timeout=timeout_s, cwd=REPO, env=env)
    print(result.stdout[-6000:])
    assert result.returncode in (0, 3), result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir, [json.loads(line) for line in (run_dir / "measurements.jsonl").read_text().splitlines()]


def _flashinfer() -> None:
    from commbench.backends.flashinfer.common import REQUIRES

    reason = REQUIRES.reason()
    if reason:
        pytest.skip(reason)


def test_flashinfer_fused_vs_unfused_on_model_shapes(tmp_path: Path) -> None:
    _flashinfer()
    fused = ["flashinfer:fused_oneshot", "flashinfer:fused_twoshot"]
    run_dir, rows = _sweep(tmp_path, "--backends", ",".join(["p2p:oneshot", "symm_mem:one_shot", *fused, "unfused:best"]),
                           "--tokens", MODEL_TOKENS, "--hidden", MODEL_HIDDEN, "--mode", "graph", "--iters", "5")
    for row in rows:
        assert row["status"] in ("ok", "skipped"), row
        assert row["status"] == "skipped" or row["wrong_elements"] == 0, row
    oneshot = [r for r in rows if r["backend"] == "flashinfer:fused_oneshot"]
    assert sorted(r["tokens"] for r in oneshot if r["status"] == "ok") == [1, 4, 16], oneshot
    twoshot = {r["tokens"]: r for r in rows if r["backend"] == "flashinfer:fused_twoshot"}
    assert "needs tokens > world size (1 <= 2)" in twoshot[1]["reason"], twoshot[1]
    assert twoshot[4]["status"] == twoshot[16]["status"] == "ok", twoshot
    summary = json.loads((run_dir / "fusion.json").read_text())
    pairs = {(s["fused_backend"], s["tokens"]): s for s in summary}
    assert set(pairs) == {("flashinfer:fused_oneshot", t) for t in (1, 4, 16)} | \
        {("flashinfer:fused_twoshot", t) for t in (4, 16)}, sorted(pairs)
    assert all(s["saving_us"] is not None and s["unfused_allreduce"] in ("p2p:oneshot", "symm_mem:one_shot")
               for s in summary), summary


def test_flashinfer_plain_variants_and_tuned_pcie_ipc(tmp_path: Path) -> None:
    _flashinfer()
    run_dir, rows = _sweep(tmp_path, "--backends", "flashinfer:trtllm_oneshot,flashinfer:trtllm_twoshot,"
                           "flashinfer:pcie_ipc", "--sizes", "8K,64K,1M", "--mode", "eager,graph", "--iters", "5")
    by = {(r["backend"], r["message_bytes"], r["mode"]): r for r in rows}
    for mode in ("eager", "graph"):
        for size in (8 << 10, 64 << 10, 1 << 20):
            assert by[("flashinfer:trtllm_oneshot", size, mode)]["status"] == "ok"
        assert by[("flashinfer:trtllm_twoshot", 1 << 20, mode)]["status"] == "ok"     # 128 tokens of 4096
        assert "needs tokens > world size" in by[("flashinfer:trtllm_twoshot", 8 << 10, mode)]["reason"]
    pcie = [r for r in rows if r["backend"] == "flashinfer:pcie_ipc"]
    assert len(pcie) == 6, pcie
    if all(r["status"] == "skipped" for r in pcie):
        # A refusal is a result: FlashInfer's own words, voted (ranks sharing a GPU may be refused).
        assert all(r["reason"] for r in pcie), pcie
        print(f"flashinfer:pcie_ipc refused: {pcie[0]['reason']}")
        return
    for row in pcie:
        assert row["status"] == "ok" and row["wrong_elements"] == 0, row
        tuning = row["extra"]["pcie_ipc_tuning"]
        assert tuning["tuned"] is True and tuning["tune_batches"] == [1, 8, 128], tuning
        # Tuning that kept nothing runs the seeds and says why in profile_errors.
        assert tuning["saved_configs"], (tuning.get("profile_failures"), tuning.get("profile_errors"))
        assert row["extra"]["pcie_ipc_config"] and row["extra"]["pcie_ipc_seed"], row["extra"]
    assert (run_dir / "flashinfer-pcie-ipc" / "w2-bfloat16.json").is_file()


def test_mscclpp_every_variant_is_measured_or_says_why(tmp_path: Path) -> None:
    from commbench.backends.mscclpp.backend import BUILD_HINT, DEFAULT_ALGORITHMS

    if importlib.util.find_spec("mscclpp") is None:
        pytest.skip(BUILD_HINT)
    _, rows = _sweep(tmp_path, "--backends", "mscclpp", "--sizes", "8K,1M", "--mode", "graph", "--iters", "5",
                     driver=True)
    names = {r["backend"] for r in rows}
    assert names == {"mscclpp:auto", "mscclpp:shim", *(f"mscclpp:algo={a}" for a in DEFAULT_ALGORITHMS)}, names
    for row in rows:
        if row["status"] == "ok":
            assert row["wrong_elements"] == 0 and row["extra"]["mscclpp_algorithm"], row
        else:
            assert row["status"] in ("skipped", "crashed", "error", "hang") and row["reason"], row
    # The probe's verdict comes first (software, then needs): multicast off or the build's own reason.
    assert all(r["status"] != "ok" for r in rows if "nvls" in r["backend"]), rows
    assert all(r["status"] == "skipped" for r in rows if r["backend"] == "mscclpp:shim"), rows
    from commbench.backends.mscclpp.backend import bootstrap_reason

    if bootstrap_reason() is None:
        # A build whose bootstrap runs here measures its auto choice at both sizes: an error there
        # (as int() of a nanobind-3 enum was) is a bug to fix, not a reason to record.
        auto = [r for r in rows if r["backend"] == "mscclpp:auto"]
        assert [r["status"] for r in auto] == ["ok", "ok"], auto
