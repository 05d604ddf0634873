"""The PCIe probe steps without a GPU: the NCCL A/B machinery as real rank processes (gloo on
the CPU, faults injected by tests/fakes/nccl_fault_child.py), the SM peer measurement around a
fake driver, the read-only host facts on a fake sysfs tree, and how the records merge."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from commbench.topology import host, link_health, nccl_checks, peer_checks, pcie_snapshot
from commbench.topology.childproc import run_child
from commbench.topology.nccl_checks import HANGS, HEALTHY, INCONCLUSIVE, P2P_FAULT, WRONG
from commbench.topology.peer_kernels import chain

FAKES = Path(__file__).parents[1] / "fakes"
FAULT_CHILD = "nccl_fault_child"
LIMIT_S = 25.0   # for runs that finish: each rank imports torch (~4 s here) before gloo meets (a hang: hang_report)


def without_faults(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Children find the fault module; no fault unless a test sets one."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKES), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("COMMBENCH_TEST_FAULT", raising=False)
    monkeypatch.delenv("COMMBENCH_TEST_FAULT_BYTES", raising=False)
    monkeypatch.delenv("COMMBENCH_TEST_NCCL_DUMPS", raising=False)
    return monkeypatch


@pytest.fixture
def fakes_on_path(monkeypatch):
    return without_faults(monkeypatch)


@pytest.fixture(scope="module")
def hang_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, float]:
    """One probe NCCL report over two gloo ranks that hang at the 4 B allreduce where P2P is on
    (LL-sized), rank 0 playing NCCL's part of the topology run: the A/B and the topology tests
    read it, 5 runs of a rank pair, one of them waited out. A hang costs the whole limit, so the
    limit is not LIMIT_S but four times what a healthy pair takes here and now (start, meet, one
    allreduce), at least 6 s: it follows the machine's load instead of racing it."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        without_faults(monkeypatch)
        healthy = nccl_checks.run_ranks([None, None], [4], {}, LIMIT_S, tmp_path_factory.mktemp("healthy"),
                                        FAULT_CHILD, "gloo")
        assert all(r.failure() is None for r in healthy), [r.stderr_tail for r in healthy]
        limit_s = round(max(6.0, 4 * max(r.elapsed_s for r in healthy)), 1)
        monkeypatch.setenv("COMMBENCH_TEST_FAULT", "hang")
        monkeypatch.setenv("COMMBENCH_TEST_FAULT_BYTES", "4")
        monkeypatch.setenv("COMMBENCH_TEST_NCCL_DUMPS", str(Path(__file__).parents[1] / "fixtures" / "nccl"))
        return nccl_checks.nccl_report([None, None], limit_s, False, module=FAULT_CHILD, backend="gloo"), limit_s


# ---------------------------------------------------------------------------------------------
# NCCL A/B: verdicts (pure) and real rank processes
# ---------------------------------------------------------------------------------------------

def rank(r, done, timed_out=False, error=None, wrong=0, last="allreduce 4 B"):
    return {"rank": r, "timed_out": timed_out, "error": error, "last_step": last, "wrong_elements": wrong,
            "sizes_done": done}


@pytest.mark.parametrize("ranks, verdict, detail", [
    ([rank(0, [4]), rank(1, [4])], HEALTHY, "exact sum on every rank"),
    ([rank(0, [4]), rank(1, [4], wrong=1)], WRONG, "rank 1: 1 wrong element(s)"),
    ([rank(0, [], timed_out=True), rank(1, [], timed_out=True)], HANGS, "rank 0 did not finish within the time "
                                                                         "limit (last step: allreduce 4 B)"),
    ([rank(0, [], error="RuntimeError: boom"), rank(1, [], timed_out=True)], INCONCLUSIVE,
     "rank 0 failed: RuntimeError: boom"),
    ([rank(0, [4]), rank(1, [])], INCONCLUSIVE, "a rank exited without reporting every size"),
])
def test_run_verdict(ranks, verdict, detail):
    assert nccl_checks.run_verdict(ranks, [4]) == (verdict, detail)


@pytest.mark.parametrize("p2p, control, meaning", [
    (HEALTHY, HEALTHY, HEALTHY), (HANGS, HEALTHY, P2P_FAULT), (WRONG, HEALTHY, P2P_FAULT),
    (INCONCLUSIVE, HEALTHY, INCONCLUSIVE), (HANGS, HANGS, INCONCLUSIVE), (HEALTHY, WRONG, INCONCLUSIVE),
])
def test_ab_meaning(p2p, control, meaning):
    assert nccl_checks.ab_meaning(p2p, control)[0] == meaning


