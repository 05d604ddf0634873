"""The vocabulary an engine's gate probes are written in (vllm.py, sglang.py): the message sizes
around every limit, meta tensors, grids of points, the communicators a dispatch probe hands the
engine's all_reduce, and the boxes commbench's side of a probe reads. Torch is only ever a
parameter here: the probes' engine side runs in the check's child process (gates.py)."""

from __future__ import annotations

import contextlib
from typing import Any

from commbench.topology.box import PROBED, Box

KiB, MiB = 1 << 10, 1 << 20
# Message sizes around every limit the engines state (16 KiB .. 128 MiB, each +-32 bytes).
EDGES = (16 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB,
         64 * MiB, 128 * MiB)
SIZES = tuple(sorted({4 * KiB, 12 * KiB, *EDGES, *(e - 32 for e in EDGES), *(e + 32 for e in EDGES)}))
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def meta(torch: Any, message_bytes: int, dtype: str = "bf16", columns: int = 8) -> Any:
    """A 2-D meta tensor of `message_bytes` (what an engine's gate is asked about: no memory)."""
    dt = getattr(torch, DTYPE_NAMES[dtype])
    numel = message_bytes // torch.empty((), dtype=dt).element_size()
    return torch.empty((numel // columns, columns), dtype=dt, device="meta")


def probe_box(world_size: int, cc: str = "9.0", nvlink: bool = True, multicast: bool = True, nodes: int = 1,
              memory_mib: float | None = None) -> Box:
    """A probed box with working P2P, for commbench's side of a probe."""
    return Box(world_size, PROBED, tuple(range(world_size)), nodes=nodes, cc=cc, memory_mib=memory_mib,
               nvlink_all=nvlink and world_size > 1, can_access_all=True, p2p_ok=True, multicast=multicast)


def grid(**axes: Any) -> list[dict[str, Any]]:
    """Every combination of the axes' values, as points."""
    points: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        points = [{**p, name: v} for p in points for v in values]
    return points


def subsets(paths: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every set of paths that would take a message, as points of a dispatch probe."""
    return [{"takers": [p for i, p in enumerate(paths) if mask >> i & 1]} for mask in range(1 << len(paths))]


class Comm:
    """A communicator in a dispatch probe: says whether it takes the message, and records the call."""

    def __init__(self, path: str, takes: bool, calls: list[str], **attrs: Any):
        self.path, self.takes, self.calls, self.disabled = path, takes, calls, False
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("should"):
            return lambda *args, **kwargs: self.takes
        if name.startswith("_"):
            raise AttributeError(name)
        return self._called

    def _called(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(self.path)
        return "out"


@contextlib.contextmanager
def nothing() -> Any:
    yield


class Proxy:
    """A module the engine's code reads (torch) with a few names replaced."""

    def __init__(self, real: Any, **names: Any):
        self._real, self._names = real, names

    def __getattr__(self, name: str) -> Any:
        return self._names[name] if name in self._names else getattr(self._real, name)
