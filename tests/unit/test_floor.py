"""commbench floor: the arithmetic, log-log interpolation, out-of-range sizes, the what-if."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from commbench import models
from commbench.cli import main as cli
from commbench.analysis.curves import decode_curves
from commbench.analysis import decide
from commbench.analysis.floor import floor_row, table_curve, what_if
from commbench.runs import load_run

RUNS = Path(__file__).parents[1] / "data" / "runs"
SYNTHETIC = RUNS / "synthetic-pcie-8gpu"
CPU_A = RUNS / "cpu-gloo-4rank-a"


def _table(tmp_path: Path, rows: str) -> Path:
    path = tmp_path / "latency.csv"
    path.write_text("bytes,latency_us\n" + rows, encoding="utf-8")
    return path


@pytest.mark.parametrize("latency_us, floor_ms", [(60.0, 9.36), (70.0, 10.92)])
def test_users_78_layer_moe_spends_9_to_11_ms_of_a_17_ms_token(tmp_path, latency_us, floor_ms):
    # docs/design.md: 78 layers, TP8, 156 allreduces of 12 KB at 60-70 us -> 9-11 ms of a 17.28 ms token.
    model = models.custom(layers=78, hidden=6144, ar_per_layer=2, dtype="bf16")
    curve = table_curve(_table(tmp_path, f"8K,{latency_us}\n12K,{latency_us}\n16K,{latency_us}\n"))
    row = floor_row(model, curve, concurrency=1)
    assert row.message_bytes == 12 * 1024
    assert row.allreduces_per_token == 156
    assert row.floor_ms_per_token == pytest.approx(floor_ms)
    assert row.max_tokens_per_s == pytest.approx(1000.0 / floor_ms)
    split = what_if(model, [curve], curve, concurrency=1, step_ms=17.28)
    assert split.rest_ms == pytest.approx(17.28 - floor_ms)
    assert 9.0 <= split.current.floor_ms_per_token <= 11.0


def test_glm5_preset_is_the_users_model():
    glm = models.lookup("GLM-5")
    assert (glm.layers, glm.hidden, glm.allreduces_per_token) == (78, 6144, 156)
    assert glm.message_bytes(1) == 12 * 1024 and glm.message_bytes(256) == 3 * 1024 * 1024
    assert models.lookup("deepseek-r1").key == "deepseek-v3"


def test_every_preset_names_its_source():
    presets = models.presets()
    for key in ("deepseek-v3", "deepseek-v4-flash", "glm-5", "kimi-k2.5", "minimax-m2.5", "qwen3-235b-a22b",
                "llama-3.1-70b", "llama-3.1-405b"):
        assert presets[key].source and presets[key].layers > 0 and presets[key].hidden > 0
    assert presets["llama-3.1-405b"].allreduces_per_token == 252


def test_interpolation_is_linear_in_log_log_space(tmp_path):
    curve = table_curve(_table(tmp_path, "8K,40\n32K,160\n4K,30\n"))
    assert curve.at(16 * 1024).latency_us == pytest.approx(80.0)           # slope 1 between 8K and 32K
    expected = math.exp(math.log(30) + 0.5 * (math.log(40) - math.log(30)))  # halfway in log(bytes)
    assert curve.at(int(4096 * math.sqrt(2))).latency_us == pytest.approx(expected, rel=1e-4)
    assert curve.at(8 * 1024).latency_us == 40.0                           # measured sizes are exact


def test_sizes_outside_the_curve_are_flagged_not_extrapolated(tmp_path):
    model = models.lookup("glm-5")
    curve = table_curve(_table(tmp_path, "8K,55\n16K,75\n"))
    inside, outside = floor_row(model, curve, 1), floor_row(model, curve, 2)
    assert inside.latency_source == "interpolated" and inside.latency_us is not None
    assert outside.latency_us is None and outside.floor_ms_per_token is None
    assert outside.latency_source == "out of range 8K-16K"


def test_what_if_swaps_in_only_a_path_the_engine_can_take():
    # Issue 27 changed this: the what-if once swapped in p2p:oneshot (+78%), which no engine runs on
    # 8 PCIe GPUs at TP8. It now swaps NCCL's default for the configuration the engine can take.
    model = models.lookup("glm-5")
    run = load_run(SYNTHETIC)
    curves = decode_curves(run, tp=8, dtype="bf16", mode="auto")
    nccl = next(c for c in curves if c.label == "nccl (graph)")
    configured = [c for c in curves if c.label == "nccl:proto=LL,algo=Ring (graph)"]
    w = what_if(model, configured, nccl, concurrency=1, step_ms=17.28)
    # nccl graph: 50 us at 8K, 68 us at 16K; NCCL_PROTO=LL 40 and 54 us -> 12K interpolated in log-log space
    nccl_us = 50 * (68 / 50) ** (math.log(1.5) / math.log(2))
    ll_us = 40 * (54 / 40) ** (math.log(1.5) / math.log(2))
    assert w.current.floor_ms_per_token == pytest.approx(156 * nccl_us / 1000)
    assert w.best.backend == "nccl:proto=LL,algo=Ring (graph)"
    assert w.new_step_ms == pytest.approx(17.28 - 156 * (nccl_us - ll_us) / 1000)
    assert w.tokens_per_s_new == pytest.approx(1000 / w.new_step_ms)


def test_floor_per_engine_default_best_and_headroom_apart(capsys, tmp_path):
    out_json = tmp_path / "floor.json"
    assert cli(["floor", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1", "--step-ms", "17.28",
                "--json", str(out_json), "--wide"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("data: fixture")
    engine_part, _, headroom = out.partition("headroom (")
    assert "p2p:" not in engine_part and "+78%" not in out
    assert re.search(r"default +1 +12K +nccl \(graph\) ", engine_part)
    assert re.search(r"configured +1 +12K +nccl:proto=LL,algo=Ring \(graph\) ", engine_part)
    assert "SGLang 0.5.23 (fixture, not a measurement) what-if: measured step 17.28 ms" in engine_part
    assert "with nccl:proto=LL,algo=Ring (graph)" in engine_part and "p2p:oneshot (graph)" in headroom
    data = json.loads(out_json.read_text())
    assert [e["engine"] for e in data["engines"]] == ["vllm", "sglang"]
    assert [w["engine"] for w in data["what_ifs"]] == ["vllm", "sglang"]
    assert all(w["what_if"]["best"]["backend"] == "nccl:proto=LL,algo=Ring (graph)" for w in data["what_ifs"])
    assert data["headroom"][0]["backend"] == "p2p:oneshot (graph)"
    assert data["engines"][1]["configuration"]["chosen"] == "NCCL (PyNccl) [NCCL_ALGO=Ring NCCL_PROTO=LL]"
    assert data["engines"][1]["floors"][0]["default"]["backend"] == "nccl (graph)"


def test_floor_and_recommend_give_one_and_the_same_per_engine_record(capsys, tmp_path):
    """Issue 57 item 4: both commands answer from question.EngineRecord; its JSON is the same."""
    argv = [str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1,64"]
    assert cli(["floor", *argv, "--json", str(tmp_path / "f.json")]) == 0
    assert cli(["recommend", *argv, "--json", str(tmp_path / "r.json")]) == 0
    capsys.readouterr()
    floor_, recommend_ = (json.loads((tmp_path / name).read_text())["engines"] for name in ("f.json", "r.json"))
    assert floor_ == recommend_


def test_no_what_if_against_a_default_that_was_not_measured(capsys):
    # 8 ranks on one H200: neither engine's default at 12K (FlashInfer, fused in vLLM) was measured in
    # the PCIe run
    run = Path(__file__).parents[2] / "results/reference/h200-mps-emulated/world8/pcie/20261202-005850-vm"
    assert cli(["floor", str(run), "--model", "glm-5", "--concurrency", "1", "--step-ms", "17.28"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert ("vLLM 0.34.0: no what-if: the engine's default at any size of the mix cannot be priced: by default the "
            "engine runs FlashInfer allreduce+RMSNorm fusion at this size, whose time includes the norm") in flat
    # GLM-5 (GlmMoeDsaForCausalLM): SGLang sends decode allreduces to FlashInfer by default
    assert ("SGLang 0.5.23: no what-if: the engine's default at any size of the mix cannot be priced: its default "
            "(FlashInfer allreduce (fusion workspace)) was not measured") in flat
    assert "not measured  " not in out    # no table of "not measured"
    assert "tokens/s" not in out


def test_cli_json_rows(tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert cli(["floor", str(SYNTHETIC), "--model", "llama-3.1-70b", "--concurrency", "1,8",
                "--backend", "nccl", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 8]
    assert set(rows[0]) >= {"concurrency", "message_bytes", "allreduces_per_token", "backend", "latency_us",
                            "floor_ms_per_token", "max_tokens_per_s"}
    # 80 layers x 2, 16 KiB at concurrency 1: nccl graph measured 68 us
    assert rows[0]["floor_ms_per_token"] == pytest.approx(160 * 68 / 1000)
    assert "Llama-3.1-70B" in capsys.readouterr().out


def test_a_shown_backend_that_failed_at_other_sizes_is_cautioned(tmp_path, capsys):
    # GLM-5 at concurrency 1 and 8 (12K, 96K): p2p:oneshot is fastest there (headroom: no engine can run
    # it on 8 PCIe GPUs), stale at 1M, hung at 2M/4M.
    out_json = tmp_path / "floor.json"
    assert cli(["floor", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1,8", "--json", str(out_json),
                "--wide"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("caution: ")]
    assert line.startswith("caution: p2p:oneshot failed its check at 1M wrong (stale), 2M hang, 4M hang")
    assert out.index("p2p:oneshot (graph)") < out.index(line)
    assert json.loads(out_json.read_text())["cautions"] == [line.removeprefix("caution: ")]
    # At concurrency 64 (768K) the NCCL paths and symm_mem:two_shot (headroom) are shown; none failed anywhere.
    assert cli(["floor", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "64"]) == 0
    assert "caution" not in capsys.readouterr().out


def test_the_what_if_against_a_named_current_backend(capsys):
    # 64 KiB (Llama-3.1-70B at concurrency 4): the step ran on plain nccl; the what-if swaps in an NCCL
    # setting the engine can take, never p2p:oneshot (fastest there, but no engine runs it here).
    assert cli(["floor", str(SYNTHETIC), "--model", "llama-3.1-70b", "--concurrency", "4", "--backend", "nccl",
                "--current", "nccl", "--step-ms", "40", "--engine", "vllm", "--wide"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("with ")]
    assert "p2p" not in line and line.startswith("with nccl")
    assert "caution: p2p:oneshot failed its check at 1M" in out     # shown as headroom, cautioned there


def test_on_a_cpu_run_the_suggested_dtype_works(tmp_path, capsys):
    """docs/commands.md's `floor RUN --model glm-5` on a CPU sweep, whose rows are fp32: the error names
    the --dtype to pass, and passing it gives the floor."""
    run = tmp_path / "cpu"
    shutil.copytree(CPU_A, run)
    rows = [line for line in (run / "measurements.jsonl").read_text().splitlines() if '"dtype": "fp32"' in line]
    (run / "measurements.jsonl").write_text("\n".join(rows) + "\n")
    assert cli(["floor", str(run), "--model", "glm-5", "--tp", "4"]) == 2
    err = capsys.readouterr().err
    suggested = re.search(r"pass (--dtype \w+) to use that curve", err)
    assert suggested, err
    assert cli(["floor", str(run), "--model", "glm-5", "--tp", "4", *suggested.group(1).split()]) == 0
    assert "hidden 6144, fp32" in capsys.readouterr().out
