"""Engine facts as data: each one a value with its provenance (engine, version, the source file
and the symbol, env var, text or kernel names it is read from), and the reader that takes the
same value out of an engine's released files with `ast` (or, for kernel names, a bounded scan
of the kernel source or library), never importing the engine (no torch here).

An engine module (vllm.py, sglang.py) lists its facts built in; `read()` reads them again from
an installed engine or an unpacked wheel and says where the two differ. `SourceTree` is the one
reader of an engine's files (the gate check imports through it too). Source files are untrusted
input: a file or symbol that is missing, or a value the reader cannot evaluate, is a difference
with its reason, never an exception.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

# How a fact is found in its file.
LITERAL = "literal"      # NAME, Class.NAME or function.NAME assigned a literal (constants and arithmetic on them)
PARAM = "param"          # Class.method.param: a parameter's default value
ENV = "env"              # an environment variable's default: os.getenv("NAME", default) or NAME = EnvBool(default)
RETURNS = "returns"      # Class.method: the string constants it returns, in order
TEXT = "text"            # the file contains this text (value True): behaviour no table states
KERNELS = "kernels"      # the distinct names a regex (one group) finds in a kernel source or library, sorted

MAX_SOURCE_BYTES = 4 << 20     # a source file larger than this is not an engine module
MAX_LIBRARY_BYTES = 512 << 20  # a compiled library scanned for kernel names, read in chunks
SCAN_CHUNK = 8 << 20


@dataclass(frozen=True)
class Fact:
    """One engine fact: `value` as the built-in data has it, where it comes from, and why it matters."""

    key: str
    value: Any
    file: str                # relative to the package's parent folder: vllm/envs.py
    symbol: str              # what `kind` looks for in that file
    kind: str = LITERAL
    meaning: str = ""
    line: int | None = None  # where the value was read (set by read(); None for built-in facts)
    since: str = ""          # the first release that has it: an older one reads as `absent`
    absent: Any = None       # the value where the release predates the fact

    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass(frozen=True)
class FactSet:
    """Every fact of one engine version, and where they were taken from."""

    engine: str              # "vllm" / "sglang"
    name: str                # "vLLM" / "SGLang"
    version: str
    facts: tuple[Fact, ...]
    origin: str = "built in"     # "built in" or "read from PATH"
    warnings: tuple[str, ...] = ()

    def fact(self, key: str) -> Fact:
        for f in self.facts:
            if f.key == key:
                return f
        raise KeyError(key)

    def value(self, key: str) -> Any:
        return self.fact(key).value

    def source(self, key: str) -> str:
        """'vLLM 0.34.0, all_reduce_utils.py:31' for an output that explains a path."""
        f = self.fact(key)
        return f"{self.name} {self.version}, {Path(f.file).name}" + (f":{f.line}" if f.line else "")

    @property
    def said(self) -> str:
        """How an output names where these facts come from."""
        if self.origin == "built in":
            return f"{self.name} {self.version} facts built in"
        return f"{self.name} {self.version} facts {self.origin}"


# --- a small, safe evaluator for literals in engine source ----------------------------------

class Unreadable(ValueError):
    """The reader cannot take a value out of this source."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv, ast.LShift: operator.lshift, ast.Pow: operator.pow}
_CONTAINERS = {"frozenset": frozenset, "set": set, "tuple": tuple, "list": list}
# The engines' typed env wrappers (SGLang environ.py): the first argument is the default.
_ENV_WRAPPERS = {"EnvBool", "EnvInt", "EnvStr", "EnvFloat"}


