"""`commbench attribute`: kernel attribution, steps, sizes and the floor, on recorded and
constructed traces (tests/data/traces/README.md says how each was made)."""

from __future__ import annotations

import gzip
import json
import os
import re
import sqlite3
import sys
from pathlib import Path

import pytest

from commbench.analysis import attribute, attribute_floor, trace_read, traces
from commbench.analysis.attribution import SizeHint
from commbench.analysis.trace_kernels import _pattern, all_patterns, classify, literal_patterns
from commbench.cli import main as cli_main
from commbench.ops import ALLREDUCE, FUSED_OP
from factories import STAND_IN_US, fused_run, graph_trace
from helpers import run_cli

TRACES = Path(__file__).parents[1] / "data" / "traces"
CONSTRUCTED = TRACES / "constructed"
VLLM = sorted(CONSTRUCTED.glob("vllm-rank*.trace.json"))
SGLANG = sorted(CONSTRUCTED.glob("*-TP-*.trace.json.gz"))
GLOO = sorted((TRACES / "gloo").glob("*.trace.json.gz"))
GPU_MANIFEST = TRACES / "h200-mps" / "manifest.json"
RUN = Path(__file__).parents[2] / "results/reference/h200-mps-emulated/world2/allreduce/20261201-171211-vm"
VLLM_CA = "vLLM-style custom allreduce (vLLM, SGLang or FlashInfer's port)"
# FlashInfer's fusion kernel with AllReduceFusionPattern 1: allreduce + residual + RMSNorm, what the
# engines run by default for decode on an H200 (the first template argument, trtllm_allreduce_fusion.cuh)
FUSED_KERNEL = ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<"
                "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true, true>"
                "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionParams<__nv_bfloat16>)")
NO_HINT = SizeHint(None, "unknown")
# scripts/construct-traces.py: 4 layers x 2 allreduces of 8 us, 2 GEMMs of 20 us and one
# attention of 12 us per layer, 1 us apart; 5 decode replays, one eager prefill.
CONSTRUCTED_STEPS, CONSTRUCTED_CALLS = 5, 8
CONSTRUCTED_WALL_US = 4 * (2 * 8 + 2 * 20 + 12) + 4 * 5 - 1
CONSTRUCTED_SHARE = 8 * 8 / CONSTRUCTED_WALL_US


def attribute_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_main(["attribute", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name, library", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "NCCL"),
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclWorkElem)", "NCCL <= 2.18"),
    ("ncclSymkDevKernel_AllReduce_AGxLL_R_sum_bf16(ncclSymkDevWorkArgs4K)", "NCCL symmetric"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(...)", "torch symm-mem one-shot"),
    ("void c10d::symmetric_memory::two_shot_all_reduce_kernel_inplace<float, 16, 4>(...)",
     "torch symm-mem two-shot"),
    ("void p2p_ll_oneshot<__nv_bfloat16, 2>(Layout, uint4 const*, uint4*, unsigned int)", "commbench p2p"),
    ("void p2p_ll_oneshot_own_slot<2, 8>(Layout, uint4 const*, uint4*, unsigned int)", "commbench p2p"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<"
     "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)0, __nv_bfloat16, 2, true, true>(...)",
     "FlashInfer TRT-LLM fusion one-shot"),
    ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 8>(vllm::RankData*, ...)", VLLM_CA),
    ("void sglang::all_reduce_1shot_push_kernel<__nv_bfloat16, 8u, true>(sglang::AllReducePushParams<8u> const)",
     "SGLang JIT custom allreduce"),
    ("void sglang::all_reduce_2shot_pull_kernel<__nv_bfloat16, 8u, false>(sglang::AllReducePullParams<8u> const)",
     "SGLang JIT custom allreduce"),
    ("void mscclpp::collective::allreducePacket<__nv_bfloat16>(...)", "MSCCL++"),
    ("void oneRankReduce<FuncPreMulSum<__nv_bfloat16> >(ncclDevKernelArgs)", "NCCL (one rank)"),
    (FUSED_KERNEL, "FlashInfer allreduce+RMSNorm fusion one-shot"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync<"
     "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 8, true>(...)",
     "FlashInfer allreduce+RMSNorm fusion two-shot"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_twoshot_sync<"
     "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)3, __nv_bfloat16, 8, true>(...)",
     "FlashInfer TRT-LLM fusion two-shot"),
    ("void p2p_fused_oneshot<__nv_bfloat16>(FusedParams, uint4 const*)", "commbench p2p"),
    # trtllm_moe_allreduce_fusion.cuh:944 and :1251 (FlashInfer 0.7.4): both of its kernels
    ("void flashinfer::trtllm_moe_allreduce_fusion::moereduce_allreduce_fusion_kernel_oneshot_lamport<"
     "__nv_bfloat16, 8>(...)", "FlashInfer MoE allreduce fusion"),
    ("void flashinfer::trtllm_moe_allreduce_fusion::moefinalize_allreduce_fusion_kernel_oneshot_lamport<"
     "__nv_bfloat16, 8>(...)", "FlashInfer MoE allreduce fusion"),
])
def test_every_backend_module_names_its_kernels(name: str, library: str) -> None:
    got = classify(name)
    assert (got.kind, got.library) == ("allreduce", library)
    # FlashInfer's pattern 1 and commbench's fused kernels compute allreduce + residual + RMSNorm
    assert got.op == (FUSED_OP if "Pattern)1" in name or "p2p_fused" in name else ALLREDUCE)


