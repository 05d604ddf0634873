"""Child process: per-GPU driver facts, peer capability, peer access and write-and-verify,
and (on request) copy-engine bandwidth and small-copy latency per directed pair.

Run by the parent as `python -m commbench.topology.local_checks SPEC_JSON` under a time limit
(childproc.py); prints one JSON record per line. Never run in the probing process itself, so a
hung peer write kills only this child, and the parent never holds contexts on every GPU.
"""

from __future__ import annotations

import sys
from typing import Any

from commbench.topology.childproc import child_main, driver_or_error, emit
from commbench.topology.cudadrv import CAPABILITY_ATTRIBUTES, ATTR_CC_MAJOR, ATTR_CC_MINOR, \
    ATTR_MULTIPROCESSOR_COUNT, CudaError, Driver, count_wrong

CHECK_WORDS = 65536            # 256 KiB per pair: enough blocks to cross every link lane, quick to verify
BANDWIDTH_BYTES = 64 << 20     # large copy, as p2pBandwidthLatencyTest
BANDWIDTH_REPS = 10
LATENCY_BYTES = 4
LATENCY_REPS = 100


def pair_seed(src: int, dst: int) -> int:
    # Distinct per directed pair, so data left by another pair can never pass the check.
    return ((src * 97 + dst * 31 + 7) * 0x9E3779B1) & 0xFFFFFFFF


def describe_devices(drv: Driver, devices: list[int]) -> None:
    for d in devices:
        try:
            facts: dict[str, Any] = {
                "index": d, "name": drv.name(d), "uuid": drv.uuid(d), "pci_bus_id": drv.pci_bus_id(d),
                "compute_capability": f"{drv.attribute(d, ATTR_CC_MAJOR)}.{drv.attribute(d, ATTR_CC_MINOR)}",
                "sm_count": drv.attribute(d, ATTR_MULTIPROCESSOR_COUNT),
                "memory_total_mib": drv.total_memory_bytes(d) // (1 << 20),
            }
        except CudaError as exc:
            emit("device", index=d, error=str(exc))
            continue
        attributes: dict[str, int | str] = {}
        for key, attr in CAPABILITY_ATTRIBUTES.items():
            try:
                attributes[key] = drv.attribute(d, attr)
            except CudaError as exc:   # an older driver does not know newer attributes
                attributes[key] = f"unknown ({exc.error_name})"
        emit("device", attributes=attributes, **facts)


def check_pairs(drv: Driver, pairs: list[tuple[int, int]], words: int) -> None:
    contexts: dict[int, Any] = {}
    buffers: dict[int, int] = {}

    def ctx(d: int) -> Any:
        if d not in contexts:
            contexts[d] = drv.primary_context(d)
        return contexts[d]

    for src, dst in pairs:
        try:
            emit("can_access", src=src, dst=dst, value=drv.can_access_peer(src, dst))
        except CudaError as exc:
            emit("can_access", src=src, dst=dst, error=str(exc))
    for src, dst in pairs:
        emit("start", step=f"P2P write GPU {src} -> GPU {dst}", src=src, dst=dst)
        try:
            drv.set_current(ctx(src))
            drv.enable_peer_access(ctx(dst))
            emit("enable_peer", src=src, dst=dst, status="ok")
        except CudaError as exc:
            emit("enable_peer", src=src, dst=dst, status="fail", detail=str(exc))
            emit("write_verify", src=src, dst=dst, status="not_run", detail="peer access could not be enabled")
            continue
        try:
            drv.set_current(ctx(dst))
            if dst not in buffers:
                buffers[dst] = drv.alloc(words * 4)
            drv.memset32(buffers[dst], 0, words)
            drv.synchronize()
            drv.set_current(ctx(src))
            seed = pair_seed(src, dst)
            drv.write_pattern(src, buffers[dst], words, seed)
            drv.synchronize()
            drv.set_current(ctx(dst))
            got = drv.read_words(buffers[dst], words)
        except CudaError as exc:
            emit("write_verify", src=src, dst=dst, status="fail", detail=str(exc))
            continue
        wrong = count_wrong(got, seed)
        if wrong == 0:
            emit("write_verify", src=src, dst=dst, status="ok", words=words)
        else:
            dropped = sum(1 for w in got if w == 0)
            emit("write_verify", src=src, dst=dst, status="wrong", words=words, wrong_words=wrong,
                 detail=f"{wrong} of {words} words wrong" + (" (writes dropped silently)" if dropped == wrong else ""))


def measure_bandwidth(drv: Driver, pairs: list[tuple[int, int]]) -> None:
    contexts: dict[int, Any] = {}
    buffers: dict[int, int] = {}
    for d in sorted({d for pair in pairs for d in pair}):
        contexts[d] = drv.primary_context(d)
        drv.set_current(contexts[d])
        buffers[d] = drv.alloc(BANDWIDTH_BYTES)
    for src, dst in pairs:
        emit("start", step=f"bandwidth GPU {src} -> GPU {dst}", src=src, dst=dst)
        try:
            peer = src == dst
            if not peer:
                try:   # P2P on in both directions, as p2pBandwidthLatencyTest does
                    drv.set_current(contexts[dst])
                    drv.enable_peer_access(contexts[src])
                    drv.set_current(contexts[src])
                    drv.enable_peer_access(contexts[dst])
                    peer = True
                except CudaError:
                    peer = False
            drv.set_current(contexts[src])
            start, end = drv.event(), drv.event()

            def timed(nbytes: int, reps: int) -> float:
                for _ in range(2):
                    drv.copy_peer_async(buffers[dst], contexts[dst], buffers[src], contexts[src], nbytes)
                drv.record(start)
                for _ in range(reps):
                    drv.copy_peer_async(buffers[dst], contexts[dst], buffers[src], contexts[src], nbytes)
                drv.record(end)
                return drv.elapsed_ms(start, end)

            bw_ms = timed(BANDWIDTH_BYTES, BANDWIDTH_REPS)
            lat_ms = timed(LATENCY_BYTES, LATENCY_REPS)
            emit("bandwidth", src=src, dst=dst, peer_access=peer,
                 bandwidth_gbps=round(BANDWIDTH_BYTES * BANDWIDTH_REPS / (bw_ms / 1e3) / 1e9, 2),
                 latency_us=round(lat_ms * 1e3 / LATENCY_REPS, 2))
        except CudaError as exc:
            emit("bandwidth", src=src, dst=dst, error=str(exc))


def main(argv: list[str]) -> int:
    return child_main(argv, run, lambda spec, exc: {"step": spec.get("task", "?")})


def run(spec: dict[str, Any]) -> None:
    drv = driver_or_error()
    if drv is None:
        return
    count = drv.device_count()
    emit("driver", version=drv.driver_version(), device_count=count)
    every = list(range(count))
    # "all" = every visible device / every directed pair of different devices (single-process probe)
    devices = every if spec.get("devices") == "all" else [int(d) for d in spec.get("devices", [])]
    pairs = ([(a, b) for a in every for b in every if a != b] if spec.get("pairs") == "all"
             else [(int(a), int(b)) for a, b in spec.get("pairs", [])])
    if spec["task"] == "caps":
        describe_devices(drv, devices)
        check_pairs(drv, pairs, int(spec.get("words", CHECK_WORDS)))
    elif spec["task"] == "bandwidth":
        measure_bandwidth(drv, pairs)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