@pytest.mark.procs
def test_one_gpu_gets_a_note_and_still_dumps_the_topology(fakes_on_path):
    report = nccl_checks.nccl_report([None], LIMIT_S, False, module=FAULT_CHILD, backend="gloo")
    assert report["ab"] == [] and report["ab_note"] == nccl_checks.ONE_GPU_NOTE
    topology = report["topology"]
    assert topology["ranks"] == 1 and topology["verdict"] == HEALTHY
    # gloo writes no NCCL dumps or logs: the fields stay empty rather than made up
    assert topology["topo_xml"] is None and topology["small_message"] == {"bytes": 32768, "algo": None, "proto": None}


@pytest.mark.procs
@pytest.mark.slow
def test_topology_run_keeps_what_nccl_wrote(hang_report):
    report, _ = hang_report
    topology = report["topology"]
    assert topology["ranks"] == 2 and topology["verdict"] == HEALTHY
    assert topology["small_message"] == {"bytes": 32768, "algo": "Ring", "proto": "Simple"}
    assert topology["graph_xml"] == (Path(__file__).parents[1] / "fixtures" / "nccl" / "turin-8x-graph.xml").read_text()
    assert len(report["ab"]) == 4 and report["ab_note"] is None
    from commbench.topology.pcie_findings import nccl_patterns

    assert [f["code"] for f in nccl_patterns(topology)] == ["nccl_all_sys", "nccl_two_channels", "nccl_simple_small"]


@pytest.mark.procs
@pytest.mark.slow
def test_ab_with_a_hang_only_over_p2p_at_the_ll_size(hang_report):
    report, limit_s = hang_report
    runs = report["ab"]
    verdicts = {(r["size_bytes"], r["arm"]): r["verdict"] for r in runs}
    assert verdicts == {(4, "p2p"): HANGS, (4, "p2p_disabled"): HEALTHY,
                        (16 << 20, "p2p"): HEALTHY, (16 << 20, "p2p_disabled"): HEALTHY}
    hung = runs[0]
    assert hung["env"] == {} and runs[1]["env"] == {"NCCL_P2P_DISABLE": "1"}
    assert all(r["timed_out"] and r["last_step"] == "allreduce 4 B" for r in hung["ranks"])
    assert limit_s <= hung["elapsed_s"] < limit_s + 10


@pytest.mark.parametrize("fault, verdict, detail", [
    ("wrong", WRONG, "rank 1: 1 wrong element(s)"),
    ("error", INCONCLUSIVE, "rank 1 failed: RuntimeError: NCCL error: unhandled cuda error (injected)"),
])
@pytest.mark.procs
def test_a_faulty_rank_is_named(fakes_on_path, tmp_path, fault, verdict, detail):
    fakes_on_path.setenv("COMMBENCH_TEST_FAULT", fault)
    results = nccl_checks.run_ranks([None, None], [4], {}, LIMIT_S, tmp_path, FAULT_CHILD, "gloo")
    ranks = [nccl_checks._rank_summary(r, res) for r, res in enumerate(results)]
    got, text = nccl_checks.run_verdict(ranks, [4])
    assert got == verdict and detail in text


