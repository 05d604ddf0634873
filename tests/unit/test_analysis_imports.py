"""No analysis command imports another command: what two commands share (the decision step,
the configuration, a curve's price, the NCCL a run loaded) lives in a module of its own."""

from __future__ import annotations

import ast
from pathlib import Path

from commbench.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {module.rsplit(".", 1)[1] for module, _ in SUBCOMMANDS.values() if module.startswith("commbench.analysis.")}


def _imports(name: str, root: Path = ROOT) -> set[str]:
    tree = ast.parse((root / "commbench" / "analysis" / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "commbench.analysis":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commbench.analysis."):
            found.add(node.module.split(".")[2])
    return found


def _reached(name: str, root: Path = ROOT) -> set[str]:
    """Every analysis module `name` imports, directly or through shared (non-command) modules:
    report reaching attribute through attribute_plots is an edge too. Stops at commands."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for module in _imports(todo.pop(), root) - seen:
            seen.add(module)
            if module not in COMMANDS and (root / "commbench" / "analysis" / f"{module}.py").exists():
                todo.append(module)
    return seen


def test_no_analysis_command_imports_another() -> None:
    assert {"floor", "recommend", "report", "compare", "table", "qualify", "attribute"} <= COMMANDS
    assert {name: sorted(_reached(name) & COMMANDS - {name}) for name in sorted(COMMANDS)} == \
        {name: [] for name in sorted(COMMANDS)}


def test_a_command_reached_through_a_shared_module_is_found(tmp_path: Path) -> None:
    """The walk follows shared modules: the edge report -> attribute_plots -> attribute that
    this test was written against (the direct-import check passed it)."""
    folder = tmp_path / "commbench" / "analysis"
    folder.mkdir(parents=True)
    (folder / "report.py").write_text("from commbench.analysis import plots_shared\n")
    (folder / "plots_shared.py").write_text("from commbench.analysis.attribute import x\n")
    (folder / "attribute.py").write_text("")
    assert _reached("report", tmp_path) & COMMANDS == {"attribute"}
