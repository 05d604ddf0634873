"""SGLang's own custom allreduce (v2, the JIT kernel SGLang 0.5.23 runs by default on CUDA).

What runs is SGLang's kernel, imported from the installed ``sglang`` wheel at run time:
``sglang.kernels.ops.communication.all_reduce`` (PushPlane, PullPlane, Communicator,
IPCManager, ``get_all_reduce_module``: the kernel ``kernels/jit/csrc/distributed/
custom_all_reduce.cuh``, compiled on first use through apache-tvm-ffi). Around it this module
does what SGLang's ``CustomAllReduceV2`` (srt/distributed/device_communicators/
custom_all_reduce_v2.py, 0.5.23) does, read there and written anew: one symmetric-memory
allocation per rank sliced into ``[2 * world push slots | pull buffer | pull semaphores]``,
zeroed, the push counter in a plain tensor; eager calls stage the input through the pull
buffer; CUDA graphs capture pull calls against a device-side pointer table whose rows are
filled after capture with the peers' IPC-opened input pointers (graph_capture below), as
SGLang registers its graph inputs after capture. Multicast stays off by policy.

Variants: ``1shot_push``, ``1shot_pull``, ``2shot_pull`` force one algorithm at every size;
``auto`` is SGLang's own choice by size and world size, from SGLang's tuned table
(configs/custom_all_reduce_v2.py, read from the installed wheel; the choice is recorded on each
row) - above its ceiling SGLang hands the call to NCCL, and the row says so.

The kernel hands back a tensor of its own (a fresh one per call; ``2shot_pull`` in a graph
reduces in place and hands back its input), and so does this backend: the harness checks and
times that tensor, with no copy SGLang's caller does not make (rows say ``copy_out: none``).
Eager pull calls still stage the input in and the result out inside SGLang's own call, as
SGLang does. SGLang's kernels have no timeout of their own: the harness's watchdog bounds every
call.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist

from commbench import engines
from commbench.backends.base import (Backend, BackendFactory, BackendUnavailable, MakeOptions, chosen_variants,
                                     parse_variant_options, voted, voted_rank0_first)

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

# Its kernels in a profiler trace, read by `commbench attribute` with ast (docs/attribute.md): SGLang
# 0.5.23 sglang/kernels/jit/csrc/distributed/custom_all_reduce.cuh:140,219,324,353 (v2, JIT; the
# names are engine facts, sglang.py v2_kernels, checked against the wheel by `engines --check`).
# sglang:auto runs whichever its size picks; 2shot_push has no forced variant here.
TRACE_KERNELS = (
    (r"\ball_reduce_1shot_push_kernel\b", "SGLang JIT custom allreduce", r"^sglang:(1shot_push|auto)$", ""),
    (r"\ball_reduce_1shot_pull_kernel\b", "SGLang JIT custom allreduce", r"^sglang:(1shot_pull|auto)$", ""),
    (r"\ball_reduce_2shot_pull_kernel\b", "SGLang JIT custom allreduce", r"^sglang:(2shot_pull|auto)$", ""),
    (r"\ball_reduce_2shot_push_kernel\b", "SGLang JIT custom allreduce", r"^sglang:auto$", ""),
)

VERSION = "0.5.23"
TVM_FFI_VERSION = "0.1.11"        # sglang 0.5.23 pins apache-tvm-ffi==0.1.11
# What importing SGLang's kernel path needs besides sglang itself, on an image that already has
# torch, triton, numpy, requests, pillow, psutil, anyio and packaging (found by importing it
# with --no-deps on the GPU machine's image; docs/engine-kernels.md).
EXTRA_PACKAGES = ("msgspec", "pybase64", "orjson", "starlette", "pyzmq", "pydantic-core")
INSTALL_HINT = (f"pip install sglang=={VERSION} --no-deps apache-tvm-ffi=={TVM_FFI_VERSION} "
                + " ".join(EXTRA_PACKAGES))
KERNEL_MODULE = "sglang.kernels.ops.communication.all_reduce"
CONFIG_FILE = "srt/distributed/device_communicators/configs/custom_all_reduce_v2.py"
ALGOS = ("1shot_push", "1shot_pull", "2shot_pull")
AUTO = "auto"
PULL_ALGOS = ("1shot_pull", "2shot_pull")
ALIGN_BYTES = 1024                 # custom_all_reduce_v2._ALIGN_BYTES
SEMAPHORE_BYTES = 128              # custom_all_reduce_v2._SEMAPHORE_BYTES
MAX_GRAPH_INPUTS = 131072          # custom_all_reduce_v2._MAX_GRAPH_INPUTS: pointer-table rows
DEFAULT_MAX_BYTES = 16 << 20       # SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB default (16 MiB)
MESSAGE_ALIGN = 16                 # should_custom_ar: byte size a multiple of 16
ALLOW_OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
KB, MB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Thresholds:
    """One dispatch context's crossovers (SGLang's Heuristic): the largest size each algorithm
    takes, in SGLang's order of preference; 0 disables one."""

    one_shot_push: int
    one_shot_pull: int
    two_shot_pull: int
    two_shot_push: int = 0


