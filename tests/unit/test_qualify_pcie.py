"""qualify's PCIe-box checks: read from a probe snapshot (--snapshot), thresholds and sources
from [fabric.<check>] in the spec, off unless the spec turns them on, bad input exits 2."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.analysis.qualify import FAIL, PASS, WARN, check_aer, check_link_under_load, check_links, check_nccl_ab, \
    check_nccl_view, check_sm_path, check_tp_socket, load_spec

ROOT = Path(__file__).parents[1]
RUN = ROOT / "data" / "runs" / "synthetic-pcie-8gpu"
SNAPSHOTS = ROOT / "fixtures" / "snapshots"
PCIE_SPEC = ROOT.parent / "commbench" / "specs" / "pcie-8x.toml"
NVSWITCH_SPEC = ROOT.parent / "commbench" / "specs" / "nvswitch-8x-h100-h200.toml"
NEW_CHECKS = ("SM peer path close to the copy-engine path", "NCCL allreduce correct with and without P2P",
              "PCIe links at max while busy", "no PCIe link errors (AER, replays)", "NCCL's topology view",
              "TP group inside one socket")


def load(name: str) -> dict:
    return json.loads((SNAPSHOTS / name).read_text())


def qualify(capsys, *args: str) -> tuple[int, str, str]:
    code = cli(["qualify", *args, "--wide"])   # one line per check, to read them by line
    out = capsys.readouterr()
    return code, out.out, out.err


def line(out: str, check: str) -> str:
    return next(l for l in out.splitlines() if check in l and l.startswith(("PASS", "WARN", "FAIL")))


@pytest.mark.parametrize("snapshot, expected", [
    ("pcie-8x-dual-socket.json", {NEW_CHECKS[0]: PASS, NEW_CHECKS[1]: FAIL, NEW_CHECKS[2]: PASS, NEW_CHECKS[3]: PASS,
                                  NEW_CHECKS[4]: WARN, NEW_CHECKS[5]: WARN}),
    ("pcie-4x-aer-link.json", {NEW_CHECKS[0]: PASS, NEW_CHECKS[1]: PASS, NEW_CHECKS[2]: FAIL, NEW_CHECKS[3]: FAIL,
                               NEW_CHECKS[4]: PASS}),
    ("pcie-4x-sysmem-staged.json", {NEW_CHECKS[0]: FAIL, NEW_CHECKS[1]: WARN, NEW_CHECKS[2]: PASS,
                                    NEW_CHECKS[3]: PASS, NEW_CHECKS[4]: WARN}),
])
def test_pcie_spec_over_the_fixtures(capsys, snapshot, expected):
    code, out, err = qualify(capsys, "--spec", str(PCIE_SPEC), str(RUN), "--snapshot", str(SNAPSHOTS / snapshot))
    assert code == 1, err       # the synthetic run itself has wrong and hung rows
    for check, status in expected.items():
        assert line(out, check).startswith(status), line(out, check)
    # every new check prints the published figure behind it
    sources = out.split("where the thresholds come from:")[1]
    for check in expected:
        assert f"  {check}: " in sources


def test_details_name_pairs_sizes_and_gpus(capsys):
    _, out, _ = qualify(capsys, "--spec", str(PCIE_SPEC), str(RUN), "--snapshot",
                        str(SNAPSHOTS / "pcie-4x-sysmem-staged.json"))
    assert re.search(r"below 0.25x of the copy engine: 0->2 0.07x, 0->3 0.07x", line(out, NEW_CHECKS[0]))
    _, out, _ = qualify(capsys, "--spec", str(PCIE_SPEC), str(RUN), "--snapshot",
                        str(SNAPSHOTS / "pcie-8x-dual-socket.json"))
    assert "turin8 4B: hangs with P2P, correct with NCCL_P2P_DISABLE=1" in line(out, NEW_CHECKS[1])
    assert "TP8 on turin8 GPUs 0,1,2,3,4,5,6,7: across sockets" in line(out, NEW_CHECKS[5])


def test_thresholds_come_from_the_spec(tmp_path):
    dual = load("pcie-8x-dual-socket.json")
    assert check_sm_path(dual, {}).status == PASS
    strict = check_sm_path(dual, {"min_ratio": 0.9, "source": "mine"})
    assert strict.status == FAIL and strict.source == "mine" and "below 0.9x" in strict.detail
    assert check_sm_path(dual, {"max_read_latency_us": 2.0}).detail.startswith("read latency above 2 us: 0->4 2.31 us")
    aer = load("pcie-4x-aer-link.json")
    aer["gpus"][3]["aer"]["port"]["nonfatal"]["SDES"] = 0
    assert check_aer(aer, {}).status == WARN
    assert check_aer(aer, {"max_correctable": 100}).status == PASS


def test_not_probed_is_a_warn_never_a_pass():
    old = load("pcie-2x4-numa.json")   # taken without --bandwidth --nccl, before AER reads
    for check in (check_sm_path, check_nccl_ab, check_link_under_load, check_aer, check_nccl_view):
        result = check(old, {})
        assert result.status == WARN and result.detail.startswith("not probed"), (check.__name__, result.detail)
    one = load("h200-1gpu.json")
    one["sm_peer"] = {"method": "m", "pairs": [{"src": 0, "dst": 0, "status": "ok", "store_gbps": 1.0,
                                                "load_gbps": 1.0, "read_latency_us": 1.0}]}
    assert check_sm_path(one, {}).detail == "not probed: fewer than two GPUs (a GPU with itself measures no fabric)"
    assert check_link_under_load({**one, "link_under_load": []}, {}).detail == ("not probed: no GPU link was read "
                                                                                 "while busy")
    one["nccl_checks"] = [{"host": "vm", "gpus": [0], "ab": [], "ab_note": "needs 2 or more GPUs: NCCL refuses two "
                                                                            "ranks on one GPU", "topology": {"ranks": 1}}]
    assert check_nccl_ab(one, {}).detail.startswith("not probed: needs 2 or more GPUs")
    assert check_nccl_view(one, {}).detail == "not probed: NCCL ran with one rank and saw one GPU"
    assert check_tp_socket(one, {}, 8).detail == "not probed: TP8 needs more than the 1 GPUs of vm"


def test_a_loaded_reading_clears_an_idle_generation():
    aer = load("pcie-4x-aer-link.json")   # GPU 0 idles at Gen1 and reached Gen5 under load; GPU 2 did not
    assert check_links(aer).detail == ("below max generation (normal when idle: re-probe under load): "
                                       "GPU 2 Gen1 of Gen5")
    healed = copy.deepcopy(aer)
    healed["link_under_load"][2].update(gen_current=5)
    assert check_links(healed).status == PASS


def test_pcie_checks_are_off_unless_the_spec_turns_them_on(capsys):
    _, out, _ = qualify(capsys, "--spec", str(NVSWITCH_SPEC), str(RUN), "--snapshot",
                        str(SNAPSHOTS / "pcie-8x-dual-socket.json"))
    assert not any(check in out for check in NEW_CHECKS)
    assert not load_spec(NVSWITCH_SPEC).fabric


def test_shipped_pcie_spec_sources_every_fabric_threshold():
    spec = load_spec(PCIE_SPEC)
    assert {k for k, v in spec.checks.items() if v} >= {"p2p_sm_path", "nccl_collective_ab", "link_under_load",
                                                         "aer_clean", "nccl_topology", "tp_within_socket"}
    assert spec.fabric["p2p_sm_path"] == {"min_ratio": 0.25, "max_read_latency_us": 5.0,
                                          "source": spec.fabric["p2p_sm_path"]["source"]}
    assert all(entry.get("source") for entry in spec.fabric.values()) and len(spec.fabric) == 6


@pytest.mark.parametrize("body, message", [
    ("[fabric.p2p_sm_paths]\nsource = 'x'\n", "unknown key 'p2p_sm_paths' in [fabric] (did you mean 'p2p_sm_path'?)"),
    ("[fabric.p2p_sm_path]\nmin_ration = 0.3\n", "unknown key 'min_ration' in [fabric.p2p_sm_path]"),
    ("[fabric.aer_clean]\nmax_correctable = 'many'\n", "[fabric.aer_clean] max_correctable must be a non-negative"),
    ("fabric = 3\n", "[fabric] must be a table, got 3"),
])
def test_spec_typos_in_fabric_exit_2(tmp_path, capsys, body, message):
    spec = tmp_path / "bad.toml"
    spec.write_text(body)
    code, _, err = qualify(capsys, "--spec", str(spec), str(RUN))
    assert code == 2 and message in err and "\n" not in err.strip()


def test_bad_snapshot_file_exits_2(tmp_path, capsys):
    code, _, err = qualify(capsys, "--spec", str(PCIE_SPEC), str(RUN), "--snapshot", str(tmp_path / "none.json"))
    assert code == 2 and "none.json: no such file" in err and len(err.strip().splitlines()) == 1


def test_without_a_snapshot_the_run_json_one_is_used(capsys):
    # the synthetic run's own snapshot (taken by the sweep, no --bandwidth/--nccl): every new check is not probed
    _, out, _ = qualify(capsys, "--spec", str(PCIE_SPEC), str(RUN))
    for check in NEW_CHECKS[:5]:
        assert line(out, check).startswith("WARN") and "not probed" in line(out, check)
