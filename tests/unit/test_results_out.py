"""Results, then renderers (commbench/analysis/results_out.py): every analysis command's --json
is the shape docs/results.md documents (dataclasses.asdict of its frozen result), --html renders
the same data as a page that parses and escapes all text, and recommend's and floor's text is
drawn from their result alone."""

from __future__ import annotations

import dataclasses
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from commbench import models
from commbench.analysis import compare, floor, question, recommend, results_out
from commbench.analysis.attribute import AttributeResult
from commbench.analysis.compare import Change, CompareResult
from commbench.analysis.curves import Curve
from commbench.analysis.decide import EngineDecision, Option
from commbench.analysis.engine_chains import CheckResult, EngineChain, EnginesResult
from commbench.analysis.floor import FloorResult
from commbench.analysis.question import EngineRecord
from commbench.analysis.qualify import QualifyResult
from commbench.analysis.recommend import RecommendResult
from commbench.analysis.report import ReportResult
from commbench.analysis.table import TableResult
from commbench.cli import build_parser, main as cli
from commbench.engines.paths import PathState
from commbench.results import Run
from factories import row, write_run

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data"
SYNTHETIC = DATA / "runs" / "synthetic-pcie-8gpu"
CPU_A = DATA / "runs" / "cpu-gloo-4rank-a"
CPU_B = DATA / "runs" / "cpu-gloo-4rank-b"
VLLM_TRACES = sorted((DATA / "traces" / "constructed").glob("vllm-rank*.trace.json"))
HOSTILE = "x<script>alert('pwned')</script>&\"q\""

COMMANDS = {
    "floor": ["floor", str(SYNTHETIC), "--model", "llama-3.1-70b"],
    "recommend": ["recommend", str(SYNTHETIC), "--model", "llama-3.1-70b"],
    "compare": ["compare", str(CPU_A), str(CPU_B)],
    "attribute": ["attribute", *map(str, VLLM_TRACES), "--steps", "annotation"],
    "qualify": ["qualify", str(SYNTHETIC), "--spec", str(ROOT / "commbench" / "specs" / "pcie-8x.toml")],
    "table": ["table", str(CPU_A), str(CPU_B)],
    "report": ["report", str(SYNTHETIC), "--out", "report-out"],
    "engines": ["engines", str(SYNTHETIC), "--model", "llama-3.1-70b"],
    # a site whose files hold no gate to import: the check runs in process (no child), and differs
    "engines --check": ["engines", "--check", str(DATA / "engine-src" / "newer-site")],
}
EXIT = {"qualify": 1, "engines --check": 1}   # the fixture is no measurement: qualify FAILs it; the site differs


def documented_keys() -> dict[str, set[str]]:
    """docs/results.md's table of top-level keys per command (what is in parentheses describes
    a key's contents, not a key of its own)."""
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    out = {}
    for command, keys in re.findall(r"^\| `([a-z][a-z -]*)` \| (.+) \|$", text, re.M):
        while re.search(r"\([^()]*\)", keys):
            keys = re.sub(r"\([^()]*\)", "", keys)
        out[command] = set(re.findall(r"`([a-z_]+)`", keys))
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_json_dash_round_trips_to_the_documented_shape(command: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)   # compare writes its plot under the current directory
    assert cli([*COMMANDS[command], "--json", "-"]) == EXIT.get(command, 0)
    data = json.loads(capsys.readouterr().out)
    assert json.loads(json.dumps(data)) == data
    assert set(data) == documented_keys()[command]


