"""The gate check's child process (gates.py runs it): imports torch and the engine's functions
from the wheel under ROOT, runs every probe of ENGINE and prints the answers as one JSON line.

    python -c "from commbench.engines.gate_child import main; ..." ROOT ENGINE
"""

from __future__ import annotations

import json
from pathlib import Path

from commbench.engines.facts import SourceTree
from commbench.engines.gates import run_probe
from commbench.engines.registry import BY_KEY


def main(argv: list[str]) -> int:
    root, key = Path(argv[0]), argv[1]
    engine = BY_KEY[key]
    try:
        import torch
    except ImportError as exc:
        print(json.dumps({"error": f"torch cannot be imported here ({exc}): the gates need it for meta tensors"}))
        return 0
    tree = SourceTree(root)
    print(json.dumps({p.key: run_probe(tree, key, p, torch) for p in engine.probes}))
    return 0


