"""What NCCL says it did: switch its INFO log on around untimed calls, and read the lines.

NCCL (src/debug.cc) re-reads NCCL_DEBUG, NCCL_DEBUG_SUBSYS and NCCL_DEBUG_FILE after the
exported ``ncclResetDebugInit()``, so commbench logs only around a variant's communicator init
and a few untimed calls per row, never inside a timed loop. Lines it reads (NCCL 2.24 to 2.30):

- per collective, comm rank 0 only (src/enqueue.cc, TUNING):
  ``NCCL INFO AllReduce: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}``
  with names from ncclAlgoToString / ncclProtoToString (src/collectives.cc);
- per collective on entry, every rank (src/enqueue.cc ncclEnqueueCheck, COLL): ``NCCL INFO AllReduce:
  opCount 3 sendbuff 0x.. recvbuff 0x.. count 2048 datatype 9 op 0 root 0 comm 0x.. [nranks=2]
  stream 0x..``, datatype as ncclDataType_t (src/nccl.h.in); a world-1 call logs no Algo line after
  it (ncclLaunchOneRank, src/enqueue.cc taskAppend);
- at init, every rank (src/graph/tuning.cc, ENV): ``NCCL INFO NCCL_PROTO set by environment to LL``;
- at init, comm rank 0 when NCCL_PROTO or NCCL_ALGO is set (src/graph/tuning.cc, ENV):
  ``NCCL INFO Enabled NCCL Func/Proto/Algo Matrix:`` then a header row and one row per function
  (``    AllReduce |        1         0         0   |             1 ...``), names from
  ncclProtoStr / ncclAlgoStr (src/init.cc);
- per collective that runs a symmetric kernel (TUNING; 2.27 src/enqueue.cc, from 2.28
  src/scheduler/symmetric_sched.cc, comm rank 0): ``NCCL INFO AllReduce [Symmetric]: 4096 Bytes ->
  Kernel AllReduce_AGxLL_R nchannels 2 nthreads 512`` (2.28 on: `` nWorks 1`` follows), names
  from ncclSymkKernelIdToString; such a call logs no ``-> Algo`` line;
- at init where the communicator cannot use symmetric memory (2.29 on, src/init.cc, INIT):
  ``NCCL INFO Symmetric memory is not supported. cuMemEnable 1, globalGinSupport 0, ...``.

Which NCCL a process runs is asked of NCCL itself: ncclGetVersion of the libnccl mapped into
the process (/proc/self/maps), never inferred from a path.

Torch-free and below the backends: the NCCL backends and the probe's NCCL check (nccl_checks)
both read NCCL's log through this module, and it spells NCCL's variable names once.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections import Counter, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

# commbench's spelling, which requests use; NCCL's own spellings map onto it.
PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("Ring", "Tree", "NVLS", "NVLSTree", "PAT", "CollnetDirect", "CollnetChain")

HONOURED = "honoured"    # NCCL's init log shows it read the variable, and it used the request
IGNORED = "ignored"      # NCCL used something other than the request
COINCIDED = "coincided"  # NCCL used the request, but nothing shows it read the variable

PROTO_VAR, ALGO_VAR = "NCCL_PROTO", "NCCL_ALGO"   # read at every communicator init
LOG_FILE_VAR = "NCCL_DEBUG_FILE"
LOG_SETTINGS = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,TUNING"}
LOG_VARIABLES = (*LOG_SETTINGS, LOG_FILE_VAR)
# Before 2.27 ncclResetDebugInit closed the log file without NCCL's log lock, racing any NCCL
# thread writing a line; from 2.27 the reset is locked and applied at the next log call.
LOCKED_RESET_VERSION_CODE = 22700

_TUNING_RE = re.compile(r"NCCL INFO AllReduce: (\d+) Bytes -> Algo (\w+) proto (\w+)")
_ENV_RE = re.compile(r"NCCL INFO (NCCL_\w+) set by environment to (.*)$")
_MATRIX_START = "NCCL INFO Enabled NCCL Func/Proto/Algo Matrix:"
_MATRIX_ROW_RE = re.compile(r"^\s*(\w+) \|([^|]*)\|([^|]*)$")
_LIBNCCL_RE = re.compile(r"/libnccl\.so(\.\d+)*$")
_SYMMETRIC_RE = re.compile(r"NCCL INFO AllReduce \[Symmetric\]: (\d+) Bytes -> Kernel (\w+)")
_NO_SYMMETRIC_MARK = "Symmetric memory is not supported."
_COLL_RE = re.compile(r"NCCL INFO AllReduce: opCount \w+ sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+) "
                      r"op \d+ root -?\d+ comm \S+ \[nranks=(\d+)\]")
# Any line NCCL's logger writes (src/debug.cc: "host:pid:tid [dev] NCCL INFO|WARN ...").
NCCL_LINE_MARKS = ("NCCL INFO", "NCCL WARN")
# Calls waiting for their choice line, per process and size: a choice follows its call within the
# same group, and a rank other than comm rank 0 logs calls that no choice ever takes.
PENDING_CALLS = 4096
# ncclDataType_t (src/nccl.h.in) -> bytes per element.
DATATYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}


def _key(name: str) -> str:
    return name.replace("_", "").lower()


_ALGO_BY_KEY = {_key(a): a for a in ALGORITHMS}
_PROTO_BY_KEY = {_key(p): p for p in PROTOCOLS}


def canonical_algo(name: str) -> str:
    """NCCL's RING, NVLS_TREE, CollNetDirect, ... in commbench's spelling; unknown names unchanged."""
    return _ALGO_BY_KEY.get(_key(name), name)


def canonical_proto(name: str) -> str:
    """NCCL's LL, LL128, SIMPLE, Simple in commbench's spelling; unknown names unchanged."""
    return _PROTO_BY_KEY.get(_key(name), name)


_CANONICAL = {PROTO_VAR: canonical_proto, ALGO_VAR: canonical_algo}


def read_lines(path: Path) -> list[str]:
    """The log NCCL wrote to path; none if it wrote nothing (NCCL opens the file lazily)."""
    if not path.exists():
        return []
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


@dataclass(frozen=True)
class LoggedAllreduce:
    """One allreduce NCCL logged its choice for (comm rank 0 only): an algorithm and protocol
    (``-> Algo`` line) or a symmetric kernel (``[Symmetric]`` line, which has no Algo line).
    ``nranks`` comes from the call's COLL line in the same process, where the log has one."""

    message_bytes: int
    algorithm: str | None = None     # commbench's spelling
    protocol: str | None = None
    symmetric_kernel: str | None = None
    nranks: int | None = None

    @property
    def choice(self) -> str:
        """'Ring/LL' or 'symmetric AllReduce_AGxLL_R'."""
        if self.symmetric_kernel:
            return f"symmetric {self.symmetric_kernel}"
        return f"{self.algorithm}/{self.protocol}"


