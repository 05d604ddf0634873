"""What a resume must share with the run it continues: the same machine, ranks and plan, or its
rows would join curves measured under something else. Timeouts may change (a longer one after a
hang is the usual reason to resume)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from commbench.errors import UsageError
from commbench.results.info import RunInfo

IDENTITY_KEYS = ("schema", "host", "world_size", "nodes", "device_type", "gpus", "emulation", "plan")
MEASURED_PLAN_KEYS = ("message_bytes", "shapes", "dtypes", "modes", "warmup", "iterations", "graph_ops",
                      "graph_replays")
_GPU_KEYS = ("host", "device", "name", "uuid", "pci_bus_id")


def resume_differences(recorded: RunInfo, current: dict[str, Any]) -> list[str]:
    """What makes `current` (keys of IDENTITY_KEYS) another run than the one run.json records;
    empty when they agree or no sweep has written the dir yet (a new dir, the driver's stub)."""
    if not recorded.swept:
        return []
    out = []
    for key in IDENTITY_KEYS:
        if key not in current:
            continue
        here, there = current[key], getattr(recorded, key)
        if key == "plan":
            out += [f"plan {name} {here.get(name)} here, {(there or {}).get(name)} in the run"
                    for name in MEASURED_PLAN_KEYS if here.get(name) != (there or {}).get(name)]
        elif key == "gpus":
            out += _gpu_differences(here, there)
        elif here != there:
            out.append(f"{key.replace('_', ' ')} {here} here, {there} in the run")
    return out


def refuse_other_run(run_dir: Path, recorded: RunInfo, current: dict[str, Any]) -> None:
    """Bad input when `--resume run_dir` would continue another run than `current` (the
    differences named); nothing when it is the same run."""
    if recorded.swept and recorded.world_size is None:
        raise UsageError(f"--resume {run_dir}: its run.json records a plan but no world_size, so nothing says "
                         "which run this is; leave out --resume to start a new one")
    differences = resume_differences(recorded, current)
    if differences:
        raise UsageError(f"--resume {run_dir}: not the run this command would make ({'; '.join(differences)}); "
                         "leave out --resume to start a new one")


def _gpu_differences(here: list[dict[str, Any]], there: Any) -> list[str]:
    def describe(gpus: Any) -> list[str]:
        return [" ".join(str(g.get(k)) for k in _GPU_KEYS if g.get(k)) for g in gpus or [] if isinstance(g, dict)]

    mine, theirs = describe(here), describe(there)
    if len(mine) != len(theirs):
        return [f"GPUs: {len(mine)} rank(s) here, {len(theirs)} in the run"]
    return [f"GPU of rank {rank}: {a} here, {b} in the run" for rank, (a, b) in enumerate(zip(mine, theirs))
            if a != b][:1]
