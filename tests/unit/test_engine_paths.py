"""The engine-path model: which allreduce paths vLLM and SGLang can take on a probed box at a TP
size, and which one each takes by default at a message size (commbench/engines/paths.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dataclasses import replace

from commbench import engines
from commbench.engines import explain
from commbench.engines import paths as engine_paths
from commbench.engines import (CUSTOM_AR, FLASHINFER_AR, FLASHINFER_FUSED, NCCL_PATH, NCCL_SYMM, SGLANG, TORCH_SYMM_MEM,
                               VLLM)
from commbench.engines.registry import BY_KEY
from commbench.policy import MULTICAST_POLICY_VARS
from commbench.topology import box as boxes
from factories import row

ROOT = Path(__file__).parents[2]
PCIE = json.loads((ROOT / "tests/data/runs/synthetic-pcie-8gpu/run.json").read_text())["snapshot"]
EMULATED = json.loads((ROOT / "results/reference/h200-mps-emulated/world8/allreduce/20261201-171600-vm/run.json")
                      .read_text())["snapshot"]
KiB = 1024


def nvswitch_h200(multicast: bool) -> dict:
    """The PCIe fixture's 8 GPUs made into H200s with NVLink on every pair and a working
    cuMemCreate exchange between every pair."""
    snap = copy.deepcopy(PCIE)
    for gpu in snap["gpus"]:
        gpu["compute_capability"] = "9.0"
        gpu["attributes"] = {"multicast": 1 if multicast else 0}
    for entry in snap["p2p"]:
        entry["nvml"] = {"nvlink": "OK"}
    snap["participants"] = [{"id": g, "gpu": g} for g in range(8)]
    snap["vmm"] = {"tested": True, "exports": [],
                   "pairs": [{"writer": a, "owner": b, "status": "ok"} for a in range(8) for b in range(8) if a != b]}
    return snap


def states(engine: str, snapshot: dict, world_size: int = 8, dtype: str = "bf16",
           workload: engine_paths.Workload | None = None, blocked: str | None = None) -> list:
    box = boxes.read(snapshot, world_size, multicast_blocked=blocked)
    return engine_paths.states(BY_KEY[engine], box, replace(workload or engine_paths.Workload(), dtype=dtype))


def by_path(engine: str, snapshot: dict, world_size: int = 8, dtype: str = "bf16",
            workload: engine_paths.Workload | None = None, blocked: str | None = None) -> dict:
    return {s.path: s for s in states(engine, snapshot, world_size, dtype, workload, blocked)}


def default(engine: str, snapshot: dict, message_bytes: int, world_size: int = 8,
            workload: engine_paths.Workload | None = None) -> str | None:
    chosen = engine_paths.default_path(states(engine, snapshot, world_size, workload=workload), message_bytes)
    return chosen.path.path if chosen.path else None


EAGER = engine_paths.Workload(mode="eager")


def test_on_8_pcie_gpus_both_engines_fall_back_to_nccl_at_every_size():
    for engine in engines.ENGINES:
        paths = by_path(engine, PCIE)
        assert paths[CUSTOM_AR].available is False and "NVLink between every pair" in paths[CUSTOM_AR].why
        assert paths[TORCH_SYMM_MEM].available is False
        assert all(default(engine, PCIE, size) == NCCL_PATH for size in (4 * KiB, 12 * KiB, 3 << 20))
    # NCCL >= 2.29.2 (the fixture's 2.30.7, from run.json when the probe did not record it) has no
    # symmetric kernels off NVLink
    with_nccl = {**PCIE, "software": {"nccl": "2.30.7"}}
    assert by_path(VLLM, with_nccl)[NCCL_SYMM].available is False


def test_two_pcie_gpus_take_the_custom_allreduce_up_to_8_mib():
    for engine in engines.ENGINES:
        assert default(engine, PCIE, 64 * KiB, world_size=2) == CUSTOM_AR
        assert default(engine, PCIE, (8 << 20) + 16, world_size=2) == NCCL_PATH
    # vLLM: inp_size < max_size; SGLang's legacy kernel: inp_size <= max_size (custom_all_reduce.py)
    assert default(VLLM, PCIE, 8 << 20, world_size=2) == NCCL_PATH
    assert default(SGLANG, PCIE, 8 << 20, world_size=2) == CUSTOM_AR


def test_nvswitch_h200_dispatch_order_and_size_caps():
    snap = nvswitch_h200(multicast=True)
    # vLLM with CUDA graphs: the allreduce+RMSNorm fusion first (on by default, up to 512 KiB at TP8
    # on SM90); under --enforce-eager nothing is fused and the standalone FlashInfer allreduce takes
    # those sizes. Then the custom allreduce (capped at 256 KiB where symm-mem is on, so FlashInfer
    # covers its sizes), then torch symm-mem (64 MiB).
    assert default(VLLM, snap, 12 * KiB) == FLASHINFER_FUSED
    assert default(VLLM, snap, 12 * KiB, workload=EAGER) == FLASHINFER_AR
    assert default(VLLM, snap, 1 << 20) == TORCH_SYMM_MEM
    assert default(VLLM, snap, 128 << 20) == NCCL_PATH
    assert by_path(VLLM, snap)[CUSTOM_AR].max_bytes == 256 * KiB
    # SGLang (no architecture given, so FlashInfer stays opt-in): custom allreduce v2 up to 16 MiB
    # inclusive, NCCL above; torch symm-mem is opt-in
    assert default(SGLANG, snap, 1 << 20) == CUSTOM_AR and default(SGLANG, snap, 16 << 20) == CUSTOM_AR
    assert default(SGLANG, snap, 32 << 20) == NCCL_PATH
    assert by_path(SGLANG, snap)[TORCH_SYMM_MEM].available is True
    # without multicast the symm-mem communicator is off and the custom allreduce keeps 8 MiB
    plain = nvswitch_h200(multicast=False)
    assert by_path(VLLM, plain)[TORCH_SYMM_MEM].available is False
    assert by_path(VLLM, plain)[CUSTOM_AR].max_bytes == 8 << 20


def test_ranks_sharing_one_gpu_leave_the_fabric_gates_unknown():
    paths = by_path(SGLANG, EMULATED)
    assert paths[CUSTOM_AR].available is None and "ranks share one GPU" in paths[CUSTOM_AR].why
    assert default(SGLANG, EMULATED, 12 * KiB) is None
    # vLLM tries FlashInfer before its custom allreduce: its default at small sizes is known
    assert default(VLLM, EMULATED, 12 * KiB) == FLASHINFER_FUSED and default(VLLM, EMULATED, 1 << 20) is None
    assert default(VLLM, EMULATED, 12 * KiB, workload=EAGER) == FLASHINFER_AR
    # and the inert list no longer calls the custom allreduce inert on one shared GPU
    assert not any((VLLM, CUSTOM_AR) in r.paths for r in engines.inert_settings(boxes.read(EMULATED, 8)))


@pytest.mark.parametrize("snapshot", [PCIE, EMULATED, nvswitch_h200(True), nvswitch_h200(False)])
def test_a_path_the_inert_list_names_is_never_available(snapshot):
    inert = {p for rule in engines.inert_settings(boxes.read(snapshot, 8)) for p in rule.paths}
    assert inert or snapshot is not PCIE
    for engine in engines.ENGINES:
        for state in states(engine, snapshot):
            if (engine, state.path) in inert:
                assert state.available is False, (engine, state.path)


def test_the_fastest_path_at_a_size_for_callers_without_a_model():
    from commbench.analysis import decide
    from commbench.analysis.curves import decode_curves
    from commbench.runs import load_run
    run = load_run(ROOT / "tests/data/runs/synthetic-pcie-8gpu")
    curves = decode_curves(run, 8, "bf16", "auto")
    engine = BY_KEY[SGLANG]
    option, price = decide.best_path_at(engine, engine.facts, run, curves, decide.box_of(run, 8), "bf16", 16 * KiB)
    # p2p:oneshot (13 us) is faster there, but SGLang cannot run it on 8 PCIe GPUs
    assert option.state.path == NCCL_PATH and price.curve == "nccl:proto=LL,algo=Ring (graph)" and price.latency_us == 54


def test_explain_is_the_path_model_in_words(monkeypatch):
    """The probe's explain section renders states(): on an emulated run it cannot tell the custom
    allreduce's gate either, and every path's state and reason appear as the model has them."""
    for name in MULTICAST_POLICY_VARS:     # explain reads this host's policy
        monkeypatch.delenv(name, raising=False)
    lines = explain.explain(EMULATED, 8)
    assert ("vLLM 0.34.0 custom allreduce (CUDA IPC): cannot tell here: ranks share one GPU" in "\n".join(lines))
    words = {None: "cannot tell here", False: "off"}
    for engine in engines.ENGINES:
        for state in states(engine, EMULATED):
            status = words.get(state.available, "on" if state.default_on else "opt-in")
            head = f"{engines.ENGINE_NAMES[engine]} {BY_KEY[engine].facts.version} {state.rule.title}: {status}: "
            assert any(line.startswith(head + state.why) for line in lines), head


def test_the_write_and_verify_warning_and_flashinfer_auto_live_in_the_path_model():
    acs = json.loads((ROOT / "tests/fixtures/snapshots/pcie-switch-4x-acs.json").read_text())
    assert "WARNING: vLLM trusts cudaDeviceCanAccessPeer" in by_path(VLLM, acs, world_size=2)[CUSTOM_AR].why
    assert "WARNING" not in by_path(VLLM, PCIE, world_size=2)[CUSTOM_AR].why
    assert "resolves to mnnvl" in by_path(VLLM, nvswitch_h200(True))[FLASHINFER_AR].why
    assert "falls back to trtllm" in by_path(VLLM, nvswitch_h200(False))[FLASHINFER_AR].why
    # a host whose policy forbids multicast: symm-mem off, the custom allreduce keeps 8 MiB
    blocked = by_path(VLLM, nvswitch_h200(True), blocked="disabled by policy")
    assert blocked[TORCH_SYMM_MEM].available is False and "multicast_ptr == 0" in blocked[TORCH_SYMM_MEM].why
    assert blocked[CUSTOM_AR].max_bytes == 8 << 20
    assert "forbidden by this host's policy" in blocked[FLASHINFER_AR].why


def test_sglang_at_two_pcie_gpus_runs_its_legacy_kernel_so_its_v2_rows_only_stand_in():
    """SGLang 0.5.23's custom allreduce v2 needs NVLink on every pair, 2 GPUs included: on two PCIe
    GPUs the path is on but runs the legacy kernel, so sglang:* rows (v2) price it only as a
    stand-in; with NVLink they are its own kernel. vLLM's gate at TP2 is unchanged."""
    pcie = by_path(SGLANG, PCIE, world_size=2)[CUSTOM_AR]
    assert pcie.available is True and pcie.own_kernel is False and "runs its legacy kernel here" in pcie.why
    nvlink = by_path(SGLANG, nvswitch_h200(False), world_size=2)[CUSTOM_AR]
    assert nvlink.available is True and nvlink.own_kernel is True
    assert by_path(VLLM, PCIE, world_size=2)[CUSTOM_AR].own_kernel is True