@dataclass(frozen=True)
class LoggedCall:
    """One allreduce call NCCL logged on entry (COLL, every rank; src/enqueue.cc ncclEnqueueCheck:
    ``AllReduce: opCount %lx sendbuff %p recvbuff %p count %zu datatype %d op %d root %d comm %p
    [nranks=%d] stream %p``), its size from count and datatype."""

    process: str                     # NCCL's "host:pid" prefix
    message_bytes: int | None        # None for a datatype this table does not know
    nranks: int


def _process(line: str) -> str:
    """NCCL's "host:pid" from its "host:pid:tid [dev] NCCL INFO" prefix (src/debug.cc)."""
    return ":".join(line.split(" ", 1)[0].split(":")[:2])


def logged_call(line: str) -> LoggedCall | None:
    match = _COLL_RE.search(line)
    if match is None:
        return None
    count, datatype, nranks = (int(g) for g in match.groups())
    size = DATATYPE_BYTES.get(datatype)
    return LoggedCall(_process(line), count * size if size is not None else None, nranks)


def logged_allreduces(lines: Iterable[str]) -> Iterator[LoggedAllreduce | LoggedCall]:
    """Every allreduce line of an INFO log in order: a LoggedCall per COLL line, a LoggedAllreduce
    per tuning or symmetric line, paired with the earliest unpaired call of that size in the same
    process for its nranks (NCCL logs the call on entry and its choice when it plans the launch)."""
    pending: dict[tuple[str, int | None], deque[int]] = defaultdict(lambda: deque(maxlen=PENDING_CALLS))
    for line in lines:
        if "NCCL INFO AllReduce" not in line:
            continue
        call = logged_call(line)
        if call is not None:
            pending[(call.process, call.message_bytes)].append(call.nranks)
            yield call
            continue
        tuning, symmetric = _TUNING_RE.search(line), _SYMMETRIC_RE.search(line)
        if tuning is None and symmetric is None:
            continue
        message_bytes = int((tuning or symmetric).group(1))  # type: ignore[union-attr]
        waiting = pending.get((_process(line), message_bytes))
        nranks = waiting.popleft() if waiting else None
        if tuning is not None:
            yield LoggedAllreduce(message_bytes, canonical_algo(tuning.group(2)), canonical_proto(tuning.group(3)),
                                  nranks=nranks)
        else:
            yield LoggedAllreduce(message_bytes, symmetric_kernel=symmetric.group(2), nranks=nranks)  # type: ignore[union-attr]


