"""Engine facts as data: each one a value with its provenance (engine, version, the source file
and the symbol, env var, text or kernel names it is read from), and the reader that takes the
same value out of an engine's released files with `ast` (or, for kernel names, a bounded scan
of the kernel source or library), never importing the engine (no torch here).

An engine module (vllm.py, sglang.py) lists its facts built in, and so does a library the engines
call whose wheel ships its sources (flashinfer.py, a `Library`); `read()` reads them again from an
installed package or an unpacked wheel and says where the two differ. `SourceTree` is the one
reader of an engine's files (the gate check imports through it too). Source files are untrusted
input: a file or symbol that is missing, or a value that is no literal, is a difference with its
reason (a release moves and renames things); a file that is no regular file or past its bound, a
literal whose value would be huge or slow (1 / 0, 1e300 ** 2, chained powers), and a value not of
the built-in value's kinds (a NaN size, None for a list) are bad input: one line naming the
file:line (UsageError), never an exception.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from commbench.engines import values
from commbench.errors import UsageError
from commbench.files import NoSuchFile, byte_blocks, read_text
from commbench.results.text import capped

# How a fact is found in its file.
LITERAL = "literal"      # NAME, Class.NAME or function.NAME assigned a literal (constants and arithmetic on them)
PARAM = "param"          # Class.method.param: a parameter's default value
ENV = "env"              # an environment variable's default: os.getenv("NAME", default) or NAME = EnvBool(default)
RETURNS = "returns"      # Class.method: the string constants it returns, in order
TEXT = "text"            # the file contains this text (value True): behaviour no table states
KERNELS = "kernels"      # the distinct strings a regex (one group) finds in a kernel source or library, sorted:
                         # kernel names, or what a trace name or a launch takes from a source no ast reads

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


@dataclass(frozen=True)
class Library:
    """A library the engines' paths run whose wheel ships the sources its facts are read from
    (FlashInfer): `engines --check` reads them as it reads an engine's. It has no dispatch order
    or gate functions of its own to run: the engines' gates call it."""

    facts: FactSet               # built in; facts.engine is its package's import name
    distribution: str            # the name of its dist-info folder: flashinfer_python-0.7.4.dist-info

    @property
    def key(self) -> str:
        return self.facts.engine


# --- a small, safe evaluator for literals in engine source ----------------------------------

class Unreadable(ValueError):
    """The reader cannot take a value out of this source (no such file, symbol or literal): a real
    release moves and renames things, so this is a difference (--check) or a warning."""


class Refused(Unreadable):
    """A literal whose value would be huge, slow or no number (1 / 0, 1e300 ** 2, 0x of 8,192
    digits, chained powers): never computed, and bad input where a fact reads it. Its text is
    what the value does ("divides by zero"); `origin` the module-level name it was refused at."""

    def __init__(self, why: str, origin: _RefusedName | None = None):
        super().__init__(why)
        self.origin = origin


MAX_MAGNITUDE = 1 << 64      # a number the evaluator makes: engine constants are sizes, counts, capabilities
MAX_EVAL_STEPS = 1 << 20     # nodes evaluated and items copied: a file's module constants together, or one fact


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_EVAL_STEPS

    def spend(self, steps: int = 1) -> None:
        self.left -= steps
        if self.left < 0:
            raise Refused(f"takes more than {MAX_EVAL_STEPS} steps to evaluate")


@dataclass(frozen=True)
class _RefusedName:
    """A module-level name whose literal was refused: a name or fact that uses it is refused,
    naming this one, its line and why."""

    name: str
    line: int
    why: str


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv, ast.LShift: operator.lshift, ast.Pow: operator.pow, ast.BitAnd: operator.and_}
_CONTAINERS = {"frozenset": frozenset, "set": set, "tuple": tuple, "list": list}
# The engines' typed env wrappers (SGLang environ.py): the first argument is the default.
_ENV_WRAPPERS = {"EnvBool", "EnvInt", "EnvStr", "EnvFloat"}


def evaluate(node: ast.AST, names: dict[str, Any], budget: _Budget | None = None) -> Any:
    """A literal of constants, containers and arithmetic, with names bound at module level.
    Unreadable where it is no such literal; Refused where its value would be out of bounds."""
    return _evaluate(node, names, budget or _Budget())