def test_the_result_objects_json_is_their_asdict(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No hand-built record beside the dataclasses: each level's keys are the result's fields."""
    monkeypatch.chdir(tmp_path)   # report writes its page under --out, here

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    for command, result, key, item in (("recommend", RecommendResult, "engines", EngineRecord),
                                       ("floor", FloorResult, "engines", EngineRecord),
                                       ("compare", CompareResult, "changes", Change),
                                       ("engines", EnginesResult, "engines", EngineChain)):
        assert cli([*COMMANDS[command], "--json", "-"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert set(data) == names(result) and data[key] and set(data[key][0]) == names(item)
    assert cli([*COMMANDS["engines --check"], "--json", "-"]) == 1
    assert set(json.loads(capsys.readouterr().out)) == names(CheckResult)
    for command, result in (("qualify", QualifyResult), ("table", TableResult), ("report", ReportResult),
                            ("attribute", AttributeResult)):
        assert cli([*COMMANDS[command], "--json", "-"]) == EXIT.get(command, 0)
        assert set(json.loads(capsys.readouterr().out)) == names(result)
    cost = json.loads(_run_json(["recommend", str(SYNTHETIC), "--model", "glm-5"], capsys))
    priced = next(s["default_cost"] for s in cost["engines"][0]["sizes"] if s["default_cost"])
    assert set(priced) == {"price", "stand_in", "mode"}     # curves.price(): the point used and how
    assert priced["price"]["how"] in ("measured", "interpolated") and priced["price"]["point"]["latency_us"] > 0


def _run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli([*argv, "--json", "-"]) == 0
    return capsys.readouterr().out


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parsed(page: str) -> _Tags:
    parser = _Tags()
    parser.feed(page)
    parser.close()
    return parser


def test_the_html_page_escapes_hostile_text_and_parses() -> None:
    @dataclasses.dataclass(frozen=True)
    class Result:
        backend: str
        rows: tuple[dict, ...]
        notes: dict[str, str]

    page = results_out.page(results_out.data(Result(HOSTILE, ({"kernel": HOSTILE, "us": 1.5},), {HOSTILE: HOSTILE})),
                            f"title {HOSTILE}")
    parsed = _parsed(page)
    assert "script" not in parsed.tags and "<script" not in page
    assert sum(HOSTILE in t for t in parsed.text) >= 4   # title, heading, value, table cell, key: as text


def test_html_of_a_run_with_a_hostile_backend_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: a run file names a backend <script>...; compare's page shows it as text."""
    rows = [row(backend=backend, message_bytes=4096 << i, latency_us=10.0 + i, jitter_p10_us=9.0 + i,
                jitter_p90_us=11.0 + i) for backend in (HOSTILE, "nccl") for i in range(3)]
    run = write_run(tmp_path / "run", rows)
    page = tmp_path / "compare.html"
    assert cli(["compare", str(run), str(run), "--out", str(tmp_path / "o"), "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    parsed = _parsed(text)
    assert "script" not in parsed.tags and any(HOSTILE in t for t in parsed.text)
    assert {"table", "th", "td"} <= set(parsed.tags)


@pytest.mark.parametrize("flag, message", [("-", "--html -: give a file name"), ("{tmp}", "is a directory")])
def test_a_bad_html_target_is_one_line_before_any_work(flag: str, message: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli([*COMMANDS["floor"], "--html", flag.format(tmp=tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_json_written_is_asdict_without_its_copy(capsys: pytest.CaptureFixture[str]) -> None:
    """write() encodes dataclasses one level at a time (no deep copy of a large result): the same
    JSON as dataclasses.asdict."""
    @dataclasses.dataclass(frozen=True)
    class Inner:
        name: str
        sizes: tuple[int, ...]

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner
        rows: tuple[Inner, ...]
        by_name: dict[str, Inner | None]
        raw: dict[str, list[dict[str, int]]]

    result = Outer(Inner("a", (1, 2)), (Inner("b", ()),), {"c": Inner("c", (3,)), "d": None}, {"e": [{"f": 4}]})
    results_out.write(SimpleNamespace(json="-", html=None), result, "t")
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(dataclasses.asdict(result)))


FILE_HOSTILE = HOSTILE.replace("/", "")   # a file name: the same tags, no folder separator


def _hostile_run(tmp_path: Path) -> Path:
    """A run whose folder (its run id) and one backend have hostile names."""
    rows = [row(backend=backend, message_bytes=4096 << i, latency_us=10.0 + i, jitter_p10_us=9.0 + i,
                jitter_p90_us=11.0 + i) for backend in (HOSTILE, "nccl") for i in range(6)]
    return write_run(tmp_path / FILE_HOSTILE, rows)


@pytest.mark.parametrize("command", ["compare", "engines", "attribute", "recommend", "floor"])
def test_every_page_shows_a_hostile_name_as_text(command: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A name from a run file or a trace's file name (`<script>`) is text on the page, and the
    --json - beside it is the documented shape."""
    run = str(_hostile_run(tmp_path))
    traces = []
    for trace in VLLM_TRACES:   # attribute names its traces' files
        traces.append(tmp_path / f"{FILE_HOSTILE}{trace.name}")
        traces[-1].write_bytes(trace.read_bytes())
    argv = {"compare": ["compare", run, run, "--out", str(tmp_path / "o")],
            "engines": ["engines", run, "--model", "llama-3.1-70b"],
            "attribute": ["attribute", *map(str, traces), "--steps", "annotation"],
            "recommend": ["recommend", run, "--model", "llama-3.1-70b"],
            "floor": ["floor", run, "--model", "llama-3.1-70b"]}[command]
    page = tmp_path / "page.html"
    assert cli([*argv, "--html", str(page), "--json", "-"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == documented_keys()[command]
    text = page.read_text(encoding="utf-8")
    parsed = _parsed(text)
    assert "script" not in parsed.tags and "<script" not in text and any(FILE_HOSTILE in t for t in parsed.text)


def _answer(argv: list[str]) -> tuple[question.Question, question.Answer, Any]:
    args = build_parser(argv[0]).parse_args(argv)
    model = models.requested(args)
    single = argv[0] == "floor" and args.step_ms is not None   # floor's --step-ms prices concurrency 1
    asked = question.from_args(args, model, [1] if single else models.DEFAULT_CONCURRENCIES)
    return asked, question.answer(asked), args


def _objects(value: Any) -> Iterator[Any]:
    """Every object a result holds, through dataclasses, mappings and sequences."""
    yield value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _objects(getattr(value, f.name))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _objects(k)
            yield from _objects(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _objects(v)


@pytest.mark.parametrize("argv", [
    ["recommend", str(SYNTHETIC), "--model", "glm-5"],
    ["recommend", str(SYNTHETIC), "--model", "glm-5", "--engine", "sglang", "--brief", "--concurrency", "1:0.2,16:0.8"],
    ["floor", str(SYNTHETIC), "--model", "glm-5", "--backend", "nccl"],
    ["floor", str(SYNTHETIC), "--model", "glm-5", "--engine", "sglang", "--concurrency", "1", "--step-ms", "17.28"],
], ids=["recommend", "recommend-brief", "floor", "floor-what-if"])
def test_the_text_is_drawn_from_the_result_alone(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """recommend's and floor's text takes the result and the width, nothing else: the result holds
    no run, curve or decision object, and its text is the command's output byte for byte."""
    asked, found, args = _answer(argv)
    if argv[0] == "recommend":
        result = recommend.compute(found, asked)
        drawn = recommend.text(result, wide=False, brief=args.brief)
    else:
        result = floor.compute(found, asked, args)
        drawn = floor.text(result, wide=False)
    kinds = (Run, Curve, EngineDecision, Option, PathState)
    assert not [type(o).__name__ for o in _objects(result) if isinstance(o, kinds)]
    assert cli(argv) == 0
    assert capsys.readouterr().out == drawn + "\n"


def test_compare_streams_the_same_json_as_asdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compare writes its changes one at a time: the text is json.dumps of asdict, byte for byte."""
    args = build_parser("compare").parse_args(["compare", str(CPU_A), str(CPU_B), "--out", str(tmp_path)])
    result = compare.compute(args).result
    results_out.write_json("-", result, stream="changes")
    assert capsys.readouterr().out == json.dumps(dataclasses.asdict(result), indent=2) + "\n"
