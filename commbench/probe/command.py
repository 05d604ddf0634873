"""`commbench probe`: what works between these GPUs, proven by functional checks, and why not.

Single process (sees every GPU) or under torchrun (each rank probes its own GPU, rank 0 merges
and prints). --from re-renders a saved snapshot offline (table, verdicts, plot), no GPU needed.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from commbench.errors import UsageError
from commbench.files import STDOUT, check_file_target, write_json
from commbench.units import positive_finite


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="save the snapshot as JSON")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also measure bandwidth and latency per directed pair: copy engine, then SM loads and "
                             "stores (and each GPU's PCIe link while busy)")
    parser.add_argument("--nccl", action="store_true",
                        help="also run NCCL's checks in child processes: a collective A/B with and without P2P, "
                             "and NCCL's topology and graph dump")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the topology (and bandwidth heatmaps) to a PNG")
    parser.add_argument("--from", dest="from_file", metavar="SNAPSHOT.json",
                        help="re-render a saved snapshot instead of probing")
    parser.add_argument("--allow-multicast", action="store_true",
                        help="allow creating a multicast object (only if no policy variable forbids it)")
    parser.add_argument("--share-gpus", action="store_true",
                        help="under torchrun, let several ranks share one GPU (functional checks only)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="time limit for each child-process check (default 20)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="verdicts and explain for a run of N ranks (default: this run's, or every GPU)")


def _world_size(args: argparse.Namespace, snapshot: dict) -> int:
    if args.world_size is not None:
        return args.world_size
    if snapshot.get("mode") == "torchrun":
        return int(snapshot.get("world_size") or 1)
    return max(1, len(snapshot.get("gpus") or []))


def _check_args(args: argparse.Namespace) -> None:
    if args.timeout is not None:
        positive_finite(args.timeout, "--timeout", "seconds")
    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise UsageError(f"--plot writes a PNG: give a file name ending in .png, got {args.plot}")
    for flag, given in (("--bandwidth", args.bandwidth), ("--nccl", args.nccl)):
        if args.from_file and given:
            raise UsageError(f"{flag} measures; it cannot be combined with --from (which re-renders a file)")
    if args.json == STDOUT:
        raise UsageError("--json -: the probe prints its tables on stdout; give a file name")
    # Both targets are checked before probing: a probe can take minutes, and its tables would be
    # printed before the write failed.
    check_file_target(args.json, "--json")
    check_file_target(args.plot, "--plot")


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    _check_args(args)
    from commbench.probe.snapshot import DEFAULT_TIMEOUT_S, take_snapshot
    from commbench.topology.snapshot_file import load_snapshot

    ctx = None
    if args.from_file:
        snapshot = load_snapshot(args.from_file)
    else:
        from commbench.launch_env import under_torchrun
        from commbench.runtime.context import init_context, shutdown

        if under_torchrun():
            ctx, _note = init_context(allow_multicast=args.allow_multicast, share_gpus=args.share_gpus)
        try:
            snapshot = take_snapshot(ctx, bandwidth=args.bandwidth, allow_multicast=args.allow_multicast,
                                     timeout_s=args.timeout or DEFAULT_TIMEOUT_S, nccl=args.nccl)
        finally:
            if ctx is not None:
                shutdown()
        if ctx is not None and ctx.rank != 0:
            return 0
    from commbench.probe.render import render

    render(snapshot, _world_size(args, snapshot), args.allow_multicast)
    if args.json:
        write_json(args.json, snapshot)
        print(f"snapshot {'copied' if args.from_file else 'written'} to {args.json}")
    if args.plot:
        from commbench.probe.plot import plot_snapshot

        plot_snapshot(snapshot, args.plot)
        print(f"plot written to {args.plot}")
    return 0
