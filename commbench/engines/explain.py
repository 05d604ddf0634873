"""The probe's explain section: which allreduce paths each engine would take on the probed box at
one world size, and why (paths.states in words, under this host's multicast policy)."""

from __future__ import annotations

from typing import Any

from commbench.engines import source
from commbench.engines.paths import Workload, states, status
from commbench.engines.registry import ENGINES
from commbench.policy import multicast_policy_reason
from commbench.topology import box as boxes


def explain(snapshot: dict[str, Any], world_size: int) -> list[str]:
    if not snapshot.get("gpus"):
        return ["No CUDA GPU in this snapshot: vLLM and SGLang would not start a CUDA tensor-parallel group."]
    if world_size < 2:
        return [f"World size {world_size}: there is nothing to all-reduce; pass --world-size N to see TP=N."]
    blocked = multicast_policy_reason(True)
    b = boxes.read(snapshot, world_size, multicast_blocked=blocked)
    pairs = "n/a (one GPU, ranks share it)" if len(b.gpu_ids) == 1 else "yes" if b.nvlink_all else "no"
    policy = f"; multicast {blocked}" if blocked else ""
    lines = [f"TP={world_size} on GPUs {list(b.gpu_ids)} (compute capability {b.cc}); NVLink between every pair: "
             f"{pairs}; functional P2P: {'yes' if b.p2p_ok else 'no'}; multicast attribute: "
             f"{'yes' if b.multicast else 'no'}{policy}."]
    sources = source.resolve(None)     # the engines installed here, else built in
    for engine in ENGINES:
        facts = sources[engine.key]
        lines.append(f"{source.provenance_line(facts)}:")
        lines += [f"{facts.name} {facts.version} {p.rule.title}: {status(p)}: {p.why} — {p.rule.turn_on} "
                  f"[{p.source}]." for p in states(engine, b, Workload(), facts)]
    return lines
