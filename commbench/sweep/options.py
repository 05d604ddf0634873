"""The sweep's own options, read once from its flags into a frozen object.

The plan's options (sizes, dtypes, modes, timing) become a SweepPlan (plan.py); each backend
family reads its own flags (BackendFactory.read_options). What is left is here: where results
go, what may run on this machine, the driver's settings, and argv as typed (the driver's
children and the resume hint repeat it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from commbench import backends


@dataclass(frozen=True)
class SweepOptions:
    cpu: bool
    share_gpus: bool
    allow_multicast: bool
    no_probe: bool
    out: str
    resume: str | None
    run_dir: str | None           # set by the driver for its children
    qualify: Path | None
    junit: Path | None
    model: str | None             # --model: the preset whose decode sizes the plan measures
    nproc: int | None
    env: tuple[str, ...]          # --env NAME=V1,V2 as typed
    mps: bool
    child_timeout: float
    argv: tuple[str, ...]         # the sweep's own arguments as typed
    families: Mapping[str, Any] = field(default_factory=dict)   # family -> the options it read from its flags
    recorded: Mapping[str, Any] = field(default_factory=dict)   # every flag, as run.json records them

    @classmethod
    def from_args(cls, args: argparse.Namespace, argv: Sequence[str]) -> SweepOptions:
        """Bad values of a family's flags raise UsageError (its read_options says which)."""
        return cls(cpu=args.cpu, share_gpus=args.share_gpus,
                   allow_multicast=args.allow_multicast, no_probe=args.no_probe, out=args.out, resume=args.resume,
                   run_dir=args.run_dir, qualify=args.qualify, junit=args.junit, model=args.model, nproc=args.nproc,
                   env=tuple(args.env), mps=args.mps, child_timeout=args.child_timeout, argv=tuple(argv),
                   families=backends.read_options(args),
                   recorded={k: v for k, v in vars(args).items() if not k.startswith("_")})
