"""GPU checks of the p2p backend on one machine; several ranks may share one GPU (CUDA IPC
works between processes on one device).

  python3 tests/gpu/p2p_check.py exact --world 4     exact sums: every variant, dtype and size, eager and graph,
                                                      plus bit-identical fp32-accumulated sums of random data
  python3 tests/gpu/p2p_check.py long --world 2 --calls 10000 --replays 1000 [--budget-s 60] [--graph-kernels]
                                                      back-to-back eager calls and graph replays, every result checked
  python3 tests/gpu/p2p_check.py fused --world 4     p2p:fused (one-shot, two-shot, by size): every shape and dtype,
                                                      eager and graph, against the fp32 reference within the fused
                                                      check's tolerance; random inputs within FlashInfer's test's too
  python3 tests/gpu/p2p_check.py timeout              rank 1 never arrives: rank 0 must get P2PTimeoutError
                                                      (flag one-shot, Lamport one-shot and two-shot in eager
                                                      calls, the graph one-shot in a graph replay)
  python3 tests/gpu/p2p_check.py calibrate --world 2  p2p:auto measures its rule and all ranks agree
  python3 tests/gpu/p2p_check.py floor                world size 1: graph-replayed one-shot kernels, 1 KiB - 1 MiB,
                                                      each with PDL on and off
  python3 tests/gpu/p2p_check.py tune --world 8       per kernel and size, the graph-replayed time of each launch
    [--kernels oneshot_lamport,oneshot_graph]         shape (threads per block x vectors per thread), slowest rank
    [--shapes rule,32x1,64x1]

Every call writes its sum into an output tensor the caller owns. Under an MPS daemon
(CUDA_MPS_PIPE_DIRECTORY set, as tests/gpu/run.sh does) each spawned rank runs with
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/world, rounded down; --no-sm-limit runs them with none,
the case where the ranks' spinning blocks once filled the SMs a peer's blocks needed.

Every mode but floor launches as --p2p-pdl says (default on, as in the sweep); the exact and long
summaries record whether PDL was used. The last line printed is a JSON summary
(tests/gpu/test_p2p_gpu.py reads it). Timings from ranks that share a GPU mean nothing: only the
world-size-1 floor prints times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from commbench.backends.base import MakeOptions
from commbench.backends.fused import RMS_EPS, TOLERANCE, check_fused, reference_residual_rmsnorm, rms_gamma
from commbench.backends.p2p.backend import P2PAllreduce
from commbench.backends.p2p.variants import make
from commbench.backends.p2p.kernels import P2PTimeoutError
from commbench.backends.p2p.layout import GRAPH_FALLBACK, VECTOR_BYTES, LaunchShape, fused_dims
from commbench.backends.p2p.rules import FLOOR_VARIANTS, KERNEL_VARIANT, P2POptions
from commbench.runtime.context import MPS_PERCENT_VAR, RunContext, init_context, shutdown
from commbench.sweep.mps import client_env
from commbench.units import parse_bytes
from commbench.runtime.workload import exact_pattern, expected_sum

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BYTES = 8 << 20
# 16 B up to the maximum, with odd sizes: one vector, fewer vectors than ranks, partial
# blocks, two-shot slices of unequal length, the largest buffer.
EXACT_SIZES = (16, 48, 1040, 4096, 65536 + 16, 262144, 1 << 20, (3 << 20) + 48, MAX_BYTES)
RANDOM_SIZES = (1040, 65536 + 16)
VARIANTS = ("oneshot_lamport", "oneshot", "oneshot_pull", "twoshot_lamport", "twoshot", "oneshot_graph",
            "twoshot_graph", "auto")
# In exact/long runs auto follows this rule, so all four of its kernels run inside one variant,
# back to back (LONG_SIZES: 16 B Lamport one-shot, 4 KiB flag one-shot, 64 KiB + 16 Lamport
# two-shot, 256 KiB flag two-shot).
TEST_AUTO_RULE = "oneshot_lamport<=1K,oneshot<=4K,twoshot_lamport<=128K,twoshot"
LONG_SIZES = (16, 4096, 65536 + 16, 262144)    # consecutive calls change grid and kernel
# The long run with the graph kernels: in the replays 16 B and 4 KiB graph one-shot, 64 KiB + 16
# Lamport two-shot, 256 KiB graph two-shot; the eager calls run their fallbacks.
GRAPH_AUTO_RULE = "oneshot_graph<=4K,twoshot_lamport<=128K,twoshot_graph"
LONG_EPOCHS = 3                                 # coprime with len(LONG_SIZES): every pair occurs
LONG_CHUNK = 500
TIMEOUT_MS = 300.0
FLOOR_SIZES = tuple(1024 << k for k in range(11))   # 1 KiB ... 1 MiB
FLOOR_CALLS_PER_GRAPH = 100
FLOOR_REPLAYS = 20
MPS_PIPE_VAR = "CUDA_MPS_PIPE_DIRECTORY"


# ---------------------------------------------------------------------------------------
# process plumbing


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _set_sm_share(world: int, no_sm_limit: bool) -> None:
    """Under an MPS daemon, give each rank an equal share of the SMs (or, with --no-sm-limit,
    none). CUDA reads the variable once, when it starts, so this runs before any CUDA call."""
    if not os.environ.get(MPS_PIPE_VAR):
        return
    if no_sm_limit:
        os.environ.pop(MPS_PERCENT_VAR, None)
    else:
        os.environ.update(client_env(world, gpus=1))


def _rank_main(rank: int, world: int, port: int, fn_name: str, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    _set_sm_share(world, args.no_sm_limit)
    if args.kernel_source:      # a variant of the kernels (scripts/p2p_kernel_study.py prepare)
        P2PAllreduce.kernel_source = Path(args.kernel_source).resolve()
    ctx, _ = init_context(share_gpus=True, timeout_s=120.0)
    try:
        result = WORKERS[fn_name](ctx, args)
        result["emulation"] = ctx.emulation.to_dict() if ctx.emulation else None
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        shutdown()


def spawn(fn_name: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "summary.json")
        mp.start_processes(_rank_main, args=(world, _free_port(), fn_name, args, out_path), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(out_path).read_text())


def _reduced(backend: P2PAllreduce, x: torch.Tensor) -> torch.Tensor:
    """One call into a fresh, poisoned output (NaN), so an output never written shows."""
    out = torch.full_like(x, float("nan"))
    backend.allreduce(x, out)
    return out


def _backend(variant: str, options: dict[str, Any], ctx: RunContext, pdl: str) -> P2PAllreduce:
    """The variant with these p2p settings (the flags' names: p2p_max_bytes, p2p_auto_rule, ...)."""
    backend = make(variant, MakeOptions(P2POptions.from_options({**options, "p2p_pdl": pdl})))[0]
    reason = backend.check(ctx)
    if reason is not None:
        raise RuntimeError(f"{backend.name}: check() says {reason}")
    return backend


# ---------------------------------------------------------------------------------------
# exact: every variant, dtype, size and mode


def _fp32_rank_order_sum(inputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    return acc.to(dtype)


def _random_inputs(world: int, count: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return [torch.randn(count, generator=gen, device=device).to(dtype) for _ in range(world)]


def exact_worker(ctx: RunContext, args: argparse.Namespace) -> dict[str, Any]:
    world, dev = ctx.world_size, ctx.device
    cases: list[tuple[str, str, int, str, int]] = []
    wrong: list[torch.Tensor] = []
    random_mismatch: list[str] = []
    grid_caps: set[int] = set()
    pdl: set[bool] = set()
    for variant in VARIANTS:
        options = {"p2p_auto_rule": TEST_AUTO_RULE, "p2p_max_bytes": MAX_BYTES}
        backend = _backend(variant, options, ctx, args.p2p_pdl)
        try:
            for dtype in DTYPES:
                backend.setup(ctx, MAX_BYTES, dtype)
                extra = backend.row_fields()["extra"]
                grid_caps.add(extra["p2p_grid_cap_blocks"])
                pdl.add(extra["p2p_pdl"])
                for size in EXACT_SIZES:
                    count = size // dtype.itemsize
                    for epoch in (1, 2):       # eager, back to back
                        out = _reduced(backend, exact_pattern(ctx.rank, epoch, count, world, dev, dtype))
                        wrong.append((out != expected_sum(epoch, count, world, dev, dtype)).sum())
                        cases.append((variant, str(dtype), size, "eager", epoch))
                    static = torch.empty(count, dtype=dtype, device=dev)
                    graph_out = torch.empty_like(static)
                    graph = torch.cuda.CUDAGraph()
                    with backend.graph_capture():    # registers graph kernels' buffers when capture ends
                        with torch.cuda.graph(graph):
                            backend.allreduce(static, graph_out)
                    for epoch in (3, 4):       # new inputs in the static buffer, poisoned output
                        static.copy_(exact_pattern(ctx.rank, epoch, count, world, dev, dtype))
                        graph_out.fill_(float("nan"))
                        graph.replay()
                        wrong.append((graph_out != expected_sum(epoch, count, world, dev, dtype)).sum())
                        cases.append((variant, str(dtype), size, "graph", epoch))
                for size in RANDOM_SIZES:
                    count = size // dtype.itemsize
                    inputs = _random_inputs(world, count, dtype, dev, seed=size)
                    # Zeros of both signs, where the Lamport kernels map the empty word to +0.0.
                    inputs[0][::7] = -0.0
                    inputs[-1][::5] = 0.0
                    out = _reduced(backend, inputs[ctx.rank])
                    reference = _fp32_rank_order_sum(inputs, dtype)
                    same_bits = bool(torch.equal(out.view(torch.uint8), reference.view(torch.uint8)))
                    digests = ctx.all_gather_objects(out.view(torch.uint8).cpu().numpy().tobytes())
                    if not same_bits or len(set(digests)) != 1:
                        random_mismatch.append(f"{variant} {dtype} {size}B: matches fp32 reference: {same_bits}, "
                                               f"identical on all ranks: {len(set(digests)) == 1}")
        finally:
            backend.close()
    counts = torch.stack(wrong).tolist()
    failed = [f"{c} wrong={n}" for c, n in zip(cases, counts) if n]
    per_rank = ctx.all_gather_objects({"failed": failed, "random_mismatch": random_mismatch,
                                       "wrong": int(sum(counts))})
    return {"world": world, "checked_cases": len(cases), "random_cases": len(VARIANTS) * len(DTYPES) * len(RANDOM_SIZES),
            "grid_cap_blocks": sorted(grid_caps), "pdl": sorted(pdl),
            "wrong": sum(r["wrong"] for r in per_rank),
            "failed": [f"rank {i}: {f}" for i, r in enumerate(per_rank) for f in r["failed"]][:20],
            "random_mismatch": [f"rank {i}: {m}" for i, r in enumerate(per_rank) for m in r["random_mismatch"]][:20]}


# ---------------------------------------------------------------------------------------
# fused: p2p:fused's kernels against the fp32 reference

FUSED_VARIANTS = ("fused_oneshot", "fused_twoshot", "fused")
# (tokens, hidden): the model shapes' hiddens at decode token counts, one token over the most blocks,
# fewer tokens than ranks, a row of 65 vectors (partial warps), the longest row (4 vectors a thread).
FUSED_SHAPES = ((1, 7168), (2, 6144), (3, 7168), (16, 6144), (64, 7168), (256, 6144), (5, 520), (24, 16384))
FUSED_MAX_BYTES = 256 * 7168 * 4
# FlashInfer's own test of its fused kernel (tests/comm/test_trtllm_allreduce_fusion.py):
# torch.testing.assert_close(norm_out, reference, atol=0.8 (bf16) or 0.08 (fp16), rtol=0.01).
FLASHINFER_TEST_ATOL = {torch.bfloat16: 8e-1, torch.float16: 8e-2, torch.float32: 8e-2}
FLASHINFER_TEST_RTOL = 1e-2


def _fused_call(backend: P2PAllreduce, x: torch.Tensor, residual: torch.Tensor,
                gamma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One eager call into fresh, poisoned outputs (NaN)."""
    residual_out, norm_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    backend.allreduce_residual_rmsnorm(x, residual, gamma, residual_out, norm_out)
    return residual_out, norm_out


def _fused_exact_inputs(ctx: RunContext, epoch: int, tokens: int, hidden: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's x, the residual and the fp32 reference, from the sweep's exact patterns."""
    world, dev, count = ctx.world_size, ctx.device, tokens * hidden

    def pattern(rank: int) -> torch.Tensor:
        return exact_pattern(rank, epoch, count, world + 1, dev, torch.float32).reshape(tokens, hidden)

    summed = sum(pattern(rank) for rank in range(world))
    expected = reference_residual_rmsnorm(summed, pattern(world), rms_gamma(hidden, dev, dtype), RMS_EPS)
    return pattern(ctx.rank).to(dtype), pattern(world).to(dtype), expected


def _random_error(ctx: RunContext, backend: P2PAllreduce, tokens: int, hidden: int, dtype: torch.dtype,
                  seed: int) -> dict[str, float]:
    """Random normal x, residual and weight (as FlashInfer's test draws them): each output's largest
    error against the fp32 reference, in units of the fused check's tolerance and of FlashInfer's
    test's (at most 1 passes)."""
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=ctx.device).to(dtype)

    inputs = [draw(tokens, hidden) for _ in range(ctx.world_size)]
    residual, gamma = draw(tokens, hidden), draw(hidden)
    residual_out, norm_out = _fused_call(backend, inputs[ctx.rank], residual, gamma)
    summed = inputs[0].float()
    for x in inputs[1:]:
        summed = summed + x.float()
    residual_ref, norm_ref = reference_residual_rmsnorm(summed, residual, gamma, RMS_EPS)
    tol = TOLERANCE[dtype]

    def worst(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> float:
        return float(((out.float() - ref).abs() / (atol + rtol * ref.abs())).nan_to_num(float("inf")).max().item())

    return {"residual_ours": worst(residual_out, residual_ref, tol, tol),
            "norm_ours": worst(norm_out, norm_ref, tol, tol),
            "norm_flashinfer_test": worst(norm_out, norm_ref, FLASHINFER_TEST_ATOL[dtype], FLASHINFER_TEST_RTOL)}


def _fused_cases(ctx: RunContext, backend: P2PAllreduce, tokens: int, hidden: int,
                 dtype: torch.dtype) -> list[tuple[str, tuple[int, str | None]]]:
    """Two eager calls back to back, then two replays of one captured call on new inputs."""
    dev = ctx.device
    gamma = rms_gamma(hidden, dev, dtype)
    outcomes = []
    for epoch in (1, 2):
        x, residual, expected = _fused_exact_inputs(ctx, epoch, tokens, hidden, dtype)
        residual_out, norm_out = _fused_call(backend, x, residual, gamma)
        outcomes.append(("eager", check_fused(residual_out, norm_out, expected, None, x.float() + residual.float(),
                                              dtype)))
    static_x = torch.empty(tokens, hidden, dtype=dtype, device=dev)
    static_residual = torch.empty_like(static_x)
    residual_out, norm_out = torch.empty_like(static_x), torch.empty_like(static_x)
    graph = torch.cuda.CUDAGraph()
    with backend.graph_capture(), torch.cuda.graph(graph):
        backend.allreduce_residual_rmsnorm(static_x, static_residual, gamma, residual_out, norm_out)
    for epoch in (3, 4):
        x, residual, expected = _fused_exact_inputs(ctx, epoch, tokens, hidden, dtype)
        static_x.copy_(x)
        static_residual.copy_(residual)
        residual_out.fill_(float("nan"))
        norm_out.fill_(float("nan"))
        graph.replay()
        outcomes.append(("graph", check_fused(residual_out, norm_out, expected, None, x.float() + residual.float(),
                                              dtype)))
    return outcomes


def _capped_dims(backend: P2PAllreduce, most_blocks: int, tokens: int, hidden: int, dtype: torch.dtype) -> Any:
    cap_blocks, sms = backend._grids[dtype]
    return fused_dims(tokens, hidden * dtype.itemsize // VECTOR_BYTES, min(cap_blocks, most_blocks),
                      min(sms, most_blocks))


def fused_worker(ctx: RunContext, args: argparse.Namespace) -> dict[str, Any]:
    cases: list[str] = []
    failed: list[str] = []
    worst: dict[str, float] = {}
    kernels: set[str] = set()
    refused: list[str] = []
    for variant in FUSED_VARIANTS:
        backend = _backend(variant, {"p2p_max_bytes": FUSED_MAX_BYTES}, ctx, args.p2p_pdl)
        if args.fused_blocks:   # a residency study: fewer blocks than the launch rule gives
            backend.dims = partial(_capped_dims, backend, args.fused_blocks)  # type: ignore[method-assign]
        try:
            for dtype in DTYPES:
                backend.setup(ctx, FUSED_MAX_BYTES, dtype)
                for tokens, hidden in FUSED_SHAPES:
                    if tokens * hidden * dtype.itemsize > FUSED_MAX_BYTES:
                        continue
                    name = f"{variant} {str(dtype)[6:]} {tokens}x{hidden}"
                    reason = backend.shape_reason(ctx.world_size, tokens, hidden, dtype)
                    if reason is not None:   # a row longer than the kernels hold (fp32 at 16384): never run
                        refused.append(f"{name}: {reason}")
                        continue
                    kernels.add(backend.algorithm_for(tokens * hidden * dtype.itemsize, dtype))
                    dims = backend.dims(tokens, hidden, dtype)
                    try:
                        outcomes = _fused_cases(ctx, backend, tokens, hidden, dtype)
                    except Exception as exc:   # a timeout or an error: name the case it stopped, and its launch
                        raise RuntimeError(f"{name} ({dims}; grid cap and SMs {backend._grids[dtype]}): {exc}") from exc
                    for mode, (wrong, kind) in outcomes:
                        cases.append(f"{name} {mode}")
                        if wrong:
                            failed.append(f"{name} {mode}: {wrong} wrong ({kind})")
                    errors = _random_error(ctx, backend, tokens, hidden, dtype, seed=tokens * 100_003 + hidden)
                    for key, value in errors.items():
                        label = f"{str(dtype)[6:]} {key}"
                        worst[label] = max(worst.get(label, 0.0), value)
                        if value > 1.0:
                            failed.append(f"{name} random: {key} {value:.3g}x its tolerance")
                backend.raise_if_failed()
        finally:
            backend.close()
    per_rank = ctx.all_gather_objects({"failed": failed, "worst": worst})
    return {"world": ctx.world_size, "checked_cases": len(cases), "kernels": sorted(kernels), "refused": refused,
            "failed": [f"rank {i}: {f}" for i, r in enumerate(per_rank) for f in r["failed"]][:30],
            "worst_error_in_tolerances": {k: round(max(r["worst"].get(k, 0.0) for r in per_rank), 4)
                                          for k in sorted(worst)}}


# ---------------------------------------------------------------------------------------
# long: many back-to-back calls and graph replays, every result checked on the device


def _chunks(ctx: RunContext, total: int, deadline: float) -> Any:
    """Chunk sizes until `total` or the deadline; rank 0 decides so every rank makes the same calls."""
    done = 0
    while done < total:
        if not ctx.broadcast_object(time.monotonic() < deadline):
            return
        step = min(LONG_CHUNK, total - done)
        yield step
        done += step


def long_worker(ctx: RunContext, args: argparse.Namespace) -> dict[str, Any]:
    world, dev, dtype = ctx.world_size, ctx.device, torch.bfloat16
    rule = GRAPH_AUTO_RULE if args.graph_kernels else TEST_AUTO_RULE
    backend = _backend(args.variant, {"p2p_auto_rule": rule}, ctx, args.p2p_pdl)
    counts = [size // dtype.itemsize for size in LONG_SIZES]
    inputs = [[exact_pattern(ctx.rank, e, n, world, dev, dtype) for n in counts] for e in range(LONG_EPOCHS)]
    expected = [[expected_sum(e, n, world, dev, dtype) for n in counts] for e in range(LONG_EPOCHS)]
    # One output per size, reused: its previous answer is another epoch's, so a call that
    # wrote nothing still counts as wrong.
    outs = [torch.full((n,), float("nan"), dtype=dtype, device=dev) for n in counts]
    try:
        backend.setup(ctx, MAX_BYTES, dtype)
        deadline = time.monotonic() + args.budget_s
        eager_wrong = torch.zeros((), dtype=torch.int64, device=dev)
        calls = 0
        for step in _chunks(ctx, args.calls, deadline):
            for k in range(calls, calls + step):
                i, e = k % len(LONG_SIZES), k % LONG_EPOCHS
                backend.allreduce(inputs[e][i], outs[i])
                eager_wrong += (outs[i] != expected[e][i]).sum()
            calls += step
        static = [torch.empty(n, dtype=dtype, device=dev) for n in counts]
        graph = torch.cuda.CUDAGraph()
        with backend.graph_capture():    # registers the graph kernels' buffers when the capture ends
            with torch.cuda.graph(graph):
                for s, o in zip(static, outs):
                    backend.allreduce(s, o)
        for o in outs:      # an eager call's answer must not pass for the first replay's
            o.fill_(float("nan"))
        deadline = time.monotonic() + args.budget_s
        graph_wrong = torch.zeros((), dtype=torch.int64, device=dev)
        replays = 0
        for step in _chunks(ctx, args.replays, deadline):
            for r in range(replays, replays + step):
                e = r % LONG_EPOCHS
                for s, x in zip(static, inputs[e]):
                    s.copy_(x)
                graph.replay()
                for o, ex in zip(outs, expected[e]):
                    graph_wrong += (o != ex).sum()
            replays += step
        torch.cuda.synchronize()
        backend.raise_if_failed()
        pdl = backend.row_fields()["extra"]["p2p_pdl"]
    finally:
        backend.close()
    per_rank = ctx.all_gather_objects((int(eager_wrong.item()), int(graph_wrong.item())))
    return {"world": world, "variant": backend.name, "pdl": pdl, "eager_calls": calls, "graph_replays": replays,
            "calls_per_replay": len(LONG_SIZES),
            "eager_wrong": sum(r[0] for r in per_rank), "graph_wrong": sum(r[1] for r in per_rank)}


# ---------------------------------------------------------------------------------------
# timeout: a peer that never arrives


# The flag, Lamport one-shot and two-shot kernels in eager calls; the graph one-shot (its counter
# barrier) in replays of a captured call.
TIMEOUT_VARIANTS = ("oneshot", "oneshot_lamport", "twoshot_lamport", "oneshot_graph", "fused_oneshot",
                    "fused_twoshot")


def timeout_worker(ctx: RunContext, args: argparse.Namespace) -> dict[str, Any]:
    """For each kernel kind: one healthy call, then rank 1 stays away from the second call."""
    return {"world": ctx.world_size, "variants": {v: _timeout_case(ctx, v, args.p2p_pdl) for v in TIMEOUT_VARIANTS}}


def _replayed(backend: P2PAllreduce, count: int, dtype: torch.dtype, dev: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Collective: one eager call (its fallback kernel), then one call captured in a graph; the
    function returned replays it on a new input into a poisoned output."""
    static = torch.zeros(count, dtype=dtype, device=dev)
    out = torch.empty_like(static)
    backend.allreduce(static, out)
    graph = torch.cuda.CUDAGraph()
    with backend.graph_capture():
        with torch.cuda.graph(graph):
            backend.allreduce(static, out)

    def replay(x: torch.Tensor) -> torch.Tensor:
        static.copy_(x)
        out.fill_(float("nan"))
        graph.replay()
        return out
    return replay


def _fused_as_allreduce(backend: P2PAllreduce, x: torch.Tensor) -> torch.Tensor:
    """A fused call whose residual output is the plain sum: x as 4 tokens, a zero residual."""
    rows = x.view(4, -1)
    residual_out, _ = _fused_call(backend, rows, torch.zeros_like(rows),
                                  torch.ones(rows.shape[1], dtype=x.dtype, device=x.device))
    return residual_out.view(-1)


def _timeout_case(ctx: RunContext, variant: str, pdl: str) -> dict[str, Any]:
    dev, dtype, count = ctx.device, torch.bfloat16, 4096
    backend = _backend(variant, {"p2p_timeout_ms": TIMEOUT_MS}, ctx, pdl)
    result: dict[str, Any] = {}
    try:
        backend.setup(ctx, 1 << 20, dtype)
        call = (_replayed(backend, count, dtype, dev) if variant in GRAPH_FALLBACK
                else partial(_fused_as_allreduce, backend) if variant in FUSED_VARIANTS else partial(_reduced, backend))
        out = call(exact_pattern(ctx.rank, 1, count, ctx.world_size, dev, dtype))
        result["healthy_call_wrong"] = int((out != expected_sum(1, count, ctx.world_size, dev, dtype)).sum().item())
        ctx.barrier()
        if ctx.rank == 0:              # rank 1 stays in the barrier below: it never arrives
            start = time.perf_counter()
            call(exact_pattern(0, 2, count, ctx.world_size, dev, dtype))
            torch.cuda.synchronize()
            result["kernel_returned_after_s"] = round(time.perf_counter() - start, 3)
            for attempt in ("raise_if_failed", "next_allreduce"):
                try:
                    if attempt == "raise_if_failed":
                        backend.raise_if_failed()
                    else:       # a replay never passes through allreduce(): the report says it
                        call(exact_pattern(0, 3, count, ctx.world_size, dev, dtype))
                        torch.cuda.synchronize()
                        backend.raise_if_failed()
                    result[attempt] = None
                except P2PTimeoutError as exc:
                    result[attempt] = str(exc)
        ctx.barrier()
    finally:
        backend.close()
    return result


# ---------------------------------------------------------------------------------------
# calibrate: p2p:auto measures its rule (numbers from a shared GPU are the protocol's, no fabric's)


def calibrate_worker(ctx: RunContext, args: argparse.Namespace) -> dict[str, Any]:
    backend = _backend("auto", {}, ctx, args.p2p_pdl)
    try:
        backend.setup(ctx, MAX_BYTES, torch.bfloat16)
        extra = backend.row_fields()["extra"]
        count = 65536
        out = _reduced(backend, exact_pattern(ctx.rank, 1, count, ctx.world_size, ctx.device, torch.bfloat16))
        wrong = int((out != expected_sum(1, count, ctx.world_size, ctx.device, torch.bfloat16)).sum().item())
    finally:
        backend.close()
    rules = ctx.all_gather_objects(extra["p2p_auto_rule"])
    return {"world": ctx.world_size, "rule_per_rank": rules, "source": extra["p2p_auto_rule_source"],
            "calibration": extra["p2p_calibration"], "wrong": wrong, "kernels": extra["p2p_kernels"],
            "pull_reason": extra.get("p2p_auto_pull_reason"),
            "emulation": ctx.emulation.to_dict() if ctx.emulation else None}


# ---------------------------------------------------------------------------------------
# tune: launch shapes per kernel and size (under MPS: the protocol's cost, no fabric's)

TUNE_SIZES = "4K,16K,64K,256K,1M,4M,8M"
TUNE_SHAPES = "512x1,256x1,128x1,512x2,256x2,512x4"
# Every kernel tune may measure: auto's push kernels (TEST_AUTO_RULE) and the peer-read kernels.
TUNE_RULE = "oneshot_lamport<=1K,oneshot<=2K,twoshot_lamport<=4K,twoshot<=8K,oneshot_pull<=16K,oneshot_graph<=32K," \
            "twoshot_graph"


def _tune_shapes(text: str) -> list[tuple[int | None, int]]:
    """'rule,512x1,32x1': (threads per block, vectors per thread) pairs; 'rule' is the default shape
    (threads by size: p2p_layout.spread_threads, one vector per thread)."""
    shapes: list[tuple[int | None, int]] = []
    for shape in text.split(","):
        threads, _, vectors = shape.partition("x")
        shapes.append((None, 1) if shape == "rule" else (int(threads), int(vectors)))
    return shapes


def tune_worker(ctx: RunContext, args: argparse.Namespace) -> dict[str, Any]:
    dtype = torch.bfloat16
    backend = _backend("auto", {"p2p_auto_rule": TUNE_RULE}, ctx, args.p2p_pdl)
    times: dict[str, dict[str, list[float]]] = {}
    shapes = _tune_shapes(args.shapes)
    sizes = [parse_bytes(size) for size in args.sizes.split(",")]
    kernels = [k for k in backend.algorithms if KERNEL_VARIANT[k] in args.kernels.split(",")]
    try:
        backend.setup(ctx, max(sizes), dtype)
        x = torch.ones(max(sizes) // dtype.itemsize, dtype=dtype, device=ctx.device)
        out = torch.empty_like(x)
        for kernel in kernels:
            times[kernel] = {}
            for threads, vectors in shapes:
                backend.options = replace(backend.options, shape=LaunchShape(threads, vectors))
                mine = [backend._kernel_us(kernel, x[:n // dtype.itemsize], out[:n // dtype.itemsize]) for n in sizes]
                slowest = [max(t) for t in zip(*ctx.all_gather_objects(mine))]
                times[kernel]["rule" if threads is None else f"{threads}x{vectors}"] = [round(t, 3) for t in slowest]
        backend.raise_if_failed()
    finally:
        backend.close()
    if ctx.rank == 0:
        print(f"world {ctx.world_size}: best shape (threads x vectors per thread) and us per call / us per call "
              f"with the first shape, slowest rank")
        print(f"{'kernel':>16} " + " ".join(f"{n:>16}" for n in sizes))
        for kernel, by_shape in times.items():
            cells = []
            for i in range(len(sizes)):
                best = min(by_shape, key=lambda shape: by_shape[shape][i])
                cells.append(f"{best} {by_shape[best][i]:.2f}/{by_shape[args.shapes.split(',')[0]][i]:.2f}")
            print(f"{kernel:>16} " + " ".join(f"{c:>16}" for c in cells))
    return {"world": ctx.world_size, "sizes": sizes, "us_per_call": times}


# ---------------------------------------------------------------------------------------
# floor: world size 1, the kernel alone (no peers), graph-replayed


def _graph_us_per_call(call: Callable[[], None]) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(FLOOR_CALLS_PER_GRAPH):
            call()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(FLOOR_REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1000.0 / FLOOR_CALLS_PER_GRAPH


FLOOR_PDL = ("on", "off")


def floor_main() -> dict[str, Any]:
    """Every floor kernel with PDL on and off, in one run; rows carry both times and off / on."""
    ctx, _ = init_context()
    dtype = torch.bfloat16
    backends = {f"p2p_{name}_pdl_{pdl}": _backend(name, {}, ctx, pdl)
                for name in FLOOR_VARIANTS for pdl in FLOOR_PDL}
    rows = []
    try:
        for backend in backends.values():
            backend.setup(ctx, max(FLOOR_SIZES), dtype)
        pdl = {key: {k: v for k, v in backend.row_fields()["extra"].items() if k.startswith("p2p_pdl")}
               for key, backend in backends.items()}
        for size in FLOOR_SIZES:
            count = size // dtype.itemsize
            x = exact_pattern(0, 1, count, 1, ctx.device, dtype)
            out, y = torch.empty_like(x), torch.empty_like(x)
            row: dict[str, Any] = {"bytes": size, "exact": True}
            for key, backend in backends.items():
                row["exact"] = row["exact"] and bool(torch.equal(_reduced(backend, x), x))
                row[f"{key}_us"] = round(_graph_us_per_call(lambda: backend.allreduce(x, out)), 3)
            for name in FLOOR_VARIANTS:
                off_us, on_us = row[f"p2p_{name}_pdl_off_us"], row[f"p2p_{name}_pdl_on_us"]
                row[f"p2p_{name}_pdl_off_over_on"] = round(off_us / on_us, 3)
            row["torch_copy_us"] = round(_graph_us_per_call(lambda: y.copy_(x)), 3)
            rows.append(row)
        for backend in backends.values():
            backend.raise_if_failed()
    finally:
        for backend in backends.values():
            backend.close()
        shutdown()
    _print_floor(rows, pdl)
    return {"device": torch.cuda.get_device_name(0), "dtype": "bf16", "calls_per_graph": FLOOR_CALLS_PER_GRAPH,
            "replays": FLOOR_REPLAYS, "pdl": pdl, "rows": rows}


def _print_floor(rows: list[dict[str, Any]], pdl: dict[str, dict[str, Any]]) -> None:
    for key, facts in pdl.items():
        print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    columns = [c for c in rows[0] if c not in ("bytes", "exact")]
    print(f"{'bytes':>8}  " + "  ".join(columns) + "  exact")
    for row in rows:
        print(f"{row['bytes']:>8}  " + "  ".join(f"{row[c]:>{len(c)}.3f}" for c in columns) + f"  {row['exact']}")


WORKERS: dict[str, Callable[[RunContext, argparse.Namespace], dict[str, Any]]] = {
    "exact": exact_worker, "fused": fused_worker, "long": long_worker, "timeout": timeout_worker, "calibrate": calibrate_worker,
    "tune": tune_worker}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=[*WORKERS, "floor"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--variant", default="auto")
    parser.add_argument("--graph-kernels", action="store_true",
                        help=f"long mode: p2p:auto's rule {GRAPH_AUTO_RULE} (the graph kernels in the replays, their "
                             f"fallbacks in the eager calls) instead of {TEST_AUTO_RULE}")
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--replays", type=int, default=1_000)
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="long mode: stop eager calls (and, separately, replays) after this long")
    parser.add_argument("--p2p-pdl", choices=("on", "off"), default="on",
                        help="launch with programmatic dependent launch where it can work (every mode but floor, "
                             "which measures both)")
    parser.add_argument("--kernels", default="oneshot_lamport,oneshot,twoshot_lamport,twoshot",
                        help="tune mode: the kernels to measure, by variant name (default: p2p:auto's push kernels)")
    parser.add_argument("--shapes", default=TUNE_SHAPES,
                        help="tune mode: launch shapes, threads per block x vectors per thread ('rule': the default by "
                             "size), the first the baseline")
    parser.add_argument("--sizes", default=TUNE_SIZES, help=f"tune mode: message sizes (default {TUNE_SIZES})")
    parser.add_argument("--kernel-source", metavar="FILE.cu",
                        help="build the kernels from this variant of backends/p2p/allreduce.cu (default: that file)")
    parser.add_argument("--fused-blocks", type=int, default=0, metavar="N",
                        help="fused mode: launch the fused kernels with at most N blocks (a study of residency under "
                             "MPS; default: the backend's launch rule)")
    parser.add_argument("--no-sm-limit", action="store_true",
                        help=f"under an MPS daemon, run the ranks without {MPS_PERCENT_VAR}")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.mode == "floor":
        summary = floor_main()
    else:
        summary = spawn(args.mode, 2 if args.mode == "timeout" else args.world, args)
    summary["mode"] = args.mode
    summary["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
