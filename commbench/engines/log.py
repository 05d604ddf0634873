"""The allreduce chain an engine set up, from its own start-up log, where the engine logs one
(an Engine's `log_line` and `log_names`: vLLM logs "Using ['FLASHINFER', 'CUSTOM', 'SYMM_MEM',
'PYNCCL'] all-reduce backends (in dispatch order) for group 'tp:0' ..." for every group; SGLang
0.5.23 logs no such line on CUDA, so its chain stays the model's).
The log is untrusted input: read bounded, matched by a strict pattern, names not known are named
as such, never echoed raw."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from commbench.engines.paths import Engine
from commbench.errors import UsageError

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
    """The tensor-parallel group's chain in the engine's log; one line (UsageError) when there is none."""
    try:
        file = Path(path)
        if file.stat().st_size > MAX_LOG_BYTES:
            raise UsageError(f"--engine-log {path}: larger than {MAX_LOG_BYTES >> 20} MiB")
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"--engine-log {path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    found = list(re.finditer(engine.log_line, text))
    if not found:
        raise UsageError(f"--engine-log {path}: no \"{engine.log_said}\" line ({engine.name} logs one per group at "
                         "start-up since 2026)")
    tp = next((m for m in found if m.group(2).startswith("tp")), found[0])
    names = tuple(re.findall(r"'([A-Z_]+)'", tp.group(1)))
    return Chain(engine.name, tp.group(2), names, tuple(engine.log_names[n] for n in names if n in engine.log_names))
