"""The engines commbench answers for, one line each, and the libraries their paths run whose facts
are checked like theirs: every shared module reads them from here and none names one. Adding an
engine is its own file (vllm.py and sglang.py are the pattern) and one line here; a library, its
file (flashinfer.py) and one line."""

from __future__ import annotations

from commbench.engines import flashinfer, sglang, vllm
from commbench.engines.facts import Library
from commbench.engines.paths import Engine

ENGINES: tuple[Engine, ...] = (vllm.ENGINE, sglang.ENGINE)
BY_KEY: dict[str, Engine] = {e.key: e for e in ENGINES}
KEYS: tuple[str, ...] = tuple(BY_KEY)
NAMES: dict[str, str] = {e.key: e.name for e in ENGINES}
LIBRARIES: tuple[Library, ...] = (flashinfer.LIBRARY,)
