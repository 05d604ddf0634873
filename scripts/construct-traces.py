#!/usr/bin/env python3
"""Builds the constructed traces in tests/data/traces/constructed/ (vLLM and SGLang cannot run
here): kineto's Chrome-trace layout (output_json.cpp: top keys, ph "X" events, kernel args
"correlation", "stream", "graph id", "graph node id"; launches as cuda_runtime events; c10d's
record_param_comms args) with the kernel names the engines' sources give (see each backend
module's TRACE_KERNELS and commbench/engines/settings.py). Every file says it is constructed.

    python3 scripts/construct-traces.py [OUT_DIR]

Shapes, counts and durations are fixed below, so the tests know every count and share.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "tests/data/traces/constructed"
LAYERS = 4
STEPS = 5
HIDDEN = 4096
DECODE_BATCH = 8
PREFILL_TOKENS = 128
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
ATTENTION = "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>, false>(Flash_fwd_params)"
VLLM_CA = ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, "
           "vllm::Signal*, __nv_bfloat16*, int, int)")
VLLM_CA_2STAGE = ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, "
                  "vllm::Signal*, __nv_bfloat16*, int, int)")
SGLANG_AR = ("void sglang::all_reduce_1shot_push_kernel<__nv_bfloat16, 2u, true>"
             "(sglang::AllReducePushParams<2u> const)")
NCCL_AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
# Durations (us): the decode step of each engine is these kernels, back to back, per layer.
GEMM_US, ATTN_US, AR_US, GAP_US = 20.0, 12.0, 8.0, 1.0
STEP_GAP_US = 2000.0


class Builder:
    def __init__(self, rank: int, world: int, engine: str, distributed_info: bool):
        self.events: list[dict[str, Any]] = []
        self.rank, self.world, self.engine = rank, world, engine
        self.distributed_info = distributed_info
        self.correlation = 1000
        self.external = 1
        self.gpu_ts = 1_000_000.0 + rank * 3.0   # ranks a little apart, as real ones are
        self.cpu_ts = self.gpu_ts - 500.0

    def _corr(self) -> int:
        self.correlation += 1
        return self.correlation

    def runtime(self, name: str, corr: int, dur: float = 5.0) -> None:
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 4000 + self.rank, "tid": 4000 + self.rank,
                            "ts": self.cpu_ts, "dur": dur,
                            "args": {"External id": self.external, "cbid": 311, "correlation": corr}})
        self.cpu_ts += dur + 1.0

    def kernel(self, name: str, dur: float, corr: int, graph: tuple[int, int] | None, stream: int = 7) -> None:
        args: dict[str, Any] = {"External id": self.external, "queued": 0, "device": 0, "context": 1,
                                "stream": stream, "correlation": corr, "registers per thread": 64,
                                "shared memory": 0, "blocks per SM": 1.0, "warps per SM": 8.0,
                                "grid": [132, 1, 1], "block": [256, 1, 1], "est. achieved occupancy %": 25}
        if graph is not None:
            args["graph id"], args["graph node id"] = graph
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream,
                            "ts": self.gpu_ts, "dur": dur, "args": args})
        self.gpu_ts += dur + GAP_US

    def layer_kernels(self, ar_name: str) -> list[tuple[str, float]]:
        return [(GEMM, GEMM_US), (ATTENTION, ATTN_US), (ar_name, AR_US), (GEMM, GEMM_US), (ar_name, AR_US)]

    def decode_replay(self, ar_name: str, graph_id: int) -> None:
        corr = self._corr()
        self.runtime("cudaGraphLaunch", corr)
        node = 0
        for _ in range(LAYERS):
            for name, dur in self.layer_kernels(ar_name):
                node += 1
                self.kernel(name, dur, corr, (graph_id, node))
        self.gpu_ts += STEP_GAP_US
        self.cpu_ts = self.gpu_ts - 500.0

    def eager_op(self, op: str, op_args: dict[str, Any], kernel: str, dur: float) -> None:
        start = self.cpu_ts
        self.cpu_ts += 2.0
        corr = self._corr()
        self.runtime("cudaLaunchKernel", corr)
        self.events.append({"ph": "X", "cat": "cpu_op", "name": op, "pid": 4000 + self.rank, "tid": 4000 + self.rank,
                            "ts": start, "dur": self.cpu_ts - start + 1.0,
                            "args": {"External id": self.external, "Record function id": 0, **op_args}})
        self.cpu_ts += 2.0
        self.kernel(kernel, dur, corr, None)
        self.external += 1

    def annotation(self, name: str, start: float) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 4000 + self.rank,
                            "tid": 4000 + self.rank, "ts": start, "dur": self.cpu_ts - start + 1.0,
                            "args": {"External id": self.external}})

    def document(self, provenance: str) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045034496,
                                  "computeMajor": 9, "computeMinor": 0, "numSms": 132}],
            "commbench_provenance": provenance}
        if self.distributed_info:
            doc["distributedInfo"] = {"backend": "nccl", "rank": self.rank, "world_size": self.world}
        doc["traceEvents"] = self.events
        doc["traceName"] = f"{self.engine}-rank{self.rank}"
        return doc


def vllm(rank: int) -> dict[str, Any]:
    """vLLM TP2: one eager prefill (custom op with recorded shapes, 2-stage custom AR) inside the
    engine's step annotation, then STEPS decode steps, each a full CUDA-graph replay in its own
    annotation, with 2 one-stage custom ARs per layer."""
    b = Builder(rank, 2, "vllm", distributed_info=True)
    start = b.cpu_ts
    for _ in range(LAYERS):
        for _ in range(2):
            b.eager_op("_C_custom_ar::all_reduce", {"Input Dims": [[PREFILL_TOKENS, HIDDEN], [PREFILL_TOKENS, HIDDEN], [], []],
                                                   "Input type": ["c10::BFloat16", "c10::BFloat16", "long int", "long int"]},
                       VLLM_CA_2STAGE, 30.0)
    b.annotation("gpu_model_runner: forward", start)
    b.gpu_ts += STEP_GAP_US
    b.cpu_ts = b.gpu_ts - 500.0
    for _ in range(STEPS):
        start = b.cpu_ts
        b.decode_replay(VLLM_CA, graph_id=DECODE_BATCH)
        b.annotation("gpu_model_runner: forward", start)
    return b.document("constructed, not measured: vLLM-shaped TP2 trace built by scripts/construct-traces.py "
                      "(kineto layout, kernel names from vLLM's sources)")


def sglang(rank: int) -> dict[str, Any]:
    """SGLang TP2, rank only in the file name (-TP-{rank}-): one eager prefill through NCCL
    (c10d record_param_comms with its size), then STEPS decode replays with the JIT custom AR."""
    b = Builder(rank, 2, "sglang", distributed_info=False)
    for _ in range(LAYERS):
        for _ in range(2):
            b.eager_op("record_param_comms", {"Collective name": "allreduce", "In msg nelems": PREFILL_TOKENS * HIDDEN,
                                              "Out msg nelems": PREFILL_TOKENS * HIDDEN, "dtype": "BFloat16",
                                              "Group size": 2, "Process Group Name": "0"},
                       NCCL_AR, 60.0)
    b.gpu_ts += STEP_GAP_US
    b.cpu_ts = b.gpu_ts - 500.0
    for _ in range(STEPS):
        b.decode_replay(SGLANG_AR, graph_id=DECODE_BATCH)
    return b.document("constructed, not measured: SGLang-shaped TP2 trace built by scripts/construct-traces.py "
                      "(kineto layout, kernel names from SGLang's sources)")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for rank in range(2):
        (OUT / f"vllm-rank{rank}.trace.json").write_text(json.dumps(vllm(rank), indent=0))
        with gzip.open(OUT / f"1764650000-TP-{rank}-decode.trace.json.gz", "wt", encoding="utf-8") as f:
            json.dump(sglang(rank), f)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
