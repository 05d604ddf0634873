"""The probe on a real GPU: driver facts, the PTX write kernel, cross-process IPC and VMM
sharing (two processes on one GPU when there is only one), the multicast policy, bandwidth."""

from __future__ import annotations

import os

import pytest

from commbench.probe.snapshot import take_snapshot
from commbench.topology.needs import SHARED_GPU
from commbench.probe.verdicts import backend_verdicts


@pytest.fixture(scope="module")
def snapshot():
    return take_snapshot(None, bandwidth=True, allow_multicast=False, timeout_s=60)


def test_devices_and_attributes(snapshot):
    assert snapshot["gpus"], snapshot["notes"]
    g = snapshot["gpus"][0]
    assert g["uuid"].startswith("GPU-") and g["sm_count"] > 0 and g["memory_total_mib"] > 0
    assert g["attributes"]["vmm"] == 1 and g["attributes"]["posix_fd_handle"] == 1
    assert g.get("pcie"), "NVML facts missing"
    assert not snapshot["errors"], snapshot["errors"]


def test_ipc_and_vmm_cross_process_pass(snapshot):
    for section in ("ipc", "vmm"):
        group = snapshot[section]
        assert group["tested"]
        assert group["pairs"], section
        assert all(p["status"] == "ok" for p in group["pairs"]), group["pairs"]
        assert all(e["status"] == "ok" for e in group["exports"]), group["exports"]


def test_p2p_pairs_all_verified(snapshot):
    n = len(snapshot["gpus"])
    assert len(snapshot["p2p"]) == n * (n - 1)
    for e in snapshot["p2p"]:
        if e["can_access_peer"]:
            assert e["write_verify"]["status"] == "ok", e


def test_bandwidth_numbers(snapshot):
    pairs = snapshot["bandwidth"]["pairs"]
    assert pairs and all(p.get("bandwidth_gbps", 0) > 1 and p.get("latency_us", 0) > 0 for p in pairs), pairs


def test_multicast_never_created_under_policy(snapshot):
    if not any(os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")):
        pytest.skip("multicast policy variables are not set on this machine")
    assert snapshot["multicast"]["functional"]["status"].startswith("disabled by policy")
    reason = backend_verdicts(snapshot, 2, True)["symm_mem:multimem"]
    assert reason is not None and reason.startswith(("multicast disabled", "no multicast")), reason


def test_verdicts_on_this_box(snapshot):
    verdicts = backend_verdicts(snapshot, 2, False)
    assert verdicts["gloo"] is None
    assert verdicts["p2p:oneshot"] is None, verdicts["p2p:oneshot"]
    assert verdicts["symm_mem:two_shot"] is None, verdicts["symm_mem:two_shot"]
    if len(snapshot["gpus"]) == 1:
        assert verdicts["nccl"] == SHARED_GPU, verdicts["nccl"]