def test_nccl_children_run_without_multicast_unless_allowed(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert nccl_checks.base_env(False) == {"NCCL_NVLS_ENABLE": "0"}
    assert nccl_checks.base_env(True) == {}
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")    # the host's policy wins over --allow-multicast
    assert nccl_checks.base_env(True) == {"NCCL_NVLS_ENABLE": "0"}


# ---------------------------------------------------------------------------------------------
# SM peer measurement around a fake driver
# ---------------------------------------------------------------------------------------------

class FakeDriver:
    """Events that time what the fake kernels 'ran' between two records."""

    def __init__(self):
        self.clock_ms = 0.0
        self.log: list[str] = []
        self.uploads: list[tuple[int, int]] = []

    def event(self):
        return {"t": None}

    def record(self, ev):
        ev["t"] = self.clock_ms
        self.log.append("record")

    def elapsed_ms(self, start, end):
        self.log.append("elapsed")
        return end["t"] - start["t"]

    def write_bytes(self, ptr, data):
        self.uploads.append((ptr, len(data)))


class FakeKernels:
    """16-byte stores at 40 GB/s, loads at 10 GB/s, 2 us per dependent peer read, 5 us launch."""

    def __init__(self, drv):
        self.drv = drv

    def store(self, dst, nbytes, blocks, seed):
        self.drv.clock_ms += 0.005 + nbytes / 40e9 * 1e3

    def load(self, src, nbytes, out, blocks):
        self.drv.clock_ms += 0.005 + nbytes / 10e9 * 1e3

    def chase(self, start, hops, out):
        self.drv.clock_ms += 0.005 + hops * 2e-3


def test_measure_pair_arithmetic_and_the_busy_reading():
    drv = FakeDriver()
    kernels = FakeKernels(drv)
    seen = []
    result = peer_checks.measure_pair(drv, kernels, 0x7000_0000, 0x1000, 752, lambda: seen.append(list(drv.log)))
    # launch cost is inside the bandwidth figure (as for the copy engine), cancels out of the latency
    assert result["store_gbps"] == pytest.approx(40e9 * 64 * 2**20 / (64 * 2**20 + 40e9 * 5e-6) / 1e9, rel=1e-3)
    assert result["load_gbps"] == pytest.approx(10.0, rel=0.01)
    assert result["read_latency_us"] == pytest.approx(2.0, abs=0.001)
    # the link is read after the timed stores were enqueued and before waiting for them
    assert seen == [["record", "record"]]
    assert drv.uploads == [(0x7000_0000, peer_checks.CHASE_NODES * peer_checks.CHASE_STRIDE_BYTES)]


def test_pointer_ring_closes():
    image = chain(0x1000, 4, 64)
    words = [int.from_bytes(image[k * 64:k * 64 + 8], "little") for k in range(4)]
    assert words == [0x1040, 0x1080, 0x10C0, 0x1000]


@pytest.mark.procs
def test_peer_checks_child_without_a_driver_reports_a_row():
    result = run_child("commbench.topology.peer_checks", {"pairs": [[0, 0]]}, 30)
    kinds = [r["kind"] for r in result.records]
    if "sm_peer" in kinds:
        pytest.skip("this machine has an NVIDIA driver (tests/gpu covers it)")
    assert kinds == ["error", "done"] and result.failure() is None


def test_link_reader_names_what_kept_the_gpus_busy(tmp_path, monkeypatch, capsys):
    root = sysfs_gpu(tmp_path, "0000:03:00.0", speed="16.0 GT/s PCIe", width="8")
    real = link_health.link_state
    monkeypatch.setattr(link_health, "link_state", lambda bus_id: real(bus_id, root))
    peer_checks.link_reader({0: "00000000:03:00.0"}, 0, 0)()
    rec = json.loads(capsys.readouterr().out.splitlines()[0])
    assert rec == {"kind": "link_load", "device": 0, "during": "GPU 0 SM stores into its own memory",
                   "gen_current": 4, "width_current": 8, "gen_max": 5, "width_max": 16}


# ---------------------------------------------------------------------------------------------
# Read-only host facts on a fake sysfs / procfs
# ---------------------------------------------------------------------------------------------

AER_COR = "RxErr 0\nBadTLP 12\nBadDLLP 31\nRollover 0\nTimeout 4\nNonFatalErr 0\nCorrIntErr 0\nHeaderOF 0\nTOTAL_ERR_COR 47\n"


def sysfs_gpu(tmp_path: Path, bdf: str, speed: str = "32.0 GT/s PCIe", width: str = "16") -> Path:
    """devices/<bdf> -> real/pci0000:00/0000:00:01.1/<bdf>, with link files and AER counters."""
    devices, port = tmp_path / "devices", tmp_path / "real" / "pci0000:00" / "0000:00:01.1"
    gpu = port / bdf
    gpu.mkdir(parents=True)
    devices.mkdir(exist_ok=True)
    os.symlink(port, devices / "0000:00:01.1")
    os.symlink(gpu, devices / bdf)
    for name, value in (("current_link_speed", speed), ("current_link_width", width),
                        ("max_link_speed", "32.0 GT/s PCIe"), ("max_link_width", "16"),
                        ("aer_dev_correctable", AER_COR), ("aer_dev_nonfatal", "SDES 0\nTOTAL_ERR_NONFATAL 0\n")):
        (gpu / name).write_text(value + "\n")
    (port / "aer_dev_fatal").write_text("SDES 1\nTOTAL_ERR_FATAL 1\n")
    return devices


def test_aer_counters_of_the_gpu_and_its_port(tmp_path):
    root = sysfs_gpu(tmp_path, "0000:03:00.0")
    aer = link_health.gpu_aer("00000000:03:00.0", root)
    assert aer["gpu"]["bdf"] == "0000:03:00.0" and aer["gpu"]["correctable"]["BadDLLP"] == 31
    assert aer["gpu"]["nonfatal"] == {"SDES": 0, "TOTAL_ERR_NONFATAL": 0} and "fatal" not in aer["gpu"]
    assert aer["port"] == {"bdf": "0000:00:01.1", "fatal": {"SDES": 1, "TOTAL_ERR_FATAL": 1}}
    assert link_health.aer_counters("0000:09:00.0", root) is None


def test_link_state_and_generations(tmp_path):
    root = sysfs_gpu(tmp_path, "0000:03:00.0", speed="2.5 GT/s PCIe", width="16")
    assert link_health.link_state("0000:03:00.0", root) == {"gen_current": 1, "width_current": 16,
                                                            "gen_max": 5, "width_max": 16}
    assert link_health.link_state("0000:0a:00.0", root)["error"].startswith("GPU not found")
    assert [link_health.link_gen(t) for t in ("8.0 GT/s PCIe", "64.0 GT/s PCIe", "Unknown", None)] == [3, 6, None, None]


@pytest.mark.parametrize("version, taint, flavor", [
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build", None, "open"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023", None, "proprietary"),
    (None, "POE", "proprietary"),
    (None, "OE", "open"),
    (None, None, "unknown"),
])
def test_module_flavor(version, taint, flavor):
    assert link_health.module_flavor(version, taint)[0] == flavor


