"""The path model every engine shares: an engine's allreduce paths in the order it tries them,
each path's gate on a box, which path takes a message under a launch line, and what a launch
line must add for the path it names to take the sizes it claims. It knows no engine by name:
each engine's rules, gates and words are data in its own file (vllm.py, sglang.py), an `Engine`.

A path takes a message where it is on (by default, or turned on by the launch and not turned
off), its gate admits the size, and no path it yields to takes it too; the first such path in
the engine's order takes it. vLLM's and SGLang's own all_reduce functions are that order, and
`commbench engines --check` runs them on every combination of takers to prove it (gates.py).
No torch: the analysis reads it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

from commbench.engines.facts import FactSet
from commbench.ops import ALLREDUCE, FUSED_OP
from commbench.topology.box import Box
from commbench.units import DTYPE_BYTES

MiB = 1 << 20
GRAPH, EAGER = "graph", "eager"

# Path ids: the allreduce implementations an engine dispatches to. A backend says which one its
# rows price (Settings.engine_paths).
CUSTOM_AR = "custom_ar"                  # the engines' CUDA-IPC custom allreduce
NCCL_PATH = "nccl"                       # PyNccl: NCCL's own kernels
TORCH_SYMM_MEM = "torch_symm_mem"        # torch symmetric-memory one/two-shot or multimem
NCCL_SYMM = "nccl_symm"                  # NCCL symmetric-memory kernels on registered windows
FLASHINFER_AR = "flashinfer_ar"          # FlashInfer trtllm/mnnvl allreduce
FLASHINFER_PCIE_IPC = "flashinfer_pcie_ipc"
FLASHINFER_FUSED = "flashinfer_fused"    # FlashInfer allreduce + residual + RMSNorm, one kernel
MSCCLPP = "mscclpp"


@dataclass(frozen=True)
class Switch:
    """What a launch line carries to turn something on or off: engine variables and flags (a flag
    with its value is two items, matched side by side)."""

    env: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()

    def words(self) -> tuple[str, ...]:
        """The switch as a launch line's tokens: its variables as NAME=VALUE, then its flags."""
        return (*(f"{k}={v}" for k, v in self.env), *self.flags)

    def text(self) -> str:
        return shlex.join(self.words())


def env(name: str, value: str) -> Switch:
    return Switch(env=((name, value),))


def flags(*items: str) -> Switch:
    return Switch(flags=items)


@dataclass(frozen=True)
class Launch:
    """An engine's launch line as the path model reads it: its variables and its flags."""

    env: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()

    @classmethod
    def of(cls, env_: dict[str, str], flags_: list[str] | tuple[str, ...]) -> Launch:
        return cls(tuple(sorted(env_.items())), tuple(flags_))

    def has(self, switch: Switch | None) -> bool:
        if switch is None:
            return False
        env_ = dict(self.env)
        if any(env_.get(k) != v for k, v in switch.env):
            return False
        n = len(switch.flags)
        return n == 0 or any(self.flags[i:i + n] == switch.flags for i in range(len(self.flags) - n + 1))

    def plus(self, switch: Switch) -> Launch:
        env_ = {**dict(self.env), **dict(switch.env)}
        return Launch(tuple(sorted(env_.items())), self.flags + (() if self.has(Switch(flags=switch.flags))
                                                                 else switch.flags))


@dataclass(frozen=True)
class PathRule:
    """One path of one engine, in the order the engine tries them for a call."""

    path: str
    title: str
    op: str
    default_on: bool        # taken without any setting, for every model, where its gate admits it
    turn_on: str            # in words: what selects it (opt-in) or keeps it (default)
    turn_off: str           # in words: what moves decode allreduces off it
    facts: tuple[str, ...]  # the engine facts its gate and limits rest on
    on: Switch | None = None     # the launch line's switch that turns it on (None: default or nothing)
    off: Switch | None = None    # the switch that turns it off (None: nothing does; the fallback)
    yields_to: tuple[str, ...] = ()   # later paths that take a message ahead of it where they take it
    graphs_only: bool = False         # runs only inside CUDA graphs


