"""Other NCCL libraries side by side: `--nccl-lib [LABEL=]PATH`, one child torchrun each.

A process can run one libnccl.so.2 (torch binds the first one with that soname), so every
library given with --nccl-lib runs in a child torchrun of its own with the library in
LD_PRELOAD, as variant ``nccl:lib=LABEL``. The label names the library in results and never
claims a version: what a process actually ran is asked of NCCL there (ncclGetVersion on the
mapped libnccl, commbench.topology.nccl_log.loaded_nccl) and recorded on every row.

Default labels are stable, so two runs with the same path get the same variant name (compare
matches curves by name): ``cu13-2.29.7`` for a file inside an ``nvidia-nccl-cu13`` 2.29.7 wheel
(its dist-info's RECORD lists the file), ``2.29.7`` for a system file named
``libnccl.so.2.29.7``, else ``lib-`` and 8 hex digits of the real path's SHA-1.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from commbench import engines
from commbench.errors import UsageError

PRELOAD_VAR = engines.PRELOAD_VAR   # the variable a child torchrun preloads its library with
LIBRARY_NAME = "libnccl.so.2"
# Where a libnccl sits below a folder given instead of a file: a pip --target dir or
# site-packages, a wheel's nvidia/nccl, an NCCL build or install prefix, the folder itself.
_BELOW = ("nvidia/nccl/lib", "lib", "build/lib", ".")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_DIST_INFO_RE = re.compile(r"^nvidia_nccl_(cu\d+)-([0-9][0-9.]*[0-9])\.dist-info$")
_VERSIONED_FILE_RE = re.compile(r"^libnccl\.so\.(\d+\.\d+\.\d+)$")
_ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class NcclLibrary:
    """One --nccl-lib: a label for variant names and the real path of the file to preload."""

    label: str
    path: str

    @property
    def variant(self) -> str:
        return f"lib={self.label}"


def find_library(path: Path) -> Path:
    """The libnccl file for a --nccl-lib path: the file itself, or libnccl.so.2 below a folder."""
    if path.is_dir():
        for below in _BELOW:
            candidate = path / below / LIBRARY_NAME
            if candidate.is_file():
                return candidate
        raise UsageError(f"--nccl-lib {path}: no {LIBRARY_NAME} in it "
                         f"(looked in {', '.join(str(Path(b) / LIBRARY_NAME) for b in _BELOW)})")
    if not path.exists():
        raise UsageError(f"--nccl-lib {path}: no such file")
    if not path.is_file():
        raise UsageError(f"--nccl-lib {path}: not a file")
    return path


def check_shared_object(path: Path) -> None:
    """A readable ELF file, or UsageError (loading it is the child's business)."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise UsageError(f"--nccl-lib {path}: cannot read ({exc.strerror})") from None
    if magic != _ELF_MAGIC:
        raise UsageError(f"--nccl-lib {path}: not a shared library (no ELF header)")


def wheel_label(real_path: Path) -> str | None:
    """'cu13-2.29.7' when the file belongs to an installed nvidia-nccl-cuNN wheel."""
    parts = real_path.parts
    if len(parts) < 5 or parts[-4:-1] != ("nvidia", "nccl", "lib"):
        return None
    site = Path(*parts[:-4])
    relative = "/".join(parts[-4:])
    try:
        entries = sorted(site.iterdir())
    except OSError:
        return None
    for entry in entries:
        match = _DIST_INFO_RE.match(entry.name)
        if not match:
            continue
        try:
            record = (entry / "RECORD").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if any(line.split(",", 1)[0] == relative for line in record.splitlines()):
            return f"{match.group(1)}-{match.group(2)}"
    return None


def default_label(real_path: Path) -> str:
    """A stable label for a library file (see the module docstring)."""
    label = wheel_label(real_path)
    if label:
        return label
    versioned = _VERSIONED_FILE_RE.match(real_path.name)
    if versioned:
        return versioned.group(1)
    return "lib-" + hashlib.sha1(str(real_path).encode()).hexdigest()[:8]


def parse_one(spec: str) -> NcclLibrary:
    """'LABEL=PATH' or 'PATH' -> NcclLibrary with the real path; UsageError on bad input."""
    label, sep, path_text = spec.partition("=")
    if not sep or "/" in label:
        label, path_text = "", spec
    if not path_text.strip():
        raise UsageError(f"--nccl-lib {spec!r}: give a path (or LABEL=PATH)")
    if label and not _LABEL_RE.match(label):
        raise UsageError(f"--nccl-lib {spec!r}: a label is letters, digits and . _ + - (it goes into "
                         "the variant name nccl:lib=LABEL)")
    path = find_library(Path(path_text.strip()).expanduser())
    check_shared_object(path)
    real = Path(os.path.realpath(path))
    return NcclLibrary(label or default_label(real), str(real))


def parse_nccl_libs(specs: list[str] | None) -> list[NcclLibrary]:
    """Every --nccl-lib, labels unique; one path given twice counts once."""
    libraries: list[NcclLibrary] = []
    for spec in specs or []:
        library = parse_one(spec)
        same_label = [known for known in libraries if known.label == library.label]
        if any(known.path == library.path for known in same_label):
            continue
        if same_label:
            raise UsageError(f"--nccl-lib: {same_label[0].path} and {library.path} would both be "
                             f"nccl:lib={library.label}; name them LABEL=PATH")
        libraries.append(library)
    return libraries


def preload_env(library: NcclLibrary) -> dict[str, str]:
    """The child torchrun's environment: this library ahead of torch's own NCCL."""
    return {PRELOAD_VAR: library.path}


def preloaded_here(library: NcclLibrary, environ: Mapping[str, str] = os.environ) -> bool:
    """Was this process started with the library in LD_PRELOAD (i.e. is this its child)?"""
    names = re.split(r"[:\s]+", environ.get(PRELOAD_VAR, ""))
    return any(name and os.path.realpath(name) == library.path for name in names)


def by_label(libraries: list[NcclLibrary], label: str) -> NcclLibrary:
    for library in libraries:
        if library.label == label:
            return library
    known = ", ".join(lib.label for lib in libraries) or "none given"
    raise UsageError(f"nccl:lib={label}: no --nccl-lib has that label (given: {known}); "
                     f"add --nccl-lib {label}=PATH")
