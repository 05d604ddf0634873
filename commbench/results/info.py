"""run.json as a typed object: what a run is (identity), how it was started (command, versions),
what the probe found (snapshot, verdicts), what each backend declared, the plan, and how the
run went on and ended. The boundary (validate.info_problem) checks every field's type before
from_dict builds one; writers fill its fields, readers use them, and RunDir (rundir.py) reads
and writes the file.

The file keeps its flat form: a field that is None is left out, and keys this commbench does
not know stay in `other` and are written back as read, so run.json of schemas 1-3 reads and
writes unchanged (no key of run.json changed between them: only rows needed migrations).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

Table = dict[str, Any]
Moment = float | str   # time.time() when commbench writes it; text in hand-made fixtures


@dataclass
class RunInfo:
    """One run.json. Every field is optional: the --nproc driver's stub holds run_id, started
    and driver; an nccl-tests import has no snapshot; older runs lack newer fields."""

    run_id: str | None = None
    schema: int | None = None                  # set to SCHEMA_VERSION when written
    # Identity: what a resume must share (identity.py).
    host: str | None = None
    world_size: int | None = None
    nodes: int | None = None
    local_world_size: int | None = None
    device_type: str | None = None             # "cuda" | "cpu"
    gpus: list[Table] | None = None            # one per rank: host, device, name, uuid, pci_bus_id
    emulation: Table | None = None             # ranks sharing GPUs: {gpus, ranks, mps, sm_percent}
    shares_gpus: bool | None = None
    plan: Table | None = None                  # SweepPlan.record(); an import: the sizes, dtypes, modes it holds
    # How it was started.
    command: list[str] | None = None
    args: Table | list[Any] | None = None      # the sweep's flags as recorded
    versions: Table | None = None
    env: Table | None = None                   # environment variables under ENV_PREFIXES
    notes: list[str] | None = None
    note: str | None = None                    # one hand-written note (fixtures)
    driver: Table | None = None                # the --nproc driver: nproc, env, child_timeout_s
    # The probe, and what each backend declared (the analysis never imports a backend).
    snapshot: Table | None = None              # its inner fields: validate.py (the snapshot's own checks)
    verdicts: Table | None = None              # backend variant -> can it run here, and why not
    backends: list[str] | None = None
    backend_facts: Table | None = None         # variant -> family, needs, engine_settings
    env_settings: list[Table] | None = None    # the driver's --env settings the rows ran under
    # An import of another tool's output (nccl-tests), or a hand-made fixture.
    source: str | None = None
    imports: list[Table] | None = None
    provenance: str | None = None
    # How the run went on and ended.
    started: Moment | None = None
    resumed: list[Table] | None = None         # one entry per --resume: when, its command, its backends
    finished: Moment | None = None             # every backend ran
    interrupted: Moment | None = None          # Ctrl-C or an error stopped it (a hang leaves neither)
    other: Table = field(default_factory=dict)   # keys this commbench does not know, kept as read

    @classmethod
    def from_dict(cls, data: Table) -> "RunInfo":
        """A run.json already checked at the boundary (validate.info_problem)."""
        known = {name: value for name, value in data.items() if name in _FIELDS}
        return cls(**known, other={name: value for name, value in data.items() if name not in _FIELDS})

    def to_dict(self) -> Table:
        """run.json's object: the fields that are set, and the keys kept in `other`."""
        data = {**self.other}
        data.update((name, getattr(self, name)) for name in _FIELDS if getattr(self, name) is not None)
        return data

    @property
    def swept(self) -> bool:
        """Has a sweep written this run.json? The driver's stub (run_id, started, driver) and a
        new dir have no plan yet; anything else without a world size is no run a resume can check."""
        return self.world_size is not None or self.plan is not None


_FIELDS = tuple(f.name for f in dataclasses.fields(RunInfo) if f.name != "other")