def _evaluate(node: ast.AST, names: dict[str, Any], budget: _Budget) -> Any:
    budget.spend()
    if isinstance(node, ast.Constant):
        return _number(node.value) if _is_number(node.value) else node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_evaluate(e, names, budget) for e in node.elts]
        return _made({ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)], items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise Unreadable("a dict with ** unpacking")
        pairs = [(_evaluate(k, names, budget), _evaluate(v, names, budget)) for k, v in zip(node.keys, node.values)]  # type: ignore[arg-type]
        return _made(dict, pairs)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, names, budget), _evaluate(node.right, names, budget)
        if not (_is_number(left) and _is_number(right)):
            raise Unreadable("arithmetic on something that is not a number")
        return _arithmetic(node.op, left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _evaluate(node.operand, names, budget)
        if not _is_number(value):
            raise Unreadable("a negated non-number")
        return -value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):   # a mask: ~((1 << 21) - 1)
        value = _evaluate(node.operand, names, budget)
        if not (_is_number(value) and isinstance(value, int)):
            raise Unreadable("~ on something that is not a whole number")
        return ~value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise Unreadable(f"name {node.id} is not a module-level constant")
        value = names[node.id]
        if isinstance(value, _RefusedName):
            at = f"{value.name} (line {value.line})" if value.name == node.id else \
                f"{node.id}, from {value.name} (line {value.line})"
            raise Refused(f"uses {at}, which {value.why}", value)
        return value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in _CONTAINERS and len(node.args) <= 1 and not node.keywords:
            given = _evaluate(node.args[0], names, budget) if node.args else ()
            if not isinstance(given, (list, tuple, set, frozenset, dict, str)):
                raise Refused(f"calls {node.func.id}() on a {type(given).__name__}, which is no collection")
            budget.spend(len(given))
            return _made(_CONTAINERS[node.func.id], given)
        if node.func.id in _ENV_WRAPPERS and node.args:
            return _evaluate(node.args[0], names, budget)
    raise Unreadable(f"{type(node).__name__} is not a literal")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: int | float) -> int | float:
    """A number within the bounds every value the evaluator makes keeps."""
    if isinstance(value, float) and not math.isfinite(value):
        raise Refused(f"is {value}, not a finite number")
    if abs(value) >= MAX_MAGNITUDE:
        raise Refused("is larger than 2^64, more than any engine constant")
    return value


def _arithmetic(op: ast.operator, left: int | float, right: int | float) -> int | float:
    """left op right, refused before it is computed where it would be huge or slow (a power, a
    shift: both operands are already within 2^64, so a product or sum is cheap and checked after)."""
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 \
            and abs(left) > 1 and right * (abs(left).bit_length() - 1) >= 64:
        raise Refused(f"is larger than 2^64 ({left} ** {right}), more than any engine constant")
    if isinstance(op, ast.LShift) and not (isinstance(right, int) and 0 <= right < 64):
        raise Refused(f"shifts by {right}, not 0 to 63 bits")
    try:
        result = _BINOPS[type(op)](left, right)
    except ZeroDivisionError:
        raise Refused("divides by zero") from None
    except (OverflowError, ValueError, TypeError) as exc:
        raise Refused(f"cannot be computed ({type(exc).__name__})") from None
    if not _is_number(result):      # a negative number to a fractional power is complex
        raise Refused(f"is {type(result).__name__}, not a real number")
    return _number(result)


def _made(kind: Callable[[Any], Any], items: Any) -> Any:
    try:
        return kind(items)
    except TypeError:               # a list as a dict key or a set member
        raise Refused(f"has a list, set or table as a {'dict key' if kind is dict else 'set member'}") from None


def _module_names(tree: ast.Module) -> dict[str, Any]:
    """Module-level NAME = literal bindings (MiB = 1024 * 1024), in order; a name whose literal
    was refused is kept as such (a fact that uses it is refused), one that is no literal unbound.
    One budget for the whole file: `tuple(A)` over and over cannot make it slow."""
    names: dict[str, Any] = {}
    budget = _Budget()
    for node in tree.body:
        target = _single_target(node)
        if target is not None and isinstance(target, ast.Name) and node.value is not None:  # type: ignore[union-attr]
            try:
                names[target.id] = _evaluate(node.value, names, budget)  # type: ignore[union-attr]
            except Refused as exc:
                names[target.id] = exc.origin or _RefusedName(target.id, node.lineno, str(exc))
            except RecursionError:
                names[target.id] = _RefusedName(target.id, node.lineno, "is nested too deeply to read")
            except Unreadable:
                names.pop(target.id, None)
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


# Each finder gives the expression a fact's value is and its line; read_fact evaluates it.

def _literal(tree: ast.Module, symbol: str) -> tuple[ast.expr, int]:
    *path, name = symbol.split(".")
    scope = _scope(tree, path)
    for node in ast.walk(scope):
        target = _single_target(node)
        if isinstance(target, ast.Name) and target.id == name and getattr(node, "value", None) is not None:
            return node.value, node.lineno  # type: ignore[attr-defined]
    raise Unreadable(f"no assignment to {symbol}")


def _param(tree: ast.Module, symbol: str) -> tuple[ast.expr, int]:
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
            return default, default.lineno
    raise Unreadable(f"no parameter {name} with a default")


