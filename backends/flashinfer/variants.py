"""The flashinfer family's variants, flags and factory."""

from __future__ import annotations

import argparse

from commbench.backends.base import Backend, BackendFactory
from commbench.backends.flashinfer.common import DISTRIBUTION, FlashinferMake, FlashinferOptions
from commbench.backends.flashinfer.flags import add_arguments
from commbench.backends.flashinfer.pcie import PcieIpcAllreduce
from commbench.backends.flashinfer.trtllm import MnnvlAllreduce, TrtllmAllreduce, TrtllmFused


VARIANTS = ("trtllm_oneshot", "trtllm_twoshot", "fused_oneshot", "fused_twoshot", "pcie_ipc", "mnnvl")


def _build(variant: str, options: FlashinferMake) -> Backend:
    if variant.startswith("trtllm_"):
        return TrtllmAllreduce(variant.endswith("oneshot"), options)
    if variant.startswith("fused_"):
        return TrtllmFused(variant.endswith("oneshot"), options)
    if variant == "pcie_ipc":
        return PcieIpcAllreduce(options)
    return MnnvlAllreduce(options)


def make(variant: str | None, options: FlashinferMake) -> list[Backend]:
    if variant is None:
        # The fused variants only make sense on model shapes.
        names = [v for v in VARIANTS if options.sweep.hidden or not v.startswith("fused_")]
        return [_build(v, options) for v in names]
    if variant not in VARIANTS:
        from commbench.errors import UsageError

        raise UsageError(f"flashinfer: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return [_build(variant, options)]


def read_options(args: argparse.Namespace) -> FlashinferOptions:
    return FlashinferOptions(pcie_tune=args.flashinfer_pcie_tune == "measure", pdl=args.flashinfer_pdl == "on")


FACTORY = BackendFactory(
    family="flashinfer",
    make=make,
    native=True,
    summary="FlashInfer TRT-LLM allreduce and allreduce+residual+RMSNorm fusion, PCIe IPC, MNNVL (optional)",
    variants_help=[
        "flashinfer:trtllm_oneshot  TRT-LLM Lamport one-shot allreduce (backend='trtllm')",
        "flashinfer:trtllm_twoshot  TRT-LLM two-shot allreduce (tokens > world size)",
        "flashinfer:fused_oneshot   allreduce + residual + RMSNorm, one kernel, one-shot (model shapes)",
        "flashinfer:fused_twoshot   allreduce + residual + RMSNorm, one kernel, two-shot (model shapes)",
        "flashinfer:pcie_ipc        PcieIpcAllReduceWorkspace, tuned per size bucket at setup (flashinfer >= 0.7.2)",
        "flashinfer:mnnvl           multicast allreduce (needs --allow-multicast)",
    ],
    probe_specs=VARIANTS,
    packages=(DISTRIBUTION,),
    add_arguments=add_arguments, read_options=read_options,
)
