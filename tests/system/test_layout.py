"""The layout keeps its promises: imports run one way through declared layers, the analysis half
runs without torch, the probe and the backends check needs in one order, and the repository names
no file it does not contain."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from commbench.backends import probe_variants
from commbench.topology.needs import NEEDS

REPO = Path(__file__).resolve().parents[2]
ANALYSIS = ["commbench.analysis." + p.stem for p in (REPO / "commbench" / "analysis").glob("*.py")
            if p.stem != "__init__"]


@pytest.mark.procs
def test_the_analysis_half_imports_no_torch() -> None:
    modules = ANALYSIS + ["commbench.results", "commbench.runs", "commbench.inflight", "commbench.engines", "commbench.models",
                          "commbench.units", "commbench.policy", "commbench.files"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'commbench.sweep')))\n"
            "print(bad)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    assert len(ANALYSIS) >= 9


# The installed layout (pyproject's package-dir): folder -> the package it installs as.
INSTALLED = {"commbench": "commbench", "backends": "commbench.backends", "topology": "commbench.topology"}

# Layers, lowest first (docs/design.md draws them). A module may import its own layer and the
# layers below it, never one above; the longest matching pattern places a module, and every
# module must be placed. "facts" is what the probe, the backends and the analysis all read:
# torch-free machine checks and readings (topology), how each engine picks a path (engines) and
# model shapes (models); the op names sit lower still, in base, since the row schema names its op.
# The probe and the analysis stand side by side on one floor above the backends, and neither
# imports the other: the probe asks the backends for verdicts, the analysis reads their rows and
# their TRACE_KERNELS source, never their modules.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("commbench", "commbench.errors", "commbench.units", "commbench.files", "commbench.json_stream", "commbench.policy",
              "commbench.launch_env", "commbench.waits", "commbench.ops", "commbench.terminal")),
    ("results", ("commbench.results", "commbench.results.*", "commbench.inflight", "commbench.runs")),
    ("facts", ("commbench.engines", "commbench.engines.*", "commbench.topology", "commbench.topology.*",
               "commbench.models")),
    ("runtime", ("commbench.runtime", "commbench.runtime.*")),
    ("backends", ("commbench.backends", "commbench.backends.*")),
    ("probe", ("commbench.probe", "commbench.probe.*")),
    ("analysis", ("commbench.analysis", "commbench.analysis.*", "commbench.fleet", "commbench.fleet.*")),
    ("sweep", ("commbench.sweep", "commbench.sweep.*")),
    ("cli", ("commbench.cli", "commbench.__main__")),
]
# Layers that share a floor: an import between them runs sideways, and is as wrong as one back up.
SIDE_BY_SIDE = {"probe": "analysis", "analysis": "probe"}


def floor_of(layer: int) -> int:
    """A layer's floor: its place in LAYERS, less the side-by-side layers below it."""
    names = [name for name, _ in LAYERS[: layer + 1]]
    return layer - sum(1 for i, name in enumerate(names[:-1]) if SIDE_BY_SIDE.get(name) == names[i + 1])


def installed_modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of the installed package, by its installed name."""
    found = {}
    for folder, package in INSTALLED.items():
        for path in (repo / folder).rglob("*.py"):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if folder == "commbench" and parts[0] in INSTALLED:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imported_names(module: str, tree: ast.Module, is_package: bool) -> set[str]:
    """Every name an import statement anywhere in the module (functions and TYPE_CHECKING
    included: a lazy import is still a dependency) may load, submodules included."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    """module -> the modules of the package it imports, statically. Importing a.b.c runs the
    __init__ of a.b too, so a module outside a package that imports into it depends on it."""
    modules = installed_modules(repo)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets: set[str] = set()
        for name in _imported_names(module, tree, path.name == "__init__.py"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            while name:
                if not (module + ".").startswith(name + "."):
                    targets.add(name)
                name = name.rpartition(".")[0]
        graph[module] = targets - {module}
    return graph


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            prefix = pattern[:-2] if pattern.endswith(".*") else None
            if module == pattern or (prefix and module.startswith(prefix + ".")):
                if best is None or len(pattern) > best[0]:
                    best = (len(pattern), index)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports back up a floor, or sideways between two layers of one floor."""
    def wrong_way(a: int, b: int) -> bool:
        return floor_of(b) > floor_of(a) or (floor_of(b) == floor_of(a) and a != b)

    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
                  for a, targets in graph.items() for b in targets
                  if layer_of(a) is not None and layer_of(b) is not None and wrong_way(layer_of(a), layer_of(b)))


def test_every_module_has_a_layer() -> None:
    assert [m for m in sorted(installed_modules()) if layer_of(m) is None] == []


def test_imports_make_no_circle() -> None:
    assert cycles(import_graph()) == []


def test_no_import_runs_back_up_a_layer() -> None:
    assert upward_imports(import_graph()) == []