def test_where_ranks_share_a_gpu_sglang_v2_rows_stand_in_at_every_world_size():
    """On an emulated run SGLang's gate cannot be read at 8 ranks (available None) and reads
    "on" at 2; at both, whether v2 or the legacy kernel would run is unknown, so its rows stand in."""
    for world_size in (2, 8):
        state = by_path(SGLANG, EMULATED, world_size=world_size)[CUSTOM_AR]
        assert state.available is not False and state.own_kernel is False, (world_size, state)
        assert "cannot be told" in state.why


def test_own_kernel_rows_of_a_path_running_another_kernel_are_priced_as_stand_ins(tmp_path):
    from commbench.analysis import decide
    from commbench.analysis.curves import build_curves
    from commbench.results import Run, RunInfo

    facts = {"sglang:auto": {"engine_settings": engines.Settings(
        "sglang:auto", sglang_env=dict(engines.SGLANG_CUSTOM_AR_V2_ENV), vllm_supported=False,
        engine_paths=engines.claim(engines.CUSTOM_AR, SGLANG)).to_dict()}}
    rows = [row(backend="sglang:auto", message_bytes=64 * KiB, latency_us=9.0)]
    for snapshot, own in ((PCIE, False), (nvswitch_h200(False), True)):
        run = Run(tmp_path, RunInfo(snapshot=snapshot, world_size=2, backend_facts=facts), rows)
        found = states(SGLANG, snapshot, 2)
        (option,) = [o for o in decide.options(SGLANG, found, run, build_curves(rows), [64 * KiB])
                     if o.state.path == CUSTOM_AR]
        assert ([c.backend for c in option.own], [c.backend for c in option.stand_ins]) == \
            ((["sglang:auto"], []) if own else ([], ["sglang:auto"]))
