"""Backend verdicts, the LL128 warning and explain, over the recorded and hand-made snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commbench import backends
from commbench.backends.mscclpp.backend import MscclppOptions
from commbench.engines.explain import explain
from commbench.policy import MULTICAST_POLICY_VARS
from commbench.probe import verdicts
from commbench.topology.needs import NO_GPU, SHARED_GPU
from commbench.probe.verdicts import backend_verdicts

SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "snapshots"


def variant(name: str):
    (backend,) = backends.expand([name], backends.Options(), on_gpu=True)
    return backend


def reason_for(name: str, snapshot: dict, world_size: int, allow_multicast: bool) -> str | None:
    """The verdict for one variant, named as a user names it."""
    return verdicts.reason_for(variant(name), snapshot, world_size, allow_multicast)


def nccl_unsafe_reason(name: str, snapshot: dict) -> str | None:
    return variant(name).snapshot_warning(snapshot)


def load(name: str) -> dict:
    return json.loads((SNAPSHOTS / name).read_text())


@pytest.fixture(autouse=True)
def no_policy(monkeypatch):
    """Verdicts read the multicast policy from the environment: start every test without it."""
    for name in MULTICAST_POLICY_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pcie8():
    return load("pcie-2x4-numa.json")


@pytest.fixture
def hgx():
    return load("nvswitch-8x-h100.json")


@pytest.fixture
def acs4():
    return load("pcie-switch-4x-acs.json")


def test_every_registered_variant_gets_a_verdict(hgx):
    got = backend_verdicts(hgx, 8, allow_multicast=True)
    assert set(got) == {b.name for b in backends.probe_variants()}
    assert {"nccl", "nccl:proto=LL128,algo=NVLSTree", "p2p:oneshot_pull", "mscclpp:auto", "mscclpp:shim",
            "flashinfer:fused_twoshot", "flashinfer:mnnvl", "symm_mem:multimem", "gloo"} <= set(got)
    assert all(v is None for v in got.values()), {k: v for k, v in got.items() if v}


def test_the_probed_machines_software_answers_for_its_snapshot(hgx):
    recorded = {**hgx, "backend_software": {"flashinfer:trtllm_oneshot": "flashinfer-python not installed (pip ...)",
                                            "p2p:oneshot": None}}
    assert reason_for("flashinfer:trtllm_oneshot", recorded, 8, False) == "flashinfer-python not installed (pip ...)"
    assert reason_for("p2p:oneshot", recorded, 8, False) is None
    assert verdicts.software_record([variant("gloo")]) == {"gloo": None}


@pytest.mark.procs
def test_the_sweeps_verdicts_take_the_software_answer_of_its_own_variants(hgx, tmp_path):
    # The snapshot's record comes from variants built without the run's options; a sweep given
    # --mscclpp-nccl-lib must not be told by it that the shim needs that flag.
    library = tmp_path / "libmscclpp_nccl.so"
    library.write_bytes(b"\x7fELF")
    (shim,) = backends.factory("mscclpp").variants("shim", MscclppOptions(str(library)))
    recorded = {**hgx, "backend_software": verdicts.software_record(backends.probe_variants())}
    assert "--mscclpp-nccl-lib" in verdicts.reason_for(shim, recorded, 8, False)
    assert verdicts.run_verdicts([shim], recorded, 8, False) == {"mscclpp:shim": None}
    (missing,) = backends.factory("mscclpp").variants("shim", MscclppOptions(str(tmp_path / "gone.so")))
    assert verdicts.run_verdicts([missing], recorded, 8, False) == {
        "mscclpp:shim": f"--mscclpp-nccl-lib {tmp_path / 'gone.so'}: no such file"}


def test_no_gpu_snapshot_skips_every_gpu_backend(hgx):
    empty = {**hgx, "gpus": [], "p2p": [], "participants": []}
    verdicts = backend_verdicts(empty, 2, allow_multicast=True)
    assert verdicts.pop("gloo") is None
    assert set(verdicts.values()) == {NO_GPU}


def test_pcie_islands_p2p_inside_a_numa_node_only(pcie8):
    # TP4 on GPUs 0-3 (one NUMA node): P2P and IPC work, but rank 5 is not in it -> VMM fine too
    assert reason_for("p2p:oneshot", pcie8, 4, False) is None
    assert reason_for("mscclpp:auto", pcie8, 4, False) is None
    assert reason_for("flashinfer:pcie_ipc", pcie8, 4, False) is None
    # torch symm_mem sets its signal pad with system-scope CAS on the peer: this box's NVML says
    # its PCIe pairs have no P2P atomics.
    assert reason_for("symm_mem:two_shot", pcie8, 4, False) == \
        "no P2P atomics (NVML): GPU 0 -> GPU 1 not supported (and 11 more)"
    with_atomics = {**pcie8, "p2p": [{**e, "nvml": {**e["nvml"], "atomics": "OK"}} for e in pcie8["p2p"]]}
    assert reason_for("symm_mem:two_shot", with_atomics, 4, False) is None
    # TP8 crosses the SYS link: no functional P2P on the cross-socket pairs
    reason = reason_for("p2p:twoshot", pcie8, 8, False)
    assert reason.startswith("no functional P2P: GPU 0 -> GPU 4 NOT_RUN") and "more)" in reason
    assert reason_for("nccl:proto=LL", pcie8, 8, False) is None


def test_pcie_vmm_import_failure_names_the_rank(pcie8):
    # Only GPUs 4-7 would work for P2P; rank 5's cuMemCreate import fails there
    sub = {**pcie8, "participants": pcie8["participants"][4:] + pcie8["participants"][:4]}
    reason = reason_for("flashinfer:trtllm_oneshot", sub, 4, False)
    assert "rank 5 (GPU 5)" in reason and "cuMemImportFromShareableHandle" in reason
    assert reason_for("p2p:oneshot", sub, 4, False) is None   # legacy IPC does not use cuMemCreate


def test_multicast_backends(pcie8, hgx, monkeypatch):
    assert reason_for("symm_mem:multimem", pcie8, 4, True).startswith("no multicast: GPU 0 reports")
    assert reason_for("symm_mem:multimem", hgx, 8, False) == "multicast not tested: pass --allow-multicast"
    assert reason_for("flashinfer:mnnvl", hgx, 8, True) is None
    assert reason_for("nccl:proto=Simple,algo=NVLS", hgx, 8, True) is None
    assert reason_for("nccl:proto=Simple,algo=Ring", hgx, 8, False) is None
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert reason_for("nccl:proto=LL128,algo=NVLSTree", hgx, 8, True) == \
        "multicast disabled by policy (NCCL_NVLS_ENABLE=0)"
    assert reason_for("symm_mem:two_shot", hgx, 8, True) is None


def test_failed_multicast_setup_is_a_skip(hgx):
    hgx["multicast"]["functional"] = {"status": "fail", "detail": "process 3 on GPU 3: cuMulticastBindMem failed"}
    assert "cuMulticastBindMem" in reason_for("symm_mem:multimem", hgx, 8, True)


def test_broken_p2p_behind_acs(acs4):
    assert reason_for("p2p:oneshot", acs4, 2, False).startswith("no functional P2P: GPU 0 -> GPU 1 WRONG")
    assert "HANGS" in reason_for("p2p:oneshot", acs4, 4, False) or "WRONG" in reason_for("p2p:oneshot", acs4, 4, False)
    assert reason_for("nccl", acs4, 4, False) is None


def test_ipc_wrong_data_is_a_skip(acs4):
    # Pretend P2P passed: the legacy IPC pair 1 -> 0 still returned wrong data.
    for e in acs4["p2p"]:
        e["write_verify"] = {"status": "ok"}
    reason = reason_for("p2p:oneshot", acs4, 2, False)
    assert reason.startswith("CUDA IPC (cudaIpcGetMemHandle/OpenMemHandle) failed: WRONG")
    assert reason_for("symm_mem:two_shot", acs4, 4, False).startswith("CUDA IPC")
    assert reason_for("p2p:oneshot", acs4, 1, False) is None


def test_missing_vmm_attribute(acs4):
    for e in acs4["p2p"]:
        e["write_verify"] = {"status": "ok"}
    acs4["ipc"]["pairs"] = [dict(p, status="ok", detail=None) for p in acs4["ipc"]["pairs"]]
    acs4["gpus"][1]["attributes"]["vmm"] = 0
    assert "VIRTUAL_MEMORY_MANAGEMENT" in reason_for("flashinfer:trtllm_twoshot", acs4, 2, False)
    assert reason_for("flashinfer:pcie_ipc", acs4, 2, False) is None


def test_multi_node_and_shared_gpus(hgx):
    two_hosts = json.loads(json.dumps(hgx))
    for g in two_hosts["gpus"][4:]:
        g["host"] = "other"
    assert reason_for("p2p:oneshot", two_hosts, 8, False) == "node-local backend: the ranks span 2 hosts"
    one = {**hgx, "gpus": hgx["gpus"][:1]}
    assert reason_for("nccl", one, 2, False) == SHARED_GPU


def test_a_backend_that_needs_nothing_runs_anywhere(acs4):
    assert reason_for("gloo", acs4, 4, False) is None
    assert reason_for("gloo", {"gpus": []}, 4, False) is None


def test_ll128_without_nvlink_is_flagged_not_skipped(pcie8, hgx):
    assert nccl_unsafe_reason("nccl:proto=LL128", pcie8) == "LL128 forced without NVLink: may corrupt data"
    assert nccl_unsafe_reason("nccl:proto=LL128,algo=Ring", pcie8) is not None
    assert reason_for("nccl:proto=LL128", pcie8, 4, False) is None
    assert nccl_unsafe_reason("nccl:proto=LL128", hgx) is None
    assert nccl_unsafe_reason("nccl:proto=LL", pcie8) is None
    assert nccl_unsafe_reason("p2p:oneshot", pcie8) is None


def test_explain_pcie_gates_custom_allreduce(pcie8):
    text = "\n".join(explain(pcie8, 4))
    assert ("vLLM 0.34.0 custom allreduce (CUDA IPC): off: above 2 GPUs it needs NVLink between every pair "
            "('not supported on more than two PCIe-only GPUs'") in text
    assert "no multicast on these GPUs" in text
    assert "SGLang 0.5.23" in text
    tp2 = "\n".join(explain(pcie8, 2))
    assert "custom allreduce (CUDA IPC): on: always 1-stage at TP2" in tp2
    tp8 = "\n".join(explain(pcie8, 8))
    assert "vLLM 0.34.0 FlashInfer allreduce: off" in tp8 and "VLLM_ALLREDUCE_USE_FLASHINFER=1 (default)" in tp8
    assert "needs SM90 or SM10x, this is compute capability 12.0" in tp8


def test_explain_nvswitch(hgx, monkeypatch):
    text = "\n".join(explain(hgx, 8))
    assert "1-stage below 256 KiB, 2-stage above (full NVLink" in text
    assert "torch symmetric memory: on: multimem" in text
    assert "resolves to mnnvl" in text and "trtllm (SM90, single node)" in text
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    text = "\n".join(explain(hgx, 4))
    assert "1-stage below 512 KiB" in text
    assert "multicast_ptr == 0" in text and "VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm" in text


def test_explain_warns_when_vllm_trusts_a_broken_capability(acs4):
    text = "\n".join(explain(acs4, 2))
    assert "WARNING: vLLM trusts cudaDeviceCanAccessPeer" in text
    assert explain(acs4, 1)[0].startswith("World size 1")
    assert "compute capability 8.9" in "\n".join(explain(acs4, 4))


def test_explain_sm90_vmm_failure_turns_flashinfer_fusion_off(hgx):
    for p in hgx["vmm"]["pairs"]:
        if p["writer"] == 2:
            p.update(status="fail", detail="process 2 on GPU 2 writing to process 0 on GPU 0: "
                                           "cuMemImportFromShareableHandle failed: CUDA_ERROR_INVALID_VALUE (1)")
    text = "\n".join(explain(hgx, 4))
    assert "SGLang 0.5.23 FlashInfer allreduce+RMSNorm fusion: off: its cuMemCreate " \
           "preflight would fail on at least one rank" in text
    assert "process 2 on GPU 2" in text
    assert reason_for("symm_mem:two_shot", hgx, 4, False).startswith("cuMemCreate -> POSIX FD export")


def test_recorded_h200_single_process():
    """The real one-GPU H200 (multicast off by policy and by attribute), probed with two processes."""
    s = load("h200-1gpu.json")
    assert s["gpus"][0]["name"] == "NVIDIA H200" and s["gpus"][0]["attributes"]["vmm"] == 1
    verdicts = backend_verdicts(s, 2, allow_multicast=False)
    for name in ("p2p:oneshot", "symm_mem:two_shot", "flashinfer:trtllm_oneshot", "flashinfer:pcie_ipc",
                 "mscclpp:auto"):
        assert verdicts[name] is None, (name, verdicts[name])
    assert verdicts["nccl:proto=LL"] == SHARED_GPU
    assert verdicts["symm_mem:multimem"].startswith("no multicast: GPU 0 reports")
    assert backend_verdicts(s, 1, False)["nccl"] is None
    text = "\n".join(explain(s, 2))
    assert "n/a (one GPU, ranks share it)" in text and "falls back to trtllm" in text


def test_recorded_h200_torchrun_four_ranks_on_one_gpu():
    s = load("h200-1gpu-torchrun4.json")
    assert s["mode"] == "torchrun" and [p["rank"] for p in s["participants"]] == [0, 1, 2, 3]
    assert len(s["vmm"]["pairs"]) == 12 and all(p["status"] == "ok" for p in s["vmm"]["pairs"])
    assert reason_for("flashinfer:trtllm_twoshot", s, 4, False) is None
    assert reason_for("nccl", s, 4, False) == SHARED_GPU
    broken = json.loads(json.dumps(s))
    broken["vmm"]["pairs"][5].update(status="fail", detail="rank 1 (GPU 0) writing to rank 3 (GPU 0): "
                                                          "cuMemSetAccess failed: CUDA_ERROR_INVALID_DEVICE (101)")
    assert "rank 1 (GPU 0) writing to rank 3" in reason_for("symm_mem:one_shot", broken, 4, False)
    assert reason_for("p2p:oneshot", broken, 4, False) is None
