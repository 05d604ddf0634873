"""One configuration per engine per server: where the fastest setting differs by concurrency, one
configuration comes out for the whole mix, priced against the default at every size, with the
sizes where it loses; never one paste block per concurrency."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commbench import models
from commbench.analysis import configure, decide
from commbench.analysis.curves import decode_curves
from commbench.cli import main as cli
from commbench.errors import UsageError
from commbench.engines.registry import BY_KEY
from commbench.runs import load_run
from commbench.topology import box as boxes

SYNTHETIC = Path(__file__).parents[1] / "data" / "runs" / "synthetic-pcie-8gpu"
GLM5 = models.lookup("glm-5")
LL = "NCCL (PyNccl) [NCCL_ALGO=Ring NCCL_PROTO=LL]"
CHANNELS = "NCCL (PyNccl) [NCCL_MIN_NCHANNELS=8]"


def decided(engine: str, run, curves, concurrencies: list[int]) -> decide.EngineDecision:
    e = BY_KEY[engine]
    return decide.decide(e, e.facts, run, decide.box_of(run, 8), curves, GLM5, concurrencies,
                         decide.workload(GLM5, "auto"))


def _configure(mix: str, engine: str = "sglang", prefill_tokens: int = 16,
               output_tokens: int = configure.DEFAULT_OUTPUT_TOKENS) -> configure.Configuration:
    run = load_run(SYNTHETIC)
    curves = decode_curves(run, tp=8, dtype="bf16", mode="auto")
    loads = configure.parse_loads(mix, [])
    d = decided(engine, run, curves, [l.concurrency for l in loads])
    return configure.configure(d, GLM5, configure.Mix(loads, prefill_tokens, "test", output_tokens), 8)


def test_per_concurrency_winners_differ_and_one_configuration_comes_out() -> None:
    # GLM-5 on the 8-GPU PCIe fixture: Ring/LL is fastest at concurrency 1 (12K), NCCL_MIN_NCHANNELS=8
    # at 16 and 64; LL is 18% slower than the default at 64 (768K). Decided per concurrency, that was
    # two paste blocks for one server.
    run = load_run(SYNTHETIC)
    curves = decode_curves(run, tp=8, dtype="bf16", mode="auto")
    d = decided("sglang", run, curves, [1, 16, 64])
    assert {s.concurrency: s.best.label for s in d.sizes} == {1: LL, 16: CHANNELS, 64: CHANNELS}

    even = _configure("1,16,64")
    assert even.chosen == CHANNELS and even.paste[0] == "export NCCL_MIN_NCHANNELS=8"
    assert not any(line.startswith("export NCCL_PROTO") for line in even.paste)
    assert [c.label for c in even.candidates] == ["the engine's default", LL, CHANNELS]
    steps = {c.label: c.weighted_step_ms for c in even.candidates}
    assert steps[CHANNELS] < steps["the engine's default"] < steps[LL]
    assert even.weighted_saving_ms == pytest.approx(steps["the engine's default"] - steps[CHANNELS])
    assert configure.NCCL_ENV_SCOPE in even.notes

    # Served almost only at concurrency 1, LL is the one configuration: its loss at 64 is shown, not hidden.
    mostly_one = _configure("1:0.97,64:0.03")
    assert mostly_one.chosen == LL
    (loss,) = [c for c in mostly_one.losses if c.phase == configure.DECODE]
    assert loss.tokens == 64 and loss.saving_us < 0 and loss.beyond_spread is True
    assert loss.chosen_us / loss.default_us == pytest.approx(653 / 555, rel=0.01)


def test_the_cli_prints_one_paste_block_per_engine_with_its_trade_offs(capsys: pytest.CaptureFixture[str],
                                                                        tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1:0.97,64:0.03", "--brief",
                "--wide", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert text.count("paste-ready:") == 2          # one per engine
    assert text.count("export NCCL_PROTO=LL") == 2 and "NCCL_MIN_NCHANNELS=8\n" not in text.replace("> ", "")
    assert "concurrency 64 (768K): 97.9 us/call slower than the default" in text
    # both engines take NCCL here: one trade-off table, said once
    assert text.count("trade-offs (fixture, not a measurement)") == 1
    assert "(trade-offs: the same as vLLM 0.34.0's above)" in text
    data = json.loads(out_json.read_text())
    (loss,) = [c for c in data["engines"][0]["losses"] if c["phase"] == "decode"]
    assert loss["tokens"] == 64


@pytest.mark.parametrize("text, message", [
    ("1:0.5,16", "a weight to every concurrency or to none"),
    ("1:-1", "positive"), ("0", "positive"), ("1,1", "1 is listed twice"), ("x", "expected N"),
])
def test_a_bad_mix_is_one_line(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        configure.parse_loads(text, [])


def test_weights_are_shares_and_the_prefill_chunk_is_the_engines_default_for_the_gpu() -> None:
    assert [l.weight for l in configure.parse_loads("1:1,16:3", [])] == [0.25, 0.75]
    assert [l.weight for l in configure.parse_loads(None, [1, 2])] == [0.5, 0.5]
    vllm, sglang = BY_KEY["vllm"], BY_KEY["sglang"]

    def chunk(engine, gpu: dict | None) -> int:
        return engine.prefill(boxes.read({"gpus": [gpu]} if gpu else None, 1), engine.facts)[0]
    h200 = {"name": "NVIDIA H200", "memory_total_mib": 143771}
    rtx = {"name": "NVIDIA RTX PRO 6000", "memory_total_mib": 97887}
    assert chunk(vllm, h200) == 8192 and chunk(sglang, h200) == 8192
    assert chunk(vllm, None) == 2048 and chunk(sglang, None) == 4096
    assert chunk(sglang, {"memory_total_mib": 180 * 1024}) == 16384
    assert chunk(vllm, rtx) == 8192


def _engine_sections(text: str) -> list[list[str]]:
    """The lines of each '== engine ==' section, up to the next section or the headroom."""
    sections: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("== "):
            sections.append([])
        elif line.startswith(("headroom (", "caution: ", "A microbenchmark win")):
            sections.append(None)  # type: ignore[arg-type]
        if sections and sections[-1] is not None:
            sections[-1].append(line)
    return [s for s in sections if s is not None]


@pytest.mark.parametrize("kind", ["cpu", "emulated"])
def test_a_run_that_cannot_price_the_default_says_why_and_names_the_sweep(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dead ends of issue 38: a CPU run, ranks sharing a GPU without the engines' kernels, an
    nccl-tests import. recommend --brief: a short block per engine with the next command; floor:
    that block, never a table of 'not measured'."""
    root = Path(__file__).resolve().parents[2]
    if kind == "cpu":
        run, extra = SYNTHETIC.parent / "cpu-gloo-4rank-a", ["--dtype", "fp32"]
    else:
        run, extra = root / "results/reference/h200-mps-emulated/world8/pcie/20261202-005850-vm", []
    assert cli(["recommend", str(run), "--model", "glm-5", "--brief", *extra]) == 0
    brief = capsys.readouterr().out
    sections = _engine_sections(brief)
    assert len(sections) == 2
    for section in sections:
        assert len([line for line in section if line.strip()]) <= 12, section
        assert any(line.strip().startswith("torchrun --nproc-per-node") for line in section), section
        assert any(line.startswith("no configuration can be priced from this run") for line in section)
    assert cli(["floor", str(run), "--model", "glm-5", *extra]) == 0
    floor = capsys.readouterr().out
    assert "torchrun --nproc-per-node" in floor
    assert not any(line.rstrip().endswith("not measured") for line in floor.splitlines())   # no such table


