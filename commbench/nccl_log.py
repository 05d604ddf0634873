"""What NCCL says it did: parse NCCL_DEBUG=INFO output (subsystems INIT,ENV,TUNING).

NCCL's rank 0 logs one line per collective it enqueues, e.g.
``NCCL INFO AllReduce: 4194304 Bytes -> Algo Tree proto Simple channel{Lo..Hi}={0..31}``
(src/enqueue.cc, INFO(NCCL_TUNING, ...)). NCCL_DEBUG* are read once per process, so the sweep
sets them before the first communicator exists and points NCCL_DEBUG_FILE at the run dir.
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter
from pathlib import Path

_TUNING_RE = re.compile(r"NCCL INFO AllReduce: (\d+) Bytes -> Algo (\w+) proto (\w+)")

ALGO_NAMES = {"ring": "Ring", "tree": "Tree", "nvls": "NVLS", "nvlstree": "NVLSTree", "pat": "PAT",
              "collnetdirect": "CollnetDirect", "collnetchain": "CollnetChain"}
PROTO_NAMES = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}


def canonical_algo(name: str) -> str:
    return ALGO_NAMES.get(name.lower(), name)


def canonical_proto(name: str) -> str:
    return PROTO_NAMES.get(name.lower(), name)


def configure_logging(log_dir: Path) -> Path | None:
    """Ask NCCL to log its choices into log_dir. Leaves a user's own NCCL_DEBUG untouched
    (then nothing is parsed). Must run before the first NCCL communicator of the process."""
    if "NCCL_DEBUG" in os.environ:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_SUBSYS"] = "INIT,ENV,TUNING"
    os.environ["NCCL_DEBUG_FILE"] = str(log_dir / "nccl.%h.%p.log")
    return log_dir


class NcclLogReader:
    """Reads the lines this process's NCCL appended since the last call."""

    def __init__(self, log_dir: Path | None):
        self.log_dir = log_dir
        self._offset = 0
        self._path: str | None = None

    def _find(self) -> str | None:
        if self._path is None and self.log_dir is not None:
            mine = glob.glob(str(self.log_dir / f"nccl.*.{os.getpid()}.log"))
            self._path = mine[0] if mine else None
        return self._path

    def new_lines(self) -> list[str]:
        path = self._find()
        if path is None:
            return []
        with open(path, encoding="utf-8", errors="replace") as handle:
            handle.seek(self._offset)
            text = handle.read()
            self._offset = handle.tell()
        return text.splitlines()


def used_algo_proto(lines: list[str], message_bytes: int) -> tuple[str | None, str | None]:
    """The (algorithm, protocol) NCCL logged most often for allreduces of this size."""
    seen = Counter()
    for line in lines:
        match = _TUNING_RE.search(line)
        if match and int(match.group(1)) == message_bytes:
            seen[(canonical_algo(match.group(2)), canonical_proto(match.group(3)))] += 1
    if not seen:
        return None, None
    return seen.most_common(1)[0][0]
