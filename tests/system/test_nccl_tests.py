"""commbench import-nccl-tests: nccl-tests' all_reduce_perf output (text and -J JSON) as a results dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from commbench.cli import main as cli
from commbench.analysis.curves import build_curves, is_failed_check
from commbench.analysis.nccl_tests_import import read_sources, rows_for
from commbench.analysis.nccl_tests_format import parse_nccl_tests_args, printed_tolerance, read_output, strtol
from commbench.results import CSV_FILE, NO_WORK, OK, RUN_FILE, WRONG
from commbench.runs import load_run
from helpers import rows as rows_of, run_cli

DATA = Path(__file__).parents[1] / "data" / "nccl-tests"
FIXTURES = sorted(p for p in DATA.iterdir() if p.suffix in (".txt", ".json"))
GRAPH8_JSON, GRAPH8_TXT = DATA / "h200-8gpu-mpi-graph.json", DATA / "h200-8gpu-mpi-graph.txt"
ONE_JSON, ONE_TXT = DATA / "h200-1gpu-graph.json", DATA / "h200-1gpu-graph.txt"
PERITER_JSON, PERITER_TXT = DATA / "h200-8gpu-mpi-eager-periter.json", DATA / "h200-8gpu-mpi-eager-periter.txt"
NOCHECK_TXT = DATA / "h200-8gpu-threads-eager-nocheck.txt"


def _import(tmp_path: Path, *files: Path, extra: list[str] | None = None, out: str = "run") -> Path:
    target = tmp_path / out
    assert cli(["import-nccl-tests", *map(str, files), "--out", str(target), *(extra or [])]) == 0
    return target


def _usage_error(capsys, argv: list[str]) -> str:
    """Exit status 2 and exactly one line on stderr; returns that line."""
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err.strip()


def _json_variant(tmp_path: Path, name: str, change) -> Path:
    data = json.loads(GRAPH8_JSON.read_text())
    change(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- the parser on every fixture

@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_every_fixture_parses_whole(path: Path) -> None:
    out = read_output(path)
    assert out.complete and out.results
    assert out.program is None or out.program.startswith("all_reduce_perf")
    assert out.world_size() >= 1 and out.ranks
    for row in out.results:
        assert set(row.placements) == {"out_of_place", "in_place"}
        assert row.size_bytes > 0 and row.type_name
        for p in row.placements.values():
            assert p.time_us is not None and p.time_us > 0
            assert (p.wrong is None) == (out.config.validation == 0)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_every_fixture_imports_and_reports(tmp_path: Path, path: Path) -> None:
    extra = ["--average", "1"] if path.suffix == ".txt" else []
    run = _import(tmp_path, path, extra=extra)
    rows = rows_of(run)
    out = read_output(path)
    assert len(rows) == 2 * len(out.results)
    assert {r["backend"] for r in rows} == {"nccl-tests:out-of-place", "nccl-tests:in-place"}
    assert all(r["world_size"] == out.world_size() for r in rows)
    assert cli(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.html").exists() and (run / CSV_FILE).exists()


def test_text_and_json_of_one_run_agree_to_the_printed_digits() -> None:
    for text_path in (GRAPH8_TXT, ONE_TXT, PERITER_TXT):
        text, js = read_output(text_path), read_output(text_path.with_suffix(".json"))
        assert text.json_companion == js.path.name
        assert [r.size_bytes for r in text.results] == [r.size_bytes for r in js.results]
        for t_row, j_row in zip(text.results, js.results):
            for name, t in t_row.placements.items():
                j = j_row.placements[name]
                assert abs(t.time_us - j.time_us) <= printed_tolerance(j.time_us)
                assert abs(t.busbw_gbps - j.busbw_gbps) <= printed_tolerance(j.busbw_gbps, 6)


def test_header_facts_of_the_8_gpu_run() -> None:
    text, js = read_output(GRAPH8_TXT), read_output(GRAPH8_JSON)
    assert text.nccl_tests_version == "2.19.6" and text.nccl_library == 22809 == js.nccl_library
    assert text.world_size() == js.world_size() == 8
    assert len(text.ranks) == 8 and len(js.ranks) == 8          # MPI: one JSON device entry per process
    assert text.ranks[3].pci_bus_id == "0000:5d:00" and text.ranks[3].name == "NVIDIA H200"
    for out in (text, js):
        c = out.config
        assert (c.nthreads, c.ngpus, c.min_bytes, c.max_bytes, c.step_factor) == (1, 1, 4096, 256 << 20, 2)
        assert (c.iters, c.agg_iters, c.warmup_iters, c.validation, c.graph_launches) == (20, 1, 1, 1, 100)
    assert js.options()["a"] == "3" and js.json_version == 3
    assert text.out_of_bounds == 0 and js.out_of_bounds == 0


def test_threads_run_lists_every_rank_in_the_text_only() -> None:
    out = read_output(NOCHECK_TXT)
    assert out.config.nthreads == 8 and out.processes == 1 and out.timers == 8 and out.world_size() == 8
    assert all(p.wrong is None for r in out.results for p in r.placements.values())


def test_one_entry_per_process_in_json_counts_threads_and_gpus(tmp_path: Path) -> None:
    def threads(data):
        data["config"]["nthreads"], data["config"]["devices"] = 8, data["config"]["devices"][:1]
    out = read_output(_json_variant(tmp_path, "t8.json", threads))
    assert out.processes == 1 and out.timers == 8 and out.world_size() == 8


def test_nccl_tests_argument_parsing_matches_getopt_long() -> None:
    argv = ["all_reduce_perf", "-b", "4K", "-a3", "--cudagraph=100", "--iter", "50", "-h", "--check", "0"]
    assert parse_nccl_tests_args(argv) == {"b": "4K", "a": "3", "G": "100", "n": "50", "c": "0"}
    assert parse_nccl_tests_args(["x", "--a", "2"]) == {}      # ambiguous prefix (agg_iters, average)
    assert (strtol("0x10"), strtol("010"), strtol(" 7 "), strtol("-3"), strtol("abc")) == (16, 8, 7, -3, 0)


def test_nccl_log_lines_and_cycles_in_the_table(tmp_path: Path) -> None:
    lines = GRAPH8_TXT.read_text().splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith("        4096")][0]
    rows = [line for line in lines if line.startswith(" ") and "bfloat16" in line]
    noisy = (lines[:table] + ["h200-07:41211:41290 [0] NCCL INFO Channel 00/24 : 0 1 2 3 4 5 6 7"]
             + rows + rows[:3] + lines[table + len(rows):])
    path = tmp_path / "noisy.txt"
    path.write_text("\n".join(noisy) + "\n")
    out = read_output(path)
    assert len(out.results) == len(rows) + 3
    assert [r.cycle for r in out.results[-4:]] == [0, 1, 1, 1]


def test_datatype_all_gives_one_curve_per_dtype(tmp_path: Path) -> None:
    lines = GRAPH8_TXT.read_text().splitlines()
    rows = [i for i, line in enumerate(lines) if "bfloat16" in line and not line.startswith("#")]
    half = [lines[i].replace("bfloat16", "    half") for i in rows]
    path = _write(tmp_path / "all.txt", "\n".join(lines[:rows[-1] + 1] + half + lines[rows[-1] + 1:]) + "\n")
    out = read_output(path)
    assert [r.type_name for r in out.results].count("half") == len(rows)
    assert all(r.cycle == 0 for r in out.results)
    imported = rows_of(_import(tmp_path, path, extra=["--average", "3"]))
    assert {r["dtype"] for r in imported} == {"bf16", "fp16"}


# ---------------------------------------------------------------- mapping onto commbench's fields

def test_max_over_ranks_is_the_headline(tmp_path: Path) -> None:
    rows = rows_of(_import(tmp_path, GRAPH8_JSON))
    js = read_output(GRAPH8_JSON)
    assert len(rows) == 34
    first = next(r for r in rows if r["backend"] == "nccl-tests:out-of-place" and r["message_bytes"] == 4096)
    p = js.results[0].placements["out_of_place"]
    assert first["latency_us"] == p.time_us == first["extra"]["nccl_tests_time_us"]
    assert first["latency_rank_mean_us"] is None
    assert (first["algbw_gbps"], first["busbw_gbps"]) == (p.algbw_gbps, p.busbw_gbps)
    assert (first["mode"], first["iterations"], first["ops_per_graph"], first["dtype"]) == ("graph", 100, 20, "bf16")
    assert first["status"] == OK and first["wrong_elements"] == 0 and first["checked_calls"] == 1
    assert "timed calls themselves were not checked" in first["extra"]["check"]
    assert "maximum" in first["extra"]["nccl_tests_time_is"] and first["extra"]["nccl_tests_flags"]["-a"] == 3
    assert first["reason"] is None and first["env_setting"] == {}


def test_mean_over_ranks_is_not_the_headline_and_unvalidated_rows_do_not_look_checked(tmp_path: Path) -> None:
    rows = rows_of(_import(tmp_path, NOCHECK_TXT, extra=["--average", "1"]))
    for r in rows:
        assert r["latency_us"] is None and r["latency_rank_mean_us"] == r["extra"]["nccl_tests_time_us"]
        assert r["algbw_gbps"] is None and r["extra"]["nccl_tests_algbw_gbps"] is not None
        assert r["wrong_elements"] is None and r["checked_calls"] == 0
        assert "not validated" in r["reason"] and "-a 1" in r["reason"]
        assert "validation did not run" in r["extra"]["check"]
    assert build_curves(load_run(tmp_path / "run").rows) == []   # nothing to rank without the slowest rank


@pytest.mark.parametrize("mode,key", [(0, "rank 0"), (2, "minimum")])
def test_rank0_and_min_stay_in_extra(tmp_path: Path, mode: int, key: str) -> None:
    def average(data):
        data["args"][data["args"].index("-a") + 1] = str(mode)
    rows = rows_of(_import(tmp_path, _json_variant(tmp_path, f"a{mode}.json", average)))
    for r in rows:
        assert r["latency_us"] is None and r["latency_rank_mean_us"] is None
        assert key in r["extra"]["nccl_tests_time_is"] and f"-a {mode}" in r["reason"]


def test_default_average_is_the_mean_when_the_json_args_have_no_a(tmp_path: Path) -> None:
    def drop(data):
        i = data["args"].index("-a")
        del data["args"][i:i + 2]
    rows = rows_of(_import(tmp_path, _json_variant(tmp_path, "noa.json", drop)))
    assert all(r["latency_us"] is None and r["latency_rank_mean_us"] for r in rows)
    info = json.loads((tmp_path / "run" / RUN_FILE).read_text())
    assert info["imports"][0]["average_from"].startswith("nccl-tests' default")


def test_one_thread_driving_every_gpu_is_one_timer_whatever_a_says(tmp_path: Path) -> None:
    def one_thread(data):
        data["config"]["ngpus"], data["config"]["devices"] = 8, data["config"]["devices"][:1]
        data["args"][data["args"].index("-a") + 1] = "1"
    rows = rows_of(_import(tmp_path, _json_variant(tmp_path, "g8.json", one_thread)))
    assert all(r["world_size"] == 8 and r["latency_us"] == r["extra"]["nccl_tests_time_us"] for r in rows)
    assert "one host timer" in rows[0]["extra"]["nccl_tests_time_is"]


def test_one_gpu_rows_are_no_work(tmp_path: Path) -> None:
    rows = rows_of(_import(tmp_path, ONE_TXT))       # one timer: no --average needed
    assert all(r["status"] == NO_WORK and r["world_size"] == 1 for r in rows)
    in_place = [r["latency_us"] for r in rows if r["backend"] == "nccl-tests:in-place"]
    assert max(in_place) < 0.2 and "world size 1" in rows[0]["reason"]


def test_cputime_is_never_a_latency(tmp_path: Path) -> None:
    def cputime(data):
        data["args"] += ["-C", "1"]
        for entry in data["results"]:
            for name in ("out_of_place", "in_place"):
                entry[name]["cpu_time"] = entry[name].pop("time")
    rows = rows_of(_import(tmp_path, _json_variant(tmp_path, "c1.json", cputime)))
    assert all(r["latency_us"] is None and r["latency_rank_mean_us"] is None for r in rows)
    assert "enqueue" in rows[0]["reason"] and rows[0]["extra"]["nccl_tests_flags"]["-C"] == 1


def test_grouped_and_blocking_calls_carry_a_note(tmp_path: Path) -> None:
    def grouped(data):
        data["config"]["aggregated_iterations"], data["config"]["blocking_collectives"] = 4, "true"
        data["args"] += ["-m", "4", "-z", "2"]
    rows = rows_of(_import(tmp_path, _json_variant(tmp_path, "m4.json", grouped)))
    assert rows[0]["ops_per_graph"] == 80 and rows[0]["extra"]["nccl_tests_flags"]["-z"] == 2
    assert "-m 4" in rows[0]["reason"] and "-z 2" in rows[0]["reason"]


def test_a_run_without_placements_is_refused(tmp_path: Path, capsys) -> None:
    def empty(data):
        for entry in data["results"]:
            entry["out_of_place"] = entry["in_place"] = None
    path = _json_variant(tmp_path, "none.json", empty)
    assert "no out-of-place or in-place" in _usage_error(capsys, ["import-nccl-tests", str(path), "--out",
                                                                  str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_wrong_elements_make_a_wrong_row(tmp_path: Path) -> None:
    lines = GRAPH8_TXT.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("       65536"))
    lines[i] = lines[i][:-6] + "%6g" % 12
    path = tmp_path / "wrong.txt"
    path.write_text("\n".join(lines) + "\n")
    rows = rows_of(_import(tmp_path, path, extra=["--average", "3"]))
    bad = [r for r in rows if r["status"] == WRONG]
    assert len(bad) == 1 and bad[0]["wrong_elements"] == 12 and bad[0]["backend"] == "nccl-tests:in-place"
    assert bad[0]["message_bytes"] == 65536 and "12 wrong" in bad[0]["reason"]
    run = load_run(tmp_path / "run")
    assert any(is_failed_check(r) for r in run.rows)
    curve = next(c for c in build_curves(run.rows) if c.backend == "nccl-tests:in-place")
    assert 65536 in curve.failed_sizes and 65536 not in curve.sizes()


def test_per_iteration_samples_become_the_jitter_fields(tmp_path: Path) -> None:
    rows = rows_of(_import(tmp_path, PERITER_JSON))
    js = read_output(PERITER_JSON)
    times = sorted(js.results[0].placements["out_of_place"].per_iteration.times_us)
    first = rows[0]
    assert first["mode"] == "eager" and first["iterations"] == 20 and first["ops_per_graph"] == 1
    assert first["jitter_samples"] == 20 and first["jitter_min_us"] == times[0] and first["jitter_max_us"] == times[-1]
    assert first["jitter_p10_us"] <= first["jitter_p50_us"] <= first["jitter_p90_us"] <= first["jitter_p99_us"]
    text_rows = rows_of(_import(tmp_path, PERITER_TXT, extra=["--average", "3"], out="text"))
    assert text_rows[0]["jitter_min_us"] == pytest.approx(times[0], abs=0.006)
    assert text_rows[0]["jitter_p10_us"] is None   # the table prints min, max, p99 and cv only


def test_settings_tag_rows_and_are_checked_against_the_json_environment(tmp_path: Path, capsys) -> None:
    def proto(data):
        data["env"].append("NCCL_PROTO=LL")
    path = _json_variant(tmp_path, "ll.json", proto)
    rows = rows_of(_import(tmp_path, path, extra=["--setting", "NCCL_PROTO=LL"]))
    assert all(r["env_setting"] == {"NCCL_PROTO": "LL"} and r["requested"] == {"NCCL_PROTO": "LL"} for r in rows)
    line = _usage_error(capsys, ["import-nccl-tests", str(path), "--out", str(tmp_path / "x"),
                                 "--setting", "NCCL_PROTO=Simple"])
    assert "NCCL_PROTO=LL" in line and not (tmp_path / "x").exists()
    line = _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_JSON), "--out", str(tmp_path / "x"),
                                 "--setting", "NCCL_ALGO=Ring"])
    assert "has no NCCL_ALGO" in line
    assert "NAME=VALUE" in _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_JSON), "--out", str(tmp_path / "x"),
                                                 "--setting", "NCCL_ALGO"])


def test_text_and_json_of_one_run_make_one_set_ofrows_of(tmp_path: Path) -> None:
    rows = rows_of(_import(tmp_path, GRAPH8_TXT, GRAPH8_JSON))
    assert len(rows) == 34 and all(r["extra"]["source_file"] == GRAPH8_JSON.name for r in rows)
    info = json.loads((tmp_path / "run" / RUN_FILE).read_text())
    assert info["imports"][0]["same_run_as"] == [str(GRAPH8_TXT)]
    assert len(info["gpus"]) == 8 and info["world_size"] == 8 and info["versions"]["nccl"] == "2.28.9"


def test_text_and_json_with_the_same_ranks_but_other_times_are_refused(tmp_path: Path, capsys) -> None:
    text = GRAPH8_TXT.read_text().replace("     9.11    0.45", "     9.61    0.43", 1)
    path = tmp_path / "other.txt"
    path.write_text(text)
    line = _usage_error(capsys, ["import-nccl-tests", str(path), str(GRAPH8_JSON), "--out", str(tmp_path / "x")])
    assert "different times" in line


def test_text_without_its_json_needs_the_average(capsys, tmp_path: Path) -> None:
    line = _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_TXT), "--out", str(tmp_path / "x")])
    assert "--average" in line and GRAPH8_JSON.name in line and not (tmp_path / "x").exists()
    line = _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_JSON), "--average", "1", "--out", str(tmp_path / "x")])
    assert "-a 3" in line


def test_world_sizes_must_agree(tmp_path: Path, capsys) -> None:
    line = _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_JSON), str(ONE_JSON), "--out", str(tmp_path / "x")])
    assert "different world sizes" in line
    line = _usage_error(capsys, ["import-nccl-tests", str(ONE_JSON), "--expect-world-size", "8",
                                 "--out", str(tmp_path / "x")])
    assert "not the expected 8" in line and "MPI=1" in line


def test_appending_and_importing_twice(tmp_path: Path, capsys) -> None:
    run = _import(tmp_path, GRAPH8_JSON)
    _import(tmp_path, PERITER_JSON)
    assert len(rows_of(run)) == 34 + 18
    capsys.readouterr()
    assert cli(["import-nccl-tests", str(GRAPH8_JSON), str(GRAPH8_TXT), "--out", str(run)]) == 0
    assert "already imported" in capsys.readouterr().out and len(rows_of(run)) == 52
    info = json.loads((run / RUN_FILE).read_text())
    assert len(info["imports"]) == 2 and info["plan"]["modes"] == ["eager", "graph"] and "finished" in info
    line = _usage_error(capsys, ["import-nccl-tests", str(ONE_JSON), "--out", str(run)])
    assert "world size 8" in line and len(rows_of(run)) == 52
    sweep = tmp_path / "sweep"
    shutil.copytree(Path(__file__).parents[1] / "data" / "runs" / "cpu-gloo-4rank-a", sweep)
    assert "sweep" in _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_JSON), "--out", str(sweep)])


# ---------------------------------------------------------------- bad input: exit 2, one line, nothing written

def _truncated_text(tmp_path: Path) -> Path:
    lines = GRAPH8_TXT.read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith("     1048576"))
    path = tmp_path / "cut.txt"
    path.write_text("\n".join(lines[:cut]) + "\n" + lines[cut][:70])   # the run died mid-row
    return path


def _truncated_json(tmp_path: Path) -> Path:
    text = GRAPH8_JSON.read_text()
    path = tmp_path / "cut.json"
    path.write_text(text[:text.index('{"size":1048576') + 40])
    return path


BAD_FILES = {
    "not nccl-tests": lambda tmp: _write(tmp / "notes.txt", "just some text\nwith # comments\n"),
    "truncated table": _truncated_text,
    "truncated json": _truncated_json,
    "binary": lambda tmp: _write_bytes(tmp / "a.out", b"\x7fELF\x02\x01\x01\0\0\0garbage"),
    "latin-1": lambda tmp: _write_bytes(tmp / "l1.txt", "# nThread caf\xe9".encode("latin-1")),
    "directory": lambda tmp: DATA,
    "missing": lambda tmp: tmp / "nope.txt",
    "empty": lambda tmp: _write(tmp / "empty.txt", ""),
    "other json": lambda tmp: _write(tmp / "o.json", '{"hello": [1, 2]}'),
    "json list": lambda tmp: _write(tmp / "l.json", "[1, 2]"),
    "broken json": lambda tmp: _write(tmp / "b.json", "{not json"),
    "header only": lambda tmp: _write(tmp / "h.txt", "\n".join(GRAPH8_TXT.read_text().splitlines()[:14]) + "\n"),
    "all_gather": lambda tmp: _write(tmp / "ag.txt", GRAPH8_TXT.read_text().replace("all_reduce_perf", "all_gather_perf")),
    "two runs": lambda tmp: _write(tmp / "two.txt", GRAPH8_TXT.read_text() * 2),
    "unknown layout": lambda tmp: _write(tmp / "u.txt", GRAPH8_TXT.read_text().replace("#wrong", "error")),
    "garbled row": lambda tmp: _write(tmp / "g.txt", GRAPH8_TXT.read_text().replace("  0.79       0", "  0.79 x", 1)),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_one_line_and_exit_2(tmp_path: Path, capsys, case: str) -> None:
    path = BAD_FILES[case](tmp_path)
    out = tmp_path / "out"
    line = _usage_error(capsys, ["import-nccl-tests", str(path), "--average", "3", "--out", str(out)])
    assert str(path) in line
    assert not out.exists()


@pytest.mark.procs
def test_bad_file_in_a_real_process(tmp_path: Path) -> None:
    binary = _write_bytes(tmp_path / "x.bin", b"\0\1\2")
    proc = run_cli(["import-nccl-tests", str(binary), str(GRAPH8_JSON), "--out", str(tmp_path / "out")])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "binary" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_partial_imports_the_completerows_of(tmp_path: Path, capsys) -> None:
    for make, name in ((_truncated_text, "t"), (_truncated_json, "j")):
        path = make(tmp_path)
        capsys.readouterr()
        run = _import(tmp_path, path, extra=["--partial", "--average", "3"], out=name)
        assert "PARTIAL" in capsys.readouterr().out
        rows = rows_of(run)
        assert len(rows) == 2 * 8 and max(r["message_bytes"] for r in rows) == 512 << 10
        info = json.loads((run / RUN_FILE).read_text())
        assert "finished" not in info and info["imports"][0]["complete"] is False


# ---------------------------------------------------------------- the analysis commands on an import

def test_report_compare_floor_recommend_on_imports(tmp_path: Path, capsys) -> None:
    a = _import(tmp_path, GRAPH8_JSON, out="a")
    b = _import(tmp_path, GRAPH8_TXT, extra=["--average", "3"], out="b")
    assert cli(["report", str(a), "--out", str(tmp_path / "report")]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    assert "nccl-tests:out-of-place" in html and "imported from nccl-tests" in html
    changes = tmp_path / "changes.json"
    assert cli(["compare", str(a), str(b), "--out", str(tmp_path), "--json", str(changes)]) == 0
    data = json.loads(changes.read_text())["changes"]
    assert len(data) == 34
    assert all(abs(c["latency_change_pct"]) < 0.1 and c["verdict"] == "spread unknown" for c in data)
    assert cli(["floor", str(a), "--model", "glm-5", "--tp", "8"]) == 0
    assert cli(["recommend", str(a), "--model", "glm-5"]) == 0
    assert "nccl-tests:" in capsys.readouterr().out


def test_rows_from_the_library_api(tmp_path: Path) -> None:
    (source,) = read_sources([GRAPH8_JSON], None, False)
    rows = rows_for(source, {})
    assert source.average == 3 and len(rows) == 34 and rows[0].key() != rows[1].key()


# ---------------------------------------------------------------- scripts/run-nccl-tests.sh with a stand-in binary

SCRIPT = Path(__file__).parents[2] / "scripts" / "run-nccl-tests.sh"
STAND_IN = '''#!{python}
"""Stands in for all_reduce_perf: prints a recorded table and writes its JSON where -J says,
with this process's argv and environment (as nccl-tests records them)."""
import json, os, sys
data = {data!r}
name = "h200-8gpu-mpi-graph" if "-G" in sys.argv else "h200-8gpu-mpi-eager-periter"
doc = json.load(open(os.path.join(data, name + ".json")))
doc["args"], doc["env"] = sys.argv, [f"{{k}}={{v}}" for k, v in os.environ.items()]
with open(sys.argv[sys.argv.index("-J") + 1], "x") as out:
    out.write(json.dumps(doc, separators=(",", ":")))
