"""Child process, one per rank: an allreduce with exact values through torch.distributed.

Run by nccl_checks.py as `python -m commbench.topology.nccl_child SPEC_JSON`, every rank in
its own process under one hard time limit, so a collective that never completes costs a killed
child, not a hung probe. Each rank reports what it got; the parent decides healthy / hangs /
wrong / inconclusive. The ranks meet through a file store in a directory the parent made, so
nothing listens on a port.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

from commbench.topology.childproc import child_main, emit

# Values with an exact float32 sum at any world size up to 64: (rank+1) * (position % 251 + 1).
PATTERN_PERIOD = 251


def expected_sum(world: int, count: int) -> Any:
    import torch

    ranks_total = world * (world + 1) // 2
    return (torch.arange(count, dtype=torch.int64) % PATTERN_PERIOD + 1).to(torch.float32) * ranks_total


def rank_input(rank: int, count: int) -> Any:
    import torch

    return (torch.arange(count, dtype=torch.int64) % PATTERN_PERIOD + 1).to(torch.float32) * (rank + 1)


def run(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(spec["rank"]), int(spec["world"])
    device = torch.device("cuda", int(spec["device"])) if spec.get("device") is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = spec.get("backend", "nccl")
    emit("start", step="init", rank=rank)
    # device_id makes NCCL build its communicator here, inside the timed child; gloo takes none.
    dist.init_process_group(backend, init_method=f"file://{spec['store']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(spec["timeout_s"])),
                            device_id=device if backend == "nccl" else None)
    try:
        for nbytes in spec["sizes_bytes"]:
            count = max(1, int(nbytes) // 4)
            emit("start", step=f"allreduce {nbytes} B", rank=rank)
            x = rank_input(rank, count).to(device)
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wrong = int((x.cpu() != expected_sum(world, count)).sum())
            emit("allreduce", rank=rank, size_bytes=int(nbytes), elements=count, wrong_elements=wrong)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    return child_main(argv, run, lambda spec, exc: {"rank": spec.get("rank")})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
