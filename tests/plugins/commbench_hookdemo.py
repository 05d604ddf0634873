"""An outside backend that uses every hook commbench offers, without touching commbench's code:
its own flag, needs, a software check, engine settings and a per-row observation. Loaded
through the `commbench.backends` entry-point group (tests put this folder on PYTHONPATH; the
dist-info beside it declares the entry point). It reduces with gloo, so it runs on the CPU.

  hookdemo:plain    needs every rank in one node
  hookdemo:gpu      needs CUDA GPUs too (skipped on a CPU run, with the reason)
  hookdemo:missing  its "library" is not installed (skipped, with what to install)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from commbench import engines
from commbench.backends.base import Backend, BackendFactory, MakeOptions
from commbench.errors import UsageError

if TYPE_CHECKING:
    import torch

# torch is imported where a rank uses it: the sweep's driver imports this module for its flag.

VARIANTS = ("plain", "gpu", "missing")


class HookDemo(Backend):
    family = "hookdemo"
    graph_capturable = False

    def __init__(self, variant: str, level: int):
        self.name = f"hookdemo:{variant}"
        self.variant = variant
        self.level = level
        self.needs = ("node", "cuda") if variant == "gpu" else ("node",)
        self.group: Any = None

    def software_reason(self) -> str | None:
        return "hookdemo-lib not installed (pip install hookdemo-lib)" if self.variant == "missing" else None

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        # A stand-in for vLLM's NCCL path (the claim recommend prices paths by).
        return engines.Settings(self.name, vllm_env={"HOOKDEMO_LEVEL": str(self.level)}, sglang_supported=False,
                                notes=[f"hookdemo at level {self.level} on {world_size} ranks"],
                                engine_paths=engines.claim(engines.NCCL_PATH, engines.VLLM, stand_in=True))

    def setup(self, ctx, max_bytes: int, dtype: torch.dtype) -> None:
        if self.group is None:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        import torch.distributed as dist

        out.copy_(x)
        dist.all_reduce(out, group=self.group)

    def row_fields(self) -> dict[str, Any]:
        return {"requested": {"HOOKDEMO_LEVEL": str(self.level)}}

    def observe(self, call, message_bytes: int) -> dict[str, Any]:
        call()   # what a library reports after a call of this size
        return {"observed": {"HOOKDEMO_LEVEL": str(self.level)}, "setting_applied": "honoured",
                "extra": {"hookdemo_observed_bytes": message_bytes}}

    def close(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hookdemo-level", type=int, default=1, help="the demo library's level (1-9)")


@dataclass(frozen=True)
class HookDemoOptions:
    level: int = 1    # --hookdemo-level


def read_options(args: argparse.Namespace) -> HookDemoOptions:
    if not 1 <= args.hookdemo_level <= 9:
        raise UsageError(f"--hookdemo-level must be 1-9, got {args.hookdemo_level}")
    return HookDemoOptions(level=args.hookdemo_level)


def make(variant: str | None, options: MakeOptions[HookDemoOptions]) -> list[Backend]:
    names = ("plain",) if variant is None else (variant,)
    for name in names:
        if name not in VARIANTS:
            raise UsageError(f"unknown hookdemo variant {name!r}: choose from {', '.join(VARIANTS)}")
    return [HookDemo(name, options.own.level) for name in names]


FACTORY = BackendFactory(family="hookdemo", make=make, on_gpu_by_default=False, on_cpu_by_default=False,
                         summary="a plug-in that uses every hook", variants_help=[f"hookdemo:{v}" for v in VARIANTS],
                         probe_specs=VARIANTS, packages=("pytest",), add_arguments=add_arguments,
                         read_options=read_options)
