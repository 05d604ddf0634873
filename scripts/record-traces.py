#!/usr/bin/env python3
"""Records the real profiler traces `commbench attribute` is tested on.

    python3 scripts/record-traces.py --out DIR            GPU: one CUDA device, ranks sharing it
    python3 scripts/record-traces.py --gloo --out DIR     CPU: a gloo allreduce loop (format only)
    python3 scripts/record-traces.py --skew --out DIR     GPU: SKEW_WORLD ranks, one made late on purpose
    python3 scripts/record-traces.py --skew --gloo --out DIR   the same on the CPU (the script's dry run)

GPU mode (run it through scripts/record-traces.sh, which starts a private MPS daemon so that the
ranks run concurrently): for each backend in BACKENDS, WORLD ranks share GPU 0 and run a decode
step of LAYERS layers, each with model-shaped GEMMs (hidden HIDDEN, TP WORLD, BATCH tokens) and
ALLREDUCES_PER_LAYER allreduces through that commbench backend, captured in one CUDA graph
and replayed STEPS times under torch.profiler, each replay inside a "decode_step" annotation. NCCL cannot put two
ranks on one GPU, so its trace is world size 1, eager, with ReduceOp.AVG (at one rank NCCL runs
its oneRankReduce kernel for AVG; SUM in place launches nothing). A backend that cannot run here
(FlashInfer not installed, ...) is skipped with its reason in the manifest.

--skew (issue 39: `attribute` splits a call into wait and transfer): SKEW_WORLD ranks share the GPU
under MPS and run the same captured decode step through each backend in SKEW_BACKENDS; on rank
LATE_RANK only, a spin kernel of a known length (torch.cuda._sleep, its cycles per us measured on
that rank first) runs inside the graph just before the allreduces SKEW_DELAYS_US names (by their
index in the step) and before no other. The other ranks' kernels for those calls wait for it; the
trace holds the spin kernels themselves, the delay as the GPU ran it. With --gloo, the same ranks
run gloo allreduces on the CPU with a host sleep instead (no GPU kernels: a dry run of the script).

Every trace is written as <name>-rank<r>.trace.json.gz with a "commbench_provenance" key, and
manifest.json says what each holds by construction: layers, allreduces per step, message
size, steps, the kernel library expected (tests/system/test_attribute.py checks these).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

LAYERS = 8
ALLREDUCES_PER_LAYER = 2
HIDDEN = 4096
INTERMEDIATE = 14336
BATCH = 8
WORLD = 2
STEPS = 12
WARMUP_STEPS = 3
DTYPE = torch.bfloat16
# (trace name, commbench backend spec, library `attribute` must name)
BACKENDS = (
    ("symm_mem-one_shot", "symm_mem:one_shot", "torch symm-mem one-shot"),
    ("p2p-oneshot_lamport", "p2p:oneshot_lamport", "commbench p2p"),
    ("flashinfer-trtllm_oneshot", "flashinfer:trtllm_oneshot", "FlashInfer TRT-LLM fusion one-shot"),
)
NCCL_TRACE = ("nccl-world1", "nccl (ReduceOp.AVG, world size 1, eager)", "NCCL (one rank)")
GLOO_TRACE = "gloo-cpu"
# --skew: who is late, before which allreduces of a step (index 0..LAYERS*ALLREDUCES_PER_LAYER-1)
# and by how much. Index 0 is left alone: the first call of a replay already waits for the
# ranks' host launches (each rank replays on its own), which the test tells apart from these.
SKEW_WORLD = 4
LATE_RANK = 2
SKEW_DELAYS_US = {3: 40.0, 8: 80.0, 13: 40.0}
SKEW_BACKENDS = (
    ("skew-p2p-oneshot_lamport", "p2p:oneshot_lamport", "commbench p2p"),
    ("skew-symm_mem-one_shot", "symm_mem:one_shot", "torch symm-mem one-shot"),
)
CALIBRATION_CYCLES = 20_000_000     # about 10 ms of spinning at an H200's clock
# Each profiled step runs inside this annotation (torch.profiler marks ProfilerStep#N only under a
# schedule): the annotation rule's input where a trace has no graph replays.
STEP_ANNOTATION = "decode_step"
GLOO_COUNT = 4096
MPS_PERCENT_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
BACKEND_BUDGET_S = 60.0     # per backend (spawn, setup, capture, 12 replays take seconds)
TOTAL_BUDGET_S = 330.0     # FlashInfer (last) builds its allreduce on first use: about 2.5 min on an H200
MIN_BUDGET_S = 20.0         # FlashInfer's least, whatever the others took


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") and world > 1:
        os.environ[MPS_PERCENT_VAR] = str(100 // world)   # read once, at CUDA's start


def _write_trace(prof: profile, path: Path, provenance: str) -> int:
    """The profiler's Chrome trace, gzipped, with what it is said in PROVENANCE_KEY."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        doc = json.loads(raw.read_text())
    doc = {"commbench_provenance": provenance, **doc}
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(doc, f)
    return path.stat().st_size


