"""No analysis command imports another command: what two commands share (the decision step,
the configuration, a curve's price, the NCCL a run loaded) lives in a module of its own."""

from __future__ import annotations

import ast
from pathlib import Path

from commbench.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {module.rsplit(".", 1)[1] for module, _ in SUBCOMMANDS.values() if module.startswith("commbench.analysis.")}


def _imports(name: str) -> set[str]:
    tree = ast.parse((ROOT / "commbench" / "analysis" / f"{name}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "commbench.analysis":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commbench.analysis."):
            found.add(node.module.split(".")[2])
    return found


def test_no_analysis_command_imports_another() -> None:
    assert {"floor", "recommend", "report", "compare", "table", "qualify"} <= COMMANDS
    assert {name: sorted(_imports(name) & COMMANDS - {name}) for name in sorted(COMMANDS)} == \
        {name: [] for name in sorted(COMMANDS)}
