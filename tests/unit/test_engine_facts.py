"""The engine facts of issue 37, each checked against what vLLM 0.33.0/0.34.0 and SGLang 0.5.23 do
(results/reference/engine-rules/ has the source check), on the H200 NVLink, B300 and 8x PCIe
snapshots; the reader and checker on hand-written stand-ins (tests/data/engine-src); the engines'
start-up log; launch lines that do what they claim; an nccl-tests import priced as NCCL."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from commbench import engines
from commbench.analysis import decide
from commbench.analysis.curves import decode_curves
from commbench.cli import main as cli
from commbench.engines import facts as facts_
from commbench.engines import flashinfer, paths, sglang, source, vllm
from commbench.engines.paths import Workload
from commbench.engines.registry import BY_KEY
from commbench.engines.settings import (CUSTOM_AR, FLASHINFER_AR, FLASHINFER_FUSED, FLASHINFER_PCIE_IPC, MSCCLPP,
                                        NCCL_PATH, NCCL_SYMM, SGLANG, TORCH_SYMM_MEM, VLLM)
from commbench.runs import load_run
from commbench.topology import box as boxes

ROOT = Path(__file__).parents[2]
SNAPSHOTS = ROOT / "tests/fixtures/snapshots"
H200 = json.loads((SNAPSHOTS / "h200-nvlink-8x.json").read_text())
B300 = json.loads((SNAPSHOTS / "b300-nvlink-8x.json").read_text())
PCIE_RUN = ROOT / "tests/data/runs/synthetic-pcie-8gpu"
PCIE = json.loads((PCIE_RUN / "run.json").read_text())["snapshot"]
SRC = ROOT / "tests/data/engine-src"
KiB, MiB = 1 << 10, 1 << 20
GLM5 = Workload("GlmMoeDsaForCausalLM", 6144)
LLAMA = Workload("LlamaForCausalLM", 8192)


def found(engine: str, snapshot: dict, workload: Workload = Workload(), world_size: int = 8) -> list:
    return paths.states(BY_KEY[engine], boxes.read(snapshot, world_size), workload)


def states(engine: str, snapshot: dict, workload: Workload = Workload(), world_size: int = 8) -> dict:
    return {s.path: s for s in found(engine, snapshot, workload, world_size)}


def default(engine: str, snapshot: dict, size: int, workload: Workload = Workload(), world_size: int = 8) -> str | None:
    chosen = paths.default_path(found(engine, snapshot, workload, world_size), size)
    return chosen.path.path if chosen.path else None


# --- the nine facts ---------------------------------------------------------------------------

@pytest.mark.parametrize("snapshot, cap", [(H200, 512 * KiB), (B300, 4 * MiB)])
def test_1_vllm_fuses_allreduce_rmsnorm_by_default_on_sm90_and_sm10x(snapshot, cap):
    fused = states(VLLM, snapshot, GLM5)[FLASHINFER_FUSED]
    assert fused.default_on and fused.available is True and fused.max_bytes == cap and fused.inclusive
    assert default(VLLM, snapshot, 12 * KiB, GLM5) == FLASHINFER_FUSED
    assert default(VLLM, snapshot, cap + 16, GLM5) != FLASHINFER_FUSED
    # --enforce-eager compiles nothing: no fusion pass
    assert states(VLLM, snapshot, Workload(mode="eager"))[FLASHINFER_FUSED].available is False
    # SM12 has no row: off
    assert states(VLLM, PCIE)[FLASHINFER_FUSED].available is False


def test_2_sglang_routes_decode_to_flashinfer_for_listed_architectures():
    assert "GlmMoeDsaForCausalLM" in sglang.FACTS.value("flashinfer_archs")
    for snapshot in (H200, B300):
        assert default(SGLANG, snapshot, 12 * KiB, GLM5) == FLASHINFER_AR
        # 2048 tokens x 6144 x 2 bytes, inclusive
        assert default(SGLANG, snapshot, 2048 * 6144 * 2, GLM5) == FLASHINFER_AR
        assert default(SGLANG, snapshot, 12 * KiB, LLAMA) == CUSTOM_AR
    fi = states(SGLANG, H200, Workload("MyOwnForCausalLM", 4096))[FLASHINFER_AR]
    assert not fi.default_on and "MyOwnForCausalLM is not in SGLang's list" in fi.why
    unknown = states(SGLANG, H200, Workload(hidden=4096))[FLASHINFER_AR]
    assert not unknown.default_on and "--arch" in unknown.why


def test_3_sglang_0523_ships_flashinfer_pcie_ipc():
    pcie_ipc = states(SGLANG, PCIE)[FLASHINFER_PCIE_IPC]
    assert pcie_ipc.available is True and not pcie_ipc.default_on
    assert pcie_ipc.rule.turn_on == "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1"
    assert states(SGLANG, PCIE, world_size=6)[FLASHINFER_PCIE_IPC].available is False
    settings = engines.pcie_ipc("flashinfer:pcie_ipc", [])
    assert engines.declared_paths(settings) == {VLLM: {"path": FLASHINFER_PCIE_IPC, "stand_in": False},
                                                SGLANG: {"path": FLASHINFER_PCIE_IPC, "stand_in": False}}
    lines, refusal = engines.paste_lines(settings, SGLANG, 8)
    assert refusal is None and lines[-1].startswith("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 python -m sglang.launch_server")


def test_4_sglang_dispatch_order():
    order = [s.path for s in found(SGLANG, H200) if s.rule.op == paths.ALLREDUCE]
    # MSCCL++ comes after custom allreduce and PCIe IPC, which yield to it where it takes a message
    assert order == [NCCL_SYMM, FLASHINFER_AR, CUSTOM_AR, FLASHINFER_PCIE_IPC, MSCCLPP, TORCH_SYMM_MEM, NCCL_PATH]
    assert paths.pick(sglang.RULES, {CUSTOM_AR, MSCCLPP, NCCL_PATH}) == MSCCLPP
    assert sglang.FACTS.value("outplace_order")[:2] == ["ca", "pcie_ipc"]
    # --enable-torch-symm-mem alone leaves custom allreduce in front: it is the default below 16 MiB
    assert default(SGLANG, H200, 1 * MiB, LLAMA) == CUSTOM_AR


def test_5_sglang_custom_allreduce_v2_takes_16_mib_inclusive_and_tests_p2p():
    ca = states(SGLANG, H200)[CUSTOM_AR]
    assert ca.max_bytes == 16 * MiB and ca.inclusive and ca.own_kernel
    assert default(SGLANG, H200, 16 * MiB, LLAMA) == CUSTOM_AR
    assert default(SGLANG, H200, 16 * MiB + 16, LLAMA) == NCCL_PATH
    assert sglang.FACTS.value("skip_p2p_check") == "0" and vllm.FACTS.value("env_skip_p2p_check") == "1"
    assert "2shot_push" in engines.SGLANG_ALGO_BY_SIZE and "SGLANG_FORCE_CUSTOM_ALL_REDUCE_V2_PUSH_SIZE_KB" in \
        engines.SGLANG_ALGO_BY_SIZE


def test_6_vllm_custom_allreduce_stage_is_a_setting():
    forced = engines.vllm_forced_stage("vllm:one_stage", "1stage", [])
    assert engines.declared_paths(forced) == {VLLM: {"path": CUSTOM_AR, "stand_in": False}}
    lines, refusal = engines.paste_lines(forced, VLLM, 8)
    assert refusal is None and "VLLM_CUSTOM_ALLREDUCE_ALGO=1stage" in lines[-1]
    assert "VLLM_CUSTOM_ALLREDUCE_ALGO=1stage|2stage forces one" in states(VLLM, H200)[CUSTOM_AR].why


def test_7_vllm_pcie_ipc_needs_cuda_graphs_and_is_bounded_by_the_captured_batch():
    graph = states(VLLM, PCIE, Workload(hidden=4096))[FLASHINFER_PCIE_IPC]
    assert graph.available is True and graph.max_bytes == 512 * 4096 * 2
    h200 = states(VLLM, H200, Workload(hidden=6144))[FLASHINFER_PCIE_IPC]
    assert h200.max_bytes == 512 * 6144 * 2 and h200.inclusive
    assert states(VLLM, B300, Workload(hidden=6144))[FLASHINFER_PCIE_IPC].max_bytes == 1024 * 6144 * 2
    eager = states(VLLM, PCIE, Workload(hidden=4096, mode="eager"))[FLASHINFER_PCIE_IPC]
    assert eager.available is False and "needs CUDA graphs" in eager.why


def test_8_vllm_has_sm103_rows_for_b300():
    paths_ = states(VLLM, B300)
    assert paths_[TORCH_SYMM_MEM].available is True and paths_[TORCH_SYMM_MEM].max_bytes == 64 * MiB
    assert paths_[CUSTOM_AR].max_bytes == 4 * MiB        # min(CUSTOM_ALL_REDUCE_MAX_SIZES["10.3"][8], 8 MiB)
    assert paths_[FLASHINFER_AR].max_bytes == 128 * MiB   # FI_MNNVL_ALLREDUCE_MAX_SIZE_MB[(103, 8, 1)]
    assert not engines.inert_settings(boxes.read(B300, 8))
    # the custom allreduce's cap where symm-mem is on is never above its 8 MiB buffer
    assert states(VLLM, H200, world_size=2)[CUSTOM_AR].max_bytes == 8 * MiB


def test_9_sglang_flashinfer_fusion_flag_fails_at_start_up_on_sm12():
    (rule,) = [r for r in engines.inert_settings(boxes.read(PCIE, 8)) if r.setting.startswith("SGLang --enable-flashinfer")]
    assert "fails at start-up" in rule.why and "silently" not in rule.why
    assert "stops the server at start-up" in states(SGLANG, PCIE)[FLASHINFER_AR].why


# --- the engines command and recommend on the fixtures -------------------------------------------

def test_engines_command_gives_the_chains_the_source_gives(capsys):
    assert cli(["engines", str(SNAPSHOTS / "h200-nvlink-8x.json"), "--model", "glm-5", "--mode", "graph"]) == 0
    out = capsys.readouterr().out
    vllm_part, sglang_part = out.split("== SGLang")
    assert "facts: vLLM 0.34.0 facts built in (not installed here)" in vllm_part
    assert "1. FlashInfer allreduce+RMSNorm fusion [on by default]" in vllm_part
    row = next(line for line in vllm_part.splitlines() if line.strip().startswith("1 ") and "12K" in line)
    assert "FlashInfer allreduce+RMSNorm fusion" in row
    row = next(line for line in sglang_part.splitlines() if line.strip().startswith("1 ") and "12K" in line)
    assert "FlashInfer allreduce" in row and "source: SGLang 0.5.23 (built in)" in sglang_part
    assert cli(["engines", str(SNAPSHOTS / "h200-nvlink-8x.json"), "--model", "llama-3.1-70b", "--engine", "sglang",
                "--mode", "graph"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("1 ") and "16K" in line)
    assert "custom allreduce (CUDA IPC)" in row


def test_engines_without_a_box_prints_the_chains_with_their_sources(capsys):
    assert cli(["engines", "--engine", "vllm"]) == 0
    out = " ".join(capsys.readouterr().out.split())   # folded to the terminal
    assert "no box given" in out and "turn off: VLLM_ALLREDUCE_USE_FLASHINFER=0" in out


def test_recommend_on_the_pcie_fixture_offers_sglang_pcie_ipc(capsys):
    assert cli(["recommend", str(PCIE_RUN), "--model", "glm-5", "--engine", "sglang", "--wide"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("  4. FlashInfer PCIe IPC allreduce [")]
    assert "[opt-in: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1; not measured]: available here" in row


# --- launch lines that do what they claim ----------------------------------------------------

GLM5_SIZES = [6144 * 2 * c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256)]


def _launch(engine: str, snapshot: dict, path: str, settings: engines.Settings, workload: Workload) -> list[str]:
    """The line, or [] where no line moves decode to the path here (the option is not offered)."""
    launched, moved = engines.launch_settings(settings, engine, path, found(engine, snapshot, workload), GLM5_SIZES)
    if moved.why_not:
        return []
    lines, refusal = engines.paste_lines(launched, engine, 8)
    assert refusal is None
    return shlex.split(lines[-1])


def read_back(engine: str, line: str) -> paths.Launch:
    """A paste-ready line as the engine reads it: the variables before the command, the flags after."""
    words = shlex.split(line)
    command = len(shlex.split(BY_KEY[engine].words.command.format(tp=8)))
    env_words = [w for w in words[:len(words) - command] if "=" in w]
    rest = words[len(env_words) + command:]
    return paths.Launch.of(dict(w.split("=", 1) for w in env_words), rest)


VLLM_LINES = {NCCL_PATH: engines.nccl_path("nccl"), CUSTOM_AR: engines.Settings(
    "vllm:auto", vllm_env=dict(engines.VLLM_ONLY_CUSTOM_ALLREDUCE), engine_paths=engines.claim(CUSTOM_AR, VLLM)),
    TORCH_SYMM_MEM: engines.Settings("symm_mem", vllm_env=dict(engines.VLLM_ONLY_SYMM_MEM),
                                     engine_paths=engines.claim(TORCH_SYMM_MEM, VLLM)),
    FLASHINFER_PCIE_IPC: engines.pcie_ipc("flashinfer:pcie_ipc", [])}
SGLANG_LINES = {NCCL_PATH: engines.nccl_path("nccl"),
                MSCCLPP: engines.Settings("mscclpp", sglang_flags=[engines.SGLANG_MSCCLPP]),
                TORCH_SYMM_MEM: engines.Settings("symm", sglang_flags=[engines.SGLANG_TORCH_SYMM_MEM]),
                NCCL_SYMM: engines.Settings("nccl_symm", sglang_flags=["--enable-symm-mem"]),
                FLASHINFER_PCIE_IPC: engines.pcie_ipc("flashinfer:pcie_ipc", [])}
FUSION_OFF = engines.VLLM_NO_FUSE_ALLREDUCE_RMS


@pytest.mark.parametrize("path", sorted(VLLM_LINES))
def test_every_vllm_line_moving_decode_off_flashinfer_turns_the_fusion_off(path):
    argv = _launch(VLLM, H200, path, VLLM_LINES[path], GLM5)
    at = argv.index(FUSION_OFF[0])
    assert json.loads(argv[at + 1]) == {"pass_config": {"fuse_allreduce_rms": False}}
    # where the fusion is off anyway (SM12, --enforce-eager) the line does not carry it (on 8 PCIe GPUs
    # custom allreduce and torch symm-mem are off: no line is offered for them)
    assert FUSION_OFF[0] not in _launch(VLLM, PCIE, path, VLLM_LINES[path], GLM5)
    assert bool(_launch(VLLM, PCIE, path, VLLM_LINES[path], GLM5)) == (path in (NCCL_PATH, FLASHINFER_PCIE_IPC))
    assert FUSION_OFF[0] not in _launch(VLLM, H200, path, VLLM_LINES[path], Workload("X", 6144, "eager"))


@pytest.mark.parametrize("path", sorted(SGLANG_LINES))
def test_every_sglang_line_for_a_listed_architecture_disables_its_flashinfer_routing(path):
    assert engines.SGLANG_NO_FLASHINFER in _launch(SGLANG, H200, path, SGLANG_LINES[path], GLM5)
    assert engines.SGLANG_NO_FLASHINFER not in _launch(SGLANG, H200, path, SGLANG_LINES[path], LLAMA)


@pytest.mark.parametrize("path, snapshot, world_size", [
    (TORCH_SYMM_MEM, H200, 8),              # custom allreduce v2 takes <= 16 MiB ahead of torch symm-mem
    (NCCL_SYMM, H200, 8),                   # --enable-symm-mem yields to custom allreduce
    (FLASHINFER_PCIE_IPC, PCIE, 2)])        # the legacy custom allreduce takes <= 8 MiB ahead of PCIe IPC
def test_sglang_opt_in_lines_turn_off_the_custom_allreduce_that_sglang_tries_first(path, snapshot, world_size):
    """Issue 57: SGLang tries its custom allreduce before NCCL symmetric memory, PCIe IPC and torch
    symmetric memory (parallel_state.py): their lines carry --disable-custom-all-reduce too."""
    launched, moved = engines.launch_settings(SGLANG_LINES[path], SGLANG, path, found(SGLANG, snapshot, GLM5, world_size),
                                              GLM5_SIZES)
    assert engines.DISABLE_CUSTOM_ALLREDUCE in launched.sglang_flags and moved.sizes
    assert any("--disable-custom-all-reduce turns custom allreduce (CUDA IPC) off" in n for n in launched.notes)


SNAPSHOT_FILES = sorted(SNAPSHOTS.glob("*.json"))
WORKLOADS = {"glm-5 graph": GLM5, "llama graph": LLAMA, "llama eager": Workload("LlamaForCausalLM", 8192, "eager"),
             "glm-5 fp16": Workload("GlmMoeDsaForCausalLM", 6144, dtype="fp16")}


@pytest.mark.parametrize("snapshot_file", SNAPSHOT_FILES, ids=lambda p: p.stem)
def test_every_option_of_every_engine_moves_the_decode_sizes_it_claims(snapshot_file):
    """Issue 57 item 1: for every path a user can select in every engine, on every fixture box at
    every world size it has, the printed launch line, read back as the engine reads it, makes that
    path the first in the engine's order to take each decode size the option claims; an option that
    cannot is not offered and says why."""
    snapshot = json.loads(snapshot_file.read_text())
    gpus = len(snapshot.get("gpus") or [])
    checked = 0
    for world_size in sorted({w for w in (2, 4, 8) if w <= max(gpus, 2)}):
        for name, workload in WORKLOADS.items():
            sizes = [(workload.hidden or 1) * 2 * c for c in (1, 4, 16, 64, 256)]
            for engine in engines.ENGINES:
                states_ = found(engine, snapshot, workload, world_size)
                for state in states_:
                    rule = state.rule
                    if rule.on is None and rule.off is None:
                        continue            # the fallback: nothing selects it
                    base = engines.Settings(f"{engine}:{rule.path}", **{
                        f"{engine}_env": dict(rule.on.env) if rule.on else {},
                        f"{engine}_flags": list(rule.on.flags) if rule.on else []})
                    launched, moved = engines.launch_settings(base, engine, rule.path, states_, sizes)
                    if moved.why_not:
                        assert not moved.sizes, (engine, rule.path)
                        continue
                    lines, refusal = engines.paste_lines(launched, engine, world_size)
                    assert refusal is None, refusal
                    launch = read_back(engine, lines[-1])
                    for size in moved.sizes:
                        taker = paths.taker(states_, launch, size, rule.op).path
                        assert taker is not None and taker.path == rule.path, (
                            snapshot_file.stem, world_size, name, engine, rule.path, size, lines[-1])
                        checked += 1
    assert checked or gpus < 2


def test_a_path_that_needs_cuda_graphs_says_so_in_the_engines_words_and_the_fused_line_keeps_the_fusion():
    launched, _ = engines.launch_settings(VLLM_LINES[FLASHINFER_PCIE_IPC], VLLM, FLASHINFER_PCIE_IPC,
                                          found(VLLM, PCIE, GLM5), GLM5_SIZES)
    assert "this path runs only inside CUDA graphs: do not add --enforce-eager" in launched.notes
    launched, _ = engines.launch_settings(SGLANG_LINES[MSCCLPP], SGLANG, MSCCLPP, found(SGLANG, H200, LLAMA),
                                          GLM5_SIZES)
    assert "this path runs only inside CUDA graphs: do not add --disable-decode-cuda-graph" in launched.notes
    fused = engines.Settings("flashinfer:fused", vllm_flags=list(engines.VLLM_FUSE_ALLREDUCE_RMS),
                             engine_paths=engines.claim(FLASHINFER_FUSED, VLLM))
    argv = _launch(VLLM, H200, FLASHINFER_FUSED, fused, GLM5)
    assert argv.count("--compilation-config") == 1 and "true" in argv[argv.index("--compilation-config") + 1]


# --- the reader, --check, --engine-site --------------------------------------------------------

@pytest.mark.parametrize("fact", vllm.FACTS.facts + sglang.FACTS.facts + flashinfer.FACTS.facts, ids=lambda f: f.key)
def test_every_fact_names_its_source(fact):
    # A scan (KERNELS) reads a kernel source or library, or a Python call no ast kind reads
    # (FlashInfer's jit/comm.py: the architectures a module is built for).
    kinds = (".so", ".cuh", ".py") if fact.kind == facts_.KERNELS else (".py",)
    assert fact.file.startswith(("vllm/", "sglang/", "flashinfer/")) and fact.file.endswith(kinds) and fact.symbol


@pytest.mark.procs     # its custom_all_reduce.py is imported in the gate check's child process
def test_check_prints_each_difference_and_exits_1(capsys):
    assert cli(["engines", "--check", str(SRC / "vllm-site"), "--wide"]) == 1
    out = capsys.readouterr().out
    assert "vLLM 0.34.0 at " in out
    assert ("custom_ar_world_sizes: built in [2, 4, 6, 8, 16]; source [2, 4, 8] "
            "(vllm/distributed/device_communicators/custom_all_reduce.py:5)") in out
    assert "env_skip_p2p_check: built in '1'; source '0' (vllm/envs.py:6)" in out
    assert "same: env_use_flashinfer (vllm/envs.py:5)" in out and "same: custom_ar_max_bytes" in out
    assert "dispatch_order: built in [" in out and "cannot be read" in out


@pytest.mark.parametrize("site, words", [("other-site", "holds no vllm, sglang or flashinfer package (give a "
                                                        "site-packages folder or an unpacked vLLM, SGLang or FlashInfer "
                                                        "wheel)"),
                                         ("missing-site", "does not exist"), ("README.md", "is not a folder")])
def test_check_refuses_what_is_no_engine_with_one_line(site, words, capsys):
    assert cli(["engines", "--check", str(SRC / site)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_engine_site_reads_the_facts_and_says_so(capsys):
    assert cli(["engines", str(SNAPSHOTS / "h200-nvlink-8x.json"), "--engine", "vllm", "--engine-site",
                str(SRC / "vllm-site"), "--wide"]) == 0
    out = capsys.readouterr().out
    assert f"facts: vLLM 0.34.0 read from {SRC / 'vllm-site'}" in out
    assert "world size 8 is not one of" not in out and "custom_all_reduce.py:5" in out
    assert "dispatch_order not read" in out       # a fact its source does not give: built in, with a warning
    assert cli(["engines", "--engine", "vllm", "--engine-site", str(SRC / "newer-site"), "--wide"]) == 0
    out = capsys.readouterr().out
    assert "vLLM 9.9.0 read from" in out or "vLLM 9.9.0" in out
    assert "commbench has no reader checked against it; vLLM 0.34.0 facts built in used" in out
    assert cli(["engines", "--engine-site", str(SRC / "other-site")]) == 2


def test_engine_site_wants_an_engine_where_check_takes_a_library_alone(tmp_path, capsys):
    """--engine-site gives an engine's facts: a tree of FlashInfer alone is refused there, naming
    the engines only, though `engines --check` reads it."""
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    assert cli(["engines", "--engine-site", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--engine-site: {tmp_path} holds no vllm or sglang package (give a site-packages folder or an unpacked " \
           "vLLM or SGLang wheel)" in err


def test_an_installed_engine_is_found_without_importing_it(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (site / "vllm-0.34.0.dist-info").mkdir()
    (site / "vllm-0.34.0.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.34.0\n")
    monkeypatch.syspath_prepend(str(site))
    facts = source.resolve(None)[VLLM]
    assert facts.origin == "installed here" and source.provenance_line(facts) == "read from vLLM 0.34.0 installed here"
    assert facts.value("custom_ar_world_sizes") == [2, 4, 6, 8, 16] and facts.warnings   # nothing to read: built in


# --- the engine's own start-up log -------------------------------------------------------------

def test_engine_log_gives_the_chain_the_engine_set_up(capsys):
    assert cli(["engines", str(SNAPSHOTS / "h200-nvlink-8x.json"), "--engine", "vllm", "--mode", "eager",
                "--engine-log", str(SRC / "vllm-startup.log")]) == 0
    out = capsys.readouterr().out
    assert "vLLM's start-up log" in out and "FLASHINFER, CUSTOM, PYNCCL" in out
    assert "torch symmetric memory [on by default]: off: not set up by the engine" in out
    assert "custom allreduce (CUDA IPC) [on by default]: on: set up by the engine" in out


def test_a_log_without_a_dispatch_line_is_one_line_and_exit_2(capsys):
    for argv in (["engines", "--engine-log", str(SRC / "no-dispatch.log")],
                 ["recommend", str(PCIE_RUN), "--model", "glm-5", "--engine-log", str(SRC / "no-dispatch.log")],
                 ["engines", "--engine-log", str(SRC / "absent.log")]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert "--engine-log" in err and len(err.strip().splitlines()) == 1


# --- an nccl-tests import prices NCCL --------------------------------------------------------

def test_recommend_on_an_imported_8x_h200_log_prices_nccl(tmp_path, capsys):
    data = ROOT / "tests/data/nccl-tests"
    out = tmp_path / "imported"
    assert cli(["import-nccl-tests", str(data / "h200-8gpu-mpi-graph.txt"), str(data / "h200-8gpu-mpi-graph.json"),
                "--out", str(out)]) == 0
    capsys.readouterr()
    run = load_run(out)
    curves = decode_curves(run, 8, "bf16", "auto")
    for engine in engines.ENGINES:
        e = BY_KEY[engine]
        option, price = decide.best_path_at(e, e.facts, run, curves, decide.box_of(run, 8), "bf16", 12 * KiB)
        assert option is not None and option.state.path == NCCL_PATH and price is not None
    assert cli(["recommend", str(out), "--model", "glm-5", "--wide"]) == 0
    text = capsys.readouterr().out
    assert "no CUDA GPU" not in text and "cannot tell from an nccl-tests import without a probe snapshot" in text
    assert "NCCL (PyNccl): priced by nccl-tests:" in text


# --- the model's architecture ----------------------------------------------------------------

def test_presets_carry_their_architecture_and_arch_names_your_own(capsys):
    from commbench import models
    assert models.lookup("glm-5").arch == "GlmMoeDsaForCausalLM"
    assert models.lookup("llama-3.1-70b").arch == "LlamaForCausalLM"
    assert all(m.arch for m in models.presets().values())
    own = ["engines", str(SNAPSHOTS / "h200-nvlink-8x.json"), "--engine", "sglang", "--hidden", "6144", "--mode", "graph"]
    assert cli(own) == 0
    out = capsys.readouterr().out
    assert "architecture not given (--arch NAME)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("1 ") and "12K" in line)
    assert "custom allreduce (CUDA IPC)" in row      # unlisted: SGLang's default for other architectures
    assert cli([*own, "--arch", "GlmMoeDsaForCausalLM"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("1 ") and "12K" in line)
    assert "FlashInfer allreduce" in row
    assert cli([*own, "--arch", "not a class; rm -rf"]) == 2
    assert "--arch" in capsys.readouterr().err


def test_a_missing_engine_site_is_one_line_and_exit_2(capsys):
    assert cli(["recommend", str(PCIE_RUN), "--model", "glm-5", "--engine-site", str(SRC / "absent")]) == 2
    err = capsys.readouterr().err
    assert "--engine-site" in err and "does not exist" in err and len(err.strip().splitlines()) == 1


def test_sglang_pcie_ipc_is_priced_by_flashinfer_rows_where_measured(capsys):
    """The 8-rank emulated PCIe run measured flashinfer:pcie_ipc (recorded before SGLang's path was
    known: its settings are upgraded); for GLM-5 turning it on also turns SGLang's FlashInfer routing
    off (`engines` says so; recommend pastes no line here: this run cannot price SGLang's default)."""
    run = ROOT / "results/reference/h200-mps-emulated/world8/pcie/20261202-005850-vm"
    assert cli(["recommend", str(run), "--model", "glm-5", "--engine", "sglang", "--concurrency", "1", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "= FlashInfer PCIe IPC allreduce: priced by flashinfer:pcie_ipc (graph)" in out
    assert cli(["engines", str(run), "--model", "glm-5", "--engine", "sglang"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # ranks share one GPU: whether the custom allreduce (tried first) takes these sizes cannot be read,
    # so the line turns it off too
    assert ("turn on: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1; with it: `--enforce-disable-flashinfer-allreduce-fusion` "
            "`--disable-custom-all-reduce`;" in out)
    assert cli(["engines", str(run), "--model", "llama-3.1-70b", "--engine", "sglang"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # no FlashInfer routing to turn off for Llama; the custom allreduce (its gate unknown here) still is
    assert "turn on: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1; with it: `--disable-custom-all-reduce`; turn off" in out
