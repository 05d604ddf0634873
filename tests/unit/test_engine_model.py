"""Issue 57, the engine model's second pass: the partly-right rules and the facts that were not
modelled, each against the fixtures' boxes; pricing that follows each engine's dispatch order; the
kernel names a profiler trace shows per engine path; one engine in one file, one box read once."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

from commbench import engines
from commbench.analysis import decide, question
from commbench.analysis.curves import build_curves
from commbench.analysis.trace_kernels import classify
from commbench.engines import flashinfer, paths, sglang, vllm
from commbench.engines.facts import KERNELS
from commbench.engines.paths import (CUSTOM_AR, FLASHINFER_AR, FLASHINFER_FUSED, FLASHINFER_PCIE_IPC, NCCL_PATH,
                                     NCCL_SYMM, TORCH_SYMM_MEM, Workload)
from commbench.engines.registry import BY_KEY, ENGINES
from commbench.ops import ALLREDUCE, FUSED_OP
from commbench.results import Run, RunInfo
from commbench.topology import box as boxes
from factories import row

ROOT = Path(__file__).parents[2]
SNAPSHOTS = ROOT / "tests/fixtures/snapshots"
H200 = json.loads((SNAPSHOTS / "h200-nvlink-8x.json").read_text())
B300 = json.loads((SNAPSHOTS / "b300-nvlink-8x.json").read_text())
PCIE = json.loads((ROOT / "tests/data/runs/synthetic-pcie-8gpu/run.json").read_text())["snapshot"]
KiB, MiB = 1 << 10, 1 << 20
GLM5 = Workload("GlmMoeDsaForCausalLM", 6144)
LLAMA = Workload("LlamaForCausalLM", 8192)
VLLM, SGLANG = vllm.KEY, sglang.KEY


def box_of(snapshot: dict, world_size: int = 8, **changes) -> boxes.Box:
    return replace(boxes.read(snapshot, world_size), **changes)


def states(engine: str, box: boxes.Box, workload: Workload = Workload()) -> list[paths.PathState]:
    return paths.states(BY_KEY[engine], box, workload)


def by_path(engine: str, box: boxes.Box, workload: Workload = Workload()) -> dict[str, paths.PathState]:
    return {s.path: s for s in states(engine, box, workload)}


def default(engine: str, box: boxes.Box, size: int, workload: Workload = Workload()) -> str | None:
    chosen = paths.default_path(states(engine, box, workload), size).path
    return chosen.path if chosen else None


# --- the partly-right rules --------------------------------------------------------------------

def test_torch_symm_mem_is_bf16_only_in_both_engines():
    """vLLM symm_mem.py:54,120 and SGLang torch_symm_mem.py:75,143: with --dtype fp16 vLLM's
    768K-3M at H200 TP8 go to NCCL, not symm-mem."""
    fp16 = Workload("LlamaForCausalLM", 6144, dtype="fp16")
    for engine in (VLLM, SGLANG):
        state = by_path(engine, box_of(H200), fp16)[TORCH_SYMM_MEM]
        # the communicator is up (the custom allreduce keeps its smaller cap beside it) and takes nothing
        assert state.available is True and "bf16 only" in state.why and not state.admits(16 * KiB)
    for size in (768 * KiB, 1536 * KiB, 3 * MiB):
        assert default(VLLM, box_of(H200), size, fp16) == NCCL_PATH
        assert default(VLLM, box_of(H200), size, Workload("LlamaForCausalLM", 6144)) == TORCH_SYMM_MEM
    assert vllm.FACTS.fact("symm_mem_bf16_only").file.endswith("symm_mem.py")
    assert sglang.FACTS.fact("torch_symm_mem_bf16_only").file.endswith("torch_symm_mem.py")


def test_sglang_torch_symm_mem_limit_is_strict_where_vllm_is_inclusive():
    sg = by_path(SGLANG, box_of(H200))[TORCH_SYMM_MEM]
    vl = by_path(VLLM, box_of(H200))[TORCH_SYMM_MEM]
    assert not sg.inclusive and not sg.admits(128 * MiB) and sg.admits(128 * MiB - 16)
    assert vl.inclusive and vl.admits(64 * MiB)


def test_vllm_refuses_its_custom_allreduce_above_8_ranks():
    """custom_all_reduce.py:501: the communicator starts at 16 ranks but should_custom_ar refuses."""
    state = by_path(VLLM, box_of(H200, world_size=16, gpu_ids=tuple(range(16)), nvlink_all=True))[CUSTOM_AR]
    assert state.available is False and "above 8 ranks" in state.why
    assert vllm.FACTS.value("custom_ar_above_8_refused") is True


def test_vllm_custom_allreduce_keeps_8_mib_where_its_line_turns_torch_symm_mem_off():
    """The vllm:auto option runs with VLLM_ALLREDUCE_USE_SYMM_MEM=0: the custom allreduce's cap is then
    its own 8 MiB, not the 256 KiB it has at H200 TP8 beside symm-mem."""
    found = states(VLLM, box_of(H200), LLAMA)
    ca = next(s for s in found if s.path == CUSTOM_AR)
    assert ca.max_bytes == 256 * KiB and ca.cap_alone == (TORCH_SYMM_MEM, 8 * MiB)
    vllm_auto = paths.Launch.of(dict(engines.VLLM_ONLY_CUSTOM_ALLREDUCE), [])
    for size in (1 * MiB, 4 * MiB, 8 * MiB - 16):
        assert paths.taker(found, vllm_auto, size).path is ca
        assert paths.default_path(found, size).path.path == TORCH_SYMM_MEM
    assert paths.taker(found, vllm_auto, 8 * MiB).path.path == NCCL_PATH


def test_a_multi_node_blackwell_group_runs_flashinfer_mnnvl_in_both_engines():
    two_nodes = box_of(B300, nodes=2)
    for engine, path in ((VLLM, FLASHINFER_AR), (VLLM, FLASHINFER_FUSED), (SGLANG, FLASHINFER_AR)):
        state = by_path(engine, two_nodes, GLM5)[path]
        assert state.available is True and "mnnvl" in state.why, (engine, path, state.why)
    # Hopper across nodes: no FlashInfer in either
    hopper = box_of(H200, nodes=2)
    assert by_path(VLLM, hopper, GLM5)[FLASHINFER_AR].available is False
    assert by_path(SGLANG, hopper, GLM5)[FLASHINFER_AR].available is False
    assert vllm.flashinfer_backend(100, 2, False, vllm.FACTS) == "mnnvl"
    assert vllm.flashinfer_backend(90, 2, False, vllm.FACTS) is None


def test_sglang_on_sm10x_without_multicast_falls_back_from_flashinfer_to_custom_allreduce_v2():
    """flashinfer_comm_fusion.py: backend 'auto' is mnnvl on SM10x; where its workspace cannot be
    made the fusion is off for good and custom allreduce v2 takes the decode allreduces."""
    plain = box_of(B300, multicast=False)
    state = by_path(SGLANG, plain, GLM5)[FLASHINFER_AR]
    assert state.available is False and "Disabling flashinfer allreduce fusion permanently" in state.why
    assert default(SGLANG, plain, 12 * KiB, GLM5) == CUSTOM_AR
    assert default(SGLANG, box_of(B300), 12 * KiB, GLM5) == FLASHINFER_AR


def test_sglang_multicast_two_shot_pull_is_said_never_priced():
    with_multicast = by_path(SGLANG, box_of(H200))[CUSTOM_AR]
    assert "multicast two-shot pull that commbench's sglang:auto never measures" in with_multicast.why
    assert "multicast two-shot" not in by_path(SGLANG, box_of(H200, multicast=False))[CUSTOM_AR].why


def test_sglang_v2_runs_at_the_world_sizes_its_tuned_tables_have():
    """configs/custom_all_reduce_v2.py (found by `engines --check`): SM90 2-8, SM10x 2-8 and 16."""
    assert sglang.v2_world_sizes("9.0") == tuple(range(2, 9))
    assert 16 in sglang.v2_world_sizes("10.0") and 12 not in sglang.v2_world_sizes("10.0")


# --- facts that turn paths off ---------------------------------------------------------------

def test_vllm_batch_invariant_turns_flashinfer_pcie_ipc_symm_mem_off_and_the_custom_allreduce_takes_any_size():
    det = Workload("GlmMoeDsaForCausalLM", 6144, deterministic=True)
    found = by_path(VLLM, box_of(H200), det)
    for path in (FLASHINFER_FUSED, FLASHINFER_AR, FLASHINFER_PCIE_IPC, TORCH_SYMM_MEM):
        assert found[path].available is False and "VLLM_BATCH_INVARIANT=1" in found[path].why, path
    assert found[CUSTOM_AR].available is True and found[CUSTOM_AR].max_bytes is None
    assert default(VLLM, box_of(H200), 64 * MiB, det) == CUSTOM_AR
    nccl_symm = by_path(VLLM, box_of(H200), replace(det, arch=None))[NCCL_SYMM]
    assert nccl_symm.available is False


def test_sglang_deterministic_mode_turns_pcie_ipc_and_flashinfer_off():
    det = Workload("GlmMoeDsaForCausalLM", 6144, deterministic=True)
    pcie = by_path(SGLANG, box_of(PCIE, world_size=2), det)[FLASHINFER_PCIE_IPC]
    assert pcie.available is False and "--enable-deterministic-inference" in pcie.why
    fi = by_path(SGLANG, box_of(H200), det)[FLASHINFER_AR]
    assert fi.available is False and not fi.default_on
    assert default(SGLANG, box_of(H200), 12 * KiB, det) == CUSTOM_AR


def test_sglang_pcie_ipc_is_capped_at_its_decode_batch_times_hidden():
    """pcie_ipc_ar.py: max_numel = decode width x hidden; memory_hook.py: 512 rows from TP4 on a
    96-160 GiB GPU, 256 below TP4."""
    rtx = box_of(PCIE, world_size=8, memory_mib=97887.0)     # RTX PRO 6000 Blackwell Server Edition
    assert sglang.decode_max_bs(rtx) == 512 and sglang.decode_max_bs(replace(rtx, world_size=2)) == 256
    state = by_path(SGLANG, rtx, GLM5)[FLASHINFER_PCIE_IPC]
    assert state.max_bytes == 512 * 6144 * 2 and state.inclusive
    assert sglang.decode_max_bs(replace(rtx, memory_mib=None)) == 160


def test_silent_offs_and_unmodelled_conditions_are_said_with_their_sources():
    h200 = box_of(H200)
    vllm_paths = by_path(VLLM, h200, GLM5)
    assert "where the NCCL allocator's JIT build fails" in vllm_paths[NCCL_SYMM].why
    assert "off with dual-batch overlap" in vllm_paths[FLASHINFER_PCIE_IPC].why
    assert "HiSparse" in vllm_paths[FLASHINFER_AR].why
    sg = by_path(SGLANG, h200, GLM5)
    assert "`mscclpp` package" in sg[paths.MSCCLPP].why
    assert "no MoE all-to-all backend" in sg[FLASHINFER_AR].why and "no attention-DP" in sg[FLASHINFER_AR].why
    for f in (vllm.FACTS, sglang.FACTS):
        for key in ("nccl_symm_allocator_jit", "pcie_ipc_off_under_dbo", "flashinfer_hisparse_trtllm") \
                if f is vllm.FACTS else ("mscclpp_package", "flashinfer_auto_conditions", "pcie_ipc_off_deterministic"):
            assert f.fact(key).file and f.fact(key).symbol


def test_hisparse_is_a_vllm_0_34_fact_absent_from_0_33():
    fact = vllm.FACTS.fact("flashinfer_hisparse_trtllm")
    assert fact.since == "0.34.0" and fact.absent is False
    older = replace(vllm.FACTS, facts=tuple(replace(f, value=f.absent) if f.since else f for f in vllm.FACTS.facts))
    assert vllm.flashinfer_backend(100, 2, True, older) == "mnnvl"
    assert vllm.flashinfer_backend(100, 2, True, vllm.FACTS) is None


# --- each engine in its own words -----------------------------------------------------------------

def test_each_engine_names_its_own_eager_switch():
    assert BY_KEY[VLLM].words.eager == "--enforce-eager"
    assert BY_KEY[SGLANG].words.eager == "--disable-decode-cuda-graph"
    assert sglang.FACTS.fact("decode_graph_flag").symbol.startswith("disable_decode_cuda_graph")
    eager = Workload("LlamaForCausalLM", 8192, "eager")
    assert "off under --disable-decode-cuda-graph" in by_path(SGLANG, box_of(H200), eager)[paths.MSCCLPP].why


def test_the_engines_command_heads_its_modes_in_each_engines_words(capsys):
    from commbench.cli import main as cli
    assert cli(["engines", str(SNAPSHOTS / "h200-nvlink-8x.json"), "--model", "glm-5"]) == 0
    out = capsys.readouterr().out
    vllm_part, sglang_part = out.split("== SGLang")
    assert "default (--enforce-eager)" in vllm_part and "--disable-decode-cuda-graph" not in vllm_part
    assert "default (--disable-decode-cuda-graph)" in sglang_part and "--enforce-eager" not in sglang_part


# --- the kernel names a profiler trace shows -----------------------------------------------------

@pytest.mark.parametrize("fact", [f for e in ENGINES for f in e.facts.facts if f.kind == KERNELS
                                  and f.key.endswith("_kernels")],
                         ids=lambda f: f.key)
def test_every_engine_kernel_name_is_classified_by_attribute(fact):
    """The engines' kernel names are facts read from their kernel sources (checked per release):
    `attribute` must name each as that engine's allreduce, never unclassified communication."""
    for name in fact.value:
        got = classify(f"void sglang::{name}<__nv_bfloat16, 8u, true>(x)" if "all_reduce" in name
                       else f"void vllm::{name}<__nv_bfloat16, 8>(vllm::RankData*)")
        assert got.kind == "allreduce" and "unclassified" not in got.library, (name, got)


