"""An engine's gates and dispatch order, checked against its own code: each GateProbe of an engine
(vllm.py, sglang.py) names a Python function of the engine's release; a child process imports that
function from the unpacked wheel (its module's source read through facts.SourceTree, every other
engine module and the third-party packages it names replaced by inert stubs, in this file, never in
the engine's), calls it over the probe's grid (meta tensors where it asks for a tensor) and prints
the answers; this process sets them beside commbench's own and names every point that differs.

The child is the only place commbench runs engine code: it is a separate process (its stubs and
torch never reach the analysis), bounded in time and output, and run only by `engines --check`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from commbench.engines.facts import SourceTree, def_line
from commbench.engines.paths import Engine, GateProbe

CHILD_TIMEOUT_S = 300
CHILD = "import sys; from commbench.engines.gate_child import main; sys.exit(main(sys.argv[1:]))"
MAX_CHILD_OUTPUT = 16 << 20
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
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


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
                answers.append(f"raises {type(exc).__name__}")
        return {"answers": answers}
    except Exception as exc:   # an import the stubs do not carry, a renamed function: no answers
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
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


def _run_child(root: Path, engine: Engine) -> dict[str, Any]:
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(root), engine.key],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the gate check did not finish in {CHILD_TIMEOUT_S} s"}
    last = (done.stdout[-MAX_CHILD_OUTPUT:].strip().splitlines() or [""])[-1]
    try:
        found = json.loads(last)
    except json.JSONDecodeError:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"error": f"the gate check stopped (exit {done.returncode}): {tail}"}
    return found if isinstance(found, dict) else {"error": "the gate check printed no answers"}


def _point_text(point: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def check(root: Path, engine: Engine, facts: Any, run: Callable[[Path, Engine], dict[str, Any]] = _run_child
          ) -> list[GateChecked]:
    """Every probe of `engine` against the release under `root` (no child where none of the
    probes' files is there)."""
    present = [p for p in engine.probes if (root / p.file).is_file()]
    found = run(root, engine) if present else {}
    tree = SourceTree(root)
    out = []
    for probe in engine.probes:
        line = def_line(tree, probe.file, probe.function)
        where = f"{probe.file}:{line}" if line else probe.file
        if probe not in present:
            out.append(GateChecked(probe.key, probe.function, where, 0,
                                   (f"{probe.function} cannot be compared ({probe.file} is not in this release)",), 1))
            continue
        entry = found.get(probe.key) if "error" not in found else found
        points = probe.points()
        if not isinstance(entry, dict) or "answers" not in entry or len(entry["answers"]) != len(points):
            why = entry.get("error") if isinstance(entry, dict) and entry.get("error") else "no answers"
            out.append(GateChecked(probe.key, probe.function, where, 0,
                                   (f"{probe.function} cannot be compared ({why})",), 1))
            continue
        differ = []
        for point, theirs in zip(points, entry["answers"]):
            ours = _answer(probe.ours(point, facts))
            if ours != theirs:
                differ.append(f"{_point_text(point)}: built in {ours!r}; {engine.name} {theirs!r}")
        out.append(GateChecked(probe.key, probe.function, where, len(points), tuple(differ[:SHOWN_PER_PROBE]),
                               len(differ)))
    return out

