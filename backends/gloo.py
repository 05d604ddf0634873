"""gloo through torch ProcessGroupGloo: the CPU path, so the whole harness runs without GPUs."""

from __future__ import annotations


import torch
import torch.distributed as dist

from commbench import engines
from commbench.backends.base import Backend, BackendFactory, MakeOptions, ProcessGroupBackend, parse_variant_options
from commbench.runtime.context import RunContext
from commbench.errors import UsageError


class GlooBackend(ProcessGroupBackend):
    name = "gloo"
    family = "gloo"
    graph_capturable = False

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        return engines.none_selects(self.name, engines.GLOO_CPU)

    def setup(self, ctx: RunContext, max_bytes: int, dtype: torch.dtype) -> None:
        if self.group is None:
            self.group = dist.new_group(backend="gloo")


def make(variant: str | None, options: MakeOptions[None]) -> list[Backend]:
    if variant and parse_variant_options(variant):
        raise UsageError(f"gloo takes no variant options (got {variant!r})")
    return [GlooBackend()]


FACTORY = BackendFactory(family="gloo", make=make, on_gpu_by_default=False, on_cpu_by_default=True,
                         summary="gloo via torch ProcessGroupGloo (CPU path; CUDA tensors are staged on the host)",
                         variants_help=["gloo"], trace_kernels_of="")
