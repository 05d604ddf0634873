"""NCCL's checks, every run in child processes (one per rank) under one hard time limit.

- The collective A/B, after club-3090's p2p_collective_check: a tiny (4 B, which NCCL sends
  with LL) and a large (16 MiB, Simple) allreduce with exact values, once as NCCL chooses and
  once with NCCL_P2P_DISABLE=1 as the control. Each run is healthy, hangs, wrong or
  inconclusive; per size the pair says whether the fault is in the P2P path. Copy-then-sync
  tests ride completion flushes; collectives need kernels that watch each other's writes while
  resident, which is where broken P2P shows ("throughput is not a correctness signal").
- NCCL's view of the box: one communicator over the host's GPUs with NCCL_TOPO_DUMP_FILE and
  NCCL_GRAPH_DUMP_FILE set and a 32 KiB allreduce logged at TUNING level; the snapshot keeps the
  XML NCCL wrote and the protocol it picked for that message.

Without --allow-multicast the children run with NCCL_NVLS_ENABLE=0: NCCL creates multicast
objects on NVSwitch systems by itself, and the probe creates none unless allowed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from commbench.policy import multicast_policy_reason
from commbench.topology.childproc import Child, ChildResult, module_argv
from commbench.topology.nccl_log import ALGO_VAR, LOG_FILE_VAR, LOG_SETTINGS, PROTO_VAR, used_algo_proto

CHILD_MODULE = "commbench.topology.nccl_child"
TINY_BYTES = 4                # one float: NCCL's LL protocol
LARGE_BYTES = 16 << 20        # Simple protocol
SMALL_MESSAGE_BYTES = 32 << 10   # the size of the published AMD Turin figure (48 -> 26 us)
SIZES = ((TINY_BYTES, "LL-sized"), (LARGE_BYTES, "Simple-sized"))
ARMS = {"p2p": {}, "p2p_disabled": {"NCCL_P2P_DISABLE": "1"}}
HEALTHY, HANGS, WRONG, INCONCLUSIVE = "healthy", "hangs", "wrong", "inconclusive"
P2P_FAULT = "p2p_fault"
ONE_GPU_NOTE = "needs 2 or more GPUs: NCCL refuses two ranks on one GPU"
MAX_XML_CHARS = 200_000
# Settings that change NCCL's graph; recorded so a dump is read with what shaped it.
SHAPING_VARS = ("NCCL_GRAPH_FILE", "NCCL_TOPO_FILE", "NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE", "NCCL_MIN_NCHANNELS",
                "NCCL_MAX_NCHANNELS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS", PROTO_VAR, ALGO_VAR)
# The ranks' own collective timeout sits past the parent's limit, so that a hang is the parent's
# kill (a 'hangs' verdict) and not torch's watchdog aborting the process.
CHILD_TIMEOUT_MARGIN_S = 30.0


def base_env(allow_multicast: bool) -> dict[str, str]:
    return {} if multicast_policy_reason(allow_multicast) is None else {"NCCL_NVLS_ENABLE": "0"}


def run_ranks(devices: list[int | None], sizes: list[int], env: dict[str, str], timeout_s: float, workdir: Path,
              module: str = CHILD_MODULE, backend: str = "nccl",
              rank_env: dict[int, dict[str, str]] | None = None) -> list[ChildResult]:
    """One child per device (rank r on devices[r]; None = a CPU rank, for gloo), all waited on
    together until one deadline."""
    store = workdir / f"store-{time.monotonic_ns()}"
    children = []
    for rank, device in enumerate(devices):
        spec = {"rank": rank, "world": len(devices), "device": device, "store": str(store), "backend": backend,
                "sizes_bytes": sizes, "timeout_s": timeout_s + CHILD_TIMEOUT_MARGIN_S}
        children.append(Child(module_argv(module, spec), env={**env, **(rank_env or {}).get(rank, {})}))
    deadline = time.monotonic() + timeout_s
    # Waited in parallel: a child that finished early must not be judged after another's deadline.
    with ThreadPoolExecutor(len(children)) as pool:
        return list(pool.map(lambda c: c.wait(deadline), children))


def _rank_summary(rank: int, result: ChildResult) -> dict[str, Any]:
    errors = [r["detail"] for r in result.records if r.get("kind") == "error"]
    wrong = sum(r.get("wrong_elements", 0) for r in result.records if r.get("kind") == "allreduce")
    return {"rank": rank, "timed_out": result.timed_out, "error": errors[0] if errors else result.failure(),
            "last_step": result.last_started(), "wrong_elements": wrong,
            "sizes_done": [r["size_bytes"] for r in result.records if r.get("kind") == "allreduce"]}


def run_verdict(ranks: list[dict[str, Any]], sizes: list[int]) -> tuple[str, str]:
    """healthy / hangs / wrong / inconclusive for one run, with the rank and step behind it."""
    wrong = [r for r in ranks if r["wrong_elements"]]
    if wrong:
        return WRONG, "; ".join(f"rank {r['rank']}: {r['wrong_elements']} wrong element(s)" for r in wrong)
    errors = [r for r in ranks if r["error"] and not r["timed_out"]]
    if errors:   # a rank's failure often takes its peers down with it: name them all
        return INCONCLUSIVE, "; ".join(f"rank {r['rank']} failed: {r['error']}" for r in errors)
    hung = [r for r in ranks if r["timed_out"]]
    if hung:
        return HANGS, f"rank {hung[0]['rank']} did not finish within the time limit (last step: {hung[0]['last_step']})"
    if all(r["sizes_done"] == sizes for r in ranks):
        return HEALTHY, "exact sum on every rank"
    return INCONCLUSIVE, "a rank exited without reporting every size"


def ab_meaning(p2p: str, control: str) -> tuple[str, str]:
    """What a (with P2P, NCCL_P2P_DISABLE=1) pair of verdicts says about the P2P path."""
    if control != HEALTHY:
        return INCONCLUSIVE, f"the control without P2P is {control} too: the fault is not (only) in the P2P path"
    if p2p == HEALTHY:
        return HEALTHY, "correct with and without P2P"
    if p2p in (HANGS, WRONG):
        return P2P_FAULT, f"{p2p} with P2P, correct with NCCL_P2P_DISABLE=1: the P2P path is at fault"
    return INCONCLUSIVE, "the run with P2P failed to start (see its detail); the control was correct"


def collective_ab(devices: list[int | None], timeout_s: float, allow_multicast: bool, workdir: Path,
                  module: str = CHILD_MODULE, backend: str = "nccl") -> list[dict[str, Any]]:
    """Four runs (2 sizes x with/without P2P), each a fresh set of rank processes."""
    runs = []
    for size, label in SIZES:
        for arm, extra in ARMS.items():
            results = run_ranks(list(devices), [size], {**base_env(allow_multicast), **extra}, timeout_s, workdir,
                                module, backend)
            ranks = [_rank_summary(r, res) for r, res in enumerate(results)]
            verdict, detail = run_verdict(ranks, [size])
            runs.append({"size_bytes": size, "label": label, "arm": arm, "env": extra, "verdict": verdict,
                         "detail": detail, "elapsed_s": round(max(res.elapsed_s for res in results), 1),
                         "ranks": ranks})
    return runs


def _read_capped(path: Path) -> str | None:
    if not path.exists():
        return None
    return path.read_text(encoding="utf-8", errors="replace")[:MAX_XML_CHARS]


def topology_dump(devices: list[int | None], timeout_s: float, allow_multicast: bool, workdir: Path,
                  module: str = CHILD_MODULE, backend: str = "nccl") -> dict[str, Any]:
    """NCCL's topology and graph XML over these GPUs, and its choice for a 32 KiB allreduce."""
    files = {"topo": workdir / "nccl-topo.xml", "graph": workdir / "nccl-graph.xml"}
    env = {**base_env(allow_multicast), "NCCL_TOPO_DUMP_FILE": str(files["topo"]),
           "NCCL_GRAPH_DUMP_FILE": str(files["graph"]), **LOG_SETTINGS}
    logs = {r: workdir / f"nccl-rank{r}.log" for r in range(len(devices))}
    results = run_ranks(list(devices), [SMALL_MESSAGE_BYTES], env, timeout_s, workdir, module, backend,
                        rank_env={r: {LOG_FILE_VAR: str(p)} for r, p in logs.items()})
    ranks = [_rank_summary(r, res) for r, res in enumerate(results)]
    verdict, detail = run_verdict(ranks, [SMALL_MESSAGE_BYTES])
    lines = logs[0].read_text(errors="replace").splitlines() if logs[0].exists() else []
    algo, proto = used_algo_proto(lines, SMALL_MESSAGE_BYTES)
    return {"ranks": len(devices), "verdict": verdict, "detail": detail,
            "topo_xml": _read_capped(files["topo"]), "graph_xml": _read_capped(files["graph"]),
            "small_message": {"bytes": SMALL_MESSAGE_BYTES, "algo": algo, "proto": proto},
            "env": {k: os.environ[k] for k in SHAPING_VARS if k in os.environ}}


def nccl_report(devices: list[int | None], timeout_s: float, allow_multicast: bool, module: str = CHILD_MODULE,
                backend: str = "nccl") -> dict[str, Any]:
    """The A/B (2 GPUs or more) and NCCL's view (any GPU count), as one snapshot entry."""
    workdir = Path(tempfile.mkdtemp(prefix="cbn-"))
    try:
        ab = collective_ab(devices, timeout_s, allow_multicast, workdir, module, backend) if len(devices) > 1 else []
        return {"devices": list(devices), "ab": ab, "ab_note": None if len(devices) > 1 else ONE_GPU_NOTE,
                "topology": topology_dump(devices, timeout_s, allow_multicast, workdir, module, backend)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
