"""Where an engine's default is a fused kernel (FlashInfer's allreduce + residual + RMSNorm: vLLM
and SGLang on an H200 NVLink box for GLM-5), recommend and floor set the fastest stand-in for it
(p2p:fused, which no engine runs) against that default measured in the same run, at the model's
shape (tokens x hidden): never against a bare allreduce, never as a setting. A run without such a
stand-in prints what it printed before."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from commbench import engines, models
from commbench.analysis.curves import decode_curves, price
from commbench.cli import main as cli
from commbench.ops import FUSED_OP
from commbench.runs import load_run
from factories import FUSED_US, STAND_IN_US, fused_run

ROOT = Path(__file__).parents[2]
COMMITTED_FUSED = ROOT / "results" / "reference" / "h200-mps-emulated" / "world8" / "fused-h6144" / "20261201-205804-vm"
GLM5 = models.lookup("glm-5")        # hidden 6144, bf16, 78 layers x 2 = 156 allreduces per token
STAND_IN = "p2p:fused (graph allreduce_residual_rmsnorm)"
ONESHOT = "flashinfer:fused_oneshot (graph allreduce_residual_rmsnorm)"
TWOSHOT = "flashinfer:fused_twoshot (graph allreduce_residual_rmsnorm)"
FUSED_TITLE = "fused allreduce + residual + RMSNorm"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same run with and without the stand-in, each in a folder named `run` (the outputs name it)."""
    root = tmp_path_factory.mktemp("fused")
    return fused_run(root / "with" / "run"), fused_run(root / "without" / "run", stand_ins=False)