# SGLang 0.5.23's SM90 table (tuned on H200), configs/custom_all_reduce_v2.py `_sm90_configs`,
# kept as facts for the CPU side (recommend, tests); a run reads the installed table instead.
# world size -> (graph, eager). The multicast ranges are left out: multicast is off by policy.
SM90_TABLE: dict[int, tuple[Thresholds, Thresholds]] = {
    2: (Thresholds(16 * MB, 128 * MB, 128 * MB), Thresholds(32 * MB, 128 * MB, 128 * MB)),
    3: (Thresholds(1280 * KB, 1280 * KB, 128 * MB), Thresholds(3 * MB, 3 * MB, 16 * MB)),
    4: (Thresholds(384 * KB, 384 * KB, 128 * MB), Thresholds(896 * KB, 896 * KB, 32 * MB)),
    5: (Thresholds(192 * KB, 192 * KB, 32 * MB), Thresholds(384 * KB, 384 * KB, 32 * MB)),
    6: (Thresholds(128 * KB, 128 * KB, 32 * MB), Thresholds(192 * KB, 192 * KB, 32 * MB)),
    7: (Thresholds(128 * KB, 128 * KB, 32 * MB), Thresholds(128 * KB, 128 * KB, 32 * MB)),
    8: (Thresholds(128 * KB, 128 * KB, 32 * MB), Thresholds(128 * KB, 128 * KB, 128 * MB)),
}