class Gate(NamedTuple):
    """A path's gate on one box: can it run, why (not), up to which size."""

    available: bool | None
    why: str
    cap: int | None = None
    inclusive: bool = True
    default: bool | None = None          # this model's default where it differs by model
    skipped: tuple[int, int] | None = None
    own_kernel: bool = True
    # (path, cap): the cap where that path is not on (vLLM's custom allreduce keeps 8 MiB with
    # torch symmetric memory off, and a smaller table cap with it on)
    cap_alone: tuple[str, int] | None = None


@dataclass(frozen=True)
class Workload:
    """What the engines' model-dependent rules read: the model's architecture (config.json
    architectures[0]; None: not given), hidden size (None: unknown), the timing mode, the
    activation dtype and whether the server runs its deterministic mode."""

    arch: str | None = None
    hidden: int | None = None
    mode: str = GRAPH
    dtype: str = "bf16"
    deterministic: bool = False


@dataclass(frozen=True)
class InertSetting:
    """A setting that changes nothing on a box, why, the rule's source and the paths it leaves off."""

    setting: str
    why: str
    source: str
    paths: tuple[tuple[str, str], ...] = ()     # the (engine, path id) pairs it leaves off

    def _asdict(self) -> dict[str, Any]:
        return {"setting": self.setting, "why": self.why, "source": self.source, "paths": self.paths}


@dataclass(frozen=True)
class Words:
    """How an engine names what commbench tells users: its launch command, its eager switch, its
    deterministic mode and the variable its PyNccl reads for the NCCL library."""

    command: str                 # "vllm serve MODEL --tensor-parallel-size {tp}"
    eager: str                   # the flag that runs decode without CUDA graphs
    deterministic: str           # the setting of its deterministic / batch-invariant mode
    nccl_so_var: str


@dataclass(frozen=True)
class GateProbe:
    """One of an engine's gates (or its dispatch order) as a Python function of its own: commbench's
    answer and the engine's over a grid of points. `theirs` runs in a child process with the
    engine's modules imported from its wheel (gates.py): given `load(module)` and torch, it returns
    the engine's answer per point, stubbing in the check's code only what the import needs."""

    key: str
    file: str                    # the engine file that defines the function
    function: str                # Class.method or function
    meaning: str
    points: Callable[[], list[dict[str, Any]]]
    ours: Callable[[dict[str, Any], FactSet], Any]
    theirs: Callable[[Callable[[str], Any], Any], Callable[[dict[str, Any]], Any]]
    modules: tuple[str, ...]     # the engine modules loaded from the wheel; every other one is a stub
    absent: tuple[str, ...] = ()  # third-party packages the import names that are stubbed too


@dataclass(frozen=True)
class Engine:
    """One engine release, whole: its facts, its paths in dispatch order with their gates, its
    words, its start-up log's names, its prefill default and the settings that do nothing on a box.
    Built by its own file (vllm.py, sglang.py); everything shared reads only this."""

    key: str                     # "vllm"
    name: str                    # "vLLM"
    facts: FactSet               # built in
    checked: tuple[str, ...]     # releases whose source gives every fact
    rules: tuple[PathRule, ...]  # dispatch order
    gate: Callable[[PathRule, Box, FactSet, Workload], Gate]
    words: Words
    prefill: Callable[[Box, FactSet], tuple[int, str]]     # the chunked-prefill default on a box
    inert: Callable[[Box, FactSet], list[InertSetting]]
    # Its start-up log's chain: a pattern whose groups are the quoted names and the group, the
    # words that name the line, and the names -> path ids ("": it logs none).
    log_line: str = ""
    log_said: str = ""
    log_names: dict[str, str] = field(default_factory=dict)
    probes: tuple[GateProbe, ...] = ()   # its gates and order, compared with its own code (gates.py)

    def rule(self, path: str) -> PathRule:
        return next(r for r in self.rules if r.path == path)