def evaluate(node: ast.AST, names: dict[str, Any]) -> Any:
    """A literal of constants, containers and arithmetic, with names bound at module level."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [evaluate(e, names) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise Unreadable("a dict with ** unpacking")
        return {evaluate(k, names): evaluate(v, names) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = evaluate(node.left, names), evaluate(node.right, names)
        if not all(isinstance(v, (int, float)) for v in (left, right)) or (isinstance(node.op, ast.Pow) and right > 64):
            raise Unreadable("arithmetic on something that is not a number")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = evaluate(node.operand, names)
        if not isinstance(value, (int, float)):
            raise Unreadable("a negated non-number")
        return -value
    if isinstance(node, ast.Name):
        if node.id in names:
            return names[node.id]
        raise Unreadable(f"name {node.id} is not a module-level constant")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in _CONTAINERS and len(node.args) <= 1 and not node.keywords:
            return _CONTAINERS[node.func.id](evaluate(node.args[0], names) if node.args else ())
        if node.func.id in _ENV_WRAPPERS and node.args:
            return evaluate(node.args[0], names)
    raise Unreadable(f"{type(node).__name__} is not a literal")


def _module_names(tree: ast.Module) -> dict[str, Any]:
    """Module-level NAME = literal bindings (MiB = 1024 * 1024), in order."""
    names: dict[str, Any] = {}
    for node in tree.body:
        target = _single_target(node)
        if target is not None and isinstance(target, ast.Name) and node.value is not None:  # type: ignore[union-attr]
            try:
                names[target.id] = evaluate(node.value, names)  # type: ignore[union-attr]
            except Unreadable:
                pass
    return names


def _single_target(node: ast.AST) -> ast.expr | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        return node.targets[0]
    if isinstance(node, ast.AnnAssign):
        return node.target
    return None


def _scope(tree: ast.Module, path: list[str]) -> ast.AST:
    """The class or function a dotted symbol names (Class.method)."""
    scope: ast.AST = tree
    for part in path:
        found = next((n for n in ast.walk(scope) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.name == part), None)
        if found is None:
            raise Unreadable(f"no class or function {part}")
        scope = found
    return scope


def _literal(tree: ast.Module, symbol: str, names: dict[str, Any]) -> tuple[Any, int]:
    *path, name = symbol.split(".")
    scope = _scope(tree, path)
    for node in ast.walk(scope):
        target = _single_target(node)
        if isinstance(target, ast.Name) and target.id == name and getattr(node, "value", None) is not None:
            return evaluate(node.value, names), node.lineno  # type: ignore[attr-defined]
    raise Unreadable(f"no assignment to {symbol}")


def _param(tree: ast.Module, symbol: str, names: dict[str, Any]) -> tuple[Any, int]:
    *path, name = symbol.split(".")
    func = _scope(tree, path)
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise Unreadable(f"{'.'.join(path)} is not a function")
    args = func.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    for arg, default in pairs:
        if arg.arg == name:
            return evaluate(default, names), default.lineno
    raise Unreadable(f"no parameter {name} with a default")


def _env(tree: ast.Module, symbol: str, names: dict[str, Any]) -> tuple[Any, int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getenv" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value == symbol:
            return evaluate(node.args[1], names), node.lineno
        target = _single_target(node)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == symbol and isinstance(value, ast.Call) \
                and isinstance(value.func, ast.Name) and value.func.id in _ENV_WRAPPERS:
            return (evaluate(value.args[0], names) if value.args else None), node.lineno
    raise Unreadable(f"no default for {symbol}")


def _returns(tree: ast.Module, symbol: str) -> tuple[Any, int]:
    func = _scope(tree, symbol.split("."))
    found = [n for n in ast.walk(func) if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant)
             and isinstance(n.value.value, str)]
    if not found:
        raise Unreadable(f"{symbol} returns no string constant")
    found.sort(key=lambda n: n.lineno)
    return [n.value.value for n in found], found[0].lineno  # type: ignore[union-attr]


def _text(text: str, symbol: str) -> tuple[Any, int]:
    at = text.find(symbol)
    if at < 0:
        raise Unreadable("the text is not in the file")
    return True, text.count("\n", 0, at) + 1


def release(version: str) -> tuple[int, ...]:
    """'0.34.0' -> (0, 34, 0); the digits of each dotted part, so '0.35.0rc1' -> (0, 35, 0)."""
    out = []
    for part in version.split("."):
        digits = re.match(r"\d*", part).group()  # type: ignore[union-attr]
        out.append(int(digits) if digits else 0)
    return tuple(out)


class SourceTree:
    """The files of one engine release under `root` (an unpacked wheel or site-packages), read
    bounded and at most once each. The one place that reads an engine's files: the facts below
    and the gate check (gates.py) both read through it."""

    def __init__(self, root: Path):
        self.root = root
        self._python: dict[str, tuple[str, ast.Module, dict[str, Any]] | str] = {}

    def text(self, file: str) -> str:
        """A source file's text; Unreadable when it is missing, too large or unreadable."""
        path = self.root / file
        try:
            if path.stat().st_size > MAX_SOURCE_BYTES:
                raise Unreadable(f"{file} is larger than {MAX_SOURCE_BYTES >> 20} MiB")
            return path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise Unreadable(f"{file} cannot be read ({type(exc).__name__})") from None

    def python(self, file: str) -> tuple[str, ast.Module, dict[str, Any]]:
        """A Python file's text, tree and module-level constants."""
        if file not in self._python:
            try:
                text = self.text(file)
                tree = ast.parse(text)
                self._python[file] = (text, tree, _module_names(tree))
            except Unreadable as exc:
                self._python[file] = str(exc)
            except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
                self._python[file] = f"{file} cannot be read ({type(exc).__name__})"
        entry = self._python[file]
        if isinstance(entry, str):
            raise Unreadable(entry)
        return entry

    def scan(self, file: str, pattern: str) -> tuple[list[str], int | None]:
        """The distinct first groups of `pattern` in a kernel source or compiled library (read
        in chunks, at most MAX_LIBRARY_BYTES), sorted, and the line of the first in a text file."""
        path = self.root / file
        regex = re.compile(pattern.encode())
        found: set[str] = set()
        first: int | None = None
        seen = 0
        tail = b""
        try:
            with open(path, "rb") as handle:
                while seen < MAX_LIBRARY_BYTES:
                    chunk = handle.read(SCAN_CHUNK)
                    if not chunk:
                        break
                    block = tail + chunk
                    for match in regex.finditer(block):
                        found.add(match.group(1).decode("ascii", "replace"))
                        if first is None and not file.endswith(".so"):
                            first = seen - len(tail) + match.start()
                    seen += len(chunk)
                    tail = block[-256:]
        except OSError as exc:
            raise Unreadable(f"{file} cannot be read ({type(exc).__name__})") from None
        if first is None:
            return sorted(found), None
        with open(path, "rb") as handle:
            return sorted(found), handle.read(first).count(b"\n") + 1