def _flashinfer_trace_names() -> list[tuple[str, str, str]]:
    """(demangled name as a trace shows it, library, op) for every FlashInfer kernel-name fact,
    built from the facts (namespaces, the pattern argument and its numbers) the way the H200 traces
    name them: void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<
    (flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true, true>(...)."""
    f = flashinfer.FACTS
    (fusion,), (enum,), (mnnvl,), (pcie,) = (f.value(k) for k in ("fusion_namespace", "fusion_pattern_argument",
                                                                  "mnnvl_namespace", "pcie_ipc_namespace"))
    numbers = dict(entry.split(" = ") for entry in f.value("fusion_pattern_numbers"))
    assert {int(n) for n in numbers.values()} == {f.value("pattern_allreduce"), f.value("pattern_residual_rmsnorm")}
    out = []
    for kernel in f.value("fusion_kernels"):
        stage = "one-shot" if "oneshot" in kernel else "two-shot"
        for enumerator, library, op in (("kAllReduce", f"FlashInfer TRT-LLM fusion {stage}", ALLREDUCE),
                                        ("kARResidualRMSNorm", f"FlashInfer allreduce+RMSNorm fusion {stage}",
                                         FUSED_OP)):
            out.append((f"void flashinfer::{fusion}::{kernel}<(flashinfer::{fusion}::{enum}){numbers[enumerator]}, "
                        f"__nv_bfloat16, 8, true, true>(flashinfer::{fusion}::AllReduceFusionParams<__nv_bfloat16>)",
                        library, op))
    out += [(f"void flashinfer::{mnnvl}::{kernel}<(unsigned char)8, __nv_bfloat16, true, "
             f"(flashinfer::{mnnvl}::QuantType)0, float4>(flashinfer::{mnnvl}::AllReduceKernelParams<__nv_bfloat16>)",
             "FlashInfer MNNVL", ALLREDUCE) for kernel in f.value("mnnvl_kernels")]
    out += [(f"void flashinfer::comm::{pcie}::{kernel}<__nv_bfloat16, 8, true, false>(flashinfer::comm::{pcie}::"
             "PushOneshotParamData<__nv_bfloat16>)", "FlashInfer PCIe IPC", ALLREDUCE)
            for kernel in f.value("pcie_ipc_kernels")]
    return out


