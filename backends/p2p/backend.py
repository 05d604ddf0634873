"""p2p: commbench's own CUDA-IPC allreduce (Lamport one-shot and two-shot, flag one-shot push and
pull, flag two-shot, the zero-copy graph one-shot and two-shot, auto).

The kernels (allreduce.cu beside this file) are compiled at run time by NVRTC through
CuPy, once per process, device, dtype and world size, and launched on torch's current
stream, so they are captured by CUDA graphs like any torch kernel.

Design (the ideas of vLLM's and TRT-LLM's custom allreduce, our own code):

* One device allocation per rank holds the flags and data areas; its CUDA-IPC handle goes to
  every rank over the gloo control group and each rank opens its peers' allocations.
* The kernels' table of buffers (Layout) is a kernel parameter passed by value, built once per
  buffer (the Lamport one-shot takes only the part it reads, LamportLayout: less of each launch
  is parameter); peer loops are unrolled at compile time (the world size is a template
  parameter).
* Every kernel kind counts its calls in device memory, one counter per block, advanced by the
  kernel itself, because a graph replay re-launches with the arguments fixed at capture time.
  Every call is collective, so all ranks agree on the count. A peer never runs more than one
  call ahead (finishing a call needs this rank's data of it), so buffers that rotate by count
  are never overwritten while this rank still reads them, and no end-of-call barrier is
  needed. Only plain stores and loads cross the fabric; PCIe systems often lack peer atomics.
* Lamport kernels (``p2p:oneshot_lamport``, ``p2p:twoshot_lamport``; the idea of TRT-LLM's and
  FlashInfer's Lamport one-shot and of MSCCL++'s LL packets, our own code): the data is its own
  arrival flag. Buffers start filled with a 32-bit word no input can hold (the bits of fp32
  -0.0, mapped to +0.0 on the way in, which changes no value); writers push 16-byte vectors,
  readers poll their own memory until no word is empty. The one-shot rotates two buffers and
  empties each vector right after reading it; above 2 ranks up to 64 KiB a kernel of its own
  runs it in SGLang's push shape (its own slot too, every slot polled alike:
  ``layout.kernel_form``). The two-shot rotates three buffers and empties the previous call's
  buffer while it waits. No fence and no flag round trip per call.
* Flag kernels (``p2p:oneshot``, ``p2p:oneshot_pull``, ``p2p:twoshot``): data, then a system
  fence and a flag per peer, then a wait for every peer's flag; data areas alternate by parity.
* Staging happens inside the kernel: the first step of every call copies the caller's input
  into the IPC buffers (push variants write it straight into the peers' receive areas, so
  there the copy is the transfer itself). The fused copy costs no extra launch or graph node,
  and one local read and write of the message.
* The exceptions, ``p2p:oneshot_graph`` and ``p2p:twoshot_graph`` (the idea of the engines'
  graph-buffer registration and of SGLang's one-shot and two-shot pull, our own code): inside a
  CUDA graph they stage nothing. Each captured call reads a row of a device table (GraphTable)
  that is filled when the capture ends (``graph_capture``, a collective on every rank): every rank's input and output of that
  call, opened over CUDA IPC. In the two-shot rank r reads slice r of every input, reduces it
  and writes it into slice r of every output, between two flag barriers: about 2 bytes of memory
  traffic per message byte per rank, where the staged two-shot moves about 5.5 at 8 ranks. In
  the one-shot every rank reads all of every input and writes only its own output, between two
  barriers that carry no data (no fence): a counter per block that every rank adds 1 to (a peer
  atomic, as SGLang's barrier; the variant needs ``atomics``) and one thread polls; at 2 ranks
  each thread reads two vectors' worth of every input before it reduces. Both read their call
  count with one thread per block, where their grids are largest. Eager calls,
  whose buffers are never registered, run the fallback: the staged two-shot, or the Lamport
  one-shot. Registering needs an IPC handle for the allocation that holds each buffer; where
  there is none (expandable segments, cuMem pools) every rank refuses the graph with the reason.
  They read peer memory, so they are never default variants and ``p2p:auto`` takes them only
  where reads are safe (below).
* Push is the default: every byte crosses the fabric as a posted write. Reads of peer
  memory are the pattern that never completes on some PCIe systems, and such a read cannot
  be bounded by a timeout, so the pull variants (``p2p:oneshot_pull`` and the graph kernels)
  run only when asked for, the other two-shots never read peer memory, and ``p2p:auto`` adds
  the pull kernels to its candidates only where a peer's memory is known to answer reads: every rank on one GPU, or
  every pair of GPUs joined by NVLink in the probe's snapshot (``peer_reads_reason``; rows
  say why not in ``p2p_auto_pull_reason``), or when a forced rule names it.
* Waits are bounded: a peer missing for ``p2p_timeout_ms`` makes the kernel give up, record
  the peer in host-mapped memory and mark this rank's state broken; every later call returns
  at once on the GPU and raises ``P2PTimeoutError`` on the host.
* Block b of a rank spins until block b of every peer arrives, so every block of every rank
  must be resident on its GPU at once. The grid is capped at setup by what fits: the kernels'
  occupancy (blocks per SM) times the SMs a rank may count on (grid_capacity), the smallest
  rank's answer, so that every rank launches the same grid.
* ``p2p:auto`` picks among the Lamport and flag kernels by size (the four push kernels, and
  the pull one-shot and the graph kernels where reads are safe, above). The rule is measured at setup:
  every kernel is graph-replayed at sizes from 4 KiB up by factors of 2 on every rank (the
  median of several replays of up to 100 calls), the slowest rank's time counts, the fastest
  kernel wins each size (a kernel with fewer round trips keeps ties), and every rank applies
  the same rule to the same gathered numbers. With the graph kernel among them, it has two
  rules: one for calls captured in a graph and one without the graph kernels for eager calls
  (rows say ``p2p_auto_eager_rule`` where they differ); where the buffers cannot be registered
  it measures without the graph kernels (``p2p_auto_graph_reason``). ``p2p_auto_rule`` in the options skips
  the measurement (a graph kernel it names runs its eager fallback outside graphs).
* Programmatic dependent launch (PDL, ``p2p_pdl``, on by default): the kernels are launched
  through cuLaunchKernelEx (cuda-python) with programmatic stream serialization, so a call's
  blocks may start while the previous kernel in the stream finishes; every kernel waits
  (``griddepcontrol.wait``) before it touches global memory. Used only where every rank can:
  cuda-python imports, SM 9.0+, and no ranks that run concurrently on one GPU without SM shares
  of their own (a next call's waiting blocks could hold the SMs a peer's blocks need). Otherwise
  CuPy launches plainly; rows record ``p2p_pdl`` and, when off, ``p2p_pdl_reason``.

The family is a folder of modules, each with one job: layout (the kernels' contract: constants,
launch shapes, the buffer plan, the Layout and the fused kernels' arguments), rules (variants,
options, eligibility, p2p:auto's and p2p:fused's choice), kernels (compiling, launching, the shared
IPC area), this one (the plain allreduce backend), fused (p2p:fused: allreduce + residual add +
RMSNorm in one kernel) and variants (the flags and the factory).

World size 1 runs only the one-shot kernels (``p2p:oneshot_lamport``, ``p2p:oneshot``): the
kernels with no peers, as the launch-and-copy floor of our kernels (rows carry
``extra.p2p_kernel_floor``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy
import torch

from commbench import engines
from commbench.backends.base import Backend, BackendUnavailable, Requires, all_dtypes, voted, voted_gather
from commbench.backends.p2p.kernels import (KERNEL_SOURCE, GraphTable, PdlLauncher, SharedArea, cuda_driver,
                                            cupy_module, kernel_blocks_per_sm, kernel_functions)
from commbench.backends.p2p.layout import (GRAPH_FALLBACK, MAX_BLOCKS, MAX_RANKS, ONESHOT_GRAPH, THREADS_PER_BLOCK,
                                           VECTOR_BYTES, grid_capacity, kernel_form, kernel_forms, kernel_params,
                                           launch_dims, launched_kernels, plan_areas)
from commbench.backends.p2p.rules import (AUTO_READ_KERNELS, CALIBRATION_REPLAYS, CALIBRATION_SIZES,
                                          FLOOR_VARIANTS, KERNEL_VARIANT, VARIANTS, AutoRule, P2POptions,
                                          agreed_pdl_reason, auto_kernels, calibration_calls, choose_rules,
                                          format_auto_rule, pdl_reason, peer_reads_reason, per_call_median_us,
                                          quick_p2p_reason, rule_kernel, size_reason, slowest_rank_times,
                                          tensor_reason)
from commbench.runtime.timing import capture_graph, per_step_us

if TYPE_CHECKING:
    from commbench.runtime.context import RunContext

# Kernel names this family's allreduce leaves in a profiler trace, read by `commbench attribute`
# with ast, without importing this module (docs/attribute.md): (regex searched in the demangled
# name, library, regex over this family's run variants that are its floor, note[, op]).
# The kernels of allreduce.cu beside this file (layout.KERNEL_NAMES): no serving engine runs them.
TRACE_KERNELS = (
    (r"\bp2p_ll_oneshot(_own_slot)?\b", "commbench p2p", r"^p2p:oneshot_lamport$", ""),
    (r"\bp2p_ll_twoshot\b", "commbench p2p", r"^p2p:twoshot_lamport$", ""),
    (r"\bp2p_oneshot_push\b", "commbench p2p", r"^p2p:oneshot$", ""),
    (r"\bp2p_oneshot_pull\b", "commbench p2p", r"^p2p:oneshot_pull$", ""),
    (r"\bp2p_twoshot_push\b", "commbench p2p", r"^p2p:twoshot$", ""),
    (r"\bp2p_oneshot_graph\b", "commbench p2p", r"^p2p:oneshot_graph$", ""),
    (r"\bp2p_twoshot_graph\b", "commbench p2p", r"^p2p:twoshot_graph$", ""),
    (r"\bp2p_fused_(oneshot|twoshot)\b", "commbench p2p", r"^p2p:fused(_oneshot|_twoshot)?$",
     "allreduce + residual add + RMSNorm in one kernel", "allreduce_residual_rmsnorm"),
)

# CuPy compiles and launches every kernel. cuda-python is no requirement: PDL and the graph kernels'
# buffer registration use it where it imports, and rows say why not where it does not.
REQUIRES = Requires("cupy", "cupy", "pip install cupy-cuda12x or cupy-cuda13x")


@dataclass
class _Calibration:
    sizes: list[int]
    calls_per_graph: list[int]
    times_us: dict[str, list[float]]    # kernel -> slowest rank's per-call time at each size
    rule: AutoRule                      # in CUDA graphs
    eager_rule: AutoRule                # outside them: the same without the graph kernels


class P2PAllreduce(Backend):
    family = "p2p"
    needs = ("cuda", "node", "p2p", "ipc")
    graph_capturable = True
    dtypes = all_dtypes()
    max_world_size = MAX_RANKS
    requires = REQUIRES
    kernel_source = KERNEL_SOURCE   # a study subclass builds variants of the kernels from a patched copy

    def __init__(self, variant: str, options: P2POptions):
        self.variant = variant
        self.name = f"p2p:{variant}"
        self.algorithms = VARIANTS[variant]
        self.options = options
        # Why p2p:auto measures without the kernels that read peer memory, decided at its first
        # setup; None when they are in, or before, or when a forced rule picks the kernels.
        self._pull_reason: str | None = None
        if variant == "auto" and options.auto_rule is not None:
            self.algorithms = auto_kernels({kernel for _, kernel in options.auto_rule})
        if ONESHOT_GRAPH in self.algorithms:    # its barrier adds to a counter in peer memory
            self.needs = (*P2PAllreduce.needs, "atomics")
        # World size 1 is the kernel-only floor, measured with the one-shot kernels.
        self.min_world_size = 1 if variant in FLOOR_VARIANTS else 2
        self._ctx: RunContext | None = None
        self._area: SharedArea | None = None
        self._functions: dict[torch.dtype, dict[str, Any]] = {}
        # (most blocks per launch, SMs a rank may count on), agreed by all ranks
        self._grids: dict[torch.dtype, tuple[int, int]] = {}
        self._calibrations: dict[torch.dtype, _Calibration] = {}
        self._dtype: torch.dtype | None = None
        self._streams: dict[int, Any] = {}
        # PDL, decided at the first setup by all ranks: the launcher when on, else why not.
        self._pdl_decided = False
        self._pdl: PdlLauncher | None = None
        self._pdl_reason: str | None = None
        self._graph: GraphTable | None = None   # the graph kernels' pointer table, made at setup
        self._in_graph_capture = False          # inside graph_capture(): captured rows get registered
        self._graph_reason: str | None = None   # why p2p:auto's calibration left the graph kernel out

    # -- eligibility --------------------------------------------------------------------

    def check(self, ctx: "RunContext") -> str | None:
        # Without a probe snapshot (--no-probe) CUDA's own peer-access answer stands in for it.
        return super().check(ctx) or (None if ctx.verdicts else quick_p2p_reason(ctx.local_world_size))

    def engine_settings(self, world_size: int | None) -> engines.Settings:
        notes = [engines.CUSTOM_AR_ON_BY_DEFAULT]
        if world_size is None or world_size > 2:
            notes += [engines.CUSTOM_AR_PCIE_GATE, engines.FLASHINFER_PCIE_ALTERNATIVE]
        # commbench's own kernels: the same CUDA-IPC technique, not the engines' code.
        return engines.Settings(self.name, vllm_env=dict(engines.VLLM_ONLY_CUSTOM_ALLREDUCE), notes=notes,
                                engine_paths=engines.claim(engines.CUSTOM_AR, engines.VLLM, engines.SGLANG,
                                                           stand_in=True))

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        return super().supports(message_bytes, dtype) or size_reason(message_bytes, self.options.max_bytes)

    # -- lifecycle ----------------------------------------------------------------------

    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        self._ctx = ctx
        self._dtype = dtype
        if self._area is None:
            self._choose_auto_kernels(ctx)
        slot_bytes = -(-min(max_bytes, self.options.max_bytes) // VECTOR_BYTES) * VECTOR_BYTES
        slot_bytes = max(slot_bytes, VECTOR_BYTES)
        area = self._area
        local_rebuild = (area is None or area.plan.slot_bytes < slot_bytes
                         or area.timeout_error() is not None)
        # Every rank takes the same path, so no rank waits in an exchange another skips.
        if any(ctx.all_gather_objects(local_rebuild)):
            self._release()
            self._connect(ctx, slot_bytes, dtype)
        else:
            self._functions[dtype] = voted(ctx, "p2p kernel compilation",
                                           lambda: kernel_functions(ctx.device.index, dtype, ctx.world_size,
                                                                    self.kernel_source))
        if dtype not in self._grids:
            self._grids[dtype] = self._agree_grid(ctx, dtype)
        if not self._pdl_decided:
            self._decide_pdl(ctx)
        if self._graph is None and any(a in GRAPH_FALLBACK for a in self.algorithms):
            self._graph = GraphTable(ctx)
        if self.variant == "auto" and self.options.auto_rule is None and dtype not in self._calibrations:
            self._calibrations[dtype] = self._calibrate(dtype)

    def _choose_auto_kernels(self, ctx: "RunContext") -> None:
        """p2p:auto measuring its rule: add the kernels that read peer memory where reads
        complete (the same answer on every rank: the snapshot is rank 0's, broadcast)."""
        if self.variant == "auto" and self.options.auto_rule is None:
            self._pull_reason = peer_reads_reason(ctx.snapshot, ctx.world_size, ctx.emulation)
            self.algorithms = auto_kernels(() if self._pull_reason else AUTO_READ_KERNELS)

    def _connect(self, ctx: "RunContext", slot_bytes: int, dtype: torch.dtype) -> None:
        cupy_module().cuda.Device(ctx.device.index).use()
        area = SharedArea(ctx, plan_areas(self.algorithms, ctx.world_size, slot_bytes),
                           self.options.timeout_ms)
        self._area = area

        def compile_and_allocate() -> bytes | None:
            self._functions[dtype] = kernel_functions(ctx.device.index, dtype, ctx.world_size, self.kernel_source)
            return area.allocate()

        handles = voted_gather(ctx, "p2p buffer allocation", compile_and_allocate)
        voted(ctx, "opening peers' p2p buffers (CUDA IPC)", lambda: area.connect(handles))

    def _agree_grid(self, ctx: "RunContext", dtype: torch.dtype) -> tuple[int, int]:
        """Collective: the most blocks a launch may have and the SMs the block size is spread
        over. Every rank launches the same grid (block b meets block b), so the smallest rank's
        capacity counts."""
        def capacity() -> tuple[int, int]:
            cap = grid_capacity(kernel_blocks_per_sm(ctx.device.index, self._functions[dtype],
                                                     kernel_forms(launched_kernels(self.algorithms))),
                                torch.cuda.get_device_properties(ctx.device).multi_processor_count, ctx.emulation)
            refusal = cap.refusal()
            if refusal:
                raise BackendUnavailable(refusal)
            return cap.blocks, cap.sms

        caps = voted_gather(ctx, "p2p grid sizing", capacity)
        return min(MAX_BLOCKS, *(blocks for blocks, _ in caps)), min(sms for _, sms in caps)

    def _decide_pdl(self, ctx: "RunContext") -> None:
        """Collective: PDL on every rank or on none, so that no rank launches differently."""
        def local_reason() -> str | None:
            import_error = cuda_driver()[1]
            return pdl_reason(self.options.pdl, import_error, torch.cuda.get_device_capability(ctx.device),
                              ctx.emulation)

        self._pdl_reason = agreed_pdl_reason(voted_gather(ctx, "p2p PDL check", local_reason))
        self._pdl = PdlLauncher(cuda_driver()[0]) if self._pdl_reason is None else None
        self._pdl_decided = True

    def _release(self) -> None:
        # A new buffer may allow larger calibration sizes: measure again after a rebuild.
        self._calibrations.clear()
        if self._area is not None:
            area, self._area = self._area, None
            area.release()

    def close(self) -> None:
        self._release()
        if self._graph is not None:     # after the release's barrier: no peer kernel runs any more
            self._graph.release()
            self._graph = None

    # -- calls --------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise the timeout the kernels recorded, if any (cheap: reads host-mapped memory).
        allreduce() calls it first; the harness calls it after synchronising (Backend's)."""
        error = self._area.timeout_error() if self._area is not None else None
        if error is not None:
            raise error

    def algorithm_for(self, message_bytes: int, dtype: torch.dtype, in_graph: bool = True) -> str:
        """The kernel a call of this size runs, in a CUDA graph or not (a graph kernel named
        here runs its eager fallback outside graphs: _launch)."""
        if len(self.algorithms) == 1:
            return self.algorithms[0]
        return rule_kernel(self._rule(dtype, in_graph), message_bytes)

    def _rule(self, dtype: torch.dtype, in_graph: bool = True) -> AutoRule:
        if self.options.auto_rule is not None:
            return self.options.auto_rule
        calibration = self._calibrations[dtype]
        return calibration.rule if in_graph else calibration.eager_rule

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self._area is None:
            raise RuntimeError(f"{self.name}: setup() first")
        self.raise_if_failed()
        message_bytes = x.numel() * x.element_size()
        # The buffer may be smaller than p2p_max_bytes when the sweep's largest size is.
        reason = (super().supports(message_bytes, x.dtype) or size_reason(message_bytes, self._area.plan.slot_bytes)
                  or tensor_reason(x, out, self._ctx.device))
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        if x.dtype not in self._grids:
            raise RuntimeError(f"{self.name}: not set up for {x.dtype}")
        # Only a variant with graph kernels has a rule of its own for graphs.
        in_graph = self._graph is not None and torch.cuda.is_current_stream_capturing()
        self._launch(self.algorithm_for(message_bytes, x.dtype, in_graph), x, out)

    def _launch_dims(self, algorithm: str, units: int, dtype: torch.dtype) -> tuple[int, int]:
        """(blocks, threads) of one launch: layout.launch_dims on the grid the ranks agreed on
        (a method so that scripts/p2p_kernel_study.py can measure another launch shape)."""
        return launch_dims(algorithm, units, self._ctx.world_size, *self._grids[dtype], self.options.shape)

    def _launch(self, algorithm: str, x: torch.Tensor, out: torch.Tensor) -> None:
        units = x.numel() * x.element_size() // VECTOR_BYTES
        in_ptr, out_ptr = x.data_ptr(), out.data_ptr()
        if algorithm in GRAPH_FALLBACK:
            if torch.cuda.is_current_stream_capturing():
                if not self._in_graph_capture:
                    # Its table row would never be filled: the replay would read null pointers
                    # (an illegal address that poisons the CUDA context), so refuse the capture.
                    raise RuntimeError(f"{self.name}: a CUDA-graph capture of {KERNEL_VARIANT[algorithm]} must be "
                                       "inside backend.graph_capture(), which registers its buffers with the peers")
                # The kernel reads every rank's buffers of this call from its table row.
                in_ptr, out_ptr = self._graph.row_address(in_ptr, out_ptr), 0
            else:
                algorithm = GRAPH_FALLBACK[algorithm]
        blocks, threads = self._launch_dims(algorithm, units, x.dtype)
        form = kernel_form(algorithm, units, self._ctx.world_size)
        function, parameter = self._functions[x.dtype][form], self._area.parameter(form)
        if self._pdl is not None:
            self._pdl.launch(function.ptr, blocks, threads, torch.cuda.current_stream(self._ctx.device).cuda_stream,
                             kernel_params(parameter, in_ptr, out_ptr, units))
            return
        function((blocks,), (threads,), (parameter, numpy.uint64(in_ptr), numpy.uint64(out_ptr), numpy.uint32(units)),
                 stream=self._stream())

    @contextmanager
    def graph_capture(self) -> Iterator[None]:
        """With graph kernels: register the captured calls' buffers with the peers once the
        capture ends (collective, on every rank), before the first replay."""
        if self._graph is None:
            yield
            return
        self._in_graph_capture = True
        try:
            yield
        except BaseException:
            self._graph.drop_pending()
            raise
        finally:
            self._in_graph_capture = False
        self._graph.register()

    def _stream(self) -> Any:
        """torch's current stream as a CuPy stream, so launches are ordered with (and captured
        along with) torch's work."""
        ptr = torch.cuda.current_stream(self._ctx.device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)   # deprecated name in cupy 14
                stream = cupy_module().cuda.ExternalStream(ptr, self._ctx.device.index)
            self._streams[ptr] = stream
        return stream

    # -- auto calibration -----------------------------------------------------------------

    def _calibrate(self, dtype: torch.dtype) -> _Calibration:
        """Collective: graph-replay every kernel at a few sizes on every rank; every rank then
        applies choose_rules() to the same gathered numbers, so all pick the same."""
        ctx, area = self._ctx, self._area
        sizes = [s for s in CALIBRATION_SIZES if s <= area.plan.slot_bytes]
        calls = [calibration_calls(s) for s in sizes]
        def measure() -> dict[str, list[float]]:
            times: dict[str, list[float]] = {algorithm: [] for algorithm in self.algorithms}
            x = torch.ones(area.plan.slot_bytes // dtype.itemsize, dtype=dtype, device=ctx.device)
            out = torch.empty_like(x)
            for size in sizes:
                count = size // dtype.itemsize
                for algorithm in list(times):
                    try:
                        times[algorithm].append(self._kernel_us(algorithm, x[:count], out[:count]))
                    except BackendUnavailable as exc:
                        if algorithm not in GRAPH_FALLBACK:
                            raise
                        # Every rank refuses alike (GraphTable.register gathers the refusals):
                        # the rule is chosen without the graph kernel.
                        self._graph_reason = str(exc)
                        del times[algorithm]
            self.raise_if_failed()
            return times

        slowest = slowest_rank_times(voted_gather(ctx, "p2p auto calibration", measure))
        return _Calibration(sizes, calls, slowest, *choose_rules(sizes, slowest))

    def _kernel_us(self, algorithm: str, x: torch.Tensor, out: torch.Tensor) -> float:
        """This rank's per-call time of one kernel: timed replays of a graph of back-to-back calls."""
        calls = calibration_calls(x.numel() * x.element_size())
        # One eager call first: CuPy sets up its per-thread context state on a first launch,
        # which must not happen inside a capture.
        self._launch(algorithm, x, out)
        with self.graph_capture():
            graph = capture_graph(lambda _: self._launch(algorithm, x, out), calls)
        self._ctx.barrier()
        # The first replay absorbs the ranks' start skew and is dropped.
        replay_us = per_step_us(self._ctx, lambda _: graph.replay(), CALIBRATION_REPLAYS + 1)[1:]
        return per_call_median_us(replay_us, calls)

    # -- what rows record -------------------------------------------------------------------

    def row_fields(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "p2p_kernels": list(self.algorithms),
            "p2p_max_bytes": self.options.max_bytes,
            "p2p_timeout_ms": self.options.timeout_ms,
            "p2p_staging": "in-kernel" if self._graph is None else "in-kernel; none in graphs (registered buffers)",
            "p2p_threads": self.options.shape.threads or "by size",
            "p2p_vectors_per_thread": self.options.shape.vectors_per_thread,
        }
        if self._ctx is not None and self._ctx.world_size == 1:
            extra["p2p_kernel_floor"] = True
        if self._pdl_decided:
            extra["p2p_pdl"] = self._pdl is not None
            if self._pdl_reason is not None:
                extra["p2p_pdl_reason"] = self._pdl_reason
        if self._dtype in self._grids:
            extra["p2p_grid_cap_blocks"], extra["p2p_grid_sms"] = self._grids[self._dtype]
        if self._pull_reason is not None:     # only p2p:auto decides one
            extra["p2p_auto_pull_reason"] = self._pull_reason
        if self._graph_reason is not None:
            extra["p2p_auto_graph_reason"] = self._graph_reason
        if self.variant == "auto" and self._dtype is not None:
            extra["p2p_auto_rule"] = format_auto_rule(self._rule(self._dtype))
            if self._rule(self._dtype, in_graph=False) != self._rule(self._dtype):
                extra["p2p_auto_eager_rule"] = format_auto_rule(self._rule(self._dtype, in_graph=False))
            calibration = self._calibrations.get(self._dtype)
            if self.options.auto_rule is not None or calibration is None:
                extra["p2p_auto_rule_source"] = "option"
            else:
                extra["p2p_auto_rule_source"] = "measured"
                extra["p2p_calibration"] = {"sizes": calibration.sizes,
                                            "calls_per_graph": calibration.calls_per_graph,
                                            "replays": CALIBRATION_REPLAYS,
                                            "per_call_us": {KERNEL_VARIANT[k]: [round(t, 3) for t in times]
                                                            for k, times in calibration.times_us.items()}}
        return {"extra": extra}
