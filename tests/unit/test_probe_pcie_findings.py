"""The PCIe-box findings, islands/placement, NCCL's XML and the inert-settings rules, over the
hand-made fixtures (edited where a fixture does not carry the condition), and their render."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from commbench.topology import islands
from commbench.topology.findings import findings
from commbench.engines import inert_settings as _inert, nccl_version
from commbench.topology import box as boxes
from commbench.topology.nccl_xml import NcclXmlError, parse_graphs, parse_topology
from commbench.topology.pcie_findings import SM_TO_COPY_MIN_RATIO, sm_path_rows, staged_pairs

FIXTURES = Path(__file__).parents[1] / "fixtures"
SNAPSHOTS = FIXTURES / "snapshots"


def load(name: str) -> dict:
    return json.loads((SNAPSHOTS / name).read_text())


def codes(snapshot: dict) -> dict[str, str]:
    return {f["code"]: f["level"] for f in findings(snapshot)}


def of(snapshot: dict, code: str) -> list[dict]:
    return [f for f in findings(snapshot) if f["code"] == code]


@pytest.fixture
def staged():
    return load("pcie-4x-sysmem-staged.json")


@pytest.fixture
def aer():
    return load("pcie-4x-aer-link.json")


@pytest.fixture
def dual():
    return load("pcie-8x-dual-socket.json")


# ---------------------------------------------------------------------------------------------
# P2P through system memory
# ---------------------------------------------------------------------------------------------

def test_sysmem_staged_pairs_are_the_direct_attached_ones(staged):
    assert codes(staged) == {"p2p_sysmem_staged": "WARN", "p2p_sm_latency_high": "WARN", "nvidia_module": "INFO"}
    flagged = {(r["src"], r["dst"]) for r in staged_pairs(staged)}
    # GPUs 0 and 1 share a switch (PIX): their SM path is fine; every pair with GPU 2 or 3 crawls
    assert flagged == {(a, b) for a in range(4) for b in range(4) if a != b and {a, b} != {0, 1}}
    first = of(staged, "p2p_sysmem_staged")[0]
    assert first["message"].startswith("GPU 0 -> GPU 2: SM stores 3.6 / loads 2.1 GB/s vs copy engine 52.3 GB/s "
                                       "(0.07x, below 0.25)")
    assert "ForceP2P=0x11" in first["remedy"] and "/proc/driver/nvidia/params" in first["remedy"]
    assert "14.2 us" in of(staged, "p2p_sm_latency_high")[0]["message"]


def test_a_gpu_with_itself_is_never_flagged(staged):
    s = copy.deepcopy(staged)
    s["sm_peer"]["pairs"] = [p for p in s["sm_peer"]["pairs"] if p["src"] == p["dst"]]
    for p in s["sm_peer"]["pairs"]:
        p.update(store_gbps=0.1, load_gbps=0.1, read_latency_us=99.0)
    assert "p2p_sysmem_staged" not in codes(s) and "p2p_sm_latency_high" not in codes(s)


def test_the_threshold_sits_between_healthy_and_staged(staged):
    ratios = {r["ratio"] for r in sm_path_rows(staged) if r["src"] != r["dst"]}
    assert min(ratios) < SM_TO_COPY_MIN_RATIO / 3 and max(ratios) > SM_TO_COPY_MIN_RATIO * 3


def test_force_p2p_already_set_changes_the_remedy(staged):
    staged["hosts"]["ws4d"]["nvidia_module"]["registry_dwords"] = "ForceP2P=0x11"
    assert of(staged, "p2p_sysmem_staged")[0]["remedy"].startswith("ForceP2P is already set (ForceP2P=0x11)")
    assert codes(staged)["nvidia_force_p2p"] == "INFO"


@pytest.mark.parametrize("status, code, level", [("hangs", "p2p_sm_hangs", "FAIL"), ("fail", "p2p_sm_failed", "WARN")])
def test_sm_kernels_that_hang_or_fail(staged, status, code, level):
    staged["sm_peer"]["pairs"][1] = {"src": 0, "dst": 1, "status": status, "detail": "no completion"}
    assert codes(staged)[code] == level


def test_without_the_copy_measurement_no_ratio_is_made_up(staged):
    staged["bandwidth"] = None
    assert not staged_pairs(staged) and all(r["ratio"] is None for r in sm_path_rows(staged))


# ---------------------------------------------------------------------------------------------
# Collectives: the NCCL A/B, and NCCL's own view
# ---------------------------------------------------------------------------------------------

def test_hang_over_p2p_with_a_correct_control_fails(dual):
    (fault,) = of(dual, "nccl_p2p_fault")
    assert fault["level"] == "FAIL"
    assert fault["message"].startswith("turin8 GPUs [0, 1, 2, 3, 4, 5, 6, 7]: NCCL allreduce of 4B (LL-sized): hangs "
                                       "with P2P, correct with NCCL_P2P_DISABLE=1")
    assert "NCCL_P2P_DISABLE=1" in fault["remedy"]


def test_both_arms_failing_is_inconclusive_not_a_p2p_fault(dual):
    control = next(r for r in dual["nccl_checks"][0]["ab"] if r["size_bytes"] == 4 and r["arm"] == "p2p_disabled")
    control.update(verdict="hangs", detail="rank 3 did not finish")
    found = codes(dual)
    assert "nccl_p2p_fault" not in found and found["nccl_ab_inconclusive"] == "WARN"


def test_one_gpu_ab_is_a_note(dual):
    dual["nccl_checks"][0].update(ab=[], ab_note="needs 2 or more GPUs: NCCL refuses two ranks on one GPU")
    assert codes(dual)["nccl_ab_one_gpu"] == "INFO"


def test_nccl_view_patterns_of_the_turin_case(dual):
    found = {f["code"]: f for f in findings(dual)}
    assert "estimated 0.1 GB/s per channel" in found["nccl_all_sys"]["message"]
    assert found["nccl_two_channels"]["message"] == "turin8: NCCL's ring uses 2 channel(s), its minimum"
    assert "Simple for a 32K allreduce (RING)" in found["nccl_simple_small"]["message"]
    for code, setting in (("nccl_all_sys", "NCCL_P2P_LEVEL=SYS"), ("nccl_two_channels", "NCCL_MIN_NCHANNELS=8"),
                          ("nccl_simple_small", "NCCL_PROTO=LL")):
        assert found[code]["remedy"].startswith("suggestion to measure, not a fix: ") and setting in found[code]["remedy"]


def test_healthy_switch_dump_has_no_nccl_patterns(aer):
    assert not {c for c in codes(aer) if c.startswith("nccl_")}


def test_unreadable_dump_and_failed_run(dual):
    dual["nccl_checks"][0]["topology"].update(graph_xml="<graphs><graph", verdict="hangs", detail="rank 2 stuck")
    found = codes(dual)
    assert found["nccl_dump_unreadable"] == "WARN" and found["nccl_dump_failed"] == "WARN"


def test_one_rank_dump_says_nothing_about_patterns(dual):
    dual["nccl_checks"][0]["topology"]["ranks"] = 1
    assert not {"nccl_all_sys", "nccl_two_channels", "nccl_simple_small"} & set(codes(dual))


def test_xml_fixtures_parse_and_match_the_snapshots(dual, aer):
    turin = (FIXTURES / "nccl" / "turin-8x-graph.xml").read_text()
    assert dual["nccl_checks"][0]["topology"]["graph_xml"] == turin
    assert aer["nccl_checks"][0]["topology"]["graph_xml"] == (FIXTURES / "nccl" / "switch-4x-graph.xml").read_text()
    assert [(g.name, g.nchannels, g.type_intra, g.speed_intra_gbps) for g in parse_graphs(turin)] == [
        ("ring", 2, "SYS", 0.1), ("balanced tree", 2, "SYS", 0.1), ("tree", 0, "SYS", 0.0)]
    topo = parse_topology((FIXTURES / "nccl" / "turin-8x-topo.xml").read_text())
    assert [(c["numaid"], c["vendor"], c["gpus"]) for c in topo["cpus"]] == [
        ("0", "AuthenticAMD", [0, 1, 2, 3]), ("1", "AuthenticAMD", [4, 5, 6, 7])] and topo["gpu_count"] == 8
    with pytest.raises(NcclXmlError, match="root element is <system>"):
        parse_graphs((FIXTURES / "nccl" / "turin-8x-topo.xml").read_text())


# ---------------------------------------------------------------------------------------------
# Islands and placement
# ---------------------------------------------------------------------------------------------

def test_dual_socket_islands_and_placement(dual):
    gpus = list(range(8))
    assert dict(islands.islands(dual, gpus)) == {
        "PCIe switch": [[0, 1, 2, 3], [4, 5, 6, 7]], "root port": [[0, 1, 2, 3], [4, 5, 6, 7]],
        "NUMA node": [[0, 1, 2, 3], [4, 5, 6, 7]], "socket": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    by = {(p.tp, len(p.groups)): p for p in islands.placements(dual)}
    assert by[(4, 1)].groups == ((0, 1, 2, 3),) and by[(4, 1)].levels == ("PCIe switch",)
    assert [islands.cuda_visible_devices(dual, g) for g in by[(4, 2)].groups] == ["0,1,2,3", "4,5,6,7"]
    assert by[(8, 1)].levels == (islands.ACROSS_SOCKETS,) and by[(8, 1)].spans_sockets
    (warn,) = of(dual, "tp_spans_sockets")
    assert warn["message"].startswith("turin8: TP8 on GPUs 0,1,2,3,4,5,6,7 spans sockets")
    assert "run TP4 x 2 replicas (CUDA_VISIBLE_DEVICES=0,1,2,3 and CUDA_VISIBLE_DEVICES=4,5,6,7)" in warn["remedy"]


def test_placement_follows_the_islands_not_the_ordinals(dual):
    # Renumber: switch A holds GPUs 0,2,4,6 and switch B 1,3,5,7 (as CUDA_DEVICE_ORDER can make it)
    side = {g: g % 2 for g in range(8)}
    dual["links"]["matrix"] = [["X" if a == b else "PIX" if side[a] == side[b] else "SYS" for b in range(8)]
                               for a in range(8)]
    for g in dual["gpus"]:
        g["numa_node"] = side[g["index"]]
    by = {(p.tp, len(p.groups)): p for p in islands.placements(dual)}
    assert by[(4, 2)].groups == ((0, 2, 4, 6), (1, 3, 5, 7)) and not by[(4, 2)].spans_sockets
    assert islands.group_level(dual, (0, 1, 2, 3)) == islands.ACROSS_SOCKETS   # what 0,1,2,3 would have done


def test_uneven_islands_cross_where_they_must(dual):
    # 3 GPUs on socket 0, 5 on socket 1: one of the two TP4 groups has to cross
    side = {g: 0 if g < 3 else 1 for g in range(8)}
    dual["links"]["matrix"] = [["X" if a == b else "PIX" if side[a] == side[b] else "SYS" for b in range(8)]
                               for a in range(8)]
    for g in dual["gpus"]:
        g["numa_node"] = side[g["index"]]
    by = {(p.tp, len(p.groups)): p for p in islands.placements(dual)}
    assert by[(4, 1)].groups == ((4, 5, 6, 7),) and by[(4, 1)].levels == ("PCIe switch",)
    assert sorted(by[(4, 2)].levels) == ["PCIe switch", islands.ACROSS_SOCKETS]
    assert any("TP4 on GPUs 0,1,2,3 spans sockets" in f["message"] for f in of(dual, "tp_spans_sockets"))


def test_without_socket_ids_numa_nodes_stand_in():
    s = load("pcie-2x4-numa.json")
    assert not islands.sockets_known(s, list(range(8)))
    assert islands.group_level(s, tuple(range(8))) == islands.ACROSS_NUMA
    assert "socket ids not in this snapshot" in of(s, "tp_spans_sockets")[0]["message"]


def test_nvswitch_box_is_one_nvlink_island():
    s = load("nvswitch-8x-h100.json")
    assert islands.islands(s, list(range(8)))[0] == ("NVLink", [list(range(8))])
    assert not of(s, "tp_spans_sockets")


# ---------------------------------------------------------------------------------------------
# Driver and link health
# ---------------------------------------------------------------------------------------------

def test_aer_link_findings(aer):
    assert codes(aer) == {"aer_uncorrectable": "FAIL", "aer_correctable": "WARN", "pcie_replays": "WARN",
                          "pcie_below_max_under_load": "WARN", "pcie_gen_below_max": "WARN", "nvidia_module": "INFO"}
    assert of(aer, "aer_uncorrectable")[0]["message"] == ("GPU 3 link (port 0000:02:03.0): uncorrectable PCIe errors "
                                                          "since boot: SDES 1")
    assert of(aer, "aer_correctable")[0]["message"] == ("GPU 2 link (GPU side): correctable PCIe errors since boot: "
                                                        "BadTLP 12, BadDLLP 31, Timeout 4")
    assert of(aer, "pcie_below_max_under_load")[0]["message"].startswith("GPU 2 PCIe link at Gen4 x16 of Gen5 x16 "
                                                                         "while busy")


def test_an_idle_downtrained_link_is_cleared_by_a_loaded_reading(aer):
    # GPUs 0 and 2 read Gen1 idle; under load GPU 0 reached Gen5 (cleared), GPU 2 only Gen4 (kept)
    assert [f["message"] for f in of(aer, "pcie_gen_below_max")] == ["GPU 2 PCIe link at Gen1 of Gen5"]
    aer["link_under_load"] = None
    assert len(of(aer, "pcie_gen_below_max")) == 2


def test_module_flavor_is_reported(aer):
    assert of(aer, "nvidia_module")[0]["message"] == ("sw4: nvidia kernel module open 580.95.05 "
                                                      "(/proc/driver/nvidia/version)")


# ---------------------------------------------------------------------------------------------
# Settings that do nothing here
# ---------------------------------------------------------------------------------------------

def inert_settings(snapshot: dict, world: int) -> list:
    return _inert(boxes.read(snapshot, world))


def settings_of(snapshot: dict, world: int) -> set[str]:
    return {r.setting.split(" (")[0] for r in inert_settings(snapshot, world)}


def test_inert_settings_on_sm120_pcie(dual):
    rules = inert_settings(dual, 8)
    assert settings_of(dual, 8) == {
        "vLLM compilation pass fuse_allreduce_rms", "SGLang --enable-flashinfer-allreduce-fusion",
        "vLLM VLLM_ALLREDUCE_USE_SYMM_MEM=1", "SGLang --enable-torch-symm-mem", "vLLM custom allreduce",
        "SGLang custom allreduce"}
    assert all(r.source.startswith(("vLLM 0.34.0", "SGLang 0.5.23", "NCCL 2.29.2")) for r in rules)
    assert "TP 8 without full NVLink" in next(r.why for r in rules if r.setting.startswith("vLLM custom"))
    # at TP2 vLLM's custom allreduce does run on PCIe
    assert not {"vLLM custom allreduce", "SGLang custom allreduce"} & settings_of(dual, 2)


def test_nccl_symmetric_kernels_rule_needs_nccl_2_29(dual):
    assert nccl_version(dual) == (2, 28, 9)
    dual["software"]["nccl"] = "2.29.7"
    rule = next(r for r in inert_settings(dual, 8) if r.setting.startswith("NCCL symmetric kernels"))
    assert "NCCL 2.29.7 here uses its regular kernels" in rule.why and "ebd1e929" in rule.source
    dual["software"]["nccl"] = "unavailable (RuntimeError)"
    assert nccl_version(dual) is None and not any(r.setting.startswith("NCCL") for r in inert_settings(dual, 8))


def test_inert_settings_on_hopper_nvswitch_and_without_gpus():
    hgx = load("nvswitch-8x-h100.json")
    hgx["software"]["nccl"] = "2.30.1"
    assert inert_settings(hgx, 8) == []          # NVLink everywhere, SM 9.0, multicast attribute on
    assert inert_settings({**hgx, "gpus": []}, 8) == []


# ---------------------------------------------------------------------------------------------
# probe --from renders the new sections
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def probe(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")

    def run(*args: str) -> tuple[int, str, str]:
        from commbench.cli import main

        try:
            code = main(["probe", *args])
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.mark.parametrize("name, sections", [
    ("pcie-4x-sysmem-staged.json", ["P2P paths per directed pair", "0 -> 0 (same GPU, no fabric)", "0.07",
                                    "WARN: far below the copy path"]),
    ("pcie-4x-aer-link.json", ["PCIe links while busy", "Gen4 x16 / Gen5 x16 below max", "gpu 47/0/0",
                               "NCCL collective A/B", "healthy: correct with and without P2P"]),
    ("pcie-8x-dual-socket.json", ["NCCL's view of turin8 (8 rank(s)", "typeintra SYS, 0.1 GB/s",
                                  "algo RING, proto Simple", "Islands and placement",
                                  "CUDA_VISIBLE_DEVICES=0,1,2,3 | CUDA_VISIBLE_DEVICES=4,5,6,7", "across sockets",
                                  "NVIDIA kernel module", "Settings that do nothing here at world size 8",
                                  "p2p_fault"]),
])
def test_from_renders_the_pcie_sections(probe, name, sections):
    code, out, err = probe("--from", str(SNAPSHOTS / name))
    assert code == 0, err
    for text in sections:
        assert text in out, text


def test_old_snapshots_render_without_the_new_sections(probe):
    code, out, _ = probe("--from", str(SNAPSHOTS / "pcie-2x4-numa.json"))
    assert code == 0 and "P2P paths per directed pair" not in out and "NCCL collective A/B" not in out
    assert "Islands and placement" in out and "unknown: no package ids" in out


def test_nccl_flag_cannot_rerender(probe):
    code, _, err = probe("--nccl", "--from", "x.json")
    assert code == 2 and err.strip() == ("commbench probe: error: --nccl measures; it cannot be combined with --from "
                                         "(which re-renders a file)")