def _choices(lines: Iterable[str], message_bytes: int) -> list[LoggedAllreduce]:
    return [c for c in logged_allreduces(lines) if isinstance(c, LoggedAllreduce) and c.message_bytes == message_bytes]


def used_algo_proto(lines: list[str], message_bytes: int) -> tuple[str | None, str | None]:
    """The (algorithm, protocol) NCCL logged most often for allreduces of this size."""
    seen = Counter((c.algorithm, c.protocol) for c in _choices(lines, message_bytes) if c.algorithm)
    if not seen:
        return None, None
    return seen.most_common(1)[0][0]


def logged_choice(lines: list[str], message_bytes: int, log_file: Path) -> dict[str, Any]:
    """A row's view of NCCL's choice for this size: `observed` (NCCL_PROTO, NCCL_ALGO) as NCCL
    logged it, or `nccl_observed` saying that it logged no such line."""
    algo, proto = used_algo_proto(lines, message_bytes)
    if algo is None or proto is None:
        return {"nccl_observed": f"NCCL logged no 'AllReduce: {message_bytes} Bytes -> Algo' line ({log_file})"}
    return {"observed": {PROTO_VAR: proto, ALGO_VAR: algo}}


def env_settings(lines: list[str]) -> dict[str, str]:
    """Variables NCCL says it read: {"NCCL_PROTO": "LL", ...}. src/misc/param.cc's form ends
    in a period ("NCCL_NTHREADS set by environment to 256."), which is dropped."""
    found = {}
    for line in lines:
        match = _ENV_RE.search(line)
        if match:
            found[match.group(1)] = match.group(2).strip().removesuffix(".")
    return found


def enabled_for_allreduce(lines: list[str]) -> dict[str, frozenset[str]]:
    """What NCCL's last enabled matrix allows for AllReduce: {"NCCL_PROTO": {...}, "NCCL_ALGO":
    {...}}; empty without a matrix or when the row was cut short (NCCL's log lines are at most
    1023 bytes, and the matrix nearly fills one)."""
    starts = [i for i, line in enumerate(lines) if _MATRIX_START in line]
    if not starts:
        return {}
    header = _MATRIX_ROW_RE.match(lines[starts[-1] + 1]) if starts[-1] + 1 < len(lines) else None
    if header is None:
        return {}
    protos, algos = header.group(2).split(), header.group(3).split()
    for line in lines[starts[-1] + 2:]:
        row = _MATRIX_ROW_RE.match(line)
        if row is None:
            return {}
        if row.group(1) != "AllReduce":
            continue
        proto_flags, algo_flags = row.group(2).split(), row.group(3).split()
        if len(proto_flags) != len(protos) or len(algo_flags) != len(algos):
            return {}
        # 0 = disabled; LL128's 2 = "NCCL decides" (enabled where the topology allows it).
        return {PROTO_VAR: frozenset(canonical_proto(p) for p, f in zip(protos, proto_flags) if f != "0"),
                ALGO_VAR: frozenset(canonical_algo(a) for a, f in zip(algos, algo_flags) if f != "0")}
    return {}


