"""commbench recommend: winner per concurrency, margins against spread, engine settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from commbench.analysis import models
from commbench import backends, engines
from commbench.cli import main as cli
from commbench.analysis.curves import cautions, decode_curves
from commbench.analysis.recommend import choose
from commbench.runs import load_run

RUNS = Path(__file__).parent / "data" / "runs"
SYNTHETIC = RUNS / "synthetic-pcie-8gpu"


@pytest.fixture(scope="module")
def curves():
    return decode_curves(load_run(SYNTHETIC), tp=8, dtype="bf16", mode="auto")


def test_small_batches_pick_the_one_shot_kernel_with_a_real_margin(curves):
    # Llama-3.1-70B at concurrency 1 sends 16 KiB: measured 13 us p2p, 23 us two-shot, 68 us nccl.
    c = choose(models.lookup("llama-3.1-70b"), curves, 1, "nccl")
    assert (c.message_bytes, c.backend, c.latency_us) == (16 * 1024, "p2p:oneshot (graph)", 13.0)
    assert c.runner_up.other == "symm_mem:two_shot (graph)" and c.runner_up.delta_us == pytest.approx(10.0)
    assert c.vs_baseline.ratio == pytest.approx(68 / 13) and c.vs_baseline.beyond_spread is True


def test_a_margin_inside_the_spread_is_called_so(curves):
    # 4 MiB (concurrency 256): NCCL_MIN_NCHANNELS=8 2300 us vs nccl 2500 us, whose p10-p90 is 2400-2675.
    c = choose(models.lookup("llama-3.1-70b"), curves, 256, "nccl")
    assert c.backend == "nccl[NCCL_MIN_NCHANNELS=8] (graph)"
    assert c.vs_baseline.delta_us == pytest.approx(200.0)
    assert c.vs_baseline.beyond_spread is False
    # 2 MiB: 1150 vs 1300 us, nccl's spread 1248-1391 = 143 us < 150 us: beyond it
    assert choose(models.lookup("llama-3.1-70b"), curves, 128, "nccl").vs_baseline.beyond_spread is True


def test_the_wrong_size_is_never_chosen_and_is_cautioned(curves):
    # concurrency 64 of Llama-3.1-70B = 1 MiB, where p2p:oneshot was fastest but stale.
    c = choose(models.lookup("llama-3.1-70b"), curves, 64, "nccl")
    assert c.backend == "symm_mem:two_shot (graph)"
    oneshot = [x for x in curves if x.key.variant == "p2p:oneshot"]
    (line,) = cautions(load_run(SYNTHETIC).rows, oneshot)
    assert "1M wrong (stale), 2M hang, 4M hang" in line


def declared(name: str, world_size: int = 8) -> engines.Settings:
    (backend,) = backends.expand([name], {}, on_gpu=True)
    return backend.engine_settings(world_size)


def test_backends_declare_the_settings_that_select_them():
    ll = declared("nccl:proto=LL,algo=Ring")
    assert ll.nccl_env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}
    assert "--disable-custom-all-reduce" in ll.vllm_flags and ll.vllm_env["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0"
    text = engines.render(ll, 8)
    assert "export NCCL_PROTO=LL" in text and "vLLM 0.33.0" in text and "SGLang 0.5.23" in text
    assert "--tensor-parallel-size 8" in text and "--tp 8" in text
    fi = declared("flashinfer:fused_oneshot")
    assert fi.vllm_env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm" and "fuse_allreduce_rms" in " ".join(fi.vllm_flags)
    assert fi.sglang_flags == ["--flashinfer-allreduce-fusion-backend", "trtllm"]
    assert not declared("mscclpp:auto").vllm_supported
    plain = declared("nccl").with_process_env({"NCCL_MIN_NCHANNELS": "8"})
    assert plain.nccl_env == {"NCCL_MIN_NCHANNELS": "8"} and engines.NCCL_ENV_IS_PROCESS_WIDE in plain.notes
    assert engines.CUSTOM_AR_PCIE_GATE in declared("p2p:oneshot", 8).notes
    assert engines.CUSTOM_AR_PCIE_GATE not in declared("p2p:oneshot", 2).notes
    assert engines.Settings.from_dict(ll.to_dict()) == ll


def test_a_run_without_declared_settings_says_so(tmp_path, capsys):
    run = tmp_path / "old"
    shutil.copytree(SYNTHETIC, run)
    info = json.loads((run / "run.json").read_text())
    del info["backend_facts"]
    (run / "run.json").write_text(json.dumps(info))
    assert cli(["recommend", str(run), "--model", "glm-5", "--concurrency", "16"]) == 0
    assert "no engine settings recorded for symm_mem:two_shot" in capsys.readouterr().out


def test_cli_json(tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1,16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [c["backend"] for c in data["choices"]] == ["p2p:oneshot (graph)", "symm_mem:two_shot (graph)"]
    assert data["engine_versions"] == {"vllm": "0.33.0", "sglang": "0.5.23", "nccl": "2.30.7"}
    text = capsys.readouterr().out
    assert "--enable-torch-symm-mem" in text and "caution: p2p:oneshot failed its check" in text


def test_unknown_model_exits_2(capsys):
    assert cli(["recommend", str(SYNTHETIC), "--model", "llama-5"]) == 2
    assert "unknown model 'llama-5'" in capsys.readouterr().err


def test_settings_that_do_nothing_on_the_probed_box_are_said(capsys):
    # The synthetic run is 8 PCIe GPUs without NVLink: the engines' custom allreduce stays off at TP8.
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1"]) == 0
    out = capsys.readouterr().out
    assert "settings that do nothing on this box (from its probe snapshot):" in out
    assert "vLLM / SGLang custom allreduce" in out and "at TP 8 without full NVLink" in out
