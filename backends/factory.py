"""What the registry and a family's factory need without torch: how a family turns specs into
variants (BackendFactory, MakeOptions, the sweep's facts), reading a variant spec, and the error a
setup raises with a reason. commbench.backends.base re-exports every name here (plug-ins import them
from there), and the registry imports only this, so `commbench sweep --help` loads no torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

from commbench.errors import UsageError

# Backend (commbench.backends.base) is named in annotations only, as text: base imports this
# module, and this one never imports base, torch's side.


class BackendUnavailable(Exception):
    """Raised by setup() with a reason a user can act on ("flashinfer not installed", ...)."""


@dataclass(frozen=True)
class SweepFacts:
    """What the sweep tells every family when it makes variants."""

    hidden: int | None = None                 # model shapes share one hidden size; None for plain sizes
    message_bytes: tuple[int, ...] = ()       # every planned size (flashinfer:pcie_ipc tunes per size at setup)
    allow_multicast: bool = False
    run_dir: Path | None = None               # None until the run has one (validation, the probe)


OwnOptions = TypeVar("OwnOptions")


@dataclass(frozen=True)
class MakeOptions(Generic[OwnOptions]):
    """What make() is handed: this family's own options (what its read_options returned, or what it
    returns for its flags' defaults; None for a family without read_options) and the sweep's facts."""

    own: OwnOptions
    sweep: SweepFacts = SweepFacts()
    # Another family's variant by its name, made as the sweep makes it, without reading that family's
    # options (unfused:best rebuilds the allreduce it measured fastest); None outside a sweep.
    build: Callable[[str], "Backend"] | None = field(default=None, repr=False, compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        """A plug-in written before typed options read one flat dict: its own read_options' dict
        entries and the sweep's facts by name ("hidden", "message_bytes", ...). It still can."""
        if isinstance(self.own, Mapping) and key in self.own:
            return self.own[key]
        return getattr(self.sweep, key, default) if key in SweepFacts.__dataclass_fields__ else default


@dataclass
class BackendFactory:
    """How a family turns specs into variants, and what it adds to commbench.

    make(variant, options) -> list of backends; variant is the text after ``family:`` or None
    for the family's default variants; options is a MakeOptions: ``options.own`` is what this
    family's read_options returned (its own frozen object), ``options.sweep`` the sweep's facts.
    No family sees another's options.
    """

    family: str
    make: Callable[[str | None, MakeOptions[Any]], list[Backend]]
    on_gpu_by_default: bool = True
    on_cpu_by_default: bool = False
    summary: str = ""
    variants_help: list[str] = field(default_factory=list)
    probe_specs: tuple[str | None, ...] = (None,)     # variants the probe gives verdicts for
    packages: tuple[str, ...] = ()                    # distributions whose versions runs record
    add_arguments: Callable[[argparse._ArgumentGroup], None] | None = None   # the family's flags
    read_options: Callable[[argparse.Namespace], Any] | None = None  # and reading them into its options
    # Optional native code that may crash the process (MSCCL++, FlashInfer's JIT kernels): runs
    # after the built-in families. None: no for built-ins, yes for plug-ins.
    native: bool | None = None
    # Whose TRACE_KERNELS name the kernels it launches, for `commbench attribute`: None, its own
    # module (or a module it imports from this package) declares them; else the family that does
    # ("nccl": nccl4py runs libnccl's kernels), or "" when it launches no communication kernel
    # of its own (gloo runs on the CPU; unfused calls other families).
    trace_kernels_of: str | None = None

    def default_options(self) -> Any:
        """What read_options returns for this family's flags left at their defaults (None without
        read_options): the options of a probe, or of a family whose flags were not read."""
        if self.read_options is None:
            return None
        parser = argparse.ArgumentParser(add_help=False)
        if self.add_arguments is not None:
            self.add_arguments(parser.add_argument_group(self.family))
        return self.read_options(parser.parse_args([]))

    def variants(self, variant: str | None, own: Any = None, sweep: SweepFacts = SweepFacts()) -> list[Backend]:
        """make() with `own` (None: the defaults of this family's flags) and the sweep's facts."""
        return self.make(variant, MakeOptions(self.default_options() if own is None else own, sweep))


def chosen_variants(family: str, names: Sequence[str], known: Sequence[str], every: str | None = None,
                    also: str = "") -> list[str]:
    """The variants a spec names, in its order: every one of `known` where it names none (or only
    the `every` alias); a name the family lacks is bad input naming its choices (and `also`)."""
    asked = [n for n in names if n != every] or list(known)
    unknown = [n for n in asked if n not in known]
    if unknown:
        choices = ", ".join([every, *known] if every else known)
        raise UsageError(f"{family}: unknown variant {', '.join(unknown)}; choose from {choices}{also}")
    return asked


def parse_variant_options(variant: str | None) -> dict[str, str]:
    """'proto=LL,algo=Ring' -> {'proto': 'LL', 'algo': 'Ring'}; a bare word maps to itself."""
    out: dict[str, str] = {}
    for part in (variant or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip() if value else key.strip()
    return out