@dataclass(frozen=True)
class PathState:
    """One engine path on one box: can it run, why (not), and up to which size the engine sends it."""

    rule: PathRule
    available: bool | None      # None: this box cannot tell (ranks share a GPU, an import)
    why: str
    max_bytes: int | None = None    # the engine routes a message here only up to this size
    inclusive: bool = False         # max_bytes itself included or not
    # False: the engine runs another kernel on this path here than the one its own-kernel backend
    # measures (SGLang's legacy custom allreduce where its v2 gate fails): such rows stand in.
    own_kernel: bool = True
    on_by_default: bool | None = None   # None: the rule's default; else this model's
    skipped: tuple[int, int] | None = None   # sizes strictly between these go elsewhere
    source: str = ""                # the engine version and files its rule was read from
    cap_alone: tuple[str, int] | None = None

    @property
    def path(self) -> str:
        return self.rule.path

    @property
    def default_on(self) -> bool:
        return self.rule.default_on if self.on_by_default is None else self.on_by_default

    def admits(self, message_bytes: int, on: frozenset[str] | set[str] | None = None) -> bool:
        """Whether the gate takes this size; `on`: the paths on under the launch (a cap that
        depends on another path uses it; None: the default launch)."""
        if self.skipped and self.skipped[0] < message_bytes < self.skipped[1]:
            return False
        cap = self.max_bytes
        if self.cap_alone is not None and on is not None and self.cap_alone[0] not in on:
            cap = self.cap_alone[1]
        if cap is None:
            return True
        return message_bytes <= cap if self.inclusive else message_bytes < cap


def size_text(n_bytes: int | float) -> str:
    n = int(n_bytes)
    if n >= MiB and n % MiB == 0:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} bytes"


def rule_source(rule: PathRule, f: FactSet) -> str:
    """'vLLM 0.34.0 (built in): all_reduce_utils.py:31, envs.py' — where the path's rule comes from."""
    files: list[str] = []
    for key in rule.facts:
        fact = f.fact(key)
        name = "/".join(fact.file.split("/")[-2:]) + (f":{fact.line}" if fact.line else "")
        if name not in files:
            files.append(name)
    return f"{f.name} {f.version} ({'built in' if f.origin == 'built in' else f.origin}): {', '.join(files)}"


SHARED = "ranks share one GPU in this run (an emulation): the engine's gate on the fabric cannot be read"
FROM_IMPORT = ("cannot tell from an nccl-tests import without a probe snapshot (its log has no NVLink, P2P, "
               "multicast or compute capability)")


def state(engine: Engine, rule: PathRule, box: Box, facts: FactSet, workload: Workload) -> PathState:
    src = rule_source(rule, facts)
    if not box.has_gpus:
        return PathState(rule, False, "no CUDA GPU in this run's snapshot", source=src)
    if box.world_size < 2:
        return PathState(rule, False, f"world size {box.world_size}: nothing to all-reduce", source=src)
    if rule.on is None and rule.off is None:
        return PathState(rule, True, "always available: the fallback for every message no path above takes",
                         source=src)
    g = engine.gate(rule, box, facts, workload)
    return PathState(rule, g.available, g.why, g.cap, g.inclusive, g.own_kernel, g.default, g.skipped, src,
                     g.cap_alone)


def states(engine: Engine, box: Box, workload: Workload, facts: FactSet | None = None,
           logged: tuple[str, ...] | None = None) -> list[PathState]:
    """Every path of `engine` on this box, in the engine's dispatch order. A path one of the
    engine's inert settings leaves off here is off with that rule's reason, whatever its gate says:
    the two never disagree in one output. `logged`: the paths the engine's own start-up log says
    it set up (log.py), which then decide what is on."""
    f = facts or engine.facts
    inert = engine.inert(box, f) if box.fabric_known else []
    out = []
    for rule in engine.rules:
        current = state(engine, rule, box, f, workload)
        off = next((r for r in inert if (engine.key, rule.path) in r.paths), None)
        if off is not None and current.available is not False:
            current = replace(current, available=False, why=f"{off.why} ({off.source})")
        if logged is not None and rule.op == ALLREDUCE:
            current = _as_logged(current, logged)
        out.append(current)
    return out


def _as_logged(s: PathState, logged: tuple[str, ...]) -> PathState:
    if s.path in logged:
        return replace(s, available=True, why=f"set up by the engine (its start-up log); {s.why}")
    return replace(s, available=False, why="not set up by the engine: its start-up log does not list it")


# --- which path takes a message under a launch line ------------------------------------------

def enabled(found: list[PathState], launch: Launch) -> frozenset[str]:
    """The paths on under `launch`: on by default (for this model) unless its switch turns it
    off, or turned on by its switch; a path whose gate is off is never on."""
    on = set()
    for s in found:
        if s.available is False or launch.has(s.rule.off):
            continue
        if s.default_on or launch.has(s.rule.on):
            on.add(s.path)
    return frozenset(on)


