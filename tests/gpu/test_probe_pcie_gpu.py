"""The PCIe probe steps on a real GPU: the SM peer kernels (PTX JIT-compiled by the driver),
the link reading taken while the GPU is busy, NCCL's topology dump and the collective A/B.

On a one-GPU machine (the H200 of tests/gpu/run.sh) every pair is a GPU with itself and NCCL
runs with one rank: the numbers say the checks ran, never what a fabric does; the A/B machinery
runs with two processes sharing the GPU over gloo (NCCL refuses two ranks on one GPU), under
run.sh's MPS daemon. Nothing here asserts a speed. With $OUT set the snapshot is saved there.
"""

from __future__ import annotations

import io
import json
import os

import pytest
import torch

from commbench.topology import nccl_checks
from commbench.topology.findings import findings
from commbench.topology.nccl_xml import parse_graphs, parse_topology
from commbench.probe.render import render
from commbench.probe.snapshot import take_snapshot

GPUS = torch.cuda.device_count()
LIMIT_S = 180.0


@pytest.fixture(scope="module")
def snapshot():
    snap = take_snapshot(None, bandwidth=True, allow_multicast=False, timeout_s=60, nccl=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_pcie_snapshot.json"), "w") as fh:
            json.dump(snap, fh, indent=1)
    return snap


def test_sm_peer_kernels_ran_on_every_pair(snapshot):
    assert not [e for e in snapshot["errors"] if "SM peer" in str(e.get("step"))], snapshot["errors"]
    pairs = snapshot["sm_peer"]["pairs"]
    assert len(pairs) == GPUS * GPUS
    for p in pairs:
        print(p)
        assert p["status"] == "ok", p
        assert p["store_gbps"] > 0 and p["load_gbps"] > 0 and p["read_latency_us"] > 0, p


def test_links_were_read_while_busy(snapshot):
    readings = snapshot["link_under_load"]
    assert sorted(r["gpu"] for r in readings) == list(range(GPUS))
    for r in readings:
        print(r)
        assert r.get("gen_current") or r.get("error"), r


def test_aer_and_module_facts_were_read(snapshot):
    assert all("aer" in g for g in snapshot["gpus"])
    module = next(iter(snapshot["hosts"].values()))["nvidia_module"]
    assert module["flavor"] in ("open", "proprietary"), module


def test_nccl_view_and_the_ab_rows(snapshot):
    (entry,) = snapshot["nccl_checks"]
    topology = entry["topology"]
    assert topology["verdict"] == nccl_checks.HEALTHY, topology
    assert topology["topo_xml"], "NCCL wrote no topology dump"
    assert parse_topology(topology["topo_xml"])["gpu_count"] == GPUS
    if topology["graph_xml"]:
        parse_graphs(topology["graph_xml"])
    if GPUS == 1:
        assert entry["ab"] == [] and entry["ab_note"] == nccl_checks.ONE_GPU_NOTE
    else:
        assert [r["verdict"] for r in entry["ab"]] == [nccl_checks.HEALTHY] * 4, entry["ab"]


def test_one_rank_nccl_allreduce_is_exact(tmp_path):
    sizes = [nccl_checks.TINY_BYTES, nccl_checks.LARGE_BYTES]
    results = nccl_checks.run_ranks([0], sizes, nccl_checks.base_env(False), LIMIT_S, tmp_path)
    ranks = [nccl_checks._rank_summary(r, res) for r, res in enumerate(results)]
    assert nccl_checks.run_verdict(ranks, sizes)[0] == nccl_checks.HEALTHY, ranks


def test_ab_machinery_with_two_ranks_sharing_gpu_0(tmp_path):
    runs = nccl_checks.collective_ab([0, 0], LIMIT_S, False, tmp_path, backend="gloo")
    assert [(r["size_bytes"], r["arm"], r["verdict"]) for r in runs] == [
        (size, arm, nccl_checks.HEALTHY) for size, _ in nccl_checks.SIZES for arm in nccl_checks.ARMS], runs


def test_render_and_findings(snapshot):
    out = io.StringIO()
    render(snapshot, max(GPUS, 2), False, file=out, width=200)
    text = out.getvalue()
    assert "P2P paths per directed pair" in text and "NCCL's view of" in text and "Islands and placement" in text
    found = {f["code"] for f in findings(snapshot)}
    if GPUS == 1:   # a GPU with itself is never a staged pair
        assert not found & {"p2p_sysmem_staged", "p2p_sm_latency_high", "p2p_sm_hangs"}
    print(sorted(found))
