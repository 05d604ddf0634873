"""The allreduce chain an engine set up, from its own start-up log, where the engine logs one
(an Engine's `log_line` and `log_names`: vLLM logs "Using ['FLASHINFER', 'CUSTOM', 'SYMM_MEM',
'PYNCCL'] all-reduce backends (in dispatch order) for group 'tp:0' ..." for every group; SGLang
0.5.23 logs no such line on CUDA, so its chain stays the model's).
The log is untrusted input: a regular file only, read bounded by the bytes read (a FIFO blocked
forever, /dev/zero behind a symlink read 7.6 GB), matched by a strict pattern, names not known are
named as such, never echoed raw."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from commbench.engines.paths import Engine
from commbench.errors import UsageError
from commbench.files import read_lines

MAX_LOG_BYTES = 64 << 20


@dataclass(frozen=True)
class Chain:
    engine: str                 # the engine's name
    group: str
    names: tuple[str, ...]      # as logged, in dispatch order
    paths: tuple[str, ...]      # the commbench path ids among them

    def said(self, file: str) -> str:
        return (f"{self.engine}'s start-up log {file} (group '{self.group}'): {', '.join(self.names) or 'no backend'} "
                "— the chain below is the one the engine set up")


def read_chain(path: str, engine: Engine) -> Chain:
    """The tensor-parallel group's chain in the engine's log; one line (UsageError) when there is none.
    Streamed a block of lines at a time (files.read_lines: a regular file, bounded by the bytes
    read); only the first line of a tp group and the first of any group are kept."""
    pattern = re.compile(engine.log_line)
    first = tp = None
    try:
        for line in read_lines(Path(path), f"{engine.name}'s start-up log", MAX_LOG_BYTES):
            found = pattern.search(line)
            if found:
                first = first or found
                if found.group(2).startswith("tp"):
                    tp = found
                    break
    except UsageError as exc:
        raise UsageError(f"--engine-log {exc}") from None
    if first is None:
        raise UsageError(f"--engine-log {path}: no \"{engine.log_said}\" line ({engine.name} logs one per group at "
                         "start-up since 2026)")
    tp = tp or first
    names = tuple(re.findall(r"'([A-Z_]+)'", tp.group(1)))
    return Chain(engine.name, tp.group(2), names, tuple(engine.log_names[n] for n in names if n in engine.log_names))
