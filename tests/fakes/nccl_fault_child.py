"""The probe's NCCL rank child with a fault injected, for the CPU tests (run with gloo).

COMMBENCH_TEST_FAULT picks the fault: `hang` (the allreduce never returns), `wrong` (rank 1
adds 1 to its result) or `error` (rank 1 raises). It strikes only where P2P would be in use
(NCCL_P2P_DISABLE is not 1) and only for messages of COMMBENCH_TEST_FAULT_BYTES (default: any),
which is how P2P faults look from the outside. With COMMBENCH_TEST_NCCL_DUMPS=DIR, rank 0 plays
NCCL's part of the topology run: it copies DIR/turin-8x-{topo,graph}.xml where
NCCL_TOPO_DUMP_FILE / NCCL_GRAPH_DUMP_FILE point and logs a TUNING line to NCCL_DEBUG_FILE.
Everything else is the real child.
"""

import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

from commbench.topology import nccl_child

FAULT = os.environ.get("COMMBENCH_TEST_FAULT", "")
ONLY_BYTES = int(os.environ.get("COMMBENCH_TEST_FAULT_BYTES", "0"))
DUMPS = os.environ.get("COMMBENCH_TEST_NCCL_DUMPS")
P2P_ON = os.environ.get("NCCL_P2P_DISABLE") != "1"
_real_all_reduce = dist.all_reduce


def write_nccl_files(nbytes: int) -> None:
    shutil.copy(Path(DUMPS) / "turin-8x-topo.xml", os.environ["NCCL_TOPO_DUMP_FILE"])
    shutil.copy(Path(DUMPS) / "turin-8x-graph.xml", os.environ["NCCL_GRAPH_DUMP_FILE"])
    with open(os.environ["NCCL_DEBUG_FILE"], "a") as log:
        log.write(f"host:1:1 [0] NCCL INFO AllReduce: {nbytes} Bytes -> Algo RING proto SIMPLE channel{{Lo..Hi}}={{0..1}}\n")


def faulty_all_reduce(tensor, *args, **kwargs):
    if DUMPS and dist.get_rank() == 0 and "NCCL_TOPO_DUMP_FILE" in os.environ:   # the topology run only
        write_nccl_files(tensor.numel() * 4)
    strikes = P2P_ON and (not ONLY_BYTES or tensor.numel() * 4 == ONLY_BYTES)
    rank = dist.get_rank()
    if strikes and FAULT == "hang":
        time.sleep(3600)
    if strikes and FAULT == "error" and rank == 1:
        raise RuntimeError("NCCL error: unhandled cuda error (injected)")
    work = _real_all_reduce(tensor, *args, **kwargs)
    if strikes and FAULT == "wrong" and rank == 1:
        tensor.add_(1)
    return work


dist.all_reduce = faulty_all_reduce

if __name__ == "__main__":
    sys.exit(nccl_child.main(sys.argv))