sys.stdout.write(open(os.path.join(data, name + ".txt")).read())
'''


def _stand_in(tmp_path: Path) -> Path:
    import sys
    binary = tmp_path / "all_reduce_perf"
    binary.write_text(STAND_IN.format(python=sys.executable, data=str(DATA)))
    binary.chmod(0o755)
    return binary


def _script(args: list[str], env: dict[str, str] | None = None):
    import os
    import subprocess
    import sys
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    full.pop("NCCL_NVLS_ENABLE", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=full)


@pytest.mark.procs
def test_run_script_runs_each_setting_and_imports_it(tmp_path: Path) -> None:
    out = tmp_path / "res"
    proc = _script(["--bin", str(_stand_in(tmp_path)), "--out", str(out), "--launch", "threads", "--nproc", "8",
                    "--env", "NCCL_PROTO=LL,Simple", "-b", "4K", "-e", "256M", "-f", "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = rows_of(out)
    assert len(rows) == 2 * (34 + 18)
    assert sorted({r["env_setting"]["NCCL_PROTO"] for r in rows}) == ["LL", "Simple"]
    assert {r["mode"] for r in rows} == {"graph", "eager"}
    commands = next((out / "nccl-tests-raw").iterdir()) / "commands.txt"
    text = commands.read_text()
    assert "-t 8 -b 4K -e 256M -f 2 -g 1 -d bfloat16 -a 3 -c 1" in text and "-G 100" in text
    info = json.loads((out / RUN_FILE).read_text())
    assert info["env"]["NCCL_NVLS_ENABLE"] == "0" and len(info["imports"]) == 4
    assert cli(["report", str(out), "--out", str(tmp_path / "report")]) == 0


@pytest.mark.parametrize("args,words", [
    ([], "--bin"),
    (["--bin", "/nonexistent/all_reduce_perf", "--out", "x"], "build nccl-tests first"),
    (["--launch", "mpi", "--nproc", "8"], "not linked with MPI"),
    (["--launch", "threads", "--nproc", "8", "--env", "NCCL_NVLS_ENABLE=1"], "--allow-multicast"),
    (["--launch", "threads", "--nproc", "8", "--dtype", "int8"], "unknown dtype"),
    (["--launch", "threads", "--nproc", "8", "-b", "4KiB"], "malformed size"),
])
@pytest.mark.procs
def test_run_script_refuses_bad_usage(tmp_path: Path, args: list[str], words: str) -> None:
    base = [] if not args or args[0] == "--bin" else ["--bin", str(_stand_in(tmp_path)), "--out", str(tmp_path / "o")]
    proc = _script(base + args)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- real output from an H200

MEASURED = {"graph": DATA / "h200-measured-1gpu-graph", "eager": DATA / "h200-measured-1gpu-eager"}


@pytest.mark.parametrize("mode", sorted(MEASURED))
def test_measured_h200_output_imports_as_its_run(tmp_path: Path, mode: str) -> None:
    """all_reduce_perf 2.19.6 as it ran on one H200 (NCCL 2.28.9, 4K-64M bf16, -a 3): the text
    and its -J JSON are recognised as one run, and world size 1 is no_work, never a result."""
    txt, js = MEASURED[mode].with_suffix(".txt"), MEASURED[mode].with_suffix(".json")
    text_out, json_out = read_output(txt), read_output(js)
    assert text_out.complete and json_out.complete
    assert [r.size_bytes for r in text_out.results] == [r.size_bytes for r in json_out.results]
    assert len(text_out.results) == 15 and text_out.results[0].size_bytes == 4096
    assert text_out.results[-1].size_bytes == 64 << 20
    run = _import(tmp_path, txt, js)
    rows = rows_of(run)
    assert len(rows) == 2 * 15   # one run (the JSON checked against its text), out-of-place and in-place
    assert {r["mode"] for r in rows} == {mode} and {r["dtype"] for r in rows} == {"bf16"}
    assert {r["status"] for r in rows} == {NO_WORK} and all(r["wrong_elements"] == 0 for r in rows)
    assert all(r["world_size"] == 1 for r in rows)


# ---------------------------------------------------------------- the box: --snapshot

SNAPSHOTS = Path(__file__).parents[1] / "fixtures" / "snapshots"


def _sglang_defaults(tmp_path: Path, run: Path) -> list[str]:
    """SGLang's default path for GLM-5 at each decode size of the run's box (`engines --json`)."""
    out = tmp_path / f"{run.name}-engines.json"
    assert cli(["engines", str(run), "--model", "glm-5", "--engine", "sglang", "--json", str(out)]) == 0
    (engine,) = json.loads(out.read_text())["engines"]
    return sorted({paths[0] for paths in (d["paths"] for d in engine["defaults"])})


def test_an_import_with_the_boxs_probe_snapshot_reads_the_engines_gates_as_a_sweep_does(tmp_path, capsys):
    """The committed 8x H200 log with a probe of that box (its GPUs by PCI bus id; the host names
    differ): run.json holds the snapshot where a sweep keeps it, so SGLang's GLM-5 default is read
    from the box's gates (FlashInfer); without it the box's fabric is unknown."""
    snapshot = SNAPSHOTS / "h200-nvlink-8x.json"
    run = _import(tmp_path, GRAPH8_TXT, extra=["--average", "3", "--snapshot", str(snapshot)])
    said = " ".join(capsys.readouterr().out.split())   # folded to the terminal
    assert f"box: the box from the probe snapshot {snapshot}" in said
    assert "host names differ (the log: h200-07; the probe: hgx8)" in said
    info = json.loads((run / RUN_FILE).read_text())
    assert info["snapshot"] == json.loads(snapshot.read_text())
    assert any(note.startswith("box: ") for note in info["notes"])
    assert _sglang_defaults(tmp_path, run) == ["FlashInfer allreduce (fusion workspace)"]
    bare = _import(tmp_path, GRAPH8_TXT, extra=["--average", "3"], out="bare")
    assert json.loads((bare / RUN_FILE).read_text()).get("snapshot") is None
    assert _sglang_defaults(tmp_path, bare) == ["cannot tell"]
    # The same log again with the snapshot: no row added, the box recorded.
    capsys.readouterr()
    assert cli(["import-nccl-tests", str(GRAPH8_TXT), "--average", "3", "--snapshot", str(snapshot),
                "--out", str(bare)]) == 0
    assert "already imported" in capsys.readouterr().out
    assert json.loads((bare / RUN_FILE).read_text())["snapshot"] == info["snapshot"]
    assert len(rows_of(bare)) == len(rows_of(run))


def test_a_snapshot_of_another_box_is_refused_in_one_line(tmp_path, capsys):
    other = SNAPSHOTS / "pcie-8x-dual-socket.json"
    err = _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_TXT), "--average", "3", "--snapshot", str(other),
                                "--out", str(tmp_path / "run")])
    assert err.startswith(f"commbench import-nccl-tests: error: --snapshot {other}: rank 0's GPU [0000:18:00] "
                          "NVIDIA H200 in ")
    assert err.endswith("is not in it (it has 8x NVIDIA RTX PRO 6000 Blackwell Server Edition): take the probe on "
                        "the box nccl-tests ran on")
    not_one = tmp_path / "not-a-snapshot.json"
    not_one.write_text('{"kind": "something else"}')
    err = _usage_error(capsys, ["import-nccl-tests", str(GRAPH8_TXT), "--average", "3", "--snapshot", str(not_one),
                                "--out", str(tmp_path / "run")])
    assert err.endswith(f"{not_one} is not a commbench topology snapshot")
    assert not (tmp_path / "run").exists()


def test_an_import_into_a_new_dir_that_fails_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    """The new dir is built beside its name and moved there at the end: a failure after the rows
    were written (here, recording the import) leaves neither the dir nor a half-built one."""
    from commbench.analysis import nccl_tests_import
    from commbench.errors import UsageError

    def refused(*args, **kwargs):
        raise UsageError("refused while recording the import")

    monkeypatch.setattr(nccl_tests_import, "import_record", refused)
    assert cli(["import-nccl-tests", str(GRAPH8_TXT), "--average", "3", "--out", str(tmp_path / "new" / "run")]) == 2
    assert "refused while recording the import" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