def test_an_import_without_a_snapshot_prices_nccl_and_says_once_what_prices_the_rest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 53 item 4: an nccl-tests import without a probe snapshot cannot tell an engine's
    default path, but NCCL's is priced: floor gives NCCL's per-token floor (156 x its per-call time
    for GLM-5), recommend prices what NCCL alone can decide, and each says once which command (after
    the probe on that box) prices the rest."""
    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "imported"
    log = root / "tests/data/nccl-tests/h200-8gpu-mpi-graph.txt"
    assert cli(["import-nccl-tests", str(log), "--average", "3", "--out", str(run)]) == 0
    capsys.readouterr()
    hint = f"commbench import-nccl-tests {log} --average 3 --snapshot probe.json --out {run}"
    assert cli(["recommend", str(run), "--model", "glm-5", "--brief", "--concurrency", "1"]) == 0
    brief = capsys.readouterr().out
    assert brief.count(hint) == 1 and brief.count("`commbench probe --json probe.json`") == 1
    sections = _engine_sections(brief)
    assert len(sections) == 2 and all(any("its NCCL path only" in line for line in s) for s in sections)
    assert "no configuration can be priced" not in brief
    out_json = tmp_path / "floor.json"
    assert cli(["floor", str(run), "--model", "glm-5", "--concurrency", "1", "--json", str(out_json)]) == 0
    floor = capsys.readouterr().out
    assert floor.count(hint) == 1
    data = json.loads(out_json.read_text())
    (pair,) = data["engines"][0]["floors"]
    nccl = pair["default"]
    assert nccl["backend"].startswith("nccl-tests") and nccl["floor_ms_per_token"] == pytest.approx(
        156 * nccl["latency_us"] / 1000)
    assert data["engines"][0]["configuration"]["scope"] == "nccl"


def test_prefill_is_weighed_per_request_and_a_setting_that_loses_per_request_is_not_chosen(
        capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM at concurrency 1 with a 256-token prefill chunk (256 x 6144 x 2 B = 3 MiB) on the PCIe
    fixture, GLM-5 (156 allreduces per token). Per call, as the fixture gives them:

        the default (nccl)   59.85 us at 12K   1905.77 us at 3M
        Ring/LL              47.68 us          2430.85 us

    decode: 156 x (59.85 - 47.68) / 1000 = 1.899 ms saved per step
    prefill: 156 x (2430.85 - 1905.77) / 1000 = 81.91 ms more per chunk
    128 output tokens: 128 x 1.899 - 81.91 = 161.2 ms saved per request: Ring/LL is chosen
     32 output tokens:  32 x 1.899 - 81.91 = -21.1 ms, a loss per request: it is not chosen"""
    long = _configure("1", "vllm", prefill_tokens=256, output_tokens=128)
    default, ll = (next(k for k in long.candidates if k.label == label) for label in ("the engine's default", LL))
    assert default.decode_us[0] == pytest.approx(59.85, abs=0.01) and ll.decode_us[0] == pytest.approx(47.68, abs=0.01)
    assert default.prefill_us == pytest.approx(1905.77, abs=0.01) and ll.prefill_us == pytest.approx(2430.85, abs=0.01)
    assert long.prefill_weighed and long.chosen == LL and long.output_tokens == 128
    assert long.weighted_saving_ms == pytest.approx(1.899, abs=0.001)
    assert long.prefill_cost_ms == pytest.approx(81.91, abs=0.01)
    assert long.net_request_ms == pytest.approx(161.2, abs=0.1)
    assert ll.request_ms == pytest.approx(128 * 7.437 + 379.21, abs=0.1)   # 156 x 47.68 / 1000 = 7.437 ms/step

    short = _configure("1", "vllm", prefill_tokens=256, output_tokens=32)
    assert short.chosen != LL
    lost = next(k for k in short.candidates if k.label == LL)
    kept = next(k for k in short.candidates if k.label == short.chosen or k.is_default and short.is_default)
    assert lost.request_ms - kept.request_ms >= 21.1 - 0.1 and short.net_request_ms >= 0

    # the text says the same numbers, once
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--engine", "vllm", "--concurrency", "1",
                "--prefill-tokens", "256", "--output-tokens", "32", "--brief", "--wide"]) == 0
    text = capsys.readouterr().out
    assert (f"not chosen: {LL}: 1.90 ms/step saved x 32 = 60.8 ms, 81.9 ms more per prefill chunk: 21.1 ms lost per "
            "request") in text
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--engine", "vllm", "--concurrency", "1",
                "--prefill-tokens", "256", "--brief", "--wide"]) == 0
    text = capsys.readouterr().out
    assert "decode: 1.90 ms/step of allreduce saved over the mix x 128 output tokens = 243.1 ms" in text
    assert "prefill: 81.9 ms more per 256-token chunk (3M), 525.1 us/call slower" in text
    assert "net: 161.2 ms of allreduce saved per request" in text


def test_the_mix_is_weighed_per_request() -> None:
    """Over a mix the decode saving is the shares' sum: 0.5 x 156 x (59.85 - 47.68) / 1000 +
    0.5 x 156 x (555.3 - 653.2) / 1000 = 0.950 - 7.64 = -6.69 ms per step for Ring/LL, so it is
    never chosen whatever the prefill costs; NCCL_MIN_NCHANNELS=8 saves at both sizes."""
    c = _configure("1:0.5,64:0.5", "vllm", prefill_tokens=256)
    ll = next(k for k in c.candidates if k.label == LL)
    default = next(k for k in c.candidates if k.is_default)
    assert default.weighted_step_ms - ll.weighted_step_ms == pytest.approx(-6.69, abs=0.02)
    assert c.chosen == CHANNELS and c.net_request_ms == pytest.approx(
        128 * c.weighted_saving_ms - c.prefill_cost_ms, abs=1e-9)
    assert c.prefill_cost_ms < 0    # it is faster at the chunk too (1725 vs 1906 us)


def test_output_tokens_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--output-tokens", "0"]) == 2
    assert "--output-tokens must be a positive number of tokens (got 0)" in capsys.readouterr().err