def test_unknown_communication_is_never_compute() -> None:
    assert classify("void my_lab::fancy_allreduce_kernel<float>(float*)").kind == "communication"
    assert classify("ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)").kind == "communication"
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64").kind == "compute"


def test_unclassified_communication_is_listed_apart(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    graph_trace(trace, "void lab::my_allreduce_kernel<float>(float*)")
    code, out, _ = attribute_cli(capsys, str(trace))
    assert code == 0 and "no allreduce kernel in any step" in out
    assert ("unclassified communication (counted neither as compute nor as allreduce): lab::my_allreduce_kernel<> x12"
            in " ".join(out.split()))


def test_a_name_two_libraries_claim_is_ambiguous() -> None:
    patterns = (_pattern((r"\bshared_kernel\b", "lib A", "", ""), "a.py"),
                _pattern((r"\bshared_kernel\b", "lib B", "", ""), "b.py"))
    got = classify("void shared_kernel<float>()", patterns)
    assert got.kind == "allreduce" and got.library == "ambiguous: lib A or lib B" and got.floor_variants == ""


def test_patterns_are_read_from_module_sources_and_bad_literals_are_skipped() -> None:
    owners = {p.source for p in all_patterns()}
    assert {"nccl/backend.py", "nccl/symm.py", "symm_mem.py", "p2p/backend.py", "flashinfer/common.py", "mscclpp/backend.py"} <= owners
    assert literal_patterns("TRACE_KERNELS = ((r'x', 'X', '', ''),)\n", "m.py")[0].library == "X"
    assert literal_patterns("TRACE_KERNELS = compute()\n", "m.py") == []
    assert literal_patterns("TRACE_KERNELS = (('(', 'X', '', ''),)\n", "m.py") == []
    assert literal_patterns("def broken(:\n", "m.py") == []
    assert literal_patterns(f"TRACE_KERNELS = ((r'x', 'X', '', '', {FUSED_OP!r}),)\n", "m.py")[0].op == FUSED_OP
    assert literal_patterns("TRACE_KERNELS = ((r'x', 'X', '', '', 'allgather'),)\n", "m.py") == []


@pytest.mark.procs
def test_attribute_runs_with_torch_unimportable() -> None:
    # The subcommand's own module (the CLI's other subcommands may import torch).
    code = ("import argparse, sys; sys.modules['torch'] = None\n"
            "from commbench.analysis import attribute\n"
            "parser = argparse.ArgumentParser(); attribute.add_arguments(parser)\n"
            f"sys.exit(attribute.main(parser.parse_args([*{[str(p) for p in SGLANG]!r}, '--run', {str(RUN)!r}])))\n")
    done = __import__("subprocess").run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "SGLang JIT custom allreduce" in done.stdout


def _ranks(paths: list[Path], hint: SizeHint = NO_HINT, **kw: object) -> list:
    return traces.analyse_traces(paths, hint, **kw)[1]  # type: ignore[arg-type]


def test_constructed_vllm_graph_rule_counts_and_share() -> None:
    results = _ranks(VLLM)
    assert [r.rank for r in results] == [0, 1]
    for r in results:
        assert r.rule == "graph"
        assert len(r.steps) == CONSTRUCTED_STEPS and all(s.phase == "decode" for s in r.steps)
        for s in r.steps:
            assert len(s.calls) == CONSTRUCTED_CALLS
            assert {c.library for c in s.calls} == {VLLM_CA}
            assert s.wall_us == pytest.approx(CONSTRUCTED_WALL_US)
            assert s.share == pytest.approx(CONSTRUCTED_SHARE)
        assert len(r.outside_allreduce) == 8        # the eager prefill, outside the replays


def test_constructed_vllm_annotation_rule_reads_recorded_sizes() -> None:
    results = _ranks(VLLM, rule="annotation")
    for r in results:
        assert r.rule == "annotation" and len(r.steps) == CONSTRUCTED_STEPS + 1
        prefill = r.steps[0]
        assert {(c.message_bytes, c.size_from) for c in prefill.calls} == {(128 * 4096 * 2, "recorded")}
        assert {c.size_from for s in r.steps[1:] for c in s.calls} == {"unknown"}


def test_constructed_sglang_ranks_from_file_names_and_sizes_from_record_param_comms() -> None:
    results = _ranks(SGLANG, SizeHint(8 * 4096 * 2, "8 x 4096 x bf16"), rule="gap")
    assert [r.rank for r in results] == [0, 1]
    for r in results:
        assert len(r.steps) == CONSTRUCTED_STEPS + 1
        assert {(c.library, c.message_bytes, c.size_from) for c in r.steps[0].calls} == {
            ("NCCL", 128 * 4096 * 2, "recorded")}
        assert {(c.message_bytes, c.size_from) for s in r.steps[1:] for c in s.calls} == {
            (8 * 4096 * 2, "8 x 4096 x bf16")}


def test_streaming_reader_gives_the_same_records_at_any_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = trace_read.read_trace(SGLANG[0])[0]
    monkeypatch.setattr(trace_read, "CHUNK_CHARS", 7)
    chunked = trace_read.read_trace(SGLANG[0])[0]
    assert chunked.kernels == whole.kernels and chunked.collective_ops == whole.collective_ops
    assert len(whole.kernels) == 8 + CONSTRUCTED_STEPS * 4 * 5


def test_terminal_summary_fits_100_columns_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = attribute_cli(capsys, *map(str, VLLM), "--steps", "annotation", "--json", str(tmp_path / "a.json"))
    assert code == 0
    assert out.startswith("trace: constructed, not measured")
    assert max(len(line) for line in out.splitlines()) <= 100
    data = json.loads((tmp_path / "a.json").read_text())
    assert [len(s["calls"]) for s in data["ranks"][0]["steps"]] == [8] * 6
    assert data["kernels"][0]["library"] == VLLM_CA


def test_overlap_busy_time_and_a_merged_file_of_two_devices(tmp_path: Path) -> None:
    """Per replay: an allreduce on stream 7 (ts 0-30) beside a GEMM on stream 9 (ts 10-50); the
    merged file holds two devices and no rank, so each device is a rank."""
    events = []
    for device in (0, 1):
        for corr in range(3):
            t = 1000.0 + 5000 * corr
            events += [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)", "pid": device,
                        "tid": 7, "ts": t, "dur": 30.0, "args": {"stream": 7, "correlation": corr, "graph id": 1}},
                       {"ph": "X", "cat": "kernel", "name": "gemm", "pid": device, "tid": 9, "ts": t + 10, "dur": 40.0,
                        "args": {"stream": 9, "correlation": corr, "graph id": 1}}]
    path = tmp_path / "merged.json"
    path.write_text(json.dumps({"traceEvents": events}))
    results = _ranks([path])
    assert [r.rank for r in results] == [0, 1]
    for s in (s for r in results for s in r.steps):
        assert (s.wall_us, s.busy_us, s.overlap_us) == (50.0, 50.0, 20.0)
        assert s.share == pytest.approx(30 / 50)


