"""Library backends on a GPU: several processes share the visible GPU(s) (share_gpus=True).

Each variant is checked exact (plain allreduce) or within the stated tolerance (fused),
eager and as K calls captured in one CUDA graph. Timings from a shared GPU mean nothing, so
none are taken. A variant that cannot run here must say why: its reason is part of the
result (written to $OUT/library_gpu_<n>.json when $OUT is set) and printed.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

import pytest
import torch

from commbench.backends.base import Backend, SweepFacts
from helpers import spawn_ranks

GRAPH_CALLS = 3
# one variant's setup, sizes and checks; FlashInfer's JIT is built beforehand (docs/testing.md)
VARIANT_LIMIT_S = float(os.environ.get("COMMBENCH_GPU_TEST_VARIANT_LIMIT_S", 300))
STALL_EXIT = 86           # a rank's exit code when one variant outlived VARIANT_LIMIT_S
PLAIN_BYTES = (8 << 10, 96 << 10, 1 << 20)        # 4K..512K bf16 elements
SHAPES = ((1, 7168), (16, 7168), (64, 6144))       # (tokens, hidden): DeepSeek-V3's and GLM-5's hidden


def _wanted(family: str) -> bool:
    """COMMBENCH_GPU_TEST_FAMILIES=symm_mem,flashinfer runs a subset; the tests check only those."""
    families = os.environ.get("COMMBENCH_GPU_TEST_FAMILIES")
    return not families or family in families.split(",")


def _variants() -> list[Backend]:
    from commbench.backends import factory

    specs = ["symm_mem:one_shot", "symm_mem:two_shot", "symm_mem:multimem",
             "flashinfer:trtllm_oneshot", "flashinfer:trtllm_twoshot",
             "flashinfer:fused_oneshot", "flashinfer:fused_twoshot",
             "flashinfer:pcie_ipc", "flashinfer:mnnvl", "mscclpp",    # mscclpp: auto, each algorithm, shim
             "sglang:custom_ar", "vllm:custom_ar"]                    # the engines' own kernels, every variant
    specs = [s for s in specs if _wanted(s.partition(":")[0])]
    out: list[Backend] = []
    for spec in specs:
        family, _, variant = spec.partition(":")
        # message_bytes: the sizes pcie_ipc tunes a bucket for at setup, as the sweep passes them
        sweep = SweepFacts(hidden=4096, message_bytes=tuple(PLAIN_BYTES))
        out.extend(factory(family).variants(variant or None, sweep=sweep))
    return out


def _check_calls(backend: Backend, workload, graph: bool, epoch: int) -> tuple[int, str | None]:
    """GRAPH_CALLS back-to-back calls, eager or captured in one graph (inside the backend's
    graph_capture(), as the sweep captures), each into its own output; every one is checked."""
    workload.prepare(epoch)
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            workload.call(0)                        # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with backend.graph_capture(), torch.cuda.graph(g):
            for i in range(GRAPH_CALLS):
                workload.call(i)
        workload.prepare(epoch + 3)
        g.replay()
    else:
        for i in range(GRAPH_CALLS):
            workload.call(i)
    torch.cuda.synchronize()
    result = workload.verify(0, GRAPH_CALLS)
    return result.wrong_elements, ",".join(sorted(result.kinds)) or None


def _progress(ctx, line: str) -> None:
    """A line per step, flushed at once into $OUT: when a hang stops the test, this file names
    the variant and size each rank was in (pytest's captured output dies with the kill)."""
    folder = os.environ.get("OUT")
    if folder:
        with open(os.path.join(folder, f"library_progress_{ctx.world_size}.txt"), "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} rank {ctx.rank} {line}\n")


def _stalled(ctx, name: str) -> None:
    _progress(ctx, f"{name}: no answer in {VARIANT_LIMIT_S:g} s, the rank exits (code {STALL_EXIT})")
    os._exit(STALL_EXIT)


def _run_variant(ctx, backend: Backend, dtype: torch.dtype) -> dict:
    from commbench.analysis.fusion import FUSED_OP

    reason = backend.check(ctx)
    if reason:
        return {"status": "skipped", "reason": reason}
    if backend.op == FUSED_OP:
        cases = [(t * h, (t, h)) for t, h in SHAPES]
    else:
        cases = [(b // dtype.itemsize, None) for b in PLAIN_BYTES]
    max_bytes = max(count for count, _ in cases) * dtype.itemsize
    _progress(ctx, f"{backend.name}: setup")
    try:
        backend.setup(ctx, max_bytes, dtype)
    except Exception as exc:
        return {"status": "setup_failed", "reason": f"{type(exc).__name__}: {exc}"}
    rows = []
    try:
        for count, shape in cases:
            size_reason = backend.supports(count * dtype.itemsize, dtype)
            if size_reason:
                rows.append({"count": count, "shape": shape, "status": "unsupported", "reason": size_reason})
                continue
            _progress(ctx, f"{backend.name}: {count * dtype.itemsize} bytes")
            try:
                workload = backend.make_workload(ctx, count, dtype, shape, GRAPH_CALLS)
            except Exception as exc:
                rows.append({"count": count, "shape": shape, "status": "unsupported", "reason": str(exc)})
                continue
            try:
                workload.prepare(0)
                observed = backend.observe(lambda: workload.call(0), count * dtype.itemsize)
            except Exception as exc:
                rows.append({"count": count, "shape": shape, "status": "error",
                             "reason": f"observe: {type(exc).__name__}: {exc}"})
                continue
            for graph in ([False, True] if backend.graph_capturable else [False]):
                try:
                    wrong, kind = _check_calls(backend, workload, graph, epoch=3)
                    rows.append({"count": count, "shape": shape, "graph": graph, "wrong": wrong, "kind": kind,
                                 "status": "ok" if wrong == 0 else "wrong", "observed": observed,
                                 **backend.row_fields()})
                except Exception as exc:
                    rows.append({"count": count, "shape": shape, "graph": graph, "status": "error",
                                 "reason": f"{type(exc).__name__}: {exc}"})
    finally:
        backend.close()
    _progress(ctx, f"{backend.name}: done")
    return {"status": "ran", "rows": rows}


def _worker(rank: int, world: int) -> dict:
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):   # tests/gpu/run.sh's daemon: an equal SM share
        from commbench.sweep.mps import client_env

        os.environ.update(client_env(world, gpus=1))
    from commbench.runtime.context import init_context, shutdown

    ctx, _ = init_context(share_gpus=True, timeout_s=240)
    out = {}
    for backend in _variants():
        # A hung kernel never returns: the rank leaves with the variant's name in its progress file,
        # and spawn_ranks answers for it at once instead of after the test's whole timeout.
        watchdog = threading.Timer(VARIANT_LIMIT_S, _stalled, (ctx, backend.name))
        watchdog.daemon = True
        watchdog.start()
        out[backend.name] = _run_variant(ctx, backend, torch.bfloat16)
        watchdog.cancel()
        if rank == 0:
            print(f"[{world} ranks] {backend.name}: {json.dumps(out[backend.name], default=str)[:400]}",
                  flush=True)
        ctx.barrier()
    # fp16 shows whether this torch's symm_mem kernels take it (their dispatch says bf16/fp32).
    from commbench.backends.symm_mem import SymmMemAllreduce

    out["symm_mem:one_shot(fp16 op)"] = _fp16_probe(ctx, SymmMemAllreduce("one_shot"))
    ctx.barrier()
    shutdown()
    return out


def _fp16_probe(ctx, backend) -> dict:
    try:
        backend.setup(ctx, 4096, torch.float16)
        x = torch.ones(1024, dtype=torch.float16, device=ctx.device)
        y = torch.empty_like(x)
        backend.allreduce(x, y)
        torch.cuda.synchronize()
        return {"status": "ran", "ok": bool((y == ctx.world_size).all())}
    except Exception as exc:
        return {"status": "refused", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    finally:
        backend.close()


@functools.lru_cache(maxsize=None)
def _run_world(world: int) -> dict:
    gathered = spawn_ranks(_worker, world, timeout_s=600)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"library_gpu_{world}.json"), "w") as f:
            json.dump(gathered, f, indent=1, default=str)
    return gathered


@pytest.mark.parametrize("world", [2, 4])
def test_library_backends_on_shared_gpu(world: int) -> None:
    gathered = _run_world(world)
    crashes = {r: v["crash"] for r, v in gathered.items() if "crash" in v}
    assert not crashes, crashes
    report = gathered[0]
    for name, result in report.items():
        print(f"[{world} ranks] {name}: {json.dumps(result, default=str)[:600]}")
    # Whatever ran must be exact on every rank.
    for rank, out in gathered.items():
        for name, result in out.items():
            for row in result.get("rows", []):
                assert row["status"] in ("ok", "unsupported"), (rank, name, row)
    # torch symmetric memory one/two-shot must run on a shared GPU.
    for name in ("symm_mem:one_shot", "symm_mem:two_shot"):
        if name in report:
            assert report[name]["status"] == "ran", (name, report[name])
            assert any(r["status"] == "ok" for r in report[name]["rows"]), report[name]
    # Multicast stays off here (tests/gpu/run.sh keeps the policy variables set).
    for name in ("symm_mem:multimem", "flashinfer:mnnvl"):
        if name in report:
            assert report[name]["status"] == "skipped", (name, report[name])
    # Every variant either ran or says why not.
    for name, result in report.items():
        assert result["status"] == "ran" or result.get("reason"), (name, result)
    # Every MSCCL++ variant is there (unless a subset leaves the family out); NVLS algorithms stay
    # off with multicast off.
    if _wanted("mscclpp"):
        assert sum(name.startswith("mscclpp:") for name in report) == 12, sorted(report)
    for name in report:
        if name.startswith("mscclpp:algo=") and "nvls" in name:
            assert report[name]["status"] == "skipped", (name, report[name])
    # pcie_ipc: each row ran the launch configuration its tuned bucket chose.
    pcie = report.get("flashinfer:pcie_ipc", {})
    for row in pcie.get("rows", []):
        if row["status"] == "ok":
            assert row["extra"]["pcie_ipc_tuning"]["tuned"] is True, row
            assert row["observed"]["extra"]["pcie_ipc_config"], row


def _skip_unless_wanted(family: str) -> None:
    if not _wanted(family):
        pytest.skip(f"COMMBENCH_GPU_TEST_FAMILIES leaves {family} out")


def _library_report(family: str, reason: str | None) -> dict:
    _skip_unless_wanted(family)
    if reason:
        pytest.skip(reason)
    return _run_world(2)[0]


def test_flashinfer_trtllm_and_fused_run_exact_when_installed() -> None:
    from commbench.backends.flashinfer.common import REQUIRES

    report = _library_report("flashinfer", REQUIRES.reason())
    for name in ("flashinfer:trtllm_oneshot", "flashinfer:trtllm_twoshot", "flashinfer:fused_oneshot",
                 "flashinfer:fused_twoshot"):
        assert report[name]["status"] == "ran", (name, report[name])
        assert any(r["status"] == "ok" for r in report[name]["rows"]), (name, report[name])
    assert report["flashinfer:pcie_ipc"]["status"] == "ran" or report["flashinfer:pcie_ipc"]["reason"]


def test_mscclpp_runs_or_says_why_when_installed() -> None:
    import importlib.util

    from commbench.backends.mscclpp.backend import BUILD_HINT

    report = _library_report("mscclpp", BUILD_HINT if importlib.util.find_spec("mscclpp") is None else None)
    auto = report["mscclpp:auto"]
    assert auto["status"] == "ran" or "MSCCL++" in auto.get("reason", "") or "mscclpp" in auto.get("reason", ""), auto


ENGINE_FAMILIES = ("sglang", "vllm")


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_kernel_exact_at_2_ranks(family: str) -> None:
    """The engines' own custom allreduce (sglang:*, vllm:*): exact on every rank, eager and in
    graphs, at 2 ranks sharing the GPU; skipped with its reason where the library is missing."""
    _skip_unless_wanted(family)
    gathered = _run_world(2)
    crashes = {r: v["crash"] for r, v in gathered.items() if "crash" in v}
    assert not crashes, crashes
    mine = {name: result for name, result in gathered[0].items() if name.startswith(family + ":")}
    assert mine, sorted(gathered[0])
    missing = [r["reason"] for r in mine.values() if r["status"] == "skipped" and "not installed" in r["reason"]]
    if missing:
        pytest.skip(missing[0])
    for rank, out in gathered.items():
        for name in mine:
            result = out[name]
            assert result["status"] == "ran", (rank, name, result)
            assert all(row["status"] in ("ok", "unsupported") for row in result["rows"]), (rank, name, result)
            if name != "vllm:two_stage":      # at 2 ranks the kernel always runs one-stage
                ran = {row["graph"] for row in result["rows"] if row["status"] == "ok"}
                assert ran == {False, True}, (rank, name, result)