@pytest.mark.parametrize("name, library, op", _flashinfer_trace_names(), ids=lambda v: v[:90])
def test_every_flashinfer_kernel_name_is_classified_by_attribute(name, library, op):
    """FlashInfer's kernel names are facts read from its kernel sources (flashinfer.py, checked per
    release): `attribute` names each as that FlashInfer allreduce, the fused pattern as the fused op."""
    got = classify(name)
    assert (got.kind, got.library, got.op) == ("allreduce", library, op), name


def test_flashinfer_kernel_facts_cover_each_of_its_engine_paths():
    """Every kernel-name fact of FlashInfer is one the test above builds a trace name from."""
    kernels = {f.key for f in flashinfer.FACTS.facts if f.kind == KERNELS and f.key.endswith("_kernels")}
    assert kernels == {"fusion_kernels", "mnnvl_kernels", "pcie_ipc_kernels"}


def test_sglang_v2_kernel_names_are_the_wheels():
    assert sglang.FACTS.value("v2_kernels") == ["all_reduce_1shot_pull_kernel", "all_reduce_1shot_push_kernel",
                                                 "all_reduce_2shot_pull_kernel", "all_reduce_2shot_push_kernel"]
    assert sglang.FACTS.fact("v2_kernels").file == "sglang/kernels/jit/csrc/distributed/custom_all_reduce.cuh"


