"""The gate check's child process (gates.py runs it): imports torch and the engine's functions
from the wheel under ROOT, runs the named probes of ENGINE and says, one JSON line each, when each
starts and its answers.

    python -c "from commbench.engines.gate_child import main; ..." ROOT ENGINE PROBE...

The lines go out on a copy of the standard output taken at the start; the standard output itself
then goes to the standard error, so what the engine's code prints never mixes with them (the
parent keeps only the end of it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from commbench.engines.facts import SourceTree
from commbench.engines.gates import run_probe
from commbench.engines.registry import BY_KEY


def main(argv: list[str]) -> int:
    root, key, wanted = Path(argv[0]), argv[1], set(argv[2:])
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)

    def say(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    engine = BY_KEY[key]
    try:
        import torch
    except ImportError as exc:
        say({"error": f"torch cannot be imported here ({exc}): the gates need it for meta tensors"})
        return 0
    tree = SourceTree(root)
    for probe in engine.probes:
        if probe.key in wanted:
            say({"start": probe.key})
            say({"key": probe.key, **run_probe(tree, key, probe, torch)})
    return 0