def _cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, run: Path, *argv: str
         ) -> tuple[str, dict]:
    """The command's text and JSON, run from the run's folder so that both outputs name it `run`."""
    monkeypatch.chdir(run.parent)
    out = run.parent / "out.json"
    assert cli([*argv[:1], "run", "--model", "glm-5", "--concurrency", "1,8,64", *argv[1:], "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_fused_rows_answer_a_model_only_at_its_shape(runs: tuple[Path, Path]) -> None:
    run = load_run(runs[0])
    stand_in = next(c for c in decode_curves(run, 8, "bf16", "auto", GLM5) if c.key.variant == "p2p:fused")
    # 6 x 7168 has the bytes of 7 x 6144, and the row claiming 2 tokens has 8 tokens' bytes: neither counts
    assert [(p.message_bytes, p.latency_us) for p in stand_in.points] == \
        [(t * 6144 * 2, us) for t, us in STAND_IN_US["p2p:fused"].items()]
    at7 = price(stand_in, GLM5.message_bytes(7))
    # between 1 token (4.00 us) and 8 (6.00) in log-log: 4 x 1.5^(ln 7 / ln 8) = 5.85 us, never the 7168 row's 1.0
    assert at7.how == "interpolated" and at7.latency_us == pytest.approx(4.0 * 1.5 ** (math.log(7) / math.log(8)))
    deepseek = decode_curves(run, 8, "bf16", "auto", models.lookup("deepseek-v3"))   # hidden 7168
    fused = [c for c in deepseek if c.key.op == FUSED_OP]
    assert [(c.key.variant, [p.latency_us for p in c.points]) for c in fused] == [("p2p:fused", [1.0])]


def test_recommend_sets_the_stand_in_against_the_engines_fused_default(runs, capsys, monkeypatch) -> None:
    text, data = _cli(capsys, monkeypatch, runs[0], "recommend")
    rooms = {r["concurrency"]: r for r in data["fused_headroom"]}
    assert sorted(rooms) == [1, 8, 64] and {r["kernel"] for r in rooms.values()} == {STAND_IN}
    for c, versus, default_us in ((1, ONESHOT, 6.68), (8, ONESHOT, 11.80), (64, TWOSHOT, 35.0)):
        r, stand_in_us = rooms[c], STAND_IN_US["p2p:fused"][c]
        assert r["message_bytes"] == c * 6144 * 2 and r["cost"]["price"]["point"]["latency_us"] == stand_in_us
        assert r["versus"]["price"]["curve"] == versus and r["versus"]["price"]["point"]["latency_us"] == default_us
        assert r["saving"]["per_call_us"] == pytest.approx(default_us - stand_in_us)
        assert r["saving"]["per_step_ms"] == pytest.approx(156 * (default_us - stand_in_us) / 1000)
    # vLLM's fusion takes up to 512 KiB at TP8 (42 tokens of 6144): at 64 tokens only SGLang's is the default
    assert rooms[1]["said"] == "vLLM 0.34.0 and SGLang 0.5.23 run FlashInfer allreduce+RMSNorm fusion by default here"
    assert rooms[64]["said"] == "SGLang 0.5.23 runs FlashInfer allreduce+RMSNorm fusion by default here"
    # the table, by hand: 6.68 - 4.00 = 2.68 us x 156 = 0.42 ms/step, 6.68 / 4.00 = 1.67x
    lines = text.splitlines()
    assert "c=1 12K    p2p:fused  4.00  flashinfer:fused_oneshot  6.68  1.67x   0.42" in lines
    assert "c=8 96K    p2p:fused  6.00  flashinfer:fused_oneshot  11.8  1.97x   0.90" in lines
    assert "c=64 768K  p2p:fused  20.0  flashinfer:fused_twoshot  35.0  1.75x   2.34" in lines
    assert "  c=64: SGLang 0.5.23 runs FlashInfer allreduce+RMSNorm fusion by default here" in lines


def test_the_stand_in_is_headroom_never_a_setting(runs, capsys, monkeypatch) -> None:
    text, data = _cli(capsys, monkeypatch, runs[0], "recommend")
    engine_part = text.split(f"\n{FUSED_TITLE} at the model's shape")[0]
    assert "p2p:fused" not in engine_part   # shown apart, as commbench's plain kernels are
    pasted = [line for block in engine_part.split("  paste-ready:\n")[1:]
              for line in block.splitlines() if line.startswith("    ")]
    assert not [line for line in pasted if "fuse_allreduce_rms\": true" in line
                or " ".join(engines.SGLANG_FLASHINFER_TRTLLM) in line]
    for e in data["engines"]:
        assert not [o for o in e["options"] if "p2p:fused" in " ".join(o["own"] + o["stand_ins"])]
        assert e["configuration"]["path"] != engines.FLASHINFER_FUSED
    brief, _ = _cli(capsys, monkeypatch, runs[0], "recommend", "--brief")
    part, _, rooms = brief.partition("\nheadroom (")
    assert "p2p:fused" not in part   # shown apart, in the headroom
    assert (f"p2p:fused (graph allreduce_residual_rmsnorm): would save 15.0 us/call, 2.34 ms/step at concurrency 64 "
            f"(768K) vs {TWOSHOT}, the engines' fused default (both times include the norm)") in " ".join(rooms.split())


def _without_section(text: str, start: str, last: str) -> list[str]:
    """The text's lines less those from the one starting `start` (and the blank line before it)
    through the last line starting `last`."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    end = max(i for i, line in enumerate(lines) if line.startswith(last))
    return lines[:first - (lines[first - 1] == "")] + lines[end + 1:]


@pytest.mark.parametrize("argv, start, last", [
    (["recommend"], f"{FUSED_TITLE} at the model's shape", "  c=64: "),
    (["recommend", "--brief"], "headroom (", "    default (both times include the norm)"),
    (["floor"], f"{FUSED_TITLE} (fixture", "  c=64: "),
])
def test_a_run_without_the_stand_in_prints_what_it_printed_before(runs, capsys, monkeypatch, argv, start, last):
    with_text, with_data = _cli(capsys, monkeypatch, runs[0], *argv)
    without_text, without_data = _cli(capsys, monkeypatch, runs[1], *argv)
    assert without_data["fused_headroom"] == [] and "stand-in" not in without_text
    assert _without_section(with_text, start, last) == without_text.splitlines()
    assert {k: v for k, v in with_data.items() if k != "fused_headroom"} == \
        {k: v for k, v in without_data.items() if k != "fused_headroom"}


def test_a_committed_run_without_a_stand_in_says_nothing_new(capsys) -> None:
    assert cli(["recommend", str(COMMITTED_FUSED), "--model", "glm-5", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["fused_headroom"] == []


def test_floor_gives_the_fused_default_and_the_stand_in_per_size(runs, capsys, monkeypatch) -> None:
    text, data = _cli(capsys, monkeypatch, runs[0], "floor")
    pairs = {f["stand_in"]["concurrency"]: f for f in data["fused_headroom"]}
    for c in (1, 8):
        default_us, stand_in_us = FUSED_US["flashinfer:fused_oneshot"][c], STAND_IN_US["p2p:fused"][c]
        assert pairs[c]["default"]["backend"] == ONESHOT and pairs[c]["stand_in"]["backend"] == STAND_IN
        assert pairs[c]["default"]["floor_ms_per_token"] == pytest.approx(156 * default_us / 1000)
        assert pairs[c]["stand_in"]["floor_ms_per_token"] == pytest.approx(156 * stand_in_us / 1000)
        assert pairs[c]["stand_in"]["max_tokens_per_s"] == pytest.approx(c * 1000 / (156 * stand_in_us / 1000))
    # 156 x 6.68 us = 1.04 ms/step, 960 tok/s; 156 x 4.00 = 0.62 ms/step, 1603 tok/s
    cells = [line.split() for line in text.split(f"\n{FUSED_TITLE} (fixture")[1].splitlines()]
    assert "default 1 12K flashinfer:fused_oneshot 6.68 1.04 960 measured".split() in cells
    assert "stand-in 1 12K p2p:fused 4.00 0.62 1603 measured".split() in cells


def test_a_line_that_turns_the_fusion_off_is_not_priced_by_plain_rows(runs, capsys, monkeypatch) -> None:
    """SGLang's custom allreduce beats its FlashInfer allreduce in the fixture's plain rows (3 vs 4 us at
    c=1), but its launch line adds --enforce-disable-flashinfer-allreduce-fusion, which also turns off
    the fused allreduce+RMSNorm SGLang runs by default at these sizes: the allreduce, add and norm
    then run apart, which plain rows do not price. So it is said, never chosen or pasted."""
    text, data = _cli(capsys, monkeypatch, runs[0], "recommend")
    sglang = next(e for e in data["engines"] if e["engine"] == "sglang")["configuration"]
    assert sglang["is_default"] and not sglang["paste"]
    (why,) = sglang["unpriced"]
    assert why.startswith("custom allreduce (CUDA IPC): its launch line turns off FlashInfer allreduce+RMSNorm "
                          "fusion, which the engine runs by default at these decode sizes")
    assert "--enforce-disable-flashinfer-allreduce-fusion" not in "\n".join(
        line for block in text.split("  paste-ready:\n")[1:] for line in block.splitlines()[:3])
    assert "  not priced: custom allreduce (CUDA IPC): its launch line turns off" in text