def def_line(tree: SourceTree, file: str, dotted: str) -> int | None:
    """The line where `Class.function` (or `function`) is defined in a Python file, or None."""
    try:
        scope = _scope(tree.python(file)[1], dotted.split("."))
    except (Unreadable, RecursionError):
        return None
    return getattr(scope, "lineno", None)


def read_fact(tree: SourceTree, fact: Fact) -> Fact | str:
    """`fact` with its value and line as the source under `tree` has them, or why it cannot be read."""
    try:
        if fact.kind == KERNELS:
            names, line = tree.scan(fact.file, fact.symbol)
            if not names:
                raise Unreadable("no kernel of that name in the file")
            return replace(fact, value=names, line=line)
        text, module, names_bound = tree.python(fact.file)
        if fact.kind == LITERAL:
            value, line = _literal(module, fact.symbol, names_bound)
        elif fact.kind == PARAM:
            value, line = _param(module, fact.symbol, names_bound)
        elif fact.kind == ENV:
            value, line = _env(module, fact.symbol, names_bound)
        elif fact.kind == RETURNS:
            value, line = _returns(module, fact.symbol)
        else:
            value, line = _text(text, fact.symbol)
    except (Unreadable, RecursionError) as exc:
        return str(exc) if isinstance(exc, Unreadable) else "nested too deeply to read"
    return replace(fact, value=value, line=line)


@dataclass(frozen=True)
class Difference:
    fact: Fact               # the built-in fact
    source_value: Any        # None where the source could not be read
    where: str               # file:line in the source, or the file
    why: str = ""            # why the source value could not be read

    def line(self) -> str:
        found = self.why or shown(self.source_value)
        return f"{self.fact.key}: built in {shown(self.fact.value)}; source {found} ({self.where})"


def shown(value: Any) -> str:
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(repr(v) for v in sorted(value, key=repr)) + "}"
    return repr(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (set, frozenset)) or isinstance(b, (set, frozenset)):
        return isinstance(a, (set, frozenset)) and isinstance(b, (set, frozenset)) and set(a) == set(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def read(tree: SourceTree, built_in: FactSet, version: str, origin: str) -> tuple[FactSet, list[Difference]]:
    """Every fact of `built_in` read from the source under `tree`: the facts as that source has
    them (a fact it does not give keeps its built-in value, with a warning) and the differences.
    A fact from a later release than `version` must be absent there, and reads as its `absent`."""
    facts, differences, warnings = [], [], []
    for fact in built_in.facts:
        found = read_fact(tree, fact)
        if fact.since and release(version) < release(fact.since):
            if isinstance(found, str):
                facts.append(replace(fact, value=fact.absent))
            else:
                facts.append(fact)
                differences.append(Difference(fact, found.value, found.where(),
                                              f"present, though built in as new in {fact.since}"))
            continue
        if isinstance(found, str):
            facts.append(fact)
            differences.append(Difference(fact, None, fact.file, found))
            warnings.append(f"{fact.key} not read ({found}): the built-in value is used")
            continue
        facts.append(found)
        if not _same(fact.value, found.value):
            differences.append(Difference(fact, found.value, found.where()))
    return (FactSet(built_in.engine, built_in.name, version, tuple(facts), origin, tuple(warnings)), differences)