class DecodeStep:
    """LAYERS x (QKV GEMM, O GEMM, allreduce, up GEMM, down GEMM, allreduce) on static buffers."""

    def __init__(self, backend: Any, device: torch.device, world: int,
                 before_allreduce: Callable[[int], None] | None = None):
        g = torch.Generator(device=device).manual_seed(0)
        self.before_allreduce = before_allreduce

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g, device=device) * 0.01).to(DTYPE)
        self.backend, self.world = backend, world
        self.h = torch.randn(BATCH, HIDDEN, generator=g, device=device).to(DTYPE)
        self.w_qkv = weight(HIDDEN, 3 * HIDDEN // world)
        self.w_o = weight(HIDDEN // world, HIDDEN)
        self.w_up = weight(HIDDEN, INTERMEDIATE // world)
        self.w_down = weight(INTERMEDIATE // world, HIDDEN)
        self.partial = torch.empty(BATCH, HIDDEN, dtype=DTYPE, device=device)
        self.reduced = torch.empty(BATCH, HIDDEN, dtype=DTYPE, device=device)

    def _allreduce(self, index: int) -> torch.Tensor:
        if self.before_allreduce is not None:
            self.before_allreduce(index)
        x = self.partial.view(-1)
        out = x if getattr(self.backend, "in_place", False) else self.reduced.view(-1)
        self.backend.allreduce(x, out)
        return out.view(BATCH, HIDDEN)

    def __call__(self) -> None:
        h = self.h
        for layer in range(LAYERS):
            qkv = h @ self.w_qkv
            torch.matmul(qkv[:, : HIDDEN // self.world], self.w_o, out=self.partial)
            h = self._allreduce(2 * layer) * 0.5
            torch.matmul(torch.nn.functional.silu(h @ self.w_up), self.w_down, out=self.partial)
            h = self._allreduce(2 * layer + 1) * 0.5


def _cycles_per_us() -> float:
    """The spin kernel's cycles per microsecond on this rank (the median of three timed spins)."""
    rates = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(CALIBRATION_CYCLES)
        end.record()
        torch.cuda.synchronize()
        rates.append(CALIBRATION_CYCLES / (start.elapsed_time(end) * 1000.0))
    return sorted(rates)[1]


def _spin_before(delays_us: dict[int, float], cycles_per_us: float) -> Callable[[int], None]:
    def spin(index: int) -> None:
        if index in delays_us:
            torch.cuda._sleep(int(delays_us[index] * cycles_per_us))
    return spin


def _graph_rank(rank: int, world: int, port: int, name: str, spec: str, out_dir: str, skew: bool,
                result_path: str) -> None:
    _rank_env(rank, world, port)
    from commbench import backends
    from commbench.runtime.context import init_context, shutdown

    ctx, _ = init_context(share_gpus=True, timeout_s=120.0)
    backend = None
    try:
        [backend] = backends.expand([spec], backends.Options(), on_gpu=True)   # every family's flag defaults
        reasons = ctx.all_gather_objects(backend.check(ctx) or backend.supports(BATCH * HIDDEN * 2, DTYPE))
        reason = next((f"rank {i}: {r}" for i, r in enumerate(reasons) if r), None)
        if reason is None:
            try:
                backend.setup(ctx, BATCH * HIDDEN * 2, DTYPE)
                error = None
            except Exception as exc:  # voted below: every rank skips together
                error = f"{type(exc).__name__}: {exc}"
            errors = ctx.all_gather_objects(error)
            reason = next((f"rank {i}: setup failed: {e}" for i, e in enumerate(errors) if e), None)
        if reason is not None:
            if rank == 0:
                Path(result_path).write_text(json.dumps({"skipped": reason}))
            return
        late = skew and rank == LATE_RANK
        cycles_per_us = _cycles_per_us() if late else None
        step = DecodeStep(backend, ctx.device, world,
                          _spin_before(SKEW_DELAYS_US, cycles_per_us) if cycles_per_us else None)
        for _ in range(WARMUP_STEPS):
            step()
        torch.cuda.synchronize()
        # CUPTI starts before the capture, so the graph's kernels are traced when it replays.
        with profile(activities=[ProfilerActivity.CUDA]):
            torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with backend.graph_capture(), torch.cuda.graph(graph):
            step()
        for _ in range(WARMUP_STEPS):
            graph.replay()
        torch.cuda.synchronize()
        ctx.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(STEPS):
                with record_function(STEP_ANNOTATION):
                    graph.replay()
                torch.cuda.synchronize()
        path = Path(out_dir) / f"{name}-rank{rank}.trace.json.gz"
        how = "under MPS" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "time-sliced (no MPS)"
        late_text = (f"; rank {LATE_RANK} made late on purpose by a spin kernel before some allreduces"
                     if skew else "")
        size = _write_trace(prof, path, f"recorded by scripts/record-traces.py: {spec}, rank {rank} of {world} "
                                        f"sharing one {torch.cuda.get_device_name()} {how} (emulated box: no "
                                        f"fabric between the ranks){late_text}")
        sizes = ctx.all_gather_objects(size)
        rates = ctx.all_gather_objects(cycles_per_us)
        if rank == 0:
            extra = {"cycles_per_us": rates[LATE_RANK]} if skew else {}
            Path(result_path).write_text(json.dumps({"bytes": sizes, "device": torch.cuda.get_device_name(),
                                                     **extra}))
    finally:
        if backend is not None:
            backend.close()
        shutdown()


def _nccl_rank(rank: int, world: int, port: int, out_dir: str, result_path: str) -> None:
    _rank_env(rank, world, port)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)

        class Nccl:
            in_place = True

            def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
                dist.all_reduce(x, op=dist.ReduceOp.AVG)
        step = DecodeStep(Nccl(), device, 1)
        for _ in range(WARMUP_STEPS):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(STEPS):
                with record_function(STEP_ANNOTATION):
                    step()
                torch.cuda.synchronize()
        path = Path(out_dir) / f"{NCCL_TRACE[0]}-rank0.trace.json.gz"
        size = _write_trace(prof, path, f"recorded by scripts/record-traces.py: {NCCL_TRACE[1]}, one "
                                        f"{torch.cuda.get_device_name()}")
        Path(result_path).write_text(json.dumps({"bytes": [size], "device": torch.cuda.get_device_name()}))
    finally:
        dist.destroy_process_group()


def _gloo_rank(rank: int, world: int, port: int, out_dir: str, name: str, skew: bool, result_path: str) -> None:
    _rank_env(rank, world, port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.ones(GLOO_COUNT, dtype=torch.float32)
        for _ in range(LAYERS * ALLREDUCES_PER_LAYER):     # warm-up, unrecorded
            dist.all_reduce(x)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(STEPS):
                with record_function(STEP_ANNOTATION):
                    for index in range(LAYERS * ALLREDUCES_PER_LAYER):
                        if skew and rank == LATE_RANK and index in SKEW_DELAYS_US:
                            time.sleep(SKEW_DELAYS_US[index] / 1e6)
                        dist.all_reduce(x)
        path = Path(out_dir) / f"{name}-rank{rank}.trace.json.gz"
        size = _write_trace(prof, path, f"recorded by scripts/record-traces.py --gloo: gloo on the CPU, rank {rank} "
                                        f"of {world} (format only: no GPU kernels)")
        sizes = [None] * world
        dist.all_gather_object(sizes, size)
        if rank == 0:
            Path(result_path).write_text(json.dumps({"bytes": sizes}))
    finally:
        dist.destroy_process_group()


def _spawn(fn: Any, world: int, budget_s: float, *args: Any) -> dict[str, Any]:
    """Runs fn on `world` spawned ranks; a rank that fails or a run over budget_s is a skip
    with the reason (the ranks are killed), and the other traces stay."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        started = time.monotonic()
        procs = mp.start_processes(fn, args=(world, _free_port(), *args, result), nprocs=world,
                                   start_method="spawn", join=False)
        try:
            while not procs.join(timeout=1.0):
                if time.monotonic() - started > budget_s:
                    for proc in procs.processes:
                        proc.kill()
                        proc.join()
                    return {"skipped": f"timed out after {budget_s:.0f} s"}
        except Exception as exc:   # a rank died
            return {"skipped": f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
        out = json.loads(Path(result).read_text()) if Path(result).exists() else {"skipped": "no result written"}
        out["seconds"] = round(time.monotonic() - started, 1)
        return out


def _entry(name: str, what: str, library: str, world: int, mode: str, result: dict[str, Any],
           allreduces_per_layer: int = ALLREDUCES_PER_LAYER) -> dict[str, Any]:
    entry = {"name": name, "backend": what, "library": library, "world_size": world, "mode": mode,
             "files": [f"{name}-rank{r}.trace.json.gz" for r in range(world)], "layers": LAYERS,
             "allreduces_per_layer": allreduces_per_layer, "allreduces_per_step": LAYERS * allreduces_per_layer,
             "steps": STEPS, "step_annotation": STEP_ANNOTATION, "batch": BATCH, "hidden": HIDDEN, "dtype": "bf16",
             "message_bytes": BATCH * HIDDEN * DTYPE.itemsize, **result}
    if "skipped" in entry:
        entry["files"] = []
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the traces and manifest.json")
    parser.add_argument("--gloo", action="store_true", help="record the CPU/gloo trace only")
    parser.add_argument("--skew", action="store_true",
                        help=f"record {SKEW_WORLD} ranks with rank {LATE_RANK} made late before some allreduces")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    deadline = time.monotonic() + TOTAL_BUDGET_S

    def record(entry: dict[str, Any]) -> None:
        """Appended and written at once: a run cut short keeps the manifest of what it recorded."""
        entries.append(entry)
        print(json.dumps(entry), flush=True)
        _write_manifest(args.out, entries, "cpu" if args.gloo else None)

    skew = {"late_rank": LATE_RANK, "delays_us": {str(i): us for i, us in SKEW_DELAYS_US.items()}} if args.skew else {}
    if args.gloo:
        world, name = (SKEW_WORLD, f"skew-{GLOO_TRACE}") if args.skew else (WORLD, GLOO_TRACE)
        result = _spawn(_gloo_rank, world, BACKEND_BUDGET_S, str(args.out), name, args.skew)
        record({**_entry(name, "gloo (CPU)", "", world, "eager", result),
                "message_bytes": GLOO_COUNT * 4, "dtype": "fp32", "batch": None, "hidden": None, **skew})
    elif not torch.cuda.is_available():
        print("record-traces: no CUDA device (use --gloo for the CPU trace)", file=sys.stderr)
        return 2
    elif args.skew:
        for name, spec, library in SKEW_BACKENDS:
            record({**_entry(name, spec, library, SKEW_WORLD, "graph",
                             _spawn(_graph_rank, SKEW_WORLD, BACKEND_BUDGET_S, name, spec, str(args.out), True)),
                    **skew})
    else:
        # NCCL before FlashInfer: FlashInfer may JIT-compile, so it gets whatever time is left.
        for name, spec, library in BACKENDS:
            flashinfer = spec.startswith("flashinfer")
            if flashinfer:
                record(_entry(*NCCL_TRACE, 1, "eager", _spawn(_nccl_rank, 1, BACKEND_BUDGET_S, str(args.out))))
            budget = max(MIN_BUDGET_S, deadline - time.monotonic()) if flashinfer else BACKEND_BUDGET_S
            record(_entry(name, spec, library, WORLD, "graph",
                          _spawn(_graph_rank, WORLD, budget, name, spec, str(args.out), False)))
    print(f"wrote {args.out}/manifest.json: {sum(1 for e in entries if 'skipped' not in e)} of {len(entries)} recorded")
    return 0


def _write_manifest(out: Path, entries: list[dict[str, Any]], device: str | None) -> None:
    manifest = {"recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "host": platform.node(),
                "device": device or next((e["device"] for e in entries if e.get("device")), "unknown"),
                "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "torch": torch.__version__,
                "traces": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