def test_a_rule_the_trace_cannot_follow_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = attribute_cli(capsys, str(SGLANG[0]), "--steps", "annotation")
    assert code == 2 and "no step annotation" in err


def test_run_prices_each_call_against_the_same_librarys_floor(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    from commbench.analysis.curves import decode_curves
    from commbench.runs import load_run

    trace = tmp_path / "t.json"
    graph_trace(trace, "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(x)")
    code, out, _ = attribute_cli(capsys, str(trace), "--run", str(RUN), "--hidden", "4096", "--batch", "8")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("trace: a profiler trace as given") and lines[1].startswith("data: emulated: 2 ranks")
    floor_us = next(c for c in decode_curves(load_run(RUN), 2, "bf16", "graph")
                    if c.key.variant == "symm_mem:one_shot").at(8 * 4096 * 2).latency_us
    row = next(line for line in out.splitlines() if line.startswith("torch symm-mem one-shot") and line.endswith("%"))
    floor, per_call, per_step, per_token = (float(c) for c in row.split()[-5:-1])
    assert floor == pytest.approx(floor_us, rel=0.01)
    assert per_call == pytest.approx(30.0 - floor_us, abs=0.06)
    assert per_step == pytest.approx(4 * (30.0 - floor_us), abs=0.6)       # 4 calls a step
    assert per_token == pytest.approx(4 * (30.0 - floor_us) / 8, abs=0.06)  # batch 8


def test_an_engine_aware_choice_plugs_in_as_one_function(tmp_path: Path) -> None:
    """The seam for the engine-path model: given the run's curves and a size, the path the engine
    could take; here, for the test, the run's fastest curve at that size."""
    from commbench.analysis.curves import ranking
    from commbench.runs import load_run

    trace = tmp_path / "t.json"
    graph_trace(trace, "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(x)")
    ranks, results = traces.analyse_traces([trace], SizeHint(8 * 4096 * 2, "8 x 4096 x bf16"))
    lines = attribute_floor.floor_lines(load_run(RUN), ranks, results, None, 8,
                                  alternative=lambda curves, size: ranking(curves, size)[0].curve)
    [line] = lines
    assert line.alternative is not None and line.alternative.latency_us <= line.floor.latency_us  # type: ignore[union-attr]
    assert line.alternative.saving_per_step_us == pytest.approx(4 * (30.0 - line.alternative.latency_us))
    text = attribute_floor.floor_text(lines)
    assert "what the engine could take instead" in text and f"instead: {line.alternative.variant}" in text


@pytest.mark.parametrize("argv, expected", [
    (["--model", "llama-3.1-70b", "--batch", "4"], SizeHint(4 * 8192 * 2, "4 x 8192 x bf16", 8192)),
    (["--hidden", "4096", "--batch", "2", "--dtype", "fp32"], SizeHint(2 * 4096 * 4, "2 x 4096 x fp32", 4096)),
    (["--hidden", "4096"], SizeHint(None, "unknown")),
])
def test_size_hint_from_the_model_or_hidden_and_batch(argv: list[str], expected: SizeHint) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    attribute.add_arguments(parser)
    args = parser.parse_args(["t.json", *argv])
    assert traces.size_hint(args.model, args.hidden, args.batch, args.dtype) == expected


@pytest.mark.parametrize("argv, expected", [
    (["--batch", "0", "--hidden", "4096"], "--batch must be a whole number from 1"),
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "llama-3.1-70b", "--hidden", "4096"], "give --model or --hidden, not both"),
    (["--step-annotation", "("], "--step-annotation: not a regular expression"),
])
def test_bad_options_are_one_line_and_exit_2(argv: list[str], expected: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = attribute_cli(capsys, str(VLLM[0]), *argv)
    assert (code, out) == (2, "") and err.count("\n") == 1 and expected in err


def test_without_a_size_the_floor_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = attribute_cli(capsys, *map(str, SGLANG), "--run", str(RUN))
    assert code == 0
    assert "no floor: SGLang JIT custom allreduce at unknown: message size unknown" in out


def test_report_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    graph_trace(trace, "void p2p_ll_oneshot<__nv_bfloat16, 2>(Layout)")
    assert cli_main(["report", str(RUN), "--out", str(tmp_path / "rep"), "--trace", str(trace),
                     "--trace-hidden", "4096", "--trace-batch", "8"]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "Serving trace: what the engine pays for allreduce" in page and "commbench p2p" in page
    assert (tmp_path / "rep" / "plots" / "trace_timeline.png").stat().st_size > 0
    assert (tmp_path / "rep" / "plots" / "trace_floor.png").stat().st_size > 0


def test_nsys_sqlite_export(tmp_path: Path) -> None:
    db_path = tmp_path / "profile.sqlite"
    db = sqlite3.connect(db_path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, streamId INT,
            correlationId INT, demangledName INT, shortName INT, globalPid INT, graphId INT);
        INSERT INTO StringIds VALUES (1, 'ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)'),
                                     (2, 'gemm_kernel');
    """)
    rows = []
    for step in range(4):
        t = step * 1_000_000
        rows += [(t, t + 20_000, 0, 7, step, 2, 2, 1 << 24, None), (t + 21_000, t + 61_000, 0, 7, step, 1, 1, 1 << 24, None)]
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?)", rows)
    db.commit()
    db.close()
    [result] = _ranks([db_path])
    assert result.rule == "gap" and len(result.steps) == 4
    assert all(len(s.calls) == 1 and s.calls[0].library == "NCCL" and s.calls[0].dur_us == 40.0 for s in result.steps)


def test_gloo_trace_sizes_are_read_but_a_cpu_profile_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    trace = trace_read.read_trace(GLOO[0])[0]
    assert (trace.rank, trace.world_size, trace.comm_backend) == (0, 2, "gloo")
    sized = [op for op in trace.collective_ops if op.message_bytes is not None]
    manifest = json.loads((TRACES / "gloo" / "manifest.json").read_text())["traces"][0]
    assert len(sized) == manifest["steps"] * manifest["allreduces_per_step"]
    assert {op.message_bytes for op in sized} == {manifest["message_bytes"]}
    code, out, err = attribute_cli(capsys, *map(str, GLOO))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "no GPU kernels" in err


def _bad(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("case, expected", [
    ("text", "not a Chrome trace JSON"),
    ("json_not_trace", "no traceEvents"),
    ("truncated_gzip", "truncated or corrupt gzip"),
    ("truncated_json", "truncated?"),
    ("duplicate_rank", "mismatched ranks: rank 0 in both"),
    ("world_sizes", "mismatched ranks: the traces come from world sizes [2, 4]"),
    ("directory", "is a directory"),
])
def test_bad_input_is_one_line_and_exit_2(case: str, expected: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    good = SGLANG[0].read_bytes()
    (tmp_path / "folder").mkdir()
    args = {
        "text": [_bad(tmp_path, "text.json", b"hello, not a trace\n")],
        "json_not_trace": [_bad(tmp_path, "other.json", b'{"schemaVersion": 1}')],
        "truncated_gzip": [_bad(tmp_path, "cut.json.gz", good[: len(good) // 2])],
        "truncated_json": [_bad(tmp_path, "cut.json", VLLM[0].read_bytes()[:20000])],
        "duplicate_rank": [str(VLLM[0]), _bad(tmp_path, "copy.json", VLLM[0].read_bytes())],
        "world_sizes": [str(VLLM[0]), _bad(tmp_path, "w4.json", VLLM[1].read_bytes().replace(
            b'"world_size": 2', b'"world_size": 4'))],
        "directory": [str(tmp_path / "folder")],
    }[case]
    code, out, err = attribute_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err, err


# ------------------------------------------------------------------ real traces from the GPU

def _gpu_entries() -> list[dict]:
    if not GPU_MANIFEST.exists():
        return []
    return [e for e in json.loads(GPU_MANIFEST.read_text())["traces"] if "skipped" not in e]


def _independent_steps(paths: list[Path], kernel: re.Pattern[str]) -> list[tuple[int, float]]:
    """(allreduce kernels, their share of the step) per CUDA-graph replay, straight from the JSON."""
    out = []
    for path in paths:
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        # A replay's kernels share the correlation id of its cudaGraphLaunch (this kineto build
        # records no "graph id" on them).
        launches = {e["args"]["correlation"] for e in events
                    if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"}
        replays: dict[int, list[dict]] = {}
        for e in events:
            if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches:
                replays.setdefault(e["args"]["correlation"], []).append(e)
        for kernels in replays.values():
            wall = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
            ar = [k for k in kernels if kernel.search(k["name"])]
            out.append((len(ar), sum(k["dur"] for k in ar) / wall))
    return out


@pytest.mark.skipif(not _gpu_entries(), reason="no GPU traces yet: run scripts/record-traces.sh on a GPU "
                    "and copy $OUT/traces to tests/data/traces/h200-mps/")
@pytest.mark.parametrize("entry", _gpu_entries(), ids=lambda e: e["name"])
def test_recorded_gpu_traces_match_what_the_generator_built(entry: dict) -> None:
    paths = [GPU_MANIFEST.parent / f for f in entry["files"]]
    hint = SizeHint(entry["batch"] * entry["hidden"] * 2, "manifest")
    graph = entry["mode"] == "graph"
    results = _ranks(paths, hint, rule="graph" if graph else "annotation",
                     annotation=re.compile(f"^{entry['step_annotation']}$"))
    assert len(results) == entry["world_size"]
    for r in results:
        assert len(r.steps) == entry["steps"]
        for s in r.steps:
            assert len(s.calls) == pytest.approx(entry["allreduces_per_step"], rel=0.02)
            assert {c.library for c in s.calls} == {entry["library"]}
            assert {c.message_bytes for c in s.calls} == {entry["message_bytes"]}
            assert not s.other_comm
    if graph:
        ours = [(len(s.calls), s.share) for r in results for s in r.steps]
        names = re.compile("|".join(re.escape(n) for n in {c.name for r in results for s in r.steps for c in s.calls}))
        theirs = _independent_steps(paths, names)
        assert sorted(n for n, _ in ours) == sorted(n for n, _ in theirs)
        assert sorted(x for _, x in ours) == pytest.approx(sorted(x for _, x in theirs), rel=0.02)
    else:   # eager: the sizes come from the trace's own records
        assert {c.size_from for r in results for s in r.steps for c in s.calls} == {"recorded"}


@pytest.mark.procs
def test_cli_lists_attribute() -> None:
    done = run_cli(["attribute", "--help"])
    assert done.returncode == 0 and "--run" in done.stdout


def test_the_engine_alternative_is_recommends_fastest_path_and_never_a_stand_in() -> None:
    """On the 8-GPU PCIe fixture recommend's fastest SGLang path at 12K is NCCL with LL/Ring (its
    custom allreduce is gated off there); p2p:oneshot is faster but no engine runs it."""
    from commbench.analysis.curves import decode_curves
    from commbench.runs import load_run

    run = load_run(Path(__file__).parents[1] / "data" / "runs" / "synthetic-pcie-8gpu")
    curves = decode_curves(run, 8, "bf16", "auto")
    choose = attribute_floor.engine_alternative("sglang", run, 8, "bf16")
    chosen = choose(curves, 12 * 1024)
    assert chosen is not None and chosen.label == "nccl:proto=LL,algo=Ring (graph)"
    assert min(curves, key=lambda c: c.at(12 * 1024).latency_us if c.at(12 * 1024) else 1e9).backend == "p2p:oneshot"


def test_engine_needs_a_run(capsys) -> None:
    trace = Path(__file__).parents[1] / "data" / "traces" / "h200-mps" / "symm_mem-one_shot-rank0.trace.json.gz"
    assert cli_main(["attribute", str(trace), "--engine", "vllm"]) == 2
    assert "give --run too" in capsys.readouterr().err


NCCL_LOGS = Path(__file__).parents[1] / "data" / "nccl-logs"
ENGINE_LOGS = [str(NCCL_LOGS / f"engine-2.28-tp2.rank{r}.log") for r in (0, 1)]


def test_the_nccl_log_names_the_algorithm_and_protocol_per_size(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    """The SGLang trace's 16 eager NCCL calls at 1 MiB against the engine's log: rank 0's three
    Ring/LL128 choices count; the 8-rank communicator's Tree/Simple at 1 MiB is another group's."""
    code, out, _ = attribute_cli(capsys, *map(str, SGLANG), "--steps", "gap", "--nccl-log", *ENGINE_LOGS,
                                 "--json", str(tmp_path / "a.json"))
    assert code == 0
    assert "NCCL at 1M (16 calls in the trace): Ring/LL128 x3\n" in out
    assert "Tree" not in out and "--nccl-log" not in out
    assert max(len(line) for line in out.splitlines()) <= 100
    data = json.loads((tmp_path / "a.json").read_text())["nccl_log"]
    assert data["files"] == ENGINE_LOGS
    assert data["lines"] == [{"library": "NCCL", "message_bytes": 1 << 20, "trace_calls": 16,
                              "choices": {"Ring/LL128": 3}, "said": "Ring/LL128 x3"}]


@pytest.mark.parametrize("log, said", [
    ("symm-2.28-nvswitch.observe.log", "symmetric AllReduce_RSxLD_AGxST x2"),
    ("symm-2.29-pcie.observe.log", "not in the log"),          # it holds 4096 B calls only
    ("engine-2.28-tp2.rank1.log",
     "not in the log: 3 calls logged, no choice (NCCL logs its choice on comm rank 0 only, with TUNING"),
])
def test_what_the_log_says_at_the_traces_size(log: str, said: str, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    code, _, _ = attribute_cli(capsys, *map(str, SGLANG), "--steps", "gap", "--nccl-log", str(NCCL_LOGS / log),
                               "--json", str(tmp_path / "a.json"))
    lines = json.loads((tmp_path / "a.json").read_text())["nccl_log"]["lines"]
    assert code == 0 and len(lines) == 1
    assert lines[0]["said"].startswith(said) and lines[0]["message_bytes"] == 1 << 20


def test_without_a_log_attribute_says_how_to_get_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = attribute_cli(capsys, *map(str, SGLANG), "--steps", "gap", "--json", str(tmp_path / "a.json"))
    assert code == 0 and "NCCL_DEBUG_SUBSYS=INIT,TUNING,COLL and give its log as --nccl-log" in out
    assert json.loads((tmp_path / "a.json").read_text())["nccl_log"] is None
    # At world size 1 NCCL chooses nothing: no hint; a log says why it has no choice.
    world1 = TRACES / "h200-mps" / "nccl-world1-rank0.trace.json.gz"
    code, out, _ = attribute_cli(capsys, str(world1))
    assert code == 0 and "--nccl-log" not in out
    log = tmp_path / "world1.log"
    log.write_text("h:1:1 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x1 count 32768 datatype 9 "
                   "op 4 root 0 comm 0x2 [nranks=1] stream 0x3\n" * 2)
    code, out, _ = attribute_cli(capsys, str(world1), "--nccl-log", str(log))
    assert code == 0
    assert "NCCL (one rank) at 64K (192 calls in the trace): not in the log: 2 calls on one rank" in out


def test_an_unreadable_nccl_log_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "nccl.log"
    log.write_text("h:1:1 [0] NCCL INFO NCCL version 2.28.9\n")
    real_open = os.open

    def refuse(path: Path, *args: object, **kwargs: object):   # root reads a chmod 000 file
        if Path(path) == log:
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", refuse)
    code, out, err = attribute_cli(capsys, str(VLLM[0]), "--nccl-log", str(log))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert f"--nccl-log {log}: cannot read (Permission denied)" in err


def test_the_floor_names_the_fastest_kernel_of_the_run_and_whose_it_is(tmp_path: Path) -> None:
    """Beside the library's own floor: the fastest plain allreduce the run measured at that size,
    any backend, with whose it is (here commbench's p2p, a stand-in for the engines' kernel)."""
    from commbench.analysis.curves import decode_curves, ranking
    from commbench.runs import load_run

    trace = tmp_path / "t.json"
    graph_trace(trace, "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(x)")
    ranks, results = traces.analyse_traces([trace], SizeHint(8 * 4096 * 2, "8 x 4096 x bf16"))
    run = load_run(RUN)
    [line] = attribute_floor.floor_lines(run, ranks, results, None, 8)
    top = ranking([c for c in decode_curves(run, 2, "bf16", "auto") if c.key.op == "allreduce"], 8 * 4096 * 2)[0]
    assert line.fastest is not None and line.fastest.variant == top.curve.label != line.floor.variant  # type: ignore[union-attr]
    assert line.fastest.latency_us < line.floor.latency_us  # type: ignore[union-attr]
    assert line.fastest_whose.startswith("the p2p backend; stands in for SGLang's custom_ar path")
    text = " ".join(attribute_floor.floor_text([line]).split())
    assert "the fastest kernel measured in the same run at that size, any backend" in text
    assert f"{top.curve.label}: the p2p backend; stands in for" in text


def test_a_fused_kernel_is_set_against_fused_rows_of_its_shape(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """FlashInfer's allreduce + residual + RMSNorm kernel: its floor is its library's fused rows at
    the calls' shape (8 tokens x 6144), the fastest beside it the fastest fused row there (commbench's
    p2p:fused), never a bare allreduce, and no engine path is offered instead."""
    from commbench.runs import load_run

    run = load_run(fused_run(tmp_path / "run"))
    trace = tmp_path / "t.json"
    graph_trace(trace, FUSED_KERNEL, world_size=8)
    ranks, results = traces.analyse_traces([trace], SizeHint(8 * 6144 * 2, "8 x 6144 x bf16", 6144))
    [line] = attribute_floor.floor_lines(run, ranks, results, None, 8, engine="vllm")
    assert line.op == FUSED_OP and line.alternative is None
    assert line.floor.variant == "flashinfer:fused_oneshot (graph allreduce_residual_rmsnorm)"  # type: ignore[union-attr]
    assert line.floor.latency_us == 11.80  # type: ignore[union-attr]
    assert line.fastest.variant == "p2p:fused (graph allreduce_residual_rmsnorm)"  # type: ignore[union-attr]
    # the row claiming 2 tokens carries 8 tokens' bytes at 0.5 us: its shape is not the calls'
    assert line.fastest.latency_us == STAND_IN_US["p2p:fused"][8]  # type: ignore[union-attr]
    assert line.fastest.saving_per_call_us == pytest.approx(30.0 - 6.0)
    code, out, _ = attribute_cli(capsys, str(trace), "--run", str(tmp_path / "run"), "--model", "glm-5", "--batch", "8",
                                 "--engine", "vllm")
    text = " ".join(out.split())
    assert code == 0 and "could take instead" not in text and "instead:" not in text
    assert ("fastest (allreduce + residual add + RMSNorm at this shape, the norm included): p2p:fused (graph "
            "allreduce_residual_rmsnorm) (measured); size from 8 x 6144 x bf16") in text
    # 6 tokens of hidden 7168 have the bytes of 7 of 6144: only the 7168 row answers that shape
    ranks, results = traces.analyse_traces([trace], SizeHint(6 * 7168 * 2, "6 x 7168 x bf16", 7168))
    [line] = attribute_floor.floor_lines(run, ranks, results, None, 6)
    assert line.floor is None and line.fastest.latency_us == 1.0  # type: ignore[union-attr]
    assert line.why_no_floor == ("the run has no trusted allreduce + residual add + RMSNorm rows of this library at "
                                 "hidden 7168")
    # a size the trace recorded, without a shape, prices no fused call
    from commbench.analysis.attribution import Call, Step
    from commbench.analysis.curves import decode_curves

    call = Call(FUSED_KERNEL, "FlashInfer allreduce+RMSNorm fusion one-shot", "^flashinfer:fused_oneshot$", "", 0.0,
                30.0, 7, True, 8 * 6144 * 2, "recorded", FUSED_OP)
    [line] = attribute_floor.against_floor([Step(0, 0, "decode", 0.0, 50.0, 50.0, [call])],
                                           decode_curves(run, 8, "bf16", "auto", hidden=6144), 8)
    assert line.floor is None and line.fastest is None and "its shape is unknown" in line.why_no_floor


def test_a_plain_call_is_never_set_against_fused_rows(tmp_path: Path) -> None:
    from commbench.runs import load_run

    run = load_run(fused_run(tmp_path / "run"))
    trace = tmp_path / "t.json"
    graph_trace(trace, FUSED_KERNEL.replace("Pattern)1", "Pattern)0"), world_size=8)
    ranks, results = traces.analyse_traces([trace], SizeHint(8 * 6144 * 2, "8 x 6144 x bf16", 6144))
    [line] = attribute_floor.floor_lines(run, ranks, results, None, 8)
    assert line.op == ALLREDUCE and line.floor.variant == "flashinfer:trtllm_oneshot (graph)"  # type: ignore[union-attr]
    assert line.fastest.variant == "sglang:auto (graph)"  # type: ignore[union-attr]


def test_launches_are_found_by_correlation_in_any_order_and_the_later_of_two_is_kept() -> None:
    from commbench.analysis.trace_read import HostSpan, Launches

    launches = Launches()
    for corr, ts in ((5, 50.0), (9, 90.0), (2, 20.0), (9, 91.5)):    # out of order, 9 given twice
        launches.add("cudaLaunchKernel", ts, 3.0, 7, corr)
    assert len(launches) == 4
    assert launches.get(2) == HostSpan("cudaLaunchKernel", 20.0, 3.0, 7, 2)
    assert launches.get(9) == HostSpan("cudaLaunchKernel", 91.5, 3.0, 7, 9)
    assert launches.get(3) is None and launches.get(1) is None and launches.get(10) is None
    launches.add("cudaGraphLaunch", 1.0, 2.0, 8, 1)                  # added after a lookup sorted them
    assert launches.get(1) == HostSpan("cudaGraphLaunch", 1.0, 2.0, 8, 1) and launches.get(5).ts_us == 50.0