def test_nvidia_module_reads_version_and_registry(tmp_path):
    proc, module = tmp_path / "proc", tmp_path / "module"
    proc.mkdir()
    module.mkdir()
    (proc / "version").write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build\n")
    (proc / "params").write_text('EnableResizableBar: 1\nRegistryDwords: "ForceP2P=0x11;RMForceP2PType=1"\n'
                                 'RegistryDwordsPerDevice: ""\n')
    assert link_health.nvidia_module(proc, module) == {
        "flavor": "open", "source": "/proc/driver/nvidia/version", "version": "580.95.05",
        "registry_dwords": "ForceP2P=0x11;RMForceP2PType=1"}
    assert link_health.nvidia_module(tmp_path / "x", tmp_path / "y")["flavor"] == "not loaded"


def test_numa_sockets(tmp_path):
    for node, cpus in (("0", "0-63,128-191"), ("1", "64-127,192-255")):
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for cpu, package in (("0", "0"), ("64", "1")):
        (tmp_path / "cpu" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / "cpu" / f"cpu{cpu}" / "topology" / "physical_package_id").write_text(package + "\n")
    assert host.numa_sockets(tmp_path) == {"0": 0, "1": 1}


# ---------------------------------------------------------------------------------------------
# Merging the records into the snapshot
# ---------------------------------------------------------------------------------------------

def test_merge_marks_the_hung_sm_pair_and_keeps_the_best_busy_reading():
    index_of = {("h", 0): 0, ("h", 1): 1}
    link = {"kind": "link_load", "gen_max": 5, "width_current": 16, "width_max": 16}
    report = {"hostname": "h", "sm_peer": [
        {"kind": "sm_peer", "src": 0, "dst": 0, "status": "ok", "store_gbps": 1300.0, "load_gbps": 1200.0,
         "read_latency_us": 0.7},
        {**link, "device": 0, "during": "a", "gen_current": 1},
        {**link, "device": 0, "during": "b", "gen_current": 5},
        {**link, "device": 1, "during": "b", "gen_current": 4}],
        "failures": [{"step": pcie_snapshot.SM_STEP, "detail": "timed out after 80 s during SM peer GPU 0 -> GPU 1",
                      "timed_out": True, "last_src": 0, "last_dst": 1}],
        "nccl": {"devices": [1, 0], "ab": [], "ab_note": "x", "topology": {}}}
    merged = pcie_snapshot.merge_pcie_checks([report], index_of, {"bandwidth": True, "nccl": True})
    pairs = {(p["src"], p["dst"]): p for p in merged["sm_peer"]["pairs"]}
    assert pairs[(0, 0)]["status"] == "ok" and pairs[(0, 1)]["status"] == "hangs"
    assert [(r["gpu"], r["gen_current"], r["during"]) for r in merged["link_under_load"]] == [(0, 5, "b"), (1, 4, "b")]
    assert merged["nccl_checks"] == [{"host": "h", "gpus": [1, 0], "ab": [], "ab_note": "x", "topology": {}}]
    assert pcie_snapshot.merge_pcie_checks([report], index_of, {"bandwidth": False}) == \
        {"sm_peer": None, "link_under_load": None, "nccl_checks": None}


def test_nccl_child_values_sum_exactly():
    from commbench.topology.nccl_child import PATTERN_PERIOD, expected_sum, rank_input

    world, count = 64, 3 * PATTERN_PERIOD
    total = sum(rank_input(r, count) for r in range(world))
    assert bool((total == expected_sum(world, count)).all()) and float(total.max()) < 2 ** 24


@pytest.mark.procs
def test_bad_spec_in_a_child_is_an_error_row():
    result = run_child("commbench.topology.nccl_child", {"rank": 0}, 30)
    assert [r["kind"] for r in result.records] == ["error", "done"]
    assert "KeyError" in result.records[0]["detail"]
