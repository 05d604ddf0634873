"""The one interface every allreduce backend implements.

A backend module holds one family ("nccl", "p2p", ...) and exposes a ``FACTORY`` that turns a
variant spec (the text after ``family:``) into backend objects. Everything about a backend
lives in its module and reaches the rest of commbench through this interface, for built-ins
and entry-point plug-ins alike:

- what it needs from the machine (``needs``, names from commbench.topology.needs.NEEDS) and
  from its software: ``requires`` (a ``Requires``: the package that must be installed, new
  enough and importable, checked by the base ``software_reason`` in one wording; flashinfer,
  nccl4py and p2p declare one), or its own ``software_reason`` where the check is more than an
  import (a torch feature, a bootstrap run in a child, a version pinned exactly: nccl, symm_mem,
  mscclpp, sglang, vllm), and ``BackendFactory.packages``: the probe's verdicts and the sweep's
  checks both come from these;
- its command-line options (``BackendFactory.add_arguments`` / ``read_options``);
- the serving-engine settings that select it (``engine_settings``, recorded in run.json);
- what it observes about each row (``observe``: e.g. what NCCL chose) and records on it;
- the rules it declares rather than writes (``min_world_size``, ``max_world_size``,
  ``world_sizes``, ``dtypes``, ``message_multiple_bytes``, ``graph_capturable``), applied by
  ``check()`` and ``supports()`` in one wording;
- the names of the kernels it launches, for ``commbench attribute``: a module-level literal
  ``TRACE_KERNELS = ((kernel_regex, library, backend_name_regex, note), ...)``, read from the
  source with ast (commbench.analysis.trace_kernels), or on the factory ``trace_kernels_of``:
  the family whose literal names them, "" for none of its own (tests/system/test_layout.py checks).

The harness owns timing, checking, voting and watchdogs; a backend sets itself up, says when
it cannot run and why, and reduces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import importlib
import importlib.util
import re
import traceback
from importlib import metadata

# The torch-free half of the interface, here too: families and plug-ins import it from this module.
from commbench.backends.factory import (BackendFactory, BackendUnavailable, MakeOptions, OwnOptions,  # noqa: F401
                                       SweepFacts, chosen_variants, parse_variant_options)
from commbench.errors import UsageError
from commbench.ops import ALLREDUCE
from commbench.results import Measurement
from commbench.topology.needs import ranks_reason

if TYPE_CHECKING:
    import torch

    from commbench.engines import Settings
    from commbench.runtime.context import RunContext
    from commbench.runtime.workload import Workload

# torch is imported where a rank uses it: the sweep's driver and --help import this module (a
# plug-in's module imports it for its flags) and never need torch, which costs seconds to start.


def all_dtypes() -> tuple[torch.dtype, ...]:
    """Every dtype the sweep times."""
    import torch

    return (torch.bfloat16, torch.float16, torch.float32)


class _AllDtypes:
    """Backend.dtypes unless a backend names its own: all_dtypes(), looked up when asked."""

    def __get__(self, obj: object, owner: type) -> tuple[torch.dtype, ...]:
        return all_dtypes()

@dataclass(frozen=True)
class Requires:
    """The Python package a backend needs, declared once on the class (``requires = Requires(...)``)
    and checked by ``Backend.software_reason``: installed, new enough, importable. The check
    imports ``module`` and nothing else, so the probe may ask it on any machine."""

    name: str                                   # as a user knows it, and pip's name when versions count
    module: str                                 # what must import ("flashinfer.comm")
    install: str                                # how to install it ("pip install nccl4py")
    min_version: tuple[int, int] | None = None  # checked against the installed distribution `name`
    min_version_for: str = ""                   # what needs that version, said when it is older

    def reason(self) -> str | None:
        """Why the package cannot be used here, or None."""
        version = ""
        if self.min_version is not None:
            try:
                version = metadata.version(self.name)
            except metadata.PackageNotFoundError:
                return f"{self.name} not installed ({self.install})"
            if _major_minor(version) < self.min_version:
                return (f"{self.name} {version} is too old: needs >= {'.'.join(map(str, self.min_version))} "
                        f"({self.min_version_for})")
        else:
            try:
                found = importlib.util.find_spec(self.module) is not None
            except (ImportError, ValueError):   # its parent package is missing
                found = False
            if not found:
                return f"{self.name} not installed ({self.install})"
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # a missing dependency or a broken build: say which
            installed = f"{self.name} {version}" if version else self.name
            return f"{installed} is installed but does not import: {type(exc).__name__}: {exc}"
        return None


def _major_minor(text: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


class BackendTimeout(RuntimeError):
    """Raised by a call whose bounded wait gave up (a peer never arrived): recorded as a hang."""


class Backend(ABC):
    """One backend variant, e.g. ``nccl:proto=LL,algo=Ring`` or ``p2p:oneshot``.

    Lifecycle per sweep: check() -> setup(dtype) [-> setup(other dtype) ...] -> close().
    setup() may be called again with another dtype before close(); close() must release
    everything, also after a failed setup().

    What the harness expects around collectives: every rank calls setup(), allreduce() and
    close() the same number of times in the same order. Any of them may raise: the harness
    catches it and the row (or the setup vote) names the rank and the exception. A rank that
    raises while its peers wait in a collective it never joins cannot free them: within about
    10 s their watchdogs write an `error` row naming that rank and the exception, and the
    processes end (--resume, or the --nproc driver by itself, goes on without the backend). So
    that a failure costs only its rows, vote before each collective step (voted, voted_gather,
    raise_unless_all_ranks_ok) and bound every wait on a peer (raise BackendTimeout: a hang row).
    A crash in native code is named too (commbench.inflight), but ends the processes.
    """

    name: str = ""
    family: str = ""
    graph_capturable: bool = True
    needs: tuple[str, ...] = ()     # names from topology.needs.NEEDS, checked in its order
    in_place: bool = False          # the sum overwrites the input (torch ProcessGroups)
    op: str = ALLREDUCE            # what one call computes; see commbench.runtime.workload
    dtypes: tuple[torch.dtype, ...] = _AllDtypes()  # type: ignore[assignment]
    min_world_size: int = 1
    max_world_size: int | None = None
    world_sizes: tuple[int, ...] | None = None   # the only sizes it runs at (a kernel built per size), if so
    message_multiple_bytes: int = 1               # message sizes it takes: a multiple of this (16-byte vectors)
    requires: Requires | None = None              # the package it needs, checked by software_reason
    # Builds on rows measured earlier in this run (unfused:best picks the fastest allreduce): the
    # sweep runs it after every backend that does not, and hands it those rows (take_rows).
    reads_rows: bool = False

    @property
    def node_local(self) -> bool:
        return "node" in self.needs

    def world_size_reason(self, world_size: int) -> str | None:
        """Static rule: can this backend ever run at this world size? None = yes."""
        if world_size < self.min_world_size:
            return f"needs at least {self.min_world_size} ranks, this run has {world_size}"
        if self.max_world_size is not None and world_size > self.max_world_size:
            return f"supports at most {self.max_world_size} ranks, this run has {world_size}"
        if self.world_sizes is not None and world_size not in self.world_sizes:
            return f"supports {', '.join(map(str, self.world_sizes))} ranks, this run has {world_size}"
        return None

    def take_rows(self, rows: Sequence[Measurement]) -> None:
        """For a backend that reads_rows, before check(): every row of this run measured before
        it (resumed ones too), the same on every rank."""

    def software_reason(self) -> str | None:
        """Why its software is missing, unusable or too old ("not installed: pip install ...");
        None when it is there. No GPU work and no side effects: the probe asks it too. By
        default the package ``requires`` names; a family whose check is more overrides this."""
        return self.requires.reason() if self.requires is not None else None

    def check(self, ctx: "RunContext") -> str | None:
        """Can this rank run the backend at all? None = yes, else the reason (no side effects):
        the world size, the probe's verdict for this variant when the sweep took one (it covers
        the fabric needs: p2p, ipc, vmm, atomics), the needs the running processes can answer,
        then the software."""
        return (self.world_size_reason(ctx.world_size) or ctx.verdicts.get(self.name)
                or ranks_reason(self.needs, ctx)
                or self.software_reason())

    def engine_settings(self, world_size: int | None) -> "Settings | None":
        """The NCCL / vLLM / SGLang settings that select this variant (commbench.engines), for
        recommend; None when no engine mapping is known."""
        return None

    def snapshot_warning(self, snapshot: dict[str, Any]) -> str | None:
        """A warning for a machine where this variant runs but may give wrong answers."""
        return None

    def supports(self, message_bytes: int, dtype: torch.dtype) -> str | None:
        """Per-shape rule. None = this size and dtype can run, else the reason."""
        if dtype not in self.dtypes:
            return f"dtype {str(dtype).replace('torch.', '')} not supported"
        if message_bytes % self.message_multiple_bytes:
            return f"takes byte sizes that are a multiple of {self.message_multiple_bytes}"
        return None

    @abstractmethod
    def setup(self, ctx: "RunContext", max_bytes: int, dtype: torch.dtype) -> None:
        """Allocate and connect. Raise BackendUnavailable (or anything) to be voted out."""

    @abstractmethod
    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over all ranks, on the current stream: written into out (return None), or
        returned in a tensor of the backend's own, as an engine's kernel that allocates its
        output does (copying it into out would time a copy the engine never makes).

        The harness owns x and out and keeps every call's output until it has checked it. A
        returned tensor is checked and timed the same: it must hold x's element count in x's
        dtype on x's device, and keep this call's sum until the harness drops it (a fresh
        tensor per call, or x itself; in a CUDA graph, the tensor captured for this call, which
        every replay rewrites), never a buffer the next call overwrites. An in_place backend is
        given out = x (and a fresh x for every call); any other gets an out distinct from x."""

    def close(self) -> None:
        """Release everything (buffers, groups, IPC handles)."""

    def make_workload(self, ctx: "RunContext", count: int, dtype: torch.dtype,
                      shape: tuple[int, int] | None, pairs: int) -> Workload:
        """The inputs, calls and check for one row: `pairs` input/output pairs. Plain
        allreduce by default."""
        from commbench.runtime.workload import AllreduceWorkload

        return AllreduceWorkload(self, ctx, count, dtype, pairs)

    def process_env(self, allow_multicast: bool) -> dict[str, str] | None:
        """Environment this backend needs in a child torchrun of its own (e.g. a preloaded
        library); None when it runs in any process. The sweep's driver (--nproc) starts it."""
        return None

    def graph_capture(self) -> AbstractContextManager[Any]:
        """Entered around one CUDA-graph capture of this backend's calls, on every rank. A backend
        whose captured kernels read peer buffers known only after capture (the engines' custom
        allreduce: their graph inputs are IPC-registered once capture ends) registers them when
        this context exits, before the first replay; its exit may be collective."""
        return nullcontext()

    def raise_if_failed(self) -> None:
        """Raise what this backend's kernels recorded on the device (a bounded wait that gave up:
        a BackendTimeout), or nothing. The harness calls it after synchronising, before it checks
        a pass's outputs, so a wait that gave up inside a graph replay (which never passes
        through allreduce()) makes a hang row, not a count of wrong values. Cheap: no GPU work."""

    def row_fields(self) -> dict[str, Any]:
        """Fields recorded on every row of this variant: Measurement attributes, or 'extra' (a
        dict). Any other name goes into extra for a plug-in; from a built-in backend it is a typo,
        and the sweep raises (UnknownRowField)."""
        return {}

    def observe(self, call: Callable[[], None], message_bytes: int) -> dict[str, Any]:
        """Fields known only from calls of this size (e.g. what NCCL chose). Run on every rank
        before the row's timed passes and outside them; ``call`` makes one more call of the
        row's size (collective: every rank makes the same number). Rank 0's answer is recorded."""
        return {}


