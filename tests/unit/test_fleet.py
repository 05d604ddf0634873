"""commbench fleet on recorded runs, in process: the dataset, the outlier rule, the reasons, the
outputs, bad input (one line each, nothing else lost), and the commands that read a fleet."""

from __future__ import annotations

import json
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from commbench.cli import main as cli
from commbench.fleet import outliers
from commbench.fleet.store import FleetDir

DATA = Path(__file__).parents[1] / "data"
CPU_RUN = DATA / "runs" / "cpu-gloo-4rank-a"
PCIE_RUN = DATA / "runs" / "synthetic-pcie-8gpu"
INSPECTOR = DATA / "inspector"
SPECS = Path(__file__).parents[2] / "commbench" / "specs"


def make_run(root: Path, node: str, job: str, source: Path = CPU_RUN, scale: float = 1.0,
             info: dict[str, Any] | None = None) -> Path:
    """A copy of a recorded run as node/job, its latencies times `scale`, run.json fields set."""
    run = root / node / job / source.name
    shutil.copytree(source, run)
    data = json.loads((run / "run.json").read_text())
    data["run_id"] = f"{node}-{job}"
    data.setdefault("env", {}).update({"COMMBENCH_NODE": node, "COMMBENCH_JOB": job})
    data.update(info or {})
    (run / "run.json").write_text(json.dumps(data))
    rows = [json.loads(line) for line in (run / "measurements.jsonl").read_text().splitlines() if line.strip()]
    for row in rows:
        for key, value in row.items():
            if key.endswith("_us") and isinstance(value, (int, float)):
                row[key] = value * scale
    (run / "measurements.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def build(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli(["fleet", "build", *args])
    out, err = capsys.readouterr()
    return code, out, err


def qualify(capsys: pytest.CaptureFixture[str], fleet: Path, *args: str) -> tuple[int, str, str]:
    code = cli(["fleet", "qualify", str(fleet), "--wide", *args])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the rule


def test_the_rule_flags_the_slow_value_and_not_the_spread() -> None:
    rule = outliers.Rule(k=3.5, min_effect_pct=10, min_nodes=3)
    values = {f"n{i}": v for i, v in enumerate([10.0, 10.2, 9.9, 10.1, 10.4, 13.0])}
    assert [f.name for f in outliers.outliers(values, rule)] == ["n5"]
    # Faster is never an outlier; a small effect beyond many MADs is not one either.
    assert outliers.outliers({"a": 10.0, "b": 10.0, "c": 10.0, "d": 5.0}, rule) == []
    assert outliers.outliers({"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.5}, rule) == []
    # Bandwidth: lower is worse.
    assert [f.name for f in outliers.outliers({"a": 50.0, "b": 51.0, "c": 49.5, "d": 20.0}, rule, False)] == ["d"]
    # Too few nodes: nothing compared.
    assert outliers.outliers({"a": 1.0, "b": 100.0}, rule) == []


# ---------------------------------------------------------------- a fleet of recorded runs


@pytest.fixture
def fleet_of_six(tmp_path: Path) -> tuple[Path, Path]:
    """Six copies of a recorded CPU run as six nodes; n4 3x slower; n2 a GPU pair 0->1 at a third
    of the others' probe bandwidth."""
    root = tmp_path / "results"
    for i in range(6):
        bandwidth = 17.0 if i == 2 else 52.0 + i * 0.1
        snapshot = {"bandwidth": {"pairs": [{"src": 0, "dst": 1, "bandwidth_gbps": bandwidth, "latency_us": 2.9},
                                            {"src": 1, "dst": 0, "bandwidth_gbps": 52.0, "latency_us": 2.9}]}}
        make_run(root, f"n{i}", "job7", scale=3.0 if i == 4 else 1.0 + 0.01 * i, info={"snapshot": snapshot})
    return root, tmp_path / "fleet"


def test_build_is_incremental_and_reads_a_run_once(capsys: pytest.CaptureFixture[str], fleet_of_six: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    root, fleet = fleet_of_six
    code, out, _ = build(capsys, str(root), "--out", str(fleet))
    assert code == 0 and "added 6 run(s)" in out
    rows = len(FleetDir(fleet).runs()[0][0].run.rows)
    code, out, _ = build(capsys, str(root), "--out", str(fleet))
    assert code == 0 and "nothing new" in out and "6 run(s) already in the fleet" in out
    make_run(tmp_path / "more", "n6", "job8")
    code, out, _ = build(capsys, str(root), str(tmp_path / "more"), "--out", str(fleet))
    assert "added 1 run(s)" in out and "now 7 run(s) of 7 node(s)" in out
    runs, problems = FleetDir(fleet).runs()
    assert problems == [] and len(runs) == 7 and all(len(r.run.rows) == rows for r in runs)
    assert cli(["fleet", "query", str(fleet), "select count(*) as n, count(distinct node) as nodes from measurements"]) == 0
    assert capsys.readouterr().out.split()[-2:] == [str(7 * rows), "7"]


def test_qualify_names_the_slow_node_and_the_weak_gpu_pair(capsys: pytest.CaptureFixture[str],
                                                           fleet_of_six: tuple[Path, Path], tmp_path: Path) -> None:
    root, fleet = fleet_of_six
    build(capsys, str(root), "--out", str(fleet))
    junit, prom, report = tmp_path / "q.xml", tmp_path / "q.prom", tmp_path / "q.json"
    code, out, _ = qualify(capsys, fleet, "--junit", str(junit), "--prometheus", str(prom), "--json", str(report))
    assert code == 1
    assert "FAIL: n2, n4" in out and "rule: outlier = worse than the group's median by more than 3.5 x" in out
    verdicts = {n["node"]: n for n in json.loads(report.read_text())["nodes"]}
    assert {k for k, v in verdicts.items() if v["status"] == "FAIL"} == {"n2", "n4"}
    assert verdicts["n4"]["reasons"] == ["outlier_vs_fleet"] and verdicts["n2"]["reasons"] == ["outlier_vs_fleet"]
    pair = [c for c in verdicts["n2"]["checks"] if c["status"] == "FAIL"]
    assert len(pair) == 1 and "GPU 0->1: 17 GB/s" in pair[0]["detail"]
    failures = [(case.get("classname"), f.get("type")) for case in ET.parse(junit).iter("testcase")
                for f in case.iter("failure")]
    assert {c for c, _ in failures} == {"commbench.fleet.n2.job7", "commbench.fleet.n4.job7"}
    assert {t for _, t in failures} == {"outlier_vs_fleet"}
    text = prom.read_text()
    assert 'commbench_node_qualified{node="n4",slurm_job_id="job7",nranks="4"' in text
    qualified = {line.split('node="')[1].split('"')[0]: line.split()[-1] for line in text.splitlines()
                 if line.startswith("commbench_node_qualified")}
    assert qualified == {"n0": "1", "n1": "1", "n2": "0", "n3": "1", "n4": "0", "n5": "1"}
    assert 'commbench_gpu_pair_bandwidth_gbs{node="n2",slurm_job_id="job7",nranks="4",gpu="0",peer_gpu="1"} 17' in text
    assert all(line.startswith("#") or "{" in line for line in text.splitlines())


def test_spec_reasons_are_machine_readable(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A run claiming real hardware, 3x slower than recorded, against the PCIe spec: its limits
    violated, a size the spec reads missing; its hangs (outside the spec's backends) a failed
    workload without a spec; a CPU run is no hardware."""
    root = tmp_path / "results"
    make_run(root, "box1", "j", source=PCIE_RUN, scale=3.0, info={"provenance": None})
    make_run(root, "cpu1", "j")
    build(capsys, str(root), "--out", str(tmp_path / "fleet"))
    code, out, _ = qualify(capsys, tmp_path / "fleet", "--spec", str(SPECS / "pcie-8x.toml"), "--json", "-")
    nodes = {n["node"]: n for n in json.loads(out)["nodes"]}
    assert code == 1
    assert nodes["box1"]["reasons"] == ["threshold_violation", "no_data"]
    violated = [c for c in nodes["box1"]["checks"] if c["reason"] == "threshold_violation" and c["status"] == "FAIL"]
    assert [c["check"] for c in violated] == ["spec: latency: nccl latency at 4K", "spec: latency: nccl latency at 32K"]
    assert all(c["source"] for c in violated)
    assert "hardware_check_failed" in nodes["cpu1"]["reasons"]
    code, out, _ = qualify(capsys, tmp_path / "fleet", "--json", "-")
    nodes = {n["node"]: n for n in json.loads(out)["nodes"]}
    assert nodes["box1"]["reasons"] == ["workload_failed"] and nodes["cpu1"]["status"] != "FAIL"


# ---------------------------------------------------------------- bad input: one line each, nothing else lost


def test_bad_inputs_are_one_line_each_and_the_rest_is_built(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "results"
    for i in range(3):
        make_run(root, f"ok{i}", "j1")
    other = root / "other-tool" / "out"   # another tool's output folder
    other.mkdir(parents=True)
    (other / "measurements.jsonl").write_text('{"size": 8, "time": 1.0}\n')
    make_run(root, "dup", "j1")
    twin = make_run(tmp_path / "elsewhere", "dup", "j1")    # a second run claiming node dup, job j1
    data = json.loads((twin / "run.json").read_text())
    data["run_id"] = "another-run"
    (twin / "run.json").write_text(json.dumps(data))
    half = make_run(root, "half", "j1")
    data = json.loads((half / "run.json").read_text())
    data.pop("finished")
    (half / "run.json").write_text(json.dumps(data))
    with open(half / "measurements.jsonl", "a") as handle:
        handle.write('{"backend": "gloo", "mode": "ea')
    (tmp_path / "stray.jsonl").write_text('{"hello": 1}\n')
    code, out, err = build(capsys, str(root), str(tmp_path / "elsewhere"), str(tmp_path / "stray.jsonl"),
                           str(tmp_path / "missing"), "--out", str(tmp_path / "fleet"))
    lines = err.splitlines()
    assert code == 0 and "added 5 run(s)" in out, err
    assert len([l for l in lines if "other-tool" in l and "not a commbench run dir" in l]) == 1
    assert len([l for l in lines if "claims node dup job j1" in l]) == 1
    assert len([l for l in lines if "half-written" in l]) == 1
    assert len([l for l in lines if "incomplete last line" in l]) == 1
    assert len([l for l in lines if "stray.jsonl: not NCCL Inspector output" in l]) == 1
    assert len([l for l in lines if "missing: no such file" in l]) == 1
    assert len(lines) == 6 and "Traceback" not in err
    runs = {r.node: r for r in FleetDir(tmp_path / "fleet").runs()[0]}
    assert set(runs) == {"ok0", "ok1", "ok2", "dup", "half"}
    assert len(runs["half"].run.rows) == len(runs["ok0"].run.rows)


def test_a_fleet_of_two_groups_is_never_compared_across(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "results"
    for i in range(3):
        make_run(root, f"cpu{i}", "j", scale=10.0 if i == 0 else 1.0)
    for i in range(3):
        make_run(root, f"box{i}", "j", source=PCIE_RUN)
    code, out, _ = build(capsys, str(root), "--out", str(tmp_path / "fleet"))
    assert "in 2 group(s)" in out and "never across groups" in out
    code, out, _ = qualify(capsys, tmp_path / "fleet", "--json", str(tmp_path / "v.json"))
    assert "note: 2 groups; each node is compared with its own group only" in out
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["compared_across_groups"] is False and len(report["groups"]) == 2
    for outlier in report["outliers"]:
        group = next(g["runs"] for g in report["groups"] if g["group"] == outlier["group"])
        assert all(o["run_key"] in group for o in outlier["out"])
    assert any(o["run_key"] == "cpu0/j" for c in report["outliers"] for o in c["out"])


def test_bad_fleet_arguments_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli(["fleet", "qualify", str(tmp_path)]) == 2
    assert "not a fleet (no fleet.json)" in capsys.readouterr().err
    (tmp_path / "x").write_text("hello")
    assert cli(["fleet", "build", str(CPU_RUN), "--out", str(tmp_path)]) == 2
    assert "not a fleet and not empty" in capsys.readouterr().err
    assert cli(["fleet", "build", str(tmp_path / "nothing"), "--out", str(tmp_path / "f")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("no run could be read: nothing to build")
    assert not (tmp_path / "f").exists()
    monkeypatch.setitem(sys.modules, "pyarrow", None)   # the extra not installed
    assert cli(["fleet", "build", str(CPU_RUN), "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'commbench[fleet]'" in err


# ---------------------------------------------------------------- Inspector, and commands that read a fleet


def test_inspector_jsonl_joins_the_fleet_as_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = build(capsys, str(INSPECTOR), str(CPU_RUN), "--out", str(tmp_path / "fleet"))
    assert code == 0 and "added 3 run(s)" in out
    assert err.count("\n") == 1 and "gpu-b-5201.jsonl: skipped 1 line(s) that are not Inspector records" in err
    runs = {r.node: r for r in FleetDir(tmp_path / "fleet").runs()[0]}
    a = runs["gpu-a"]
    assert a.job == "777" and a.source == "nccl-inspector"
    by_size = {r.message_bytes: r for r in a.run.rows}
    # Per collective the slowest rank (rank 1, +0.4 us), then the median of the three.
    assert by_size[8192].latency_us == pytest.approx(15.3) and by_size[8192].jitter_samples == 3
    assert by_size[8192].op == "allreduce" and by_size[8192].wrong_elements is None
    assert by_size[8192].extra["source"] == "NCCL Inspector v4.0"


def test_imported_nccl_tests_runs_join_the_fleet(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli(["import-nccl-tests", str(DATA / "nccl-tests" / "h200-8gpu-mpi-graph.json"),
                "--out", str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    code, out, _ = build(capsys, str(tmp_path / "imported"), str(CPU_RUN), "--out", str(tmp_path / "fleet"))
    assert code == 0 and "added 2 run(s)" in out and "imported, 8 ranks" in out
    runs = {r.source: r for r in FleetDir(tmp_path / "fleet").runs()[0]}
    imported = runs["nccl-tests"]
    assert imported.group.startswith("imported, 8 ranks") and imported.run.rows
    assert all(row.extra.get("source", "").startswith("nccl-tests") for row in imported.run.rows)


def test_table_compare_and_report_read_a_fleet(capsys: pytest.CaptureFixture[str], fleet_of_six: tuple[Path, Path]) -> None:
    root, fleet = fleet_of_six
    build(capsys, str(root), "--out", str(fleet))
    assert cli(["table", str(fleet)]) == 0
    assert "runs n0-job7, n1-job7" in capsys.readouterr().out
    assert cli(["compare", f"{fleet}#n0", f"{fleet}#n4/job7", "--out", str(root / "cmp")]) == 0
    out = " ".join(capsys.readouterr().out.split())   # prose is wrapped to the terminal
    assert "A = n0-job7" in out and "B = n4-job7" in out and "+200.0%" in out
    assert cli(["compare", str(fleet), f"{fleet}#n4"]) == 2
    assert "6 runs of a fleet; name one" in capsys.readouterr().err
    assert cli(["compare", f"{fleet}#nobody", f"{fleet}#n0"]) == 2
    assert "no run of the fleet is node, node/job or run id 'nobody'" in capsys.readouterr().err
    assert cli(["report", str(fleet), "--out", str(root / "page")]) == 0
    assert "1 FAIL" not in capsys.readouterr().out
    assert not (fleet / "fleet.html").exists()     # analysis never writes into its input
    page = (root / "page" / "fleet.html").read_text()
    assert 'id="node-n4-job7"' in page and "outlier_vs_fleet" in page and "<img" in page


# ---------------------------------------------------------------- a fleet as untrusted as a run dir (issue 56)


def one_line(err: str, *words: str) -> str:
    """The command's one line on stderr (no traceback), holding every one of `words`."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def rewrite_runs(fleet: Path, change: Any) -> None:
    """The fleet's run table with its records changed by change(records) -> records, written as
    a build writes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from commbench.fleet.store import RUN_COLUMNS, _schema

    records = pq.read_table(fleet / "runs.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist(change(records), schema=_schema(pa, RUN_COLUMNS)), fleet / "runs.parquet")


@pytest.fixture
def fleet_of_three(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Path:
    root = tmp_path / "results"
    for i in range(3):
        make_run(root, f"n{i}", "j")
    assert build(capsys, str(root), "--out", str(tmp_path / "fleet"))[0] == 0
    return tmp_path / "fleet"


def test_a_second_build_while_one_writes_is_refused_and_no_run_is_lost(
        capsys: pytest.CaptureFixture[str], fleet_of_three: Path, tmp_path: Path) -> None:
    from commbench.results import LOCK_FILE, RunDir

    make_run(tmp_path / "more", "n3", "j")
    held = RunDir(fleet_of_three).lock(busy="another fleet build is writing it")   # a build in progress
    try:
        code, out, err = build(capsys, str(tmp_path / "more"), "--out", str(fleet_of_three))
        assert code == 2 and out == ""
        one_line(err, str(fleet_of_three), "another fleet build is writing it (pid ")
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        RunDir(fresh).lock(busy="another fleet build is writing it")   # a first build of a new fleet
        assert (fresh / LOCK_FILE).exists()
        code, _, err = build(capsys, str(tmp_path / "more"), "--out", str(fresh))
        assert code == 2 and "another fleet build is writing it" in err
    finally:
        held.release()
    code, out, _ = build(capsys, str(tmp_path / "more"), "--out", str(fleet_of_three))
    assert code == 0 and "now 4 run(s) of 4 node(s)" in out
    assert not (fleet_of_three / LOCK_FILE).exists()


def test_fleet_query_only_reads_the_fleet(capsys: pytest.CaptureFixture[str], fleet_of_three: Path,
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "secret.txt"
    outside.write_text("secret\n")
    before = sorted(p.name for p in tmp_path.iterdir()) + sorted(p.name for p in fleet_of_three.rglob("*"))
    for sql, words in [
            (f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'", ["one SELECT statement", "COPY"]),
            (f"COPY (SELECT 1 AS run_key) TO '{fleet_of_three / 'runs.parquet'}' (FORMAT parquet, USE_TMP_FILE false)",
             ["COPY"]),
            (f"SELECT * FROM read_text('{outside}')", ["disabled"]),
            (f"SELECT * FROM read_csv('{outside}')", ["disabled"]),
            (f"ATTACH '{tmp_path / 'made.db'}'", ["ATTACH"]),
            ("SET enable_external_access = true", ["SET"]),
            ("SELECT 1; SELECT 2", ["SELECT, SELECT"]),
            ("INSTALL httpfs", ["only reads"]),
            ("", ["an empty query"]), ("  ; ", ["an empty query"]), ("-- nothing", ["an empty query"]),
            ("SELEC 1", ["query: Parser Error"])]:
        assert cli(["fleet", "query", str(fleet_of_three), sql]) == 2, sql
        one_line(capsys.readouterr().err, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) + sorted(p.name for p in fleet_of_three.rglob("*")) == before
    assert cli(["fleet", "query", str(fleet_of_three), "select count(*) as runs from runs"]) == 0
    assert capsys.readouterr().out.split()[-1] == "3"


def test_fleet_query_fetches_no_more_rows_than_it_prints(capsys: pytest.CaptureFixture[str],
                                                         fleet_of_three: Path) -> None:
    from commbench.fleet.command import DEFAULT_LIMIT

    # A row past the first 10^6 raises: fetched, the query would fail (fast, not with gigabytes).
    endless = ("select case when range < 1000000 then range else error('fetched past the limit') end as n "
               "from range(100000000)")
    assert cli(["fleet", "query", str(fleet_of_three), endless, "--wide"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"(the first {DEFAULT_LIMIT:,} rows; more were not fetched: --limit N")
    assert len(out) == DEFAULT_LIMIT + 3 and out[2].strip() == "0"   # header, rule, rows, the line
    assert cli(["fleet", "query", str(fleet_of_three), "select range as n from range(3)", "--limit", "3"]) == 0
    assert capsys.readouterr().out.split() == ["n", "─", "0", "1", "2"]
    for limit in ("0", "-1", "100001"):
        assert cli(["fleet", "query", str(fleet_of_three), "select 1", "--limit", limit]) == 2
        one_line(capsys.readouterr().err, "--limit must be from 1 to 100,000 rows")


def test_a_damaged_fleet_file_is_one_line(capsys: pytest.CaptureFixture[str], fleet_of_three: Path) -> None:
    (measurements,) = (fleet_of_three / "measurements").glob("*.parquet")
    data = measurements.read_bytes()
    measurements.write_bytes(data[: len(data) // 2] + b"\0" * 64 + data[len(data) // 2 + 64:])
    assert cli(["fleet", "qualify", str(fleet_of_three)]) == 2
    one_line(capsys.readouterr().err, str(fleet_of_three), "a file of the fleet cannot be read")
    measurements.write_bytes(b"PAR1 not a parquet file")
    assert cli(["fleet", "query", str(fleet_of_three), "select 1"]) == 2
    one_line(capsys.readouterr().err, "a file of the fleet cannot be read")
    (fleet_of_three / "runs.parquet").write_bytes(b"\0" * 100)
    assert cli(["table", str(fleet_of_three)]) == 2
    one_line(capsys.readouterr().err, "runs.parquet: not a fleet run table")


def test_stored_runs_are_checked_as_run_dirs_are(capsys: pytest.CaptureFixture[str], fleet_of_three: Path) -> None:
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000

    def hostile(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records[0]["info_json"] = deep                       # nested 100,000 deep
        records[1]["node"] = "\x1b]0;owned\x07n1\x1b[2J\u202e"   # retitles the terminal, clears it
        records[2]["job"] = "j\r\n\x1b[31mred"
        return records + [dict(records[2]), {**records[2], "run_key": None}]   # a key twice; no key

    rewrite_runs(fleet_of_three, hostile)
    code, out, err = qualify(capsys, fleet_of_three, "--json", "-")
    assert code == 0 and "\x1b" not in out + err and "\x07" not in out + err and "\u202e" not in out + err
    nodes = json.loads(out)["nodes"]
    # 2 runs, not 3; names made safe as a build makes them
    assert sorted((n["node"], n["job"]) for n in nodes) == [("0_ownedn1_2J", "j"), ("n2", "j___31mred")], nodes
    warnings = err.splitlines()
    assert len(warnings) == 3 and "Traceback" not in err
    assert any("n0/j: its stored run.json is bad" in w and "nested deeper than" in w for w in warnings)
    assert any("record 3 skipped: run key 'n2/j' again" in w for w in warnings)
    assert any("record 4 skipped: run_key is None, not text" in w for w in warnings)
    code, out, _ = qualify(capsys, fleet_of_three)
    assert "2 run(s) of 2 node(s)" in out and "\x1b" not in out
    assert cli(["fleet", "query", str(fleet_of_three), "select node from runs order by node"]) == 0
    assert "\x1b" not in capsys.readouterr().out


def test_build_finds_runs_at_any_depth_and_cleans_what_it_echoes(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    root = tmp_path / "results"
    deep = root.joinpath(*[f"d{i}" for i in range(13)])
    make_run(deep, "far", "j")
    (root / "evil\x1b]0;owned\x07\x1b[2J").mkdir()
    (root / "evil\x1b]0;owned\x07\x1b[2J" / "measurements.jsonl").write_text("{}\n")
    code, out, err = build(capsys, str(root), "--out", str(tmp_path / "fleet"))
    assert code == 0 and "added 1 run(s)" in out
    assert "\x1b" not in err + out and "\x07" not in err
    one_line(err, "evil]0;owned", "not a commbench run dir")
    assert [r.node for r in FleetDir(tmp_path / "fleet").runs()[0]] == ["far"]