@dataclass(frozen=True)
class Default:
    """The path an engine takes for one message size under one launch line."""

    path: PathState | None     # None: cannot be told (a path ahead of it is on and its gate unknown)
    why: str


def takes(s: PathState, op: str) -> bool:
    """A fused allreduce+RMSNorm path takes a decode allreduce too: the engine replaces the call."""
    return s.rule.op == op or (op == ALLREDUCE and s.rule.op == FUSED_OP)


def pick(rules: list[PathRule] | tuple[PathRule, ...], admitting: set[str] | frozenset[str]) -> str | None:
    """The engine's dispatch order alone: of the paths that would take a message (on, and their
    gate admits it), the first in order that yields to none of the others. `engines --check` runs
    the engine's own all_reduce on every such set and compares its choice with this one."""
    for rule in rules:
        if rule.path in admitting and not any(y in admitting for y in rule.yields_to):
            return rule.path
    return None


def first_taker(found: list[PathState], launch: Launch, message_bytes: int, op: str = ALLREDUCE) -> PathState | None:
    """The path the engine's order picks for this size under `launch`; a path on whose gate cannot
    be read here counts as taking it."""
    on = enabled(found, launch)
    admitting = {s.path for s in found if s.path in on and takes(s, op)
                 and (s.available is None or s.admits(message_bytes, on))}
    chosen = pick([s.rule for s in found], admitting)
    return next((s for s in found if s.path == chosen), None)


def taker(found: list[PathState], launch: Launch, message_bytes: int, op: str = ALLREDUCE) -> Default:
    """The path that takes this size under `launch`; where a path whose gate cannot be read here
    would take it, the taker cannot be told."""
    s = first_taker(found, launch, message_bytes, op)
    if s is None:
        return Default(None, "no path that is on runs here")
    if s.available is None:
        return Default(None, f"{s.rule.title} is on and {s.why}")
    return Default(s, s.why)


def default_path(found: list[PathState], message_bytes: int, op: str = ALLREDUCE) -> Default:
    """The path the engine takes for this size with no setting changed."""
    return taker(found, Launch(), message_bytes, op)


@dataclass(frozen=True)
class Move:
    """A launch line for one path: the settings as given plus what turns off each path ahead of it
    that would take the sizes it claims; the sizes it then takes, or why no line can move them."""

    launch: Launch
    added: tuple[Switch, ...]       # the switches added to the settings as given
    sizes: tuple[int, ...]          # of the sizes asked, those the path takes under `launch`
    why_not: str = ""               # non-empty: no launch line moves these sizes to the path


def move(found: list[PathState], path: str, launch: Launch, sizes: list[int] | tuple[int, ...]) -> Move:
    """What `launch` must add for `path` to take every size of `sizes` its gate admits: each
    path ahead of it in the engine's order that takes one of them (or may: its gate unknown here),
    turned off (a path with no switch to turn it off, or one the settings themselves turn on,
    leaves the move impossible)."""
    target = next(s for s in found if s.path == path)
    if target.available is None:
        return Move(launch, (), (), f"whether {target.rule.title} runs here cannot be told ({target.why})")
    op = target.rule.op
    added: list[Switch] = []
    for _ in range(len(found)):
        on = enabled(found, launch)
        if path not in on:
            why = target.why if target.available is False else "the settings do not turn it on"
            return Move(launch, tuple(added), (), f"{target.rule.title}: {why}")
        ahead = [t for t in (first_taker(found, launch, s, op) for s in sizes if target.admits(s, on))
                 if t is not None and t is not target]
        if not ahead:
            break
        blocker = ahead[0]
        if blocker.rule.off is None or launch.has(blocker.rule.on):
            return Move(launch, tuple(added), (), f"{blocker.rule.title} takes these sizes first and nothing "
                                                  "turns it off")
        launch = launch.plus(blocker.rule.off)
        added.append(blocker.rule.off)
    taken = tuple(s for s in sizes if taker(found, launch, s, op).path is target)
    return Move(launch, tuple(added), taken, "" if taken or not sizes else
                f"{target.rule.title} takes none of these sizes here")


def status(p: PathState) -> str:
    if p.available is None:
        return "cannot tell here"
    if not p.available:
        return "off"
    return "on" if p.default_on else "opt-in"


def bytes_per(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 2)
