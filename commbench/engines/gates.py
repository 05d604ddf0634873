"""An engine's gates and dispatch order, checked against its own code: each GateProbe of an engine
(vllm.py, sglang.py) names a Python function of the engine's release; a child process imports that
function from the unpacked wheel (its module's source read through facts.SourceTree, every other
engine module and the third-party packages it names replaced by inert stubs, in this file, never in
the engine's), calls it over the probe's grid (meta tensors where it asks for a tensor) and prints
the answers; this process sets them beside commbench's own and names every point that differs.

The child is the only place commbench runs engine code: it is a separate process (its stubs and
torch never reach the analysis), run only by `engines --check`, and bounded: each gate function
has `gate_probe_s` (waits.py) for its grid, what the engine's code prints goes to the child's
stderr, of which only the end is kept, and its answers come on a channel of their own, bounded in
bytes and checked line by line. A function that hangs, exits, floods that channel or raises at
every point is named with its file:line, and the functions after it run in a new child.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from commbench.engines.facts import SourceTree, def_line
from commbench.engines.paths import Engine, GateProbe
from commbench.results.text import capped
from commbench.waits import waits

# `python -c` puts the folder it was started in first on sys.path: dropped before any import, so a
# torch.py or commbench/ there is never imported (-P, which does this, needs Python 3.11).
CHILD = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
         "from commbench.engines.gate_child import main; sys.exit(main(sys.argv[1:]))")
CHILD_START_S = 120          # the child's start (torch imported) runs no engine code
MAX_ANSWER_BYTES = 4 << 20   # what a child says on its answers channel (every probe's answers: about 20 KB)
STDERR_KEPT = 4096           # the end of what the child printed: its last line says why it stopped
MAX_ANSWER_TEXT = 200        # an engine function's answer that is text
SHOWN_PER_PROBE = 4          # differing points printed per probe (the count says how many in all)


# --- the child: the engine's functions, imported from its wheel ------------------------------

class Decorated:
    """What a stub returns when called on one function or class: as a bare decorator's result it
    calls that function; as a decorator factory's result, applied to another, it returns that one."""

    def __init__(self, target: Any):
        self._target = target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type)):
            return args[0]
        return self._target(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._target, attr)


class Stub:
    """Whatever an import takes from a module the check does not load: attributes, calls, items
    and base classes are stubs too; a stub called on one function is that function (Decorated)."""

    def __init__(self, name: str = "stub"):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], (types.FunctionType, type)):
            return Decorated(args[0])
        return Stub(f"{self._name}()")

    def __getitem__(self, key: Any) -> Any:
        return Stub(f"{self._name}[]")

    def __iter__(self) -> Any:
        return iter(())

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __or__(self, other: Any) -> Any:
        return self

    __ror__ = __or__

    def __bool__(self) -> bool:
        return False


class StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self.__name__}.{attr}")


class WheelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports under the engine's package: the probe's modules from the wheel's source (through
    SourceTree), every other one a StubModule; the `absent` third-party packages are stubs too."""

    def __init__(self, tree: SourceTree, package: str, real: tuple[str, ...], absent: tuple[str, ...]):
        self.tree, self.package, self.real, self.absent = tree, package, set(real), set(absent)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        top = name.split(".")[0]
        if top != self.package and top not in self.absent:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=name not in self.real)

    def create_module(self, spec: Any) -> Any:
        return None if spec.name in self.real else StubModule(spec.name)

    def exec_module(self, module: Any) -> None:
        name = module.__name__
        if name not in self.real:
            module.__path__ = []
            return
        file = name.replace(".", "/") + ".py"
        module.__file__ = str(self.tree.root / file)
        exec(compile(self.tree.text(file), module.__file__, "exec"), module.__dict__)  # noqa: S102 - the check's job


def _forget(package: str, absent: tuple[str, ...]) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in (package, *absent)]:
        del sys.modules[name]


def _answer(value: Any) -> Any:
    """An answer as JSON carries it: None, True/False, a number (a plain one: an int subclass or
    one of thousands of digits would not encode), or text of at most MAX_ANSWER_TEXT."""
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, int):
        return int(value) if value.bit_length() <= 64 else f"a {value.bit_length()}-bit number"
    if isinstance(value, float):
        return float(value)
    return (str.__str__(value) if isinstance(value, str) else repr(value))[:MAX_ANSWER_TEXT]


def _said(exc: BaseException) -> str:
    try:
        text = str(exc)[:300]
    except Exception:   # an exception whose str() raises says its type
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run_probe(tree: SourceTree, package: str, probe: GateProbe, torch: Any) -> dict[str, Any]:
    """The engine's answers over the probe's grid, or why there are none."""
    finder = WheelFinder(tree, package, probe.modules, probe.absent)
    sys.meta_path.insert(0, finder)
    try:
        ask = probe.theirs(importlib.import_module, torch)
        answers = []
        for point in probe.points():
            try:
                answers.append(_answer(ask(point)))
            except Exception as exc:   # the engine's function refused the point: its answer
                answers.append(f"raises {type(exc).__name__}"[:MAX_ANSWER_TEXT])
        return {"answers": answers}
    except BaseException as exc:   # an import the stubs do not carry, a renamed function, sys.exit(): no answers
        return {"error": _said(exc)}
    finally:
        sys.meta_path.remove(finder)
        _forget(package, probe.absent)


# --- this process: commbench's answers beside the engine's -----------------------------------

@dataclass(frozen=True)
class GateChecked:
    """One probe: how many points were compared and the ones that differ, each with file:line."""

    key: str
    function: str
    where: str                      # file:line of the engine's function
    compared: int
    differences: tuple[str, ...]    # "point: built in X; engine Y" for the first few
    differ: int                     # points that differ (or 1 where the probe could not run)


def _run_child(root: Path, engine: Engine, keys: list[str]) -> dict[str, dict[str, Any]]:
    """Each probe's answers ({"answers": [...]}) or why there are none ({"error": ...}), by key:
    the probes run one after another in a child; where one stops the child (it hangs past
    gate_probe_s, exits, floods its answers), it is named and the ones after it run in a new one."""
    found: dict[str, dict[str, Any]] = {}
    todo = list(keys)
    while todo:
        answered, stopped, why = talk([sys.executable, "-c", CHILD, str(root), engine.key, *todo], todo,
                                      waits().gate_probe_s)
        found.update(answered)
        if stopped is None:     # it stopped before a probe began, or answered every one
            found.update({key: {"error": why or "no answers"} for key in todo if key not in found})
            break
        found[stopped] = {"error": why}
        todo = todo[todo.index(stopped) + 1:]
    return found


def talk(argv: list[str], keys: list[str], probe_s: float,
         start_s: float = CHILD_START_S) -> tuple[dict[str, dict[str, Any]], str | None, str | None]:
    """Run a gate child and read what it says: each probe's "start" and answers, one JSON line
    each. Returns the answers by key, the probe that was running when it stopped (None where none
    was), and why it stopped early (None where it answered every probe). Bounded in time (start_s to
    start, probe_s per probe) and in memory (MAX_ANSWER_BYTES of answers, the end of stderr)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)    # its own group: the kill reaches what it started
    assert proc.stdout is not None and proc.stderr is not None
    answers: dict[str, dict[str, Any]] = {}
    running: str | None = None
    why: str | None = None
    said, tail, pending, limit = 0, b"", b"", start_s
    deadline = time.monotonic() + start_s
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            selector.register(proc.stderr, selectors.EVENT_READ)
            while why is None and selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    why = (f"gave no answer in {limit:g} s: the check ended it" if running else
                           f"the gate check did not start in {limit:g} s")
                    break
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                    elif key.fileobj is proc.stderr:
                        tail = (tail + chunk)[-STDERR_KEPT:]
                    else:
                        said += len(chunk)
                        if said > MAX_ANSWER_BYTES:
                            why = (f"printed more than {MAX_ANSWER_BYTES >> 20} MiB where the check reads its "
                                   "answers: the check ended it")
                            break
                        *lines, pending = (pending + chunk).split(b"\n")
                        for line in lines:
                            message = _message(line, keys)
                            if message is None:
                                why = ("printed something other than its answers where the check reads them: "
                                       "the check ended it")
                                break
                            if "start" in message:
                                running, limit = message["start"], probe_s
                                deadline = time.monotonic() + probe_s
                            elif "key" in message:
                                answers[message["key"]] = {k: v for k, v in message.items() if k != "key"}
                                running = None
                            else:
                                why = message["error"]
                                break
                        if why is not None:
                            break
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        status = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    if why is None and (running is not None or len(answers) < len(keys)):
        last = (tail.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
        ended = f"ended with exit status {status}" if status >= 0 else f"was killed by {_signal_name(-status)}"
        why = (f"the check's process {ended} before it answered" if running else f"the gate check {ended}") + \
            (f": {capped(last, 120)}" if last else "")
    return answers, running, why


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _message(line: bytes, keys: list[str]) -> dict[str, Any] | None:
    """One line of a gate child, checked: {"start": key}, {"key": key, "answers": [scalars]},
    {"key": key, "error": text} or {"error": text} (texts cleaned); None for anything else."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    if set(data) == {"start"} and data["start"] in keys:
        return data
    error = data.get("error")
    if isinstance(error, str) and set(data) <= {"key", "error"} and data.get("key", keys[0]) in keys:
        return {**data, "error": capped(error, 300)}
    answers = data.get("answers")
    if set(data) == {"key", "answers"} and data["key"] in keys and isinstance(answers, list) \
            and all(a is None or isinstance(a, (bool, int, float)) or (isinstance(a, str) and len(a) <= MAX_ANSWER_TEXT)
                    for a in answers):
        return data
    return None


def _point_text(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def check(root: Path, engine: Engine, facts: Any,
          run: Callable[[Path, Engine, list[str]], dict[str, dict[str, Any]]] = _run_child) -> list[GateChecked]:
    """Every probe of `engine` against the release under `root` (no child where none of the
    probes' files is there). Each probe's file is read first (SourceTree): one that is bad input
    is refused before any engine code runs."""
    tree = SourceTree(root)
    where = {}
    for probe in engine.probes:
        line = def_line(tree, probe.file, probe.function)
        where[probe.key] = f"{probe.file}:{line}" if line else probe.file
    present = [p for p in engine.probes if (root / p.file).is_file()]
    found = run(root, engine, [p.key for p in present]) if present else {}
    out = []
    for probe in engine.probes:
        def unanswered(why: str) -> GateChecked:
            return GateChecked(probe.key, probe.function, where[probe.key], 0,
                               (f"{probe.function} cannot be compared ({why})",), 1)
        if probe not in present:
            out.append(unanswered(f"{probe.file} is not in this release"))
            continue
        entry = found.get(probe.key, {})
        points = probe.points()
        if "answers" not in entry or len(entry["answers"]) != len(points):
            out.append(unanswered(entry.get("error") or "no answers"))
            continue
        raised = set(entry["answers"])
        if len(raised) == 1 and str(next(iter(raised))).startswith("raises "):
            out.append(unanswered(f"it {next(iter(raised))} at each of the {len(points)} points"))
            continue
        differ = []
        for point, theirs in zip(points, entry["answers"]):
            ours = _answer(probe.ours(point, facts))
            if ours != theirs:
                differ.append(f"{_point_text(point)}: built in {ours!r}; {engine.name} {theirs!r}")
        out.append(GateChecked(probe.key, probe.function, where[probe.key], len(points),
                               tuple(differ[:SHOWN_PER_PROBE]), len(differ)))
    return out