def _env(tree: ast.Module, symbol: str) -> tuple[ast.expr, int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getenv" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value == symbol:
            return node.args[1], node.lineno
        target = _single_target(node)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == symbol and isinstance(value, ast.Call) \
                and isinstance(value.func, ast.Name) and value.func.id in _ENV_WRAPPERS:
            return (value.args[0] if value.args else ast.Constant(None)), node.lineno
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
    and the gate check (gates.py) both read through it.

    A file that is not there is Unreadable (a release without that module: a difference); one
    that is there but is no regular file (a FIFO blocked forever, /dev/zero behind a symlink read
    without end), is larger than its bound (counted in bytes read), is binary or not UTF-8, or is
    no Python this interpreter parses, is bad input (UsageError, the file named) as everywhere."""

    def __init__(self, root: Path):
        self.root = root
        self._python: dict[str, tuple[str, ast.Module, dict[str, Any]] | Exception] = {}

    def text(self, file: str) -> str:
        """A source file's text."""
        try:
            return read_text(self.root / file, "an engine's Python source", MAX_SOURCE_BYTES)
        except NoSuchFile:
            raise Unreadable(f"{file} cannot be read (FileNotFoundError)") from None

    def python(self, file: str) -> tuple[str, ast.Module, dict[str, Any]]:
        """A Python file's text, tree and module-level constants."""
        if file not in self._python:
            try:
                text = self.text(file)
                tree = ast.parse(text)
                self._python[file] = (text, tree, _module_names(tree))
            except (Unreadable, UsageError) as exc:
                self._python[file] = exc
            except SyntaxError as exc:     # a newer Python's syntax, or an int literal of 8,192 digits
                self._python[file] = UsageError(f"{self.root / file}:{exc.lineno}: not Python this interpreter "
                                                f"parses ({capped(exc.msg, 120)})")
            except (RecursionError, MemoryError) as exc:
                self._python[file] = UsageError(f"{self.root / file}: nested too deeply to parse "
                                                f"({type(exc).__name__})")
        entry = self._python[file]
        if isinstance(entry, Exception):
            raise entry
        return entry

    def scan(self, file: str, pattern: str) -> tuple[list[str], int | None]:
        """The distinct first groups of `pattern` in a kernel source or compiled library (read
        in chunks, at most MAX_LIBRARY_BYTES), sorted, and the line of the first in a text file."""
        regex = re.compile(pattern.encode())
        found: set[str] = set()
        first: int | None = None
        newlines, tail = 0, b""
        try:
            for chunk in byte_blocks(self.root / file, "an engine's kernel source or library", SCAN_CHUNK,
                                     MAX_LIBRARY_BYTES):
                block = tail + chunk
                for match in regex.finditer(block):
                    found.add(match.group(1).decode("ascii", "replace"))
                    if first is None and not file.endswith(".so"):
                        first = newlines - tail.count(b"\n") + block.count(b"\n", 0, match.start()) + 1
                newlines += chunk.count(b"\n")
                tail = block[-256:]
        except NoSuchFile:
            raise Unreadable(f"{file} cannot be read (FileNotFoundError)") from None
        return sorted(found), first


def def_line(tree: SourceTree, file: str, dotted: str) -> int | None:
    """The line where `Class.function` (or `function`) is defined in a Python file, or None."""
    try:
        scope = _scope(tree.python(file)[1], dotted.split("."))
    except Unreadable:
        return None
    return getattr(scope, "lineno", None)


def read_fact(tree: SourceTree, fact: Fact) -> Fact | str:
    """`fact` with its value and line as the source under `tree` has them, or why it cannot be read
    (Unreadable). A value out of its bounds or not of the built-in value's kinds (values.py) is bad
    input: UsageError naming the file:line."""
    line: int | None = None
    try:
        if fact.kind == KERNELS:
            value, line = tree.scan(fact.file, fact.symbol)
            if not value:
                raise Unreadable("nothing in the file matches its pattern")
        else:
            text, module, names = tree.python(fact.file)
            if fact.kind in (LITERAL, PARAM, ENV):
                expr, line = {LITERAL: _literal, PARAM: _param, ENV: _env}[fact.kind](module, fact.symbol)
                value = evaluate(expr, names)
            elif fact.kind == RETURNS:
                value, line = _returns(module, fact.symbol)
            else:
                value, line = _text(text, fact.symbol)
    except Refused as exc:
        raise UsageError(f"{tree.root / fact.file}:{line}: {fact.symbol} {exc}") from None
    except RecursionError:
        raise UsageError(f"{tree.root / fact.file}:{line}: {fact.symbol} is nested too deeply to read") from None
    except Unreadable as exc:
        return str(exc)
    wrong = values.problem(value, values.kind_of([fact.value]), _named(fact))
    if wrong:
        at = f"{tree.root / fact.file}:{line}" if line else str(tree.root / fact.file)
        raise UsageError(f"{at}: {wrong} (commbench's fact {fact.key})")
    return replace(fact, value=value, line=line)


def _named(fact: Fact) -> str:
    """How a value's place is named: the symbol where it is one, else the fact."""
    return fact.symbol if fact.kind in (LITERAL, PARAM, ENV, RETURNS) else fact.key


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