def test_the_backends_never_import_the_analysis() -> None:
    graph = import_graph()
    assert [f"{a} -> {b}" for a, targets in graph.items() if a.startswith("commbench.backends")
            for b in targets if b.startswith(("commbench.analysis", "commbench.fleet"))] == []
    assert layer_of("commbench.analysis.fusion") > layer_of("commbench.backends.unfused")


def test_the_graph_sees_lazy_relative_and_package_imports(tmp_path: Path) -> None:
    """The checks above find what they look for: a lazy import back up, a relative import and
    the package __init__ an import runs, in a made-up tree laid out like the real one."""
    for folder in INSTALLED:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "commbench" / "results.py").write_text("def f():\n    from commbench.backends import base\n")
    (tmp_path / "backends" / "base.py").write_text("from ..results import f\n")
    (tmp_path / "topology" / "needs.py").write_text("import commbench.backends.base\n")
    graph = import_graph(tmp_path)
    assert graph["commbench.results"] == {"commbench.backends", "commbench.backends.base"}
    assert graph["commbench.backends.base"] == {"commbench.results"}
    assert graph["commbench.topology.needs"] == {"commbench.backends", "commbench.backends.base"}
    assert cycles(graph) == [["commbench.backends.base", "commbench.results"]]
    assert "commbench.topology.needs (facts) -> commbench.backends.base (backends)" in upward_imports(graph)


def test_the_probe_and_the_analysis_import_neither_way_and_topology_holds_facts_only() -> None:
    graph = {"commbench.probe.render": {"commbench.analysis.curves", "commbench.backends"},
             "commbench.analysis.curves": {"commbench.probe.verdicts", "commbench.models"},
             "commbench.topology.needs": {"commbench.backends.base"}}
    assert upward_imports(graph) == [
        "commbench.analysis.curves (analysis) -> commbench.probe.verdicts (probe)",
        "commbench.probe.render (probe) -> commbench.analysis.curves (analysis)",
        "commbench.topology.needs (facts) -> commbench.backends.base (backends)"]
    assert floor_of(layer_of("commbench.probe.command")) == floor_of(layer_of("commbench.analysis.report"))
    assert layer_of("commbench.topology.snapshot_file") < layer_of("commbench.runtime.context")


def test_every_package_folder_is_in_pyprojects_packages() -> None:
    """A new folder (a family's, the probe's) installs only when pyproject lists it."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    listed = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]
    assert sorted(m for m, path in installed_modules().items() if path.name == "__init__.py") == sorted(listed)


def test_every_need_a_backend_declares_is_in_the_one_table() -> None:
    variants = probe_variants()
    assert len(variants) > 10
    assert {need for b in variants for need in b.needs} <= set(NEEDS)


# Names of files that live beside a developer's checkout, never in it.
OUTSIDE = ("DESIGN.md", "reference/backends.md", "reference/benchmarks.md", "user-pain.md", "field-2026.md",
           "mscclpp-build.md", "../shared")
PATH_RE = re.compile(r"\b((?:docs|scripts|results/reference|commbench/specs|commbench/data|tests/gpu)/[\w./-]+\w)")


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    return [REPO / f for f in listed if f.endswith((".py", ".md", ".sh", ".toml", ".txt", ".cu")) and (REPO / f).is_file()
            and f != "tests/system/test_layout.py"]


@pytest.mark.procs
def test_the_repository_points_only_at_files_it_contains() -> None:
    missing = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        missing += [f"{path.relative_to(REPO)}: {name}" for name in OUTSIDE if name in text]
        for ref in PATH_RE.findall(text):
            target = ref.rstrip(".")
            if "<" not in target and "*" not in target and not (REPO / target).exists():
                missing.append(f"{path.relative_to(REPO)}: {target}")
    assert missing == []


# ---------------------------------------------------------------- the docs that describe the layout

MODULE_NAME = re.compile(r"^[a-z_][a-z0-9_]*(\.py)?$")


def layout_modules(text: str, repo: Path = REPO) -> tuple[set[Path], list[str]]:
    """The module files docs/layout.md's table names, and the names there with no file. A row's
    path cell gives its folder (a folder, or the folder of its first file); every lowercase name in
    backticks in either cell is a module of that folder (`name` or `name.py`, or a package
    `name/`), and a backticked path is a file of the repository."""
    named: set[Path] = set()
    missing: list[str] = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 2:
            continue
        where = re.findall(r"`([^`]+)`", cells[0])
        folder = repo / (where[0] if where[0].endswith("/") else str(Path(where[0]).parent))
        for token in where + re.findall(r"`([^`]+)`", cells[1]):
            if "/" in token:
                path = repo / token
            elif MODULE_NAME.match(token):
                module = folder / (token if token.endswith(".py") else token + ".py")
                path = module if module.exists() or not (folder / token).is_dir() else folder / token / "__init__.py"
            else:
                continue
            if not path.exists():
                missing.append(token)
            named.add(path)
    return named, missing


def layout_problems(text: str, repo: Path = REPO) -> tuple[list[str], list[str]]:
    """(names in the table with no module, modules the table does not name); a package's
    __init__.py is named with any module of its folder."""
    named, missing = layout_modules(text, repo)
    unnamed = sorted(str(path.relative_to(repo)) for path in installed_modules(repo).values()
                     if path not in named and not (path.name == "__init__.py" and any(n.parent == path.parent
                                                                                     for n in named)))
    return missing, unnamed


def test_layout_md_names_every_module_and_only_modules_that_exist() -> None:
    assert layout_problems((REPO / "docs" / "layout.md").read_text(encoding="utf-8")) == ([], [])


def test_the_layout_check_finds_a_module_left_out_and_a_name_with_no_module(tmp_path: Path) -> None:
    for folder in INSTALLED:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    for module in ("commbench/cli.py", "commbench/runs.py", "backends/base.py", "topology/needs.py"):
        (tmp_path / module).write_text("")
    text = ("| path | what |\n| --- | --- |\n| `commbench/cli.py`, `gone.py` | the CLI, `commbench/runs.py` |\n"
            "| `backends/` | `base.py` (the interface), `--not-a-module`, `RunDir` |\n")
    assert layout_problems(text, tmp_path) == (["gone.py"], ["topology/__init__.py", "topology/needs.py"])


def _flow(design: str) -> str:
    """The code block under design.md's "The flow, and where it lives"."""
    section = design.split("## The flow, and where it lives", 1)[1]
    return section.split("```", 2)[1]