@dataclass(frozen=True)
class InitEvidence:
    """What a communicator's init log says NCCL read from the environment."""

    env: dict[str, str] = field(default_factory=dict)
    enabled: dict[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def from_lines(cls, lines: list[str]) -> "InitEvidence":
        return cls(env_settings(lines), enabled_for_allreduce(lines))

    def took(self, variable: str, value: str) -> bool:
        """NCCL logged reading variable=value, or its AllReduce matrix allows only that value."""
        canonical = _CANONICAL[variable]
        said = self.env.get(variable)
        return ((said is not None and canonical(said) == canonical(value))
                or self.enabled.get(variable) == frozenset({canonical(value)}))


def setting_applied(requested: dict[str, str], used: dict[str, str], init: InitEvidence) -> str | None:
    """HONOURED / IGNORED / COINCIDED for the requested {"NCCL_PROTO": "LL", "NCCL_ALGO": ...}
    given what NCCL used (same keys); None when nothing was requested."""
    if not requested:
        return None
    if any(_CANONICAL[var](used[var]) != _CANONICAL[var](value) for var, value in requested.items()):
        return IGNORED
    if all(init.took(var, value) for var, value in requested.items()):
        return HONOURED
    return COINCIDED


def symmetric_kernel(lines: list[str], message_bytes: int) -> str | None:
    """The symmetric kernel NCCL logged most often for allreduces of this size, or None."""
    seen = Counter(c.symmetric_kernel for c in _choices(lines, message_bytes) if c.symmetric_kernel)
    return seen.most_common(1)[0][0] if seen else None


def symmetric_unsupported(lines: list[str]) -> str | None:
    """NCCL's own init line saying the communicator cannot use symmetric memory (2.29 on)."""
    for line in lines:
        at = line.find(_NO_SYMMETRIC_MARK)
        if at >= 0:
            return line[at:].strip()
    return None


def mapped_libnccls(maps_text: str) -> list[str]:
    """Every libnccl.so file mapped into a process, in map order, from its /proc/PID/maps text."""
    found: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _LIBNCCL_RE.search(fields[5]) and fields[5] not in found:
            found.append(fields[5])
    return found


def loaded_libnccl(maps_text: str) -> str | None:
    """Path of the libnccl.so mapped into a process, from its /proc/PID/maps text."""
    found = mapped_libnccls(maps_text)
    return found[0] if found else None


def version_text(code: int) -> str:
    """NCCL_VERSION_CODE as text: 22907 -> '2.29.7' (2.9 and later encode X*10000 + Y*100 + Z)."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


@dataclass(frozen=True)
class LoadedNccl:
    """The NCCL a process has mapped, as that library reports itself."""

    path: str | None                 # the first libnccl in /proc/self/maps
    version_code: int | None         # its ncclGetVersion
    others: tuple[str, ...] = ()     # further libnccl files mapped (a second NCCL in the process)
    error: str | None = None         # why the version is unknown

    @property
    def version(self) -> str | None:
        return version_text(self.version_code) if self.version_code is not None else None

    def row_extra(self) -> dict[str, Any]:
        """What every NCCL row records about the library its process ran."""
        extra: dict[str, Any] = {"nccl_version_loaded": self.version, "nccl_lib_loaded": self.path}
        if self.others:
            extra["nccl_libs_mapped"] = [self.path, *self.others]
        if self.error:
            extra["nccl_version_error"] = self.error
        return extra


def ask_version(library: Any) -> int:
    """ncclGetVersion through an open ctypes handle."""
    version = ctypes.c_int(0)
    result = library.ncclGetVersion(ctypes.byref(version))
    if result != 0:
        raise OSError(f"ncclGetVersion returned {result}")
    return version.value


def loaded_nccl(maps: Path = Path("/proc/self/maps")) -> LoadedNccl:
    """Ask the libnccl this process has mapped for its version (RTLD_NOLOAD: never a new one)."""
    try:
        found = mapped_libnccls(maps.read_text())
    except OSError as exc:
        return LoadedNccl(None, None, error=f"cannot read {maps}: {exc.strerror}")
    if not found:
        return LoadedNccl(None, None, error="no libnccl is mapped into this process")
    path, others = found[0], tuple(found[1:])
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return LoadedNccl(path, ask_version(library), others)
    except (OSError, AttributeError) as exc:
        return LoadedNccl(path, None, others, error=f"ncclGetVersion of {path} failed: {exc}")


@cache
def process_nccl() -> LoadedNccl:
    """This process's NCCL, asked once (a process maps its libnccl when torch's CUDA part loads)."""
    return loaded_nccl()


class NcclLogSwitch:
    """Turns the INFO log of the NCCL this process already loaded on and off.

    ``unavailable`` says in one line why it cannot (then on() refuses); nothing is observed then.
    """

    def __init__(self, library: Any, unavailable: str | None):
        self._library = library
        self.unavailable = unavailable

    @classmethod
    def find(cls, environ: Mapping[str, str] = os.environ,
             maps: Path = Path("/proc/self/maps")) -> "NcclLogSwitch":
        """The switch for this process; call it before any on(), so environ is the user's own."""
        users = [name for name in LOG_VARIABLES if name in environ]
        if users:
            return cls(None, f"{users[0]}={environ[users[0]]} was set before commbench started: "
                             "NCCL's log is left as set and nothing is observed")
        path = loaded_libnccl(maps.read_text())
        if path is None:
            return cls(None, "no libnccl is loaded in this process (torch without NCCL, e.g. a CPU build)")
        try:
            # RTLD_NOLOAD: the copy torch loaded, or nothing; never a second NCCL.
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError as exc:
            return cls(None, f"cannot open the loaded {path}: {exc}")
        return cls.for_library(library, path)

    @classmethod
    def for_library(cls, library: Any, path: str) -> "NcclLogSwitch":
        """The switch for an open libnccl, unavailable where that NCCL cannot be switched."""
        if not hasattr(library, "ncclResetDebugInit"):
            return cls(None, f"{path} has no ncclResetDebugInit (NCCL before 2.24): its log cannot be switched")
        version = ctypes.c_int(0)
        library.ncclGetVersion(ctypes.byref(version))
        if version.value < LOCKED_RESET_VERSION_CODE:
            return cls(None, f"NCCL {version_text(version.value)} resets its log without its lock "
                             f"(locked from {version_text(LOCKED_RESET_VERSION_CODE)}): not switched at run time")
        return cls(library, None)

    def on(self, log_file: Path) -> None:
        """NCCL logs INIT, ENV and TUNING lines into log_file (truncated) from now on."""
        if self.unavailable:
            raise RuntimeError(self.unavailable)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        os.environ.update(LOG_SETTINGS)
        # NCCL expands %h and %p in NCCL_DEBUG_FILE; '%%' keeps a literal '%' in the path.
        os.environ[LOG_FILE_VAR] = str(log_file).replace("%", "%%")
        self._reset()

    def off(self) -> None:
        """NCCL logs nothing again (NCCL_DEBUG unset)."""
        for name in LOG_VARIABLES:
            os.environ.pop(name, None)
        self._reset()

    @contextmanager
    def logging_to(self, log_file: Path) -> Iterator[None]:
        self.on(log_file)
        try:
            yield
        finally:
            self.off()

    def _reset(self) -> None:
        self._library.ncclResetDebugInit()
        # NCCL applies a reset at its next log call (src/debug.cc). An empty group logs through
        # TRACE_CALL, so the log file opens or closes now, not in the next (maybe timed)
        # collective. Its results go unchecked: were it to fail, the next log call still applies it.
        self._library.ncclGroupStart()
        self._library.ncclGroupEnd()


@cache
def process_switch() -> NcclLogSwitch:
    """This process's switch, found once: on first use, before any on()."""
    return NcclLogSwitch.find()
