"""Child process: SM-initiated peer bandwidth and latency per directed pair, and each GPU's
PCIe link as sysfs reports it while the GPU is busy.

Run by the parent after the copy-engine bandwidth step (`--bandwidth`), as
`python -m commbench.topology.peer_checks SPEC_JSON` under a time limit (childproc.py). Per pair:
64 MiB x 10 of 16-byte SM stores into the peer's memory, the same of SM loads from it (GB/s =
1e9 B/s, CUDA events around the repetitions, after two warm-up launches), and a dependent-load
round trip: one thread chases a pointer ring through the peer's memory, 2000 hops minus 1 hop
over 1999, so the launch cost cancels. A pair with src == dst measures local memory: the
number says the check ran, not what a fabric does.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from commbench.topology import link_health
from commbench.topology.childproc import child_main, driver_or_error, emit
from commbench.topology.cudadrv import ATTR_MULTIPROCESSOR_COUNT, CudaError
from commbench.topology.peer_kernels import PeerKernels, chain

SM_BYTES = 64 << 20          # as the copy-engine step, so the two paths move the same data
SM_REPS = 10
BLOCKS_PER_SM = 4            # 1024 threads per SM keep enough 16-byte requests in flight on PCIe
CHASE_NODES = 256
CHASE_STRIDE_BYTES = 4096    # one node per 4 KiB: no two hops share a cache line or a DRAM page
CHASE_HOPS = 2000
CHASE_REPS = 3
STORE_SEED = 0x5EED5EED
METHOD = ("SM kernels (PTX, JIT by the driver) on the source GPU into the destination GPU's memory with peer "
          f"access on: {SM_BYTES >> 20} MiB x {SM_REPS} of 16-byte stores, then loads (ld.global.cv), "
          f"{BLOCKS_PER_SM} blocks of 256 threads per SM, CUDA events, after 2 warm-up launches (GB/s = 1e9 B/s); "
          f"read latency = one thread chasing a pointer ring through the peer's memory, "
          f"({CHASE_HOPS} hops - 1 hop) / {CHASE_HOPS - 1}, mean of {CHASE_REPS}")


def timed_ms(drv: Any, launch: Callable[[], None], reps: int, while_busy: Callable[[], None] | None = None) -> float:
    """Milliseconds for `reps` launches between two events, after two warm-up launches (which
    also bring an idle link up to speed). while_busy runs while the timed launches execute."""
    for _ in range(2):
        launch()
    start, end = drv.event(), drv.event()
    drv.record(start)
    for _ in range(reps):
        launch()
    drv.record(end)
    if while_busy is not None:
        while_busy()
    return drv.elapsed_ms(start, end)


def gbps(nbytes: int, reps: int, ms: float) -> float:
    return round(nbytes * reps / (ms / 1e3) / 1e9, 2)


def read_latency_us(drv: Any, kernels: Any, start: int, out: int) -> float:
    long_ms = timed_ms(drv, lambda: kernels.chase(start, CHASE_HOPS, out), CHASE_REPS)
    short_ms = timed_ms(drv, lambda: kernels.chase(start, 1, out), CHASE_REPS)
    return round((long_ms - short_ms) * 1e3 / CHASE_REPS / (CHASE_HOPS - 1), 3)


def measure_pair(drv: Any, kernels: Any, peer_buf: int, out_buf: int, blocks: int,
                 while_busy: Callable[[], None]) -> dict[str, float]:
    """Store and load bandwidth and read latency from the current context into peer_buf."""
    store_ms = timed_ms(drv, lambda: kernels.store(peer_buf, SM_BYTES, blocks, STORE_SEED), SM_REPS, while_busy)
    load_ms = timed_ms(drv, lambda: kernels.load(peer_buf, SM_BYTES, out_buf, blocks), SM_REPS)
    drv.write_bytes(peer_buf, chain(peer_buf, CHASE_NODES, CHASE_STRIDE_BYTES))
    return {"store_gbps": gbps(SM_BYTES, SM_REPS, store_ms), "load_gbps": gbps(SM_BYTES, SM_REPS, load_ms),
            "read_latency_us": read_latency_us(drv, kernels, peer_buf, out_buf)}


def link_reader(bus_ids: dict[int, str], src: int, dst: int) -> Callable[[], None]:
    """Emit each GPU's sysfs link state; called while src streams into dst."""
    def read() -> None:
        what = f"GPU {src} SM stores into GPU {dst}" if src != dst else f"GPU {src} SM stores into its own memory"
        for device in sorted({src, dst}):
            emit("link_load", device=device, during=what, **link_health.link_state(bus_ids[device]))
    return read


def run(spec: dict[str, Any]) -> None:
    drv = driver_or_error()
    if drv is None:
        return
    pairs = [(int(a), int(b)) for a, b in spec["pairs"]]
    devices = sorted({d for pair in pairs for d in pair})
    contexts, buffers, outs, kernels, blocks, bus_ids = {}, {}, {}, {}, {}, {}
    for d in devices:
        contexts[d] = drv.primary_context(d)
        drv.set_current(contexts[d])
        buffers[d], outs[d] = drv.alloc(SM_BYTES), drv.alloc(16)
        kernels[d] = PeerKernels(drv)
        blocks[d] = drv.attribute(d, ATTR_MULTIPROCESSOR_COUNT) * BLOCKS_PER_SM
        bus_ids[d] = drv.pci_bus_id(d)
    for src, dst in pairs:
        emit("start", step=f"SM peer GPU {src} -> GPU {dst}", src=src, dst=dst)
        drv.set_current(contexts[src])
        if src != dst:
            try:
                drv.enable_peer_access(contexts[dst])
            except CudaError as exc:
                emit("sm_peer", src=src, dst=dst, status="not_run", detail=f"peer access could not be enabled: {exc}")
                continue
        try:
            result = measure_pair(drv, kernels[src], buffers[dst], outs[src], blocks[src],
                                  link_reader(bus_ids, src, dst))
        except CudaError as exc:
            emit("sm_peer", src=src, dst=dst, status="fail", detail=str(exc))
            continue
        emit("sm_peer", src=src, dst=dst, status="ok", **result)


def main(argv: list[str]) -> int:
    return child_main(argv, run, lambda spec, exc: {"step": "SM peer checks"})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