def unnamed_commands(flow: str, names: list[str]) -> list[str]:
    """The names the flow never says as a word of its own: "sweep" in commbench/sweep/ or
    "attribute" in attribute_plots is no mention."""
    return [name for name in names if not re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w/-])", flow)]


def test_design_md_flow_names_every_subcommand() -> None:
    from commbench.cli import SUBCOMMANDS

    flow = _flow((REPO / "docs" / "design.md").read_text(encoding="utf-8"))
    assert len(SUBCOMMANDS) >= 10 and unnamed_commands(flow, list(SUBCOMMANDS)) == []
    made_up = _flow("## The flow, and where it lives\n```\ncommbench/sweep/ -> attribute_plots, report\n```\n")
    assert unnamed_commands(made_up, ["sweep", "attribute", "report"]) == ["sweep", "attribute"]


def test_results_md_lists_every_status() -> None:
    from commbench.results import STATUSES

    text = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    (line,) = [line for line in text.splitlines() if line.startswith("| `status` |")]
    assert re.findall(r"`(\w+)`", line.split("|")[2]) == list(STATUSES)


def families_without_trace_kernels(graph: dict[str, set[str]], modules: dict[str, Path],
                                   families: dict[str, tuple[str, str | None]]) -> list[str]:
    """Built-in families ({family: (factory module, trace_kernels_of)}) whose kernels no
    TRACE_KERNELS names: a family declares them in its own module (or a module of the package it
    imports), or says whose kernels it runs (trace_kernels_of), or "" for none of its own."""
    from commbench.analysis.trace_kernels import literal_patterns

    def declares(module: str) -> bool:
        own = {module} | {m for m in graph.get(module, set())
                          if m.startswith("commbench.backends.") and m != "commbench.backends.base"}
        return any(m in modules and literal_patterns(modules[m].read_text(encoding="utf-8"), m) for m in own)

    missing = []
    for family, (module, kernels_of) in families.items():
        if kernels_of == "":
            continue
        owner = module if kernels_of is None else families.get(kernels_of, ("", None))[0]
        if not declares(owner):
            missing.append(family)
    return missing


def test_every_family_launching_its_own_kernels_declares_their_trace_names() -> None:
    from commbench.backends import BUILTIN, factory

    families = {family: (module, factory(family).trace_kernels_of) for family, module in BUILTIN.items()}
    assert families_without_trace_kernels(import_graph(), installed_modules(), families) == []
    assert {f for f, (_, of) in families.items() if of is None} >= {"nccl", "p2p", "vllm", "sglang", "flashinfer"}


def test_the_trace_kernels_check_finds_a_family_that_names_none(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("TRACE_KERNELS = ((r'my_kernel', 'mine', '', ''),)\n")
    (tmp_path / "helper.py").write_text("KERNEL = 'x'\n")
    modules = {"commbench.backends.mine": tmp_path / "mine.py", "commbench.backends.quiet": tmp_path / "helper.py",
               "commbench.backends.viamine": tmp_path / "helper.py"}
    graph = {"commbench.backends.viamine": {"commbench.backends.mine"}}
    families = {"mine": ("commbench.backends.mine", None), "quiet": ("commbench.backends.quiet", None),
                "viamine": ("commbench.backends.viamine", None), "borrows": ("commbench.backends.quiet", "mine"),
                "cpu": ("commbench.backends.quiet", ""), "wrong": ("commbench.backends.quiet", "quiet"),
                "unknown": ("commbench.backends.mine", "nosuch")}
    assert families_without_trace_kernels(graph, modules, families) == ["quiet", "wrong", "unknown"]