# --- one engine in one file, one box read once -----------------------------------------------------

SHARED = ["commbench/engines/paths.py", "commbench/engines/source.py", "commbench/engines/log.py",
          "commbench/engines/facts.py", "commbench/engines/gates.py", "commbench/engines/explain.py",
          "commbench/analysis/decide.py", "commbench/analysis/question.py", "commbench/analysis/configure.py",
          "commbench/analysis/recommend.py", "commbench/analysis/floor.py", "commbench/analysis/engine_chains.py",
          "commbench/analysis/configure_text.py", "topology/box.py"]


@pytest.mark.parametrize("file", SHARED)
def test_the_shared_machinery_knows_no_engine_by_name(file):
    """No string literal in the shared modules' code is an engine's key (or the key of a library
    checked like one, FlashInfer), and none names vLLM or SGLang as a branch would (docstrings and
    comments may say what the engines are)."""
    tree = ast.parse((ROOT / file).read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    named = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and id(n) not in docstrings and n.value.lower() in ("vllm", "sglang", "flashinfer")]
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module in ("commbench.engines.vllm", "commbench.engines.sglang", "commbench.engines.flashinfer")]
    assert not named and not imports, (file, named)


def test_no_module_level_state_in_the_engines_package():
    """source.py once kept the chosen engine site in module globals: every module's top-level
    assignments are constants now (no name is rebound by a `global` statement)."""
    for path in (ROOT / "commbench/engines").glob("*.py"):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], path.name