def reduce_into(backend: Backend, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One call of backend.allreduce: the tensor that holds the sum (the backend's own when it
    returned one, else out), shaped as out."""
    result = backend.allreduce(x, out)
    return out if result is None else result.view(out.shape)


def describe(exc: BaseException) -> str:
    """An exception as one line for a row: a refusal (BackendUnavailable) is its reason as it
    stands; anything else is its type, first line and where it was raised."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(exc, BackendUnavailable):
        return first
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    location = f" [{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]" if where else ""
    return f"{type(exc).__name__}: {first}{location}"


def _attempt(step: Callable[[], Any]) -> tuple[str | None, Any]:
    try:
        return None, step()
    except Exception as exc:  # the vote turns it into every rank's reason
        return describe(exc), None


def voted(ctx: "RunContext", what: str, step: Callable[[], Any]) -> Any:
    """Run a local step on every rank, then vote on it before anything collective follows: if
    it raised on any rank, every rank raises BackendUnavailable naming the first that failed."""
    error, result = _attempt(step)
    raise_unless_all_ranks_ok(ctx, error, what)
    return result


def voted_rank0_first(ctx: "RunContext", what: str, step: Callable[[], Any]) -> Any:
    """voted(), run by rank 0 before the others: a JIT build that the other ranks then load
    from its cache, instead of every rank compiling into one cache directory at once."""
    result = voted(ctx, what, step if ctx.rank == 0 else lambda: None)
    later = voted(ctx, what, step if ctx.rank != 0 else lambda: None)
    return result if ctx.rank == 0 else later


def voted_gather(ctx: "RunContext", what: str, step: Callable[[], Any]) -> list[Any]:
    """voted(), and every rank's result in rank order, in one collective (for small results:
    IPC handles, capacities, timings)."""
    gathered = ctx.all_gather_objects(_attempt(step))
    _raise_first_failure([error for error, _ in gathered], what)
    return [result for _, result in gathered]


def raise_unless_all_ranks_ok(ctx: "RunContext", local_error: str | None, what: str) -> None:
    """Vote on a local step before the next collective one: every rank raises, naming the first
    rank that failed, so no rank is left waiting in a rendezvous that a failed peer never joins."""
    _raise_first_failure(ctx.all_gather_objects(local_error), what)


def _raise_first_failure(errors: list[str | None], what: str) -> None:
    failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
    if failed:
        rank, err = failed[0]
        others = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise BackendUnavailable(f"{what} failed on rank {rank}{others}: {err}")


class ProcessGroupBackend(Backend):
    """A backend that is one torch.distributed group: all_reduce in place, destroy on close."""

    group: Any = None
    in_place = True

    def allreduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)

    def close(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None
