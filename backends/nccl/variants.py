"""The nccl family: its flags, its variants (nccl:proto=P,algo=A, nccl:symm, lib=LABEL) and its
factory. The backends themselves are NcclBackend (commbench.backends.nccl.backend) and NcclSymmBackend
(commbench.backends.nccl.symm); this module sits above both, so neither imports the other back.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from commbench.backends.base import Backend, BackendFactory, MakeOptions, parse_variant_options
from commbench.backends.nccl.backend import NcclBackend, nccl_log_dir
from commbench.backends.nccl.flags import add_arguments
from commbench.backends.nccl.libs import NcclLibrary, by_label, parse_nccl_libs
from commbench.topology.nccl_log import ALGORITHMS, PROTOCOLS
from commbench.backends.nccl.symm import NcclSymmBackend
from commbench.errors import UsageError


def _normalise(values: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    by_lower = {a.lower(): a for a in allowed}
    out = []
    for value in values:
        if value.lower() not in by_lower:
            raise UsageError(f"unknown NCCL {what} {value!r}: choose from {', '.join(allowed)}")
        out.append(by_lower[value.lower()])
    return out


@dataclass(frozen=True)
class NcclOptions:
    """The nccl family's flags, read once."""

    protos: tuple[str, ...] = ()              # --nccl-proto, NCCL's spelling
    algos: tuple[str, ...] = ()               # --nccl-algo
    symm: bool = False                        # --nccl-symm
    libraries: tuple[NcclLibrary, ...] = ()   # --nccl-lib
    log: bool = True                          # not --no-nccl-log


def read_options(args: argparse.Namespace) -> NcclOptions:
    split = lambda text: [v.strip() for v in text.split(",") if v.strip()] if text else []  # noqa: E731
    return NcclOptions(protos=tuple(_normalise(split(args.nccl_proto), PROTOCOLS, "protocol")),
                       algos=tuple(_normalise(split(args.nccl_algo), ALGORITHMS, "algorithm")),
                       symm=args.nccl_symm, libraries=tuple(parse_nccl_libs(args.nccl_lib)),
                       log=not args.no_nccl_log)


VARIANT_OPTIONS = ("proto", "algo", "symm", "lib")


@dataclass(frozen=True)
class VariantSpec:
    """What one nccl variant asks for, before the library it runs with is chosen."""

    proto: str | None = None
    algo: str | None = None
    symm: bool = False

    def build(self, log_dir: Path | None, library: NcclLibrary | None) -> Backend:
        if self.symm:
            return NcclSymmBackend(log_dir=log_dir, library=library)
        return NcclBackend(self.proto, self.algo, log_dir, library)


def parse_variant(variant: str, libraries: list[NcclLibrary]) -> tuple[VariantSpec, NcclLibrary | None]:
    """'proto=LL,algo=Ring', 'symm', 'lib=LABEL', ... -> the spec and its library (None: torch's)."""
    opts = parse_variant_options(variant)
    unknown = set(opts) - set(VARIANT_OPTIONS)
    if unknown:
        raise UsageError(f"unknown nccl option {sorted(unknown)[0]!r}: use nccl:proto=P,algo=A, nccl:symm "
                         "or add lib=LABEL (a --nccl-lib)")
    if "symm" in opts and opts["symm"] != "symm":
        raise UsageError(f"nccl:symm takes no value (got symm={opts['symm']})")
    if "symm" in opts and ("proto" in opts or "algo" in opts):
        raise UsageError("nccl:symm takes no proto/algo: NCCL picks its symmetric kernel itself")
    proto = _normalise([opts["proto"]], PROTOCOLS, "protocol")[0] if "proto" in opts else None
    algo = _normalise([opts["algo"]], ALGORITHMS, "algorithm")[0] if "algo" in opts else None
    library = by_label(libraries, opts["lib"]) if "lib" in opts else None
    return VariantSpec(proto, algo, "symm" in opts), library


def default_specs(options: NcclOptions) -> list[VariantSpec]:
    """NCCL's own choice, the --nccl-proto x --nccl-algo matrix, and nccl:symm with --nccl-symm."""
    specs = [VariantSpec()]
    specs += [VariantSpec(p, a) for p in options.protos or [None] for a in options.algos or [None] if p or a]
    if options.symm:
        specs.append(VariantSpec(symm=True))
    return specs


def make(variant: str | None, options: MakeOptions[NcclOptions]) -> list[Backend]:
    """Each variant with torch's NCCL, and once more per --nccl-lib unless it names its lib=."""
    log_dir = nccl_log_dir(options.sweep.run_dir, options.own.log)
    libraries = list(options.own.libraries)
    if variant:
        spec, library = parse_variant(variant, libraries)
        if library is not None:
            return [spec.build(log_dir, library)]
        specs = [spec]
    else:
        specs = default_specs(options.own)
    return [spec.build(log_dir, library) for library in [None, *libraries] for spec in specs]


FACTORY = BackendFactory(
    family="nccl", make=make, on_gpu_by_default=True, on_cpu_by_default=False,
    summary="NCCL via torch ProcessGroupNCCL; --nccl-proto/--nccl-algo sweep the protocol x algorithm matrix, "
            "--nccl-symm adds symmetric-window registration, --nccl-lib runs other NCCL libraries side by side",
    variants_help=["nccl", "nccl:proto=LL", "nccl:proto=LL128,algo=Ring",
                   "nccl:symm            buffers registered as symmetric windows (NCCL >= 2.27 kernels)",
                   "nccl:lib=LABEL       with the libnccl of --nccl-lib LABEL=PATH, preloaded in a child torchrun"],
    probe_specs=(None, "proto=LL", "proto=LL128", "proto=Simple",
                 *(f"proto={p},algo={a}" for p in PROTOCOLS for a in ("Ring", "Tree", "NVLS", "NVLSTree")), "symm"),
    packages=("nvidia-nccl-cu12", "nvidia-nccl-cu13"),
    add_arguments=add_arguments, read_options=read_options,
)