def test_the_box_is_read_once_per_answer(monkeypatch):
    """question.answer reads the run's box once and hands it down typed; nothing below re-reads
    the snapshot."""
    calls = []
    real = boxes.read
    monkeypatch.setattr(boxes, "read", lambda *a, **k: calls.append(a) or real(*a, **k))
    args = type("A", (), {"engine_site": None, "engine_log": None, "engine": None, "engine_version": None,
                          "concurrency": "1,64", "prefill_tokens": None, "run_dir": str(ROOT / "tests/data/runs/"
                                                                                              "synthetic-pcie-8gpu"),
                          "tp": None, "mode": "auto", "output_tokens": 128})()
    from commbench import models
    found = question.answer(question.from_args(args, models.lookup("glm-5")))
    assert len(calls) == 1 and found.box.fabric_known and len(found.records) == 2


def test_options_are_priced_by_who_takes_each_size_under_their_line(tmp_path):
    """SGLang on the H200 for GLM-5: --enable-torch-symm-mem alone would leave decode on FlashInfer
    and then custom allreduce v2; its line turns both off, so torch symm-mem's rows price it."""
    facts = {"symm": {"engine_settings": engines.Settings(
        "symm", sglang_flags=[engines.SGLANG_TORCH_SYMM_MEM], vllm_supported=False,
        engine_paths=engines.claim(TORCH_SYMM_MEM, SGLANG)).to_dict()}}
    rows = [row(backend="symm", message_bytes=s, latency_us=7.0) for s in (8 * KiB, 64 * KiB, 1 * MiB)]
    run = Run(tmp_path, RunInfo(snapshot=H200, world_size=8, backend_facts=facts), rows)
    engine = BY_KEY[SGLANG]
    found = paths.states(engine, boxes.read(H200, 8), GLM5)
    (option,) = decide.options(SGLANG, found, run, build_curves(rows), [12 * KiB, 96 * KiB])
    assert [s.text() for s in option.move.added] == ["--enforce-disable-flashinfer-allreduce-fusion",
                                                      "--disable-custom-all-reduce"]
    taker, price = decide.priced_under(found, [option], option, 12 * KiB)
    assert taker.path == TORCH_SYMM_MEM and price is not None and price.latency_us == pytest.approx(7.0)
    taker, price = decide.priced_under(found, [option], None, 12 * KiB)
    assert taker.path == FLASHINFER_AR and price is None     # the default, not measured here
