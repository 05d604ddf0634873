"""The p2p family's variants, flags and factory: plain allreduce kernels (backend.P2PAllreduce) and the
fused allreduce + residual add + RMSNorm kernel (fused.P2PFused)."""

from __future__ import annotations

import argparse

from commbench.backends.base import Backend, BackendFactory, MakeOptions
from commbench.backends.p2p.backend import REQUIRES, P2PAllreduce
from commbench.backends.p2p.flags import add_arguments
from commbench.backends.p2p.fused import P2PFused
from commbench.backends.p2p.rules import DEFAULT_VARIANTS, FUSED_VARIANTS, VARIANTS, P2POptions
from commbench.errors import UsageError


def read_options(args: argparse.Namespace) -> P2POptions:
    """Bad values are bad input, said before anything runs."""
    return P2POptions.from_options({"p2p_max_bytes": args.p2p_max_bytes, "p2p_auto_rule": args.p2p_auto_rule,
                                    "p2p_timeout_ms": args.p2p_timeout_ms, "p2p_threads": args.p2p_threads,
                                    "p2p_vectors_per_thread": args.p2p_vectors_per_thread, "p2p_pdl": args.p2p_pdl})


def make(variant: str | None, options: MakeOptions[P2POptions]) -> list[Backend]:
    opts = options.own
    # p2p:fused runs only when named: not among the defaults until its checks pass on a GPU at every
    # world size (tests/gpu/test_p2p_gpu.py: 2 and 4 ranks pass; 8 ranks under MPS SM shares hang
    # in the two-shot, docs/backends.md). Then, on model shapes (options.sweep.hidden), as
    # flashinfer's fused variants are.
    names = DEFAULT_VARIANTS if variant is None else (variant.strip(),)
    for name in names:
        if name not in VARIANTS:
            raise UsageError(f"unknown p2p variant {name!r}: choose from {', '.join(VARIANTS)}")
    return [P2PFused(name, opts) if name in FUSED_VARIANTS else P2PAllreduce(name, opts) for name in names]


FACTORY = BackendFactory(
    family="p2p",
    make=make,
    on_gpu_by_default=True,
    on_cpu_by_default=False,
    summary="commbench's own CUDA-IPC allreduce kernels (NVRTC via CuPy), graph-capturable, "
            "timeout-bounded",
    variants_help=[
        "p2p:oneshot_lamport  one-shot, Lamport: every rank pushes its input into every peer; the data is its own flag",
        "p2p:oneshot          one-shot, push, then a fence and a flag per peer; reduces locally",
        "p2p:oneshot_pull     one-shot, pull: every rank reads every peer's staged input (never by default)",
        "p2p:twoshot_lamport  two-shot, Lamport: reduce-scatter then all-gather, writes only, no flags",
        "p2p:twoshot          two-shot, push, a fence and a flag per peer after each half",
        "p2p:oneshot_graph    one-shot in CUDA graphs with no staging: reads every rank's captured input, writes "
        "its own output, between two flag barriers (buffers registered after capture; reads peer memory, never by "
        "default); eager calls run p2p:oneshot_lamport",
        "p2p:twoshot_graph    two-shot in CUDA graphs with no staging: reads every peer's captured input, writes "
        "the reduced slice into every rank's output (buffers registered after capture; reads peer memory, never by "
        "default); eager calls run p2p:twoshot",
        "p2p:auto             the fastest of the four push kernels per size, measured at setup, and of the pull "
        "one-shot and the graph kernels where peer reads are safe (one GPU, or NVLink between every pair) "
        "(--p2p-auto-rule, --p2p-max-bytes, --p2p-timeout-ms)",
        "p2p:fused            allreduce + residual add + RMSNorm in one kernel (model shapes: --tokens, --hidden): the "
        "one-shot up to a size per world size, the two-shot above; p2p:fused_oneshot / p2p:fused_twoshot run one form",
    ],
    probe_specs=(None, "oneshot_pull"),
    packages=("cupy-cuda12x", "cupy-cuda13x", "cupy"),
    add_arguments=add_arguments, read_options=read_options,
)
