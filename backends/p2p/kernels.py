"""p2p's GPU side: its kernels compiled through CuPy (NVRTC), their occupancy, the PDL launcher
(cuLaunchKernelEx through cuda-python) and the shared area (one IPC allocation per rank, opened by
every peer) with the timeout report the kernels write."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy
import torch

from commbench.backends.base import BackendTimeout, BackendUnavailable, describe
from commbench.backends.p2p.layout import (CTRL_WORDS, DTYPE_CODES, GRAPH_ROW_WORDS, GRAPH_ROWS, KERNEL_NAMES,
                                           LAMPORT_LAYOUT_KERNELS, LL_EMPTY, MAX_RANKS, THREADS_PER_BLOCK,
                                           AreaPlan, KernelParams, lamport_parameter, layout_parameter)

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext


KERNEL_SOURCE = Path(__file__).with_name("allreduce.cu")


HOST_ALLOC_PORTABLE_MAPPED = 0x01 | 0x02   # cudaHostAllocPortable | cudaHostAllocMapped


PHASE_NAMES = ("first barrier", "second barrier", "one-shot data", "reduce-scatter data", "all-gather data",
               "RMSNorm sum of squares")


PEER_UNKNOWN = 0xFFFFFFFF      # the counter barrier counts arrivals: it cannot say which peer is missing


_REPORT = ctypes.c_uint32 * 4     # {1 = timeout, peer, epoch, phase}, read on every call


class P2PTimeoutError(BackendTimeout):
    """A peer never reached a barrier; this rank's p2p state is broken until setup() again."""


@lru_cache(maxsize=1)
def cupy_module() -> Any:
    """The cupy module, imported at first use: check() has refused p2p where it does not import
    (backend.REQUIRES)."""
    import cupy
    return cupy