def clip(t: Thresholds, push_bytes: int, pull_bytes: int, world_size: int) -> Thresholds:
    """SGLang's Heuristic.clip: no algorithm takes more than its workspace holds (a 2shot_push
    slot holds 32 B per 16 B vector of one rank's chunk)."""
    two_shot_push_cap = world_size * 16 * (push_bytes // 32)
    return Thresholds(min(t.one_shot_push, push_bytes), min(t.one_shot_pull, pull_bytes),
                      min(t.two_shot_pull, pull_bytes), min(t.two_shot_push, two_shot_push_cap))


def default_capacity(graph: Thresholds, eager: Thresholds, world_size: int) -> tuple[int, int]:
    """(push slot bytes, pull bytes) SGLang allocates by default: what its table wants, capped at
    16 MiB, aligned to 1 KiB."""
    def push_need(t: Thresholds) -> int:
        return max(t.one_shot_push, 32 * -(-t.two_shot_push // (16 * world_size)))

    push = min(max(push_need(graph), push_need(eager)), DEFAULT_MAX_BYTES)
    pull = min(max(graph.one_shot_pull, graph.two_shot_pull, eager.one_shot_pull, eager.two_shot_pull),
               DEFAULT_MAX_BYTES)
    return _align(push), _align(pull)


def choose(t: Thresholds, message_bytes: int) -> str | None:
    """The algorithm SGLang's _pick_config takes (multicast off); None: SGLang uses NCCL."""
    if message_bytes % MESSAGE_ALIGN:
        return None
    if message_bytes <= t.one_shot_push:
        return "1shot_push"
    if message_bytes <= t.two_shot_push:
        return "2shot_push"
    if message_bytes <= t.one_shot_pull:
        return "1shot_pull"
    if message_bytes <= t.two_shot_pull:
        return "2shot_pull"
    return None


def sglang_choice(table: dict[int, tuple[Thresholds, Thresholds]], world_size: int,
                  message_bytes: int) -> dict[str, str | None]:
    """SGLang's choice in graphs and in eager calls at its default workspace size."""
    graph, eager = table[world_size]
    push, pull = default_capacity(graph, eager, world_size)
    return {mode: choose(clip(t, push, pull, world_size), message_bytes)
            for mode, t in (("graph", graph), ("eager", eager))}


def _align(nbytes: int) -> int:
    return -(-max(nbytes, ALIGN_BYTES) // ALIGN_BYTES) * ALIGN_BYTES


# --- the installed sglang ---------------------------------------------------------------------

def _sglang_root() -> str | None:
    loaded = sys.modules.get("sglang")
    if loaded is not None:
        return list(getattr(loaded, "__path__", None) or [None])[0]
    spec = importlib.util.find_spec("sglang")
    return list(spec.submodule_search_locations or [None])[0] if spec else None


def kernel_api() -> Any:
    """SGLang's kernel module. sglang/__init__.py imports the whole server (transformers, the
    frontend language): only the kernel path is imported, under a bare package for `sglang`
    when SGLang itself was not imported."""
    if "sglang" not in sys.modules:
        root = _sglang_root()
        if root is None:
            raise ModuleNotFoundError("No module named 'sglang'")
        package = types.ModuleType("sglang")
        package.__path__ = [root]
        package.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
        package.__spec__.submodule_search_locations = [root]
        sys.modules["sglang"] = package
    return importlib.import_module(KERNEL_MODULE)


@cache
def installed_config_module() -> Any:
    """SGLang's tuned table, loaded from its own file (the package above it imports the server)."""
    root = _sglang_root()
    if root is None:
        raise ModuleNotFoundError("No module named 'sglang'")
    spec = importlib.util.spec_from_file_location("_commbench_sglang_ar_v2_config", f"{root}/{CONFIG_FILE}")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed_table(world_size: int) -> dict[int, tuple[Thresholds, Thresholds]]:
    """This GPU's row of the installed table (SGLang picks it by compute capability)."""
    config = installed_config_module().get_all_reduce_config(world_size)

    def read(h: Any) -> Thresholds:
        return Thresholds(int(h.one_shot_push_threshold), int(h.one_shot_pull_threshold),
                          int(h.two_shot_pull_threshold), int(h.two_shot_push_threshold))

    return {world_size: (read(config.graph), read(config.eager))}


@cache
def import_reason() -> str | None:
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return f"sglang not installed: {INSTALL_HINT}"
    if version != VERSION:
        return f"sglang {version} installed; this backend follows SGLang {VERSION}'s custom allreduce v2 ({INSTALL_HINT})"
    try:
        kernel_api()
        installed_config_module()
    except Exception as exc:  # a missing dependency: name it, with the command that brings all of them
        return f"sglang {version} does not import its kernel path: {type(exc).__name__}: {exc} ({INSTALL_HINT})"
    return None


class SglangCustomAllreduce(Backend):
    family = "sglang"
    needs = ("cuda", "node", "p2p", "ipc", "vmm")   # torch symmetric memory (cuMemCreate) + IPC graph inputs
    min_world_size = 2
    message_multiple_bytes = MESSAGE_ALIGN
    max_world_size = 8                              # the SM90 table's world sizes (2..8)
    in_place = True                                 # graph-mode 2shot_pull reduces in its input
    dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self.name = f"sglang:{algo}"
        self._world_size = 0
        self._group: Any = None
        self._api: Any = None
        self._comm: Any = None
        self._module: Any = None
        self._ipc: Any = None
        self._keep: list[Any] = []                   # tensors the planes point into
        self._graph_params: torch.Tensor | None = None
        self._graph_rows = 0
        self._pending: list[int] = []                # graph inputs captured, not yet registered
        self._table: dict[int, tuple[Thresholds, Thresholds]] = {}
        self._fields: dict[str, Any] = {}
        self._ctx: "RunContext | None" = None

    def software_reason(self) -> str | None:
        return import_reason()

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        notes = [engines.SGLANG_CUSTOM_AR_V2, engines.CUSTOM_AR_PCIE_GATE]
        if self.algo != AUTO:
            # The engine's kernel, but no SGLang setting makes SGLang run it at every size.
            return engines.Settings(self.name, notes=[engines.SGLANG_ALGO_BY_SIZE, *notes], vllm_supported=False,
                                    sglang_supported=False)
        return engines.Settings(self.name, sglang_env=dict(engines.SGLANG_CUSTOM_AR_V2_ENV), vllm_supported=False,
                                notes=notes, engine_paths=engines.claim(engines.CUSTOM_AR, engines.SGLANG))

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        reason = super().supports(message_bytes, dtype)
        if reason:
            return reason
        if self.algo == AUTO and self._table:
            choice = sglang_choice(self._table, self._world_size, message_bytes)
            if not any(choice.values()):
                return f"SGLang {VERSION} hands {message_bytes} B to NCCL at {self._world_size} ranks (above its table)"
        return None

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        self.close()
        self._world_size = ctx.world_size
        self._ctx = ctx
        if ctx.shares_gpus:
            import os

            os.environ[ALLOW_OVERLAP_ENV] = "1"   # symmetric memory refuses peers on one device otherwise
        self._api = api = kernel_api()
        self._table = installed_table(ctx.world_size)
        config = installed_config_module().get_all_reduce_config(ctx.world_size)
        graph, eager = self._table[ctx.world_size]
        push_default, pull_default = default_capacity(graph, eager, ctx.world_size)
        # SGLang's default capacities, grown to this run's largest message for forced algorithms.
        push_bytes, pull_bytes = max(push_default, _align(max_bytes)), max(pull_default, _align(max_bytes))

        def build() -> None:
            # JIT-builds (or loads) the kernel and the communicator / IPC classes: rank 0 first,
            # so ranks never compile into one cache at once.
            self._module = api.get_all_reduce_module(dtype, ctx.world_size)
            api._init_communicator()
            self._ipc = api.IPCManager()

        voted_rank0_first(ctx, f"SGLang custom allreduce JIT build ({dtype}, {ctx.world_size} ranks)", build)
        import torch.distributed._symmetric_memory as symm_mem

        num_pull_blocks, num_push_blocks = int(config.num_pull_blocks), int(config.num_push_blocks)
        slots = 2 * ctx.world_size
        sem_bytes = SEMAPHORE_BYTES * num_pull_blocks
        total = slots * push_bytes + pull_bytes + sem_bytes
        workspace = voted(ctx, f"symmetric memory allocation ({total} B)",
                          lambda: symm_mem.empty(total, dtype=torch.uint8, device=ctx.device))
        if self._group is None:
            # Its own gloo group: the name keys the rendezvous (NCCL refuses ranks sharing a GPU).
            self._group = dist.new_group(ranks=list(range(ctx.world_size)), backend="gloo")
        handle = symm_mem.rendezvous(workspace, self._group.group_name)
        slabs = [handle.get_buffer(r, [total], torch.uint8) for r in range(ctx.world_size)]
        slabs[ctx.rank].zero_()          # push slots (Lamport markers) and semaphores start zeroed
        torch.cuda.synchronize(ctx.device)
        ctx.barrier()

        def slice_all(shape: list[int], offset: int) -> list[torch.Tensor]:
            nbytes = 1
            for dim in shape:
                nbytes *= dim
            return [slab[offset: offset + nbytes].view(shape) for slab in slabs]

        counter = torch.zeros((num_push_blocks,), dtype=torch.uint32, device=ctx.device)
        push = api.PushPlane(ctx.rank, ctx.world_size, workspaces=slice_all([slots, push_bytes], 0),
                             counter=counter.view(-1, 1).view(torch.uint8), mc_workspace=None)
        pull = api.PullPlane(ctx.rank, ctx.world_size, workspaces=slice_all([pull_bytes], slots * push_bytes),
                             semaphores=slice_all([num_pull_blocks, SEMAPHORE_BYTES], slots * push_bytes + pull_bytes),
                             mc_workspace=None, mc_semaphore=None)
        self._comm = api.Communicator(push=push, pull=pull)
        self._keep = [workspace, handle, slabs, counter]
        self._graph_params = torch.zeros((MAX_GRAPH_INPUTS, ctx.world_size), dtype=torch.uint64, device=ctx.device)
        self._graph_rows = 0
        self._pending = []
        graph_t, eager_t = self._table[ctx.world_size]
        self._fields = {
            "implementation": f"sglang {metadata.version('sglang')} custom allreduce v2 (JIT, {KERNEL_MODULE})",
            "apache_tvm_ffi": _version("apache-tvm-ffi"),
            "copy_out": "none",   # the kernel's own output tensor is the one checked
            "push_slot_bytes": push_bytes, "pull_bytes": pull_bytes, "num_push_blocks": num_push_blocks,
            "num_pull_blocks": num_pull_blocks, "multicast": False,
            "table": {"graph": graph_t.__dict__, "eager": eager_t.__dict__},
        }
        ctx.barrier()

    def _algo_for(self, nbytes: int, capturing: bool) -> str:
        if self.algo != AUTO:
            return self.algo
        algo = sglang_choice(self._table, self._world_size, nbytes)["graph" if capturing else "eager"]
        if algo is None:
            raise BackendUnavailable(f"SGLang {VERSION} hands {nbytes} B to NCCL "
                                     f"{'in graphs' if capturing else 'in eager calls'} at {self._world_size} ranks")
        return algo

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        assert self._comm is not None and self._graph_params is not None, "setup() first"
        flat = x.reshape(-1)
        capturing = torch.cuda.is_current_stream_capturing()
        algo = self._algo_for(flat.numel() * flat.element_size(), capturing)
        row = None
        if capturing and algo in PULL_ALGOS:
            index = self._graph_rows + len(self._pending)
            if index >= MAX_GRAPH_INPUTS:
                raise BackendUnavailable("SGLang's graph input table is full")
            self._pending.append(flat.data_ptr())
            row = self._graph_params[index]
        result = self._module.all_reduce(self._comm, flat, algo, row, False)
        return result if isinstance(result, torch.Tensor) else torch.from_dlpack(result)

    @contextmanager
    def graph_capture(self) -> Iterator[None]:
        yield
        self._register_graph_inputs()

    def _register_graph_inputs(self) -> None:
        """As CustomAllReduceV2._register_graph_inputs_ipc: IPC handles of every captured pull
        input, swapped over the control group, opened, and written into the pointer table."""
        assert self._ctx is not None
        pending, self._pending = self._pending, []
        local = [(list(h), int(off)) for h, off in self._ipc.batch_get_handles(pending)] if pending else []
        gathered = self._ctx.all_gather_objects(local)
        if not pending:
            return
        rank = self._ctx.rank
        per_rank = [pending if r == rank else list(self._ipc.batch_open_handles(remote))
                    for r, remote in enumerate(gathered)]
        rows = [[per_rank[r][i] for r in range(len(gathered))] for i in range(len(pending))]
        assert self._graph_params is not None
        table = torch.tensor(rows, dtype=torch.uint64, device=self._graph_params.device)
        self._graph_params[self._graph_rows: self._graph_rows + len(rows)].copy_(table)
        torch.cuda.synchronize()           # the rows must be there before the first replay
        self._graph_rows += len(rows)

    def check(self, ctx: "RunContext") -> str | None:
        reason = super().check(ctx)
        if reason is None:
            self._world_size = ctx.world_size
        return reason

    def observe(self, call: Any, message_bytes: int) -> dict[str, Any]:
        choice = sglang_choice(self._table, self._world_size, message_bytes) if self._table else {}
        return {"extra": {"sglang_choice": choice}} if self.algo == AUTO else {}

    def row_fields(self) -> dict[str, Any]:
        return {"extra": {"sglang_algo": self.algo, **self._fields}} if self._fields else {}

    def close(self) -> None:
        if self._ipc is not None:
            torch.cuda.synchronize()
            self._ipc.destroy()
        self._ipc = None
        self._comm = None
        self._module = None
        self._keep = []
        self._graph_params = None
        self._pending = []
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


VARIANTS = (*ALGOS, AUTO)


def make(variant: str | None, options: MakeOptions[None]) -> list[Backend]:
    names = chosen_variants("sglang", list(parse_variant_options(variant)), VARIANTS, every="custom_ar")
    return [SglangCustomAllreduce(n) for n in names]


FACTORY = BackendFactory(
    family="sglang",
    make=make,
    native=True,
    summary=f"SGLang {VERSION}'s own custom allreduce v2 (JIT kernel from the sglang wheel; optional)",
    variants_help=[
        "sglang:custom_ar    every variant below",
        "sglang:1shot_push   Lamport push to every peer, local reduce (forced at every size)",
        "sglang:1shot_pull   every rank reduces all peers' buffers (forced)",
        "sglang:2shot_pull   reduce-scatter + all-gather over the pull buffers (forced)",
        "sglang:auto         SGLang's own choice by size and world size (its tuned table; on the row)",
    ],
    probe_specs=(AUTO,),
    packages=("sglang", "apache-tvm-ffi"),
)
