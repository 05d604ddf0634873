"""The engines commbench answers for, one line each: every shared module reads them from here
and none names one. Adding an engine is its own file (vllm.py and sglang.py are the pattern)
and one line here."""

from __future__ import annotations

from commbench.engines import sglang, vllm
from commbench.engines.paths import Engine

ENGINES: tuple[Engine, ...] = (vllm.ENGINE, sglang.ENGINE)
BY_KEY: dict[str, Engine] = {e.key: e for e in ENGINES}
KEYS: tuple[str, ...] = tuple(BY_KEY)
NAMES: dict[str, str] = {e.key: e.name for e in ENGINES}