@lru_cache(maxsize=1)
def cuda_driver() -> tuple[Any, str | None]:
    """cuda-python's driver module and None, or None and why it did not import."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        try:
            from cuda import cuda as driver     # cuda-python before cuda.bindings (12.x)
        except ImportError:
            return None, str(exc)
    return driver, None


_FUNCTIONS: dict[tuple[int, int, int, Path], dict[str, Any]] = {}


def kernel_functions(device_index: int, dtype: torch.dtype, nranks: int,
                     source: Path = KERNEL_SOURCE) -> dict[str, Any]:
    """Compiled kernels for one device, dtype and world size (from `source`, a file with the same
    kernels and contract: scripts/p2p_kernel_study.py builds its variants so); cached for the
    process."""
    key = (device_index, DTYPE_CODES[dtype], nranks, source)
    if key not in _FUNCTIONS:
        cupy = cupy_module()
        names = {algo: f"{name}<{key[1]}, {nranks}>" for algo, name in KERNEL_NAMES.items()}
        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(code=source.read_text(), options=("--std=c++17",),
                                    name_expressions=list(names.values()))
            _FUNCTIONS[key] = {algo: module.get_function(name).kernel for algo, name in names.items()}
    return _FUNCTIONS[key]


def kernel_blocks_per_sm(device_index: int, functions: dict[str, Any], algorithms: tuple[str, ...]) -> int:
    """Resident blocks per SM of the most demanding of these kernels at THREADS_PER_BLOCK
    (cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory and threads)."""
    cupy = cupy_module()
    with cupy.cuda.Device(device_index):
        return min(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(functions[a].ptr, THREADS_PER_BLOCK, 0)
                   for a in algorithms)


class PdlLauncher:
    """Launches a CUfunction through cuLaunchKernelEx with programmatic stream serialization
    allowed: the kernel may start before the previous kernel in the stream ends (it waits for it
    in griddepcontrol.wait)."""

    def __init__(self, driver: Any):
        self.driver = driver
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        self.attrs = [attribute]
        # Built once per grid and stream, and once per kernel: filling them is host time on
        # every eager call, and a backend launches a handful of grids on one or two streams.
        self._configs: dict[tuple[int, int, int], Any] = {}
        self._functions: dict[int, Any] = {}

    def _config(self, blocks: int, threads: int, stream_ptr: int) -> Any:
        key = (blocks, threads, stream_ptr)
        config = self._configs.get(key)
        if config is None:
            driver = self.driver
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = blocks, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = 0
            config.hStream = driver.CUstream(stream_ptr)
            config.numAttrs = len(self.attrs)
            config.attrs = self.attrs
            self._configs[key] = config
        return config

    def launch(self, function_ptr: int, blocks: int, threads: int, stream_ptr: int, params: KernelParams) -> None:
        driver = self.driver
        function = self._functions.get(function_ptr)
        if function is None:
            function = self._functions[function_ptr] = driver.CUfunction(function_ptr)
        (result,) = driver.cuLaunchKernelEx(self._config(blocks, threads, stream_ptr), function, params.address, 0)
        if result != driver.CUresult.CUDA_SUCCESS:
            _, name = driver.cuGetErrorName(result)
            raise RuntimeError(f"p2p: cuLaunchKernelEx failed: {name.decode()}")


class SharedArea:
    """One rank's IPC allocation, its peers' opened allocations, the kernels' Layout table,
    the private Ctrl words and the host-mapped timeout report."""

    def __init__(self, ctx: "RunContext", plan: AreaPlan, timeout_ms: float):
        self.ctx = ctx
        self.plan = plan
        self.timeout_ms = timeout_ms
        self.base = 0
        self.report = 0
        self.opened: list[int] = []
        self.exchanged = False
        self.layout: numpy.ndarray | None = None      # the kernels' by-value Layout parameter
        self.lamport_layout: numpy.ndarray | None = None   # the Lamport one-shot's (LamportLayout)
        self.ctrl: torch.Tensor | None = None

    def allocate(self) -> bytes | None:
        """Local step: allocate, zero the flags, fill the Lamport areas with LL_EMPTY; returns the
        IPC handle to share (None at world size 1)."""
        cupy = cupy_module()
        runtime = cupy.cuda.runtime
        self.base = runtime.malloc(self.plan.total_bytes)
        runtime.memset(self.base, 0, self.plan.total_bytes)
        memory = cupy.cuda.UnownedMemory(self.base, self.plan.total_bytes, owner=None)
        for offset, nbytes in self.plan.lamport_spans:
            words = cupy.ndarray((nbytes // 4,), dtype=numpy.uint32, memptr=cupy.cuda.MemoryPointer(memory, offset))
            words.fill(LL_EMPTY)
        self.report = runtime.hostAlloc(16, HOST_ALLOC_PORTABLE_MAPPED)
        ctypes.memset(self.report, 0, 16)
        self.ctrl = torch.zeros(CTRL_WORDS, dtype=torch.int32, device=self.ctx.device)
        # Peers may write into this memory as soon as they hold the handle.
        runtime.deviceSynchronize()
        return runtime.ipcGetMemHandle(self.base) if self.ctx.world_size > 1 else None

    def connect(self, handles: list[bytes | None]) -> None:
        """Local step: open every peer's allocation and write the kernels' Layout table."""
        runtime = cupy_module().cuda.runtime
        self.exchanged = True
        bases = []
        for rank, handle in enumerate(handles):
            if rank == self.ctx.rank:
                bases.append(self.base)
            else:
                self.opened.append(runtime.ipcOpenMemHandle(handle))
                bases.append(self.opened[-1])
        self.layout = layout_parameter(self.plan, bases, int(self.timeout_ms * 1e6), self.ctrl.data_ptr(),
                                       self.report, self.ctx.rank)
        self.lamport_layout = lamport_parameter(self.layout)

    def parameter(self, kernel: str) -> numpy.ndarray:
        """The by-value table one compiled kernel (a key of KERNEL_NAMES) takes."""
        return self.lamport_layout if kernel in LAMPORT_LAYOUT_KERNELS else self.layout

    def timeout_error(self) -> P2PTimeoutError | None:
        """The error the kernels recorded, read from host-mapped memory without a sync."""
        if not self.report:
            return None
        code, peer, epoch, phase = _REPORT.from_address(self.report)
        if not code:
            return None
        who = "a peer rank" if peer == PEER_UNKNOWN else f"peer rank {peer}"
        return P2PTimeoutError(
            f"p2p: {who} did not arrive within {self.timeout_ms:g} ms "
            f"(rank {self.ctx.rank}, call {epoch}, {PHASE_NAMES[phase] if phase < len(PHASE_NAMES) else phase}); "
            "p2p is unusable until it is set up again")

    def release(self) -> None:
        """Collective: no peer may still touch this memory when it is freed."""
        runtime = cupy_module().cuda.runtime
        torch.cuda.synchronize(self.ctx.device)   # our kernels are bounded, so this returns
        if self.exchanged and self.ctx.world_size > 1:
            self.ctx.barrier()
        for ptr in self.opened:
            runtime.ipcCloseMemHandle(ptr)
        self.opened = []
        if self.base:
            runtime.free(self.base)
            self.base = 0
        if self.report:
            runtime.freeHost(self.report)
            self.report = 0
        self.layout = self.lamport_layout = self.ctrl = None


class GraphTable:
    """The graph kernels' pointer table: one row per captured call, filled after capture with
    every rank's input and output of that call, opened in this process over CUDA IPC (as the
    engines register their graph inputs). Rows are never reused: a captured graph may be replayed
    for as long as the backend lives. Buffers from torch's caching allocator share their
    segment's IPC handle; a process may open a handle only once, so every table shares the
    openings (_OPENED)."""

    def __init__(self, ctx: "RunContext"):
        self.ctx = ctx
        self.rows = torch.zeros((GRAPH_ROWS, GRAPH_ROW_WORDS), dtype=torch.int64, device=ctx.device)  # raw 64-bit addresses
        self.used = 0
        self.pending: list[tuple[int, int]] = []    # (input, output) of calls captured, not yet registered
        self._held: set[bytes] = set()               # the peer segments this table opened

    def row_address(self, in_ptr: int, out_ptr: int) -> int:
        """The row a call being captured reads; registered when the capture ends (register)."""
        index = self.used + len(self.pending)
        if index >= GRAPH_ROWS:
            raise BackendUnavailable(f"p2p's graph table is full ({GRAPH_ROWS} captured calls)")
        self.pending.append((in_ptr, out_ptr))
        return self.rows.data_ptr() + index * GRAPH_ROW_WORDS * self.rows.element_size()

    def drop_pending(self) -> None:
        """A capture that failed: its rows are never replayed."""
        self.pending = []

    def register(self) -> None:
        """Collective (every rank, after every capture): swap the IPC handles of the captured
        buffers, open the peers' and write the rows before the first replay."""
        pending, self.pending = self.pending, []
        try:   # every rank reaches the exchange, so that none waits in it for a rank that failed
            local, error = [tuple(_segment_handle(ptr) for ptr in call) for call in pending], None
        except Exception as exc:
            local, error = [], describe(exc)
        answers = self.ctx.all_gather_objects((error, local))
        errors = [f"rank {rank}: {e}" for rank, (e, _) in enumerate(answers) if e]
        if errors:
            raise BackendUnavailable(f"p2p cannot register the captured buffers with its peers ({errors[0]})")
        if not pending:
            return
        gathered = [calls for _, calls in answers]
        rows = numpy.zeros((len(pending), GRAPH_ROW_WORDS), dtype=numpy.uint64)
        for rank, calls in enumerate(gathered):
            for i, call in enumerate(calls):
                ptrs = pending[i] if rank == self.ctx.rank else [self._open(*h) for h in call]
                rows[i, rank], rows[i, MAX_RANKS + rank] = ptrs
        self.rows[self.used: self.used + len(pending)].copy_(torch.from_numpy(rows.view(numpy.int64)))
        torch.cuda.synchronize(self.ctx.device)     # the rows must be there before the first replay
        self.used += len(pending)

    def _open(self, handle: bytes, offset: int) -> int:
        if handle not in self._held:
            if handle not in _OPENED:
                _OPENED[handle] = [cupy_module().cuda.runtime.ipcOpenMemHandle(handle), 0]
            _OPENED[handle][1] += 1
            self._held.add(handle)
        return _OPENED[handle][0] + offset

    def release(self) -> None:
        """After the collective barrier of SharedArea.release: no peer kernel reads these any more."""
        runtime = cupy_module().cuda.runtime
        for handle in self._held:
            _OPENED[handle][1] -= 1
            if not _OPENED[handle][1]:
                runtime.ipcCloseMemHandle(_OPENED.pop(handle)[0])
        self._held = set()


# A peer segment's IPC handle -> [its base in this process, the tables that hold it].
_OPENED: dict[bytes, list[int]] = {}


def _segment_handle(ptr: int) -> tuple[bytes, int]:
    """The IPC handle of the allocation holding ptr and ptr's offset in it."""
    driver, import_error = cuda_driver()
    if driver is None:
        raise RuntimeError(f"cuda-python is needed to find a buffer's allocation ({import_error})")
    result, base, _ = driver.cuMemGetAddressRange(ptr)
    if result != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"p2p: cuMemGetAddressRange failed for {ptr:#x}: {result}")
    base = int(base)
    return cupy_module().cuda.runtime.ipcGetMemHandle(base), ptr - base
